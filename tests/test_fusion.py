"""Fused input projections of an int8 draft (specdec.runtime.fusion): the same logits, bit for bit,
as the separate layers, through the loader the draft worker uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from specdec.runtime import modeling
from specdec.runtime.cachelayers import cache_argument
from specdec.runtime.fusion import GateUpMLP, ProjectionPart, QKVProjection, fuse_projections
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from tests.tiny_models import build_family

INT8 = LoadOptions(device="cpu", quantize="int8")


def _passes(loaded: LoadedModel) -> list[torch.Tensor]:
    """Logits of a two-row prefill, then one-token steps and a four-token block on its cache."""
    model, generator = loaded.model, torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, loaded.vocab_size, (2, 17), generator=generator)
    outs = []
    with torch.inference_mode():
        for width in (17, 1, 1, 4, 1):
            step = ids if width == 17 else torch.randint(0, loaded.vocab_size, (2, width), generator=generator)
            outs.append(model(input_ids=step, **cache_argument(model, cache)).logits)
    return outs


@pytest.mark.parametrize(
    ("family", "mlps", "attentions"),
    [("LlamaConfig", 2, 2), ("Qwen2Config", 2, 2), ("GemmaConfig", 2, 0), ("MixtralConfig", 0, 0)],
)
def test_an_int8_draft_with_fused_projections_gives_the_same_logits_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, mlps: int, attentions: int
) -> None:
    """q/k/v and gate/up fused (Qwen2's projections have biases, Llama's none; Gemma's attention
    and Mixtral's experts are not of the fused kinds and keep their layers): every logit of a
    prefill, cached steps and a block equals the unfused int8 model's exactly, and the fused
    layers are quantized (int8, a scale per row) like the others."""
    path = str(build_family(tmp_path / family, family))
    fused = load_model(path, INT8)
    modules = list(fused.model.modules())
    assert sum(isinstance(m, GateUpMLP) for m in modules) == mlps
    assert sum(isinstance(m, QKVProjection) for m in modules) == attentions
    for module in modules:
        if isinstance(module, GateUpMLP | QKVProjection):
            layer = module.gate_up_proj if isinstance(module, GateUpMLP) else module.fused
            assert isinstance(layer, torch.ao.nn.quantized.dynamic.Linear)
            assert layer.weight().qscheme() == torch.per_channel_affine
    monkeypatch.setattr(modeling, "fuse_projections", lambda model: 0)
    plain = load_model(path, INT8)
    assert not any(isinstance(m, GateUpMLP | QKVProjection) for m in plain.model.modules())
    for got, want in zip(_passes(fused), _passes(plain), strict=True):
        assert torch.equal(got, want)
    # nothing of a pass is held once its three projections have read it
    assert all(m._last is None for m in modules if isinstance(m, QKVProjection))


def test_fused_qkv_parts_give_their_columns_whatever_the_call_order() -> None:
    """The parts read the fused output of the tensor they are given: k before q, a part called
    again with another tensor, or twice with one, each get the columns of their own layer."""
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(8, n).requires_grad_(False) for n in (6, 4, 4))
    owner = QKVProjection(q, k, v)
    parts = {"q": (ProjectionPart(owner, 0), q), "k": (ProjectionPart(owner, 1), k), "v": (ProjectionPart(owner, 2), v)}
    assert owner.columns == ((0, 6), (6, 10), (10, 14))
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    for name, x in [("k", a), ("q", a), ("q", b), ("v", a), ("v", a), ("k", b), ("q", b), ("v", b)]:
        part, layer = parts[name]
        torch.testing.assert_close(part(x), layer(x), rtol=1e-6, atol=1e-6)


def test_only_transformers_own_module_classes_are_fused() -> None:
    """A module that only shares a fused class's name (remote code's, say) keeps its layers: its
    forward may call them otherwise."""

    class LlamaMLP(torch.nn.Module):  # the name is the point
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(4, 4) for _ in range(3))
            self.act_fn = torch.nn.SiLU()

    model = torch.nn.Sequential(LlamaMLP())
    assert fuse_projections(model) == 0
    assert isinstance(model[0], LlamaMLP)
