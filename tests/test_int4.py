"""int4 Linear layers (``--quantize int4``, specdec.runtime.quantize): what a layer computes for
one-token steps and for wider passes, which layers are quantized, and a loaded int4 draft's
layers, fusion and lean step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadOptions, load_model
from specdec.runtime.quantize import GROUP, INT4_MAX_ROWS, Int4Linear, quantize_int4
from tests.tiny_models import TinyModels

INT4 = LoadOptions(device="cpu", quantize="int4", structured_output=False)


def _on_the_grid(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight whose every group of GROUP inputs is (q - 8) * scale + offset with 4-bit integers q
    spanning 0..15 and a scale and an offset exact in bfloat16: int4 holds it exactly."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP
    levels = torch.randint(0, 16, (out_features, groups, GROUP), generator=generator).float()
    levels[..., 0], levels[..., 1] = 0, 15  # each group spans the whole range: its scale is found again
    scale = (torch.rand(out_features, groups, 1, generator=generator) * 0.1 + 0.01).to(torch.bfloat16).float()
    offset = (torch.randn(out_features, groups, 1, generator=generator) * 0.1).to(torch.bfloat16).float()
    return ((levels - 8) * scale + offset).reshape(out_features, in_features)  # exact in float32


BF16_SLACK = 3e-3  # of sum |x * w|: the kernel works at bfloat16's precision (its 2**-9 per weight and sum)


@pytest.mark.parametrize(("out_features", "bias"), [(96, False), (259, True)], ids=["rows-of-16", "padded-rows"])
def test_a_weight_on_the_int4_grid_comes_through_to_bfloat16_precision(out_features: int, bias: bool) -> None:
    """A weight int4 can hold (as a checkpoint dequantized from 4-bit GGUF nearly is): the layer
    multiplies the bfloat16 input by it with no quantization error, only bfloat16's rounding, also
    where the output rows are padded to the kernel's multiple of 16 (259: the tiny models'
    vocabulary) and with a bias; float32 out."""
    linear = torch.nn.Linear(128, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_on_the_grid(out_features, 128, seed=1))
    layer = Int4Linear(linear)
    x = torch.randn(2, 1, 128)  # two rows: the int4 kernel's pass
    got = layer(x)
    xb, weight = x.to(torch.bfloat16).double(), linear.weight.double()
    want = xb @ weight.t() + (linear.bias.double() if bias else 0)
    assert got.shape == (2, 1, out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= BF16_SLACK * (xb.abs() @ weight.abs().t())).all()


def test_an_int4_layer_is_within_half_a_step_of_each_weight() -> None:
    """Any float32 weight: each output is off by at most half a group's step times the input's
    size (and bfloat16's rounding), and much less on average."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=False)
    layer = Int4Linear(linear)
    x = torch.randn(64, 256)
    got = torch.cat([layer(row) for row in x.split(1)]).double()  # one-row passes: the int4 kernel's
    xb = x.to(torch.bfloat16).double()
    exact = xb @ linear.weight.double().t()
    groups = linear.weight.detach().reshape(64, 256 // GROUP, GROUP)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).double()  # [out, groups]
    bound = (xb.abs().reshape(64, 1, 256 // GROUP, GROUP).sum(-1) * step.unsqueeze(0) / 2).sum(-1)
    assert ((got - exact).abs() <= bound + BF16_SLACK * (xb.abs() @ linear.weight.double().abs().t())).all()
    assert (got - exact).abs().mean() < bound.mean() / 4


def test_passes_of_more_than_two_rows_run_on_the_int8_copy() -> None:
    """The int4 kernel costs about a one-row pass more for every further row: a pass of more than
    INT4_MAX_ROWS rows (a prefill, a catch-up) gives the int8 copy's output exactly, and a
    narrower one the int4 kernel's (row by row what one-row passes give), not the int8 copy's."""
    torch.manual_seed(0)
    layer = Int4Linear(torch.nn.Linear(64, 48))
    x = torch.randn(1, INT4_MAX_ROWS + 1, 64)
    assert torch.equal(layer(x), layer.wide(x))
    narrow = x[:, :INT4_MAX_ROWS]
    assert not torch.equal(layer(narrow), layer.wide(narrow))
    one_at_a_time = torch.cat([layer(row) for row in narrow.split(1, dim=1)], dim=1)
    assert torch.equal(layer(narrow), one_at_a_time)  # the int4 kernel's rows, as one-token steps give them


def test_layers_whose_inputs_do_not_fill_groups_are_int8() -> None:
    """quantize_int4 makes every float32 nn.Linear whose inputs are a multiple of GROUP an
    Int4Linear and the others int8 layers, and counts both."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    assert quantize_int4(model) == (1, 1)
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], torch.ao.nn.quantized.dynamic.Linear)
    assert model(torch.randn(1, 64)).shape == (1, 16) and model(torch.randn(5, 64)).shape == (5, 16)


def test_an_int4_draft_is_fused_quantized_and_steps_lean(tiny_models: TinyModels) -> None:
    """``--quantize int4`` on the tiny target: q/k/v and gate/up fused first, every Linear layer
    int4 (the output layer too; the input embeddings it shares weights with stay float32), and its
    one-token steps through the workers' cache path get the lean step (whose logits the caches
    check against the model's forward when they are made; tests/test_lean.py checks a session's)."""
    loaded = load_model(str(tiny_models.target), INT4)
    model = loaded.model
    assert not [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 2 * 4 + 1  # per decoder layer: q/k/v, o, gate/up, down; and the output layer
    assert model.model.embed_tokens.weight.dtype == torch.float32
    caches = SessionCaches(loaded, 2, 600)
    assert caches.lean is not None  # checked against the model's forward when the caches were made


def test_an_int4_draft_keeps_nothing_of_the_checkpoint_s_memory_map(tiny_models: TinyModels, tmp_path: Path) -> None:
    """Its layers replaced in place, the tensors left (norms, embeddings) are copied out of the
    checkpoint's memory map, so the map, the whole float32 checkpoint, goes (the 0.5B draft's
    worker held 3.48 GB resident after loading with it, 2.05 GB without; int8 1.75 GB). A copy of
    the checkpoint of its own: no other test's model maps it."""
    checkpoint = Path(shutil.copytree(tiny_models.target, tmp_path / "checkpoint"))
    loaded = load_model(str(checkpoint), INT4)
    assert str(checkpoint) not in Path("/proc/self/maps").read_text()
    assert loaded.model.model.embed_tokens.weight.shape[0] == loaded.vocab_size


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (LoadOptions(device="cpu", quantize="int4", cpu_kernel="packed"), "own int4 kernels"),
        (LoadOptions(device="cpu", dtype="bfloat16", quantize="int4"), "quantizes a float32 model .* not bfloat16"),
        (LoadOptions(device="cpu", quantize="int3"), "must be none, int8 or int4"),
    ],
    ids=["packed", "bfloat16", "unknown"],
)
def test_an_int4_draft_the_load_cannot_make_is_refused(
    tiny_models: TinyModels, options: LoadOptions, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(str(tiny_models.target), options)


def test_int4_is_a_cpu_option(tiny_models: TinyModels) -> None:
    """Asked on a device other than the CPU (meta here, as this host may have no GPU), the load
    says so before reading the checkpoint."""
    with pytest.raises(ValueError, match="--quantize int4 is a CPU option"):
        load_model(str(tiny_models.target), LoadOptions(device="meta", quantize="int4"))
