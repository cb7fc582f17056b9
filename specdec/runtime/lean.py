"""One decoding step of a quantized (int8 or int4) CPU draft without transformers' per-module machinery.

A decoding step of a small draft on a CPU is short (the int8 Qwen2.5-0.5B: ~28 ms on two cores),
and besides its int8 products it pays for some 2,000 small operators and the Python around them:
module calls and their hooks, the decorators of transformers' model forward, a causal mask built
and found unneeded, the rotary helpers, RMSNorm as separate operators. ``LeanStep`` runs a
one-token step of a Llama or Qwen2 decoder whose projections ``fuse_projections`` fused: the same
operators on the same tensors in the same order as the model's own forward (transformers'
attention function, the model's rotary embedding and the function applying it, its cache's
``update``, its output layer), so
the logits are the model's own, bit for bit (``tests/test_lean.py``), minus the overhead.

Only transformers' own ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (not subclasses: their forward
may do more), with every layer fused and attending to the whole context, get one; any other
model, and every pass of more than one token (a prefill, a block, a batched pass), runs the
model's forward as before. ``startup.checked_lean_step`` also checks a step against the model's
forward when the caches are made, and leaves out a lean step that differs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec.runtime.fusion import GateUpMLP, QKVProjection

_DECODERS = (LlamaForCausalLM, Qwen2ForCausalLM)


class _Layer:
    """What a step reads of one decoder layer."""

    def __init__(self, index: int, layer: torch.nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        qkv: QKVProjection = attention.qkv_proj
        self.index = index
        self.attention = attention
        # the function the model's attention applies its rotary embedding with (transformers' own)
        self.rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = inspect.getmodule(
            type(attention)
        ).apply_rotary_pos_emb
        self.qkv: Callable[[torch.Tensor], torch.Tensor] = qkv.fused
        self.q_end, self.k_end = qkv.columns[0][1], qkv.columns[1][1]
        self.head_dim: int = attention.head_dim
        self.scaling: float = attention.scaling
        self.o_proj = attention.o_proj
        self.gate_up: Callable[[torch.Tensor], torch.Tensor] = mlp.gate_up_proj
        self.width: int = mlp.width
        self.act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        self.down: Callable[[torch.Tensor], torch.Tensor] = mlp.down_proj
        self.norms = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)


def _norm(module: torch.nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _qkv(layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value [1, heads, 1, head size] of the normalised hidden state ``x``."""
    fused = layer.qkv(x)
    shape = (1, 1, -1, layer.head_dim)
    q, k, v = fused[..., : layer.q_end], fused[..., layer.q_end : layer.k_end], fused[..., layer.k_end :]
    return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)


class LeanStep:
    """A one-token decoding step of ``model`` (see the module's note); ``of`` says whether it has one."""

    def __init__(self, model: Any) -> None:
        decoder = model.model
        self._config = model.config
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self._layers = [_Layer(i, layer) for i, layer in enumerate(decoder.layers)]
        self._final = _norm(decoder.norm)
        self._head = model.lm_head

    @classmethod
    def of(cls, model: Any) -> LeanStep | None:
        """A LeanStep for ``model`` where it computes the model's own logits, else None."""
        if type(model) not in _DECODERS or model.device.type != "cpu":
            return None
        config = model.config
        layers = model.model.layers
        whole = all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
        fused = all(
            isinstance(getattr(layer.self_attn, "qkv_proj", None), QKVProjection) and type(layer.mlp) is GateUpMLP
            for layer in layers
        )
        attends = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None) is not None
        if not (whole and fused and attends and len(layers) == config.num_hidden_layers):
            return None
        return cls(model)

    def __call__(self, cache: Any, token: int) -> torch.Tensor:
        """The float32 logits [1, vocab] of ``token`` after ``cache``, which it extends by one position."""
        position = cache.get_seq_length()
        hidden = self._embed(torch.tensor([[token]]))
        cos, sin = self._rotary(hidden, torch.tensor([[position]]))
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self._config._attn_implementation, None)
        for layer in self._layers:
            query, key, value = _qkv(layer, _rms_norm(hidden, layer.norms[0]))
            query, key = layer.rotate(query, key, cos, sin)
            key, value = cache.update(key, value, layer.index)
            out, _ = attend(layer.attention, query, key, value, None, dropout=0.0, scaling=layer.scaling)
            hidden = hidden + layer.o_proj(out.reshape(1, 1, -1).contiguous())
            both = layer.gate_up(_rms_norm(hidden, layer.norms[1]))
            hidden = hidden + layer.down(layer.act(both[..., : layer.width]) * both[..., layer.width :])
        return self._head(_rms_norm(hidden, self._final))[0].float()
