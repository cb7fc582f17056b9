"""Quantized Linear layers for a CPU draft: ``--quantize int8`` and ``--quantize int4``.

int8 (``quantize_int8``): torch's dynamic int8 layers, the weights int8 with a scale per output
row, each call's input quantized to int8 too.

int4 (``quantize_int4``): a draft's one-token step on a CPU reads every weight once, and where
the cores outrun memory its Linear layers cost what their weights weigh: int4 weights with their
scales weigh some 0.6 of int8's (Qwen2.5-Coder-0.5B: 309 MB against 494). Each row of a weight is
cut into groups of GROUP inputs, each group stored as 4-bit integers with a scale and an offset of
its own (the asymmetric scheme of llama.cpp's Q4_1 and Q4_K and of torch's int4 kernels); a pass
of one or two rows multiplies their bfloat16 values by them with torch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``, at bfloat16's precision) and hands back float32, so the rest of
the model (norms, attention, residual sums) stays float32. That kernel costs about a one-row pass
more for every further row, so a wider pass (a prefill, a catch-up, a block) runs on an int8 copy
of the layer instead, as ``--quantize int8`` runs it (a 250-token prefill of Qwen2.5-Coder-0.5B
1.22 s in int4, 0.39 s in int8). On one thread the kernel's arithmetic, not memory, bounds a step,
and int8's is faster (docs/performance.md, CPU specifics).

Either way the draft's proposals change as with any quantization; they stay exact, as the target
verifies the distribution the draft actually sampled from.
"""

from __future__ import annotations

import warnings

import torch

GROUP = 32  # inputs per group of a weight row sharing a scale and an offset
INT4_MAX_ROWS = 2  # passes of more rows run on the layer's int8 copy
_LEVELS = 15  # 4 bits: the integers 0..15
_MID = 8  # the kernel reads an integer q of a group as (q - 8) * scale + offset
_N_MULTIPLE = 16  # the kernel's packing takes a multiple of 16 output rows: others are padded


def quantized_from(dtype: str, quantize: str) -> str:
    """The ``--dtype`` a model is loaded in for ``--quantize``: int8 and int4 quantize a float32
    model (their activations stay float32), so float32 whatever ``dtype`` the rest of a run uses
    (a bfloat16 target beside an int8 draft); ``dtype`` without quantization."""
    return dtype if quantize == "none" else "float32"


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of the Linear layers (CPU): weights int8 with a scale per output
    row (per-channel), activations quantized per call. Meant for a CPU draft: about 3-4x faster per
    token; the draft's proposals change (they stay exact: the target verifies the distribution the
    draft actually sampled from). A scale per row instead of one per weight costs nothing per
    token and keeps the rows that are small next to others (measured on Qwen2.5-Coder-0.5B against
    the 1.5B's greedy replies to 16 code prompts: 926 of 1,024 tokens the same instead of 902)."""
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice; the API still works in torch 2.x
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8)


def int4_available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int4_quantizable(linear: torch.nn.Module) -> bool:
    """A plain float32 CPU nn.Linear whose inputs fill whole groups."""
    return (
        type(linear) is torch.nn.Linear
        and linear.weight.dtype == torch.float32
        and linear.weight.device.type == "cpu"
        and linear.in_features % GROUP == 0
    )


class Int4Linear(torch.nn.Module):
    """``linear`` with its weight quantized to int4 in groups of GROUP inputs for passes of up to
    INT4_MAX_ROWS rows, and to int8 for wider ones (see the module's note)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if not int4_quantizable(linear):
            raise ValueError(f"int4 needs a float32 CPU nn.Linear of a multiple of {GROUP} inputs, got {linear}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        rows = -(-self.out_features // _N_MULTIPLE) * _N_MULTIPLE
        if rows != self.out_features:  # zero rows, cut from the output again
            weight = torch.cat([weight, weight.new_zeros(rows - self.out_features, self.in_features)])
        groups = weight.reshape(rows, self.in_features // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        # the scale and the offset as the kernel reads them (bfloat16), and the integers rounded with those
        scale = ((high - low) / _LEVELS).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        offset = (low + scale.float() * _MID).to(torch.bfloat16)
        levels = ((groups - offset.float()) / scale.float() + _MID).round().clamp(0, _LEVELS)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.to(torch.int32).reshape(rows, self.in_features), 1
        )
        self.register_buffer("packed", packed)
        # [groups, rows, 2]: each group's scale and offset, the layout the kernel takes
        self.register_buffer("scales", torch.cat([scale, offset], -1).transpose(0, 1).contiguous())
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.wide = quantize_int8(torch.nn.Sequential(linear))[0]  # its own copy of the weight and bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > INT4_MAX_ROWS:
            return self.wide(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.packed, GROUP, self.scales)
        out = out[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            out += self.bias  # a tensor of its own: the conversion above copied it
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


def copy_out_of_checkpoint(model: torch.nn.Module) -> None:
    """Copies ``model``'s tensors out of the checkpoint's memory map, once its Linear layers are
    replaced in place by copies of their own (packed or quantized): the map (the whole checkpoint)
    is then unmapped instead of staying resident beside those copies."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if not tensor.is_mkldnn:
                tensor.data = tensor.data.clone()


def quantize_int4(model: torch.nn.Module) -> tuple[int, int]:
    """Replaces every Linear layer of ``model`` that int4 can hold with an Int4Linear, in place,
    and the others with int8 layers; returns how many of each. A weight tied to another module
    (input embeddings) stays float32 for that module; the tensors left are copied out of the
    checkpoint's memory map (``copy_out_of_checkpoint``)."""
    if not int4_available():
        raise ValueError("--quantize int4 needs torch's CPU int4 kernels, which this torch build lacks; use int8")
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    replaced = 0
    for parent, name, child in linears:
        if int4_quantizable(child):
            setattr(parent, name, Int4Linear(child))
            replaced += 1
        else:
            setattr(parent, name, quantize_int8(torch.nn.Sequential(child))[0])
    copy_out_of_checkpoint(model)
    return replaced, len(linears) - replaced
