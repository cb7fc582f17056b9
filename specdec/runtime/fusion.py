"""Fused input projections for an int8 CPU draft: one Linear layer computes what two or three did.

A draft step of a small model on a CPU is memory-bound in its weights and, besides, pays for every
layer call: dynamic int8 quantization measures and quantizes the layer's input on each call, then
runs the int8 product and dequantizes. A decoder layer calls ``q_proj``, ``k_proj`` and
``v_proj`` on one input and ``gate_proj`` and ``up_proj`` on another; concatenating each group's
weight rows into one layer does each group's work in one call. The outputs are bit for bit those
of the separate layers: the int8 weights keep a scale per output row (``quantize_int8``), the
input is quantized once with the same scale either way, and an output row's integer sum does not
depend on the rows beside it (``test_fusion.py``).

Only the module classes named below are fused, whose forward is known to call the projections on
one input tensor; anything else keeps its own layers.
"""

from __future__ import annotations

import torch

# decoder MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x))
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP"})
# attention modules whose forward calls q_proj, k_proj and v_proj on the same hidden states
QKV_ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})


class GateUpMLP(torch.nn.Module):
    """A gated MLP whose gate and up projections are one layer (``gate_up_proj``, gate rows first)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.width = gate.out_features
        self.gate_up_proj = _concatenated([gate, up])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.gate_up_proj(x)
        return self.down_proj(self.act_fn(both[..., : self.width]) * both[..., self.width :])


class QKVProjection(torch.nn.Module):
    """q, k and v of an attention module computed by one layer (``fused``). Registered on the
    attention module as ``qkv_proj``; its ``q_proj``, ``k_proj`` and ``v_proj`` become
    ``ProjectionPart``s that read their columns of the output for the input they are given: the
    first of the three calls with a tensor computes it, the others reuse it, and once all three
    have read it it is let go (a call with another tensor computes again, so any call order gives
    the right values)."""

    def __init__(self, q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear) -> None:
        super().__init__()
        self.fused = _concatenated([q, k, v])
        ends = (q.out_features, q.out_features + k.out_features, self.fused.out_features)
        self.columns = ((0, ends[0]), (ends[0], ends[1]), (ends[1], ends[2]))  # q's, k's, v's
        self._last: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None  # input, output, parts that read it

    def output_for(self, x: torch.Tensor, part: int) -> torch.Tensor:
        last = self._last  # read once: another thread's call replaces the triple whole
        if last is None or last[0] is not x or part in last[2]:
            last = (x, self.fused(x), set())
            self._last = last
        last[2].add(part)
        if len(last[2]) == 3:
            self._last = None
        return last[1]


class ProjectionPart(torch.nn.Module):
    """A ``QKVProjection``'s output columns of q (part 0), k (1) or v (2)."""

    def __init__(self, owner: QKVProjection, part: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a child: the attention module holds it once
        self.part = part
        self.start, self.end = owner.columns[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.output_for(x, self.part)[..., self.start : self.end]


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuses the input projections of ``model``'s known MLP and attention modules in place (before
    ``quantize_int8``, so the fused layers are quantized as any other); returns how many modules
    were fused."""
    fused = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _known(child, GATED_MLPS) and _plain(child.gate_proj, child.up_proj):
                setattr(parent, name, GateUpMLP(child))
                fused += 1
    for module in list(model.modules()):
        if _known(module, QKV_ATTENTIONS) and _plain(module.q_proj, module.k_proj, module.v_proj):
            module.qkv_proj = QKVProjection(module.q_proj, module.k_proj, module.v_proj)
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                setattr(module, name, ProjectionPart(module.qkv_proj, part))
            fused += 1
    return fused


def _known(module: torch.nn.Module, names: frozenset[str]) -> bool:
    """A module of one of ``names``' classes as transformers defines them (not remote code's)."""
    kind = type(module)
    return kind.__name__ in names and kind.__module__.startswith("transformers.models.")


def _plain(*layers: torch.nn.Module) -> bool:
    """Plain float Linear layers of one input width and dtype (nothing quantized or packed yet)."""
    return all(type(layer) is torch.nn.Linear for layer in layers) and (
        len({(layer.in_features, layer.weight.dtype, layer.weight.device) for layer in layers}) == 1
    )


def _concatenated(layers: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One Linear layer whose output is ``layers``' outputs side by side."""
    first = layers[0]
    has_bias = any(layer.bias is not None for layer in layers)
    out = torch.nn.Linear(first.in_features, sum(layer.out_features for layer in layers), bias=has_bias, device="meta")
    weight = torch.cat([layer.weight.detach() for layer in layers])
    out.weight = torch.nn.Parameter(weight, requires_grad=False)
    if has_bias:
        biases = [
            layer.bias.detach() if layer.bias is not None else weight.new_zeros(layer.out_features) for layer in layers
        ]
        out.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
    return out
