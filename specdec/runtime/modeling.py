"""Loading Hugging Face causal LMs and tokenizers (local directory or hub id)."""

from __future__ import annotations

import ctypes
import gc
import sys
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from specdec.runtime.attention import use_grouped_attention
from specdec.runtime.devices import resolve_device, resolve_dtype
from specdec.runtime.fusion import fuse_projections
from specdec.runtime.grammar import GrammarMasks
from specdec.runtime.output_vocab import read_output_vocab, restrict_output
from specdec.runtime.quantize import copy_out_of_checkpoint, quantize_int4, quantize_int8
from specdec.runtime.tokenizer import check_source, load_tokenizer, tokenizer_fingerprint

log = structlog.get_logger(__name__)

PAD_FROM_ROWS = 256  # a PackedLinear pass of at least this many rows runs on a multiple of ROW_MULTIPLE rows
ROW_MULTIPLE = 8
MIN_ROWS = 4  # a PackedLinear pass of fewer rows runs on this many
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # the weights PackedLinear packs


class PackedLinear(torch.nn.Module):
    """A CPU fp32 or bf16 Linear layer whose weight is stored pre-packed in oneDNN's blocked layout.

    ``nn.Linear`` on CPU re-packs the weight matrix on every call for a few rows (BLAS GEMM) or
    runs a single-threaded-bandwidth GEMV for one row; both read far more memory than the weights
    themselves, and on a memory-bound host that is the whole cost. Packing once at load time and
    calling oneDNN's inner product with the packed weight measured, on the benchmark's 2-core
    host (Qwen2.5 1.5B shapes): 1 row 8.3 -> 6.7 ms, 5 rows 24.9 -> 8.9 ms, 8 rows 23.3 -> 10.0 ms
    per MLP+attention projection set. Results equal ``nn.Linear`` up to float rounding (the
    summation order differs), as any other kernel choice would. A bf16 layer runs on the CPU's
    AMX tiles where it has them: the 1.5B target's one-token step 158 ms against 270 in fp32 (both
    packed), a 9-row verify 164 against 345, a 250-token prefill 0.54 s against 2.39 (2-core Intel
    Xeon with AMX, median of 10 and 5). Without AMX packed bf16 still beats ``nn.Linear``'s bf16
    (the same host with oneDNN capped by ONEDNN_MAX_CPU_ISA, 3 passes each: avx512_bf16 one token
    147-153 ms against 195-207, 9 rows 207-217 against 287-297; avx512_core_vnni 146-151 against
    176-225, 698-700 against 861-886; a 256-row prefill no slower); on a real avx512_bf16 CPU
    without AMX (a 2-core AMD EPYC guest) packed bf16 beat packed fp32 too: a one-token step 147
    against 228 ms, a 250-token prefill 1.68 against 3.20 s (docs/performance.md, CPU specifics).

    A pass of ``PAD_FROM_ROWS`` rows or more (a prefill) runs on a multiple of ``ROW_MULTIPLE``
    rows, zeros added and their outputs dropped: oneDNN's blocking makes some row counts slow
    (on a 2-core Intel Xeon guest with AMX, Qwen2.5 1.5B's whole prefill of 259 rows took
    3.4-3.5 s, padded to 264 rows 2.4-2.6 s, 257 or 260 rows 2.3-2.5 s; over 16 random prompt
    lengths of 200-520 tokens padding was 0.985x the time in all; the four Linear shapes of a
    layer alone 0.998x over the counts of 256-519 rows that are not multiples of 8, 1.03-1.05x
    below 256, hence the threshold). The real rows come out bit for bit as without the padding.

    A pass of fewer than ``MIN_ROWS`` rows (a one-token decoding step, a short verify block) runs
    on ``MIN_ROWS`` rows, zeros added. oneDNN computes a single row with another kernel than two
    or more, slower on the memory-bound 2-core AMD EPYC guest: in float32 the 1.5B target's whole
    pass through the workers' cache path (100 cached tokens, median of 20 interleaved) took 288 ms
    for one row and 247-260 ms for 4-6; its layer shapes alone were fastest at 4-6 rows (the
    output layer 38.2 ms for 1 row, 41.8 for 2, 35.4 for 4). In bfloat16, on such a guest with
    avx512_bf16 (no AMX), its one-token pass took 128.5 ms alone and 120.7 ms on 4 rows, a 2-token
    pass 147.2 and 116.5 ms (120 cached tokens, medians of 36 and 12 in 12 interleaved rounds; an
    earlier round of 10: 126 / 105 and 140 / 105; not measured with AMX). With the padding every
    row of every pass comes out of these layers bit for bit as in any other pass of it (oneDNN
    gives a row the same result in passes of 2 to 64 rows, float32 and bfloat16, at the 1.5B's
    shapes; alone it differed in the last bits), so they score a position alike in a one-token
    step and in a verify pass.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if count >= PAD_FROM_ROWS:
            short = -count % ROW_MULTIPLE
        elif 0 < count < MIN_ROWS:
            short = MIN_ROWS - count
        else:
            short = 0
        if short:
            rows = torch.cat([rows, rows.new_zeros(short, self.in_features)])
        out = _inner_product(rows, self.packed_weight, self.bias)
        return out[:count].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _inner_product(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product of ``rows`` [N, in] with a weight packed by ``_reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


def packed_linear_available() -> bool:
    """Whether this torch build has the oneDNN CPU kernels PackedLinear needs."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_bfloat16_available() -> bool:
    """Whether PackedLinear can run a bf16 layer here: oneDNN computes bf16 on this CPU."""
    return packed_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def use_packed_linear(model: torch.nn.Module) -> int:
    """Replaces every fp32 or bf16 CPU nn.Linear of ``model`` with a PackedLinear; returns how many.

    An untied layer's dense weight is released (its memory goes to the packed copy); a weight
    shared with another module (tied input/output embeddings) stays for that module. The tensors
    left are copied out of the checkpoint's memory map, so that the map (the whole checkpoint) is
    unmapped instead of staying resident beside the packed copies.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child.weight.dtype in PACKED_DTYPES and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    copy_out_of_checkpoint(model)
    return len(targets)


def release_freed_memory() -> None:
    """Hands the heap that preparing a model freed back to the OS. Quantizing copies the model and
    drops the fp32 original, but glibc keeps freed heap for reuse: an int8 early-exit draft of
    Qwen2.5-Coder-1.5B (24 layers) held 6.37 GB after loading, 2.55 GB after this."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            log.debug("malloc_trim_unavailable")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with the facts a worker reports in Info."""

    model_id: str
    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer_hash: str
    grammar: GrammarMasks | None = None  # structured output; None: its tokenizer is not a fast one


@dataclass(frozen=True)
class LoadOptions:
    """How to load and prepare a model."""

    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # none | int8 | int4
    cpu_kernel: str = "auto"  # auto (packed for fp32 CPU models, bf16 ones where oneDNN computes bf16) | packed | torch
    trust_remote_code: bool = False
    layers: int = 0  # keep only the first N decoder layers (an early-exit draft); 0 = all
    output_vocab: str = ""  # a `specdec draft-vocab` file: score only its tokens (a draft); "" = all
    structured_output: bool = True  # build grammar masks (where the tokenizer allows them)


def load_model(model_id: str, options: LoadOptions | None = None) -> LoadedModel:
    """Loads model weights and tokenizer; raises with a clear message when either is missing."""
    options = options or LoadOptions()
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    _check_quantize(options, device, dtype)
    check_source(model_id)
    tokenizer = load_tokenizer(model_id, options.trust_remote_code)
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=options.trust_remote_code)
    _check_cache_rolls_back(model_id, config)
    model = AutoModelForCausalLM.from_pretrained(
        model_id, config=config, dtype=dtype, trust_remote_code=options.trust_remote_code
    )
    if options.layers:
        keep_first_layers(model, options.layers)
        model_id = f"{model_id} (first {options.layers} layers)"
    model = model.to(device).eval()
    model.requires_grad_(False)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    eos_token_ids, fingerprint = _eos_ids(model, tokenizer), tokenizer_fingerprint(tokenizer)
    if options.output_vocab:
        ids = read_output_vocab(options.output_vocab, fingerprint)
        kept = restrict_output(model, [*ids, *(i for i in eos_token_ids if i < vocab_size)])
        log.info("draft_vocab", path=options.output_vocab, kept=kept, vocab_size=vocab_size)
    if options.quantize != "none":
        log.info("fused_projections", modules=fuse_projections(model))
    if options.quantize == "int8":
        model = quantize_int8(model)
    elif options.quantize == "int4":
        int4, int8 = quantize_int4(model)
        log.info("quantized_int4", int4_layers=int4, int8_layers=int8)
    elif _wants_packed(options.cpu_kernel, device, dtype):
        use_packed_linear(model)
        _check_runs_packed(model_id, model, device)
    if device.type == "cpu":
        use_grouped_attention()
    release_freed_memory()
    loaded = LoadedModel(
        model_id=model_id,
        model=model,
        device=device,
        dtype=dtype,
        vocab_size=vocab_size,
        max_context_len=_context_len(model.config, tokenizer),
        eos_token_ids=eos_token_ids,
        tokenizer_hash=fingerprint,
        grammar=GrammarMasks.build(tokenizer, vocab_size, eos_token_ids) if options.structured_output else None,
    )
    log.info(
        "model_loaded",
        model=model_id,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        quantize=options.quantize,
        cpu_kernel=options.cpu_kernel,
        vocab_size=loaded.vocab_size,
        max_context_len=loaded.max_context_len,
    )
    return loaded


def _check_quantize(options: LoadOptions, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses a quantization the device, kernel or dtype asked for cannot have."""
    kind = options.quantize
    if kind not in ("none", "int8", "int4"):
        raise ValueError(f"--quantize must be none, int8 or int4, not {kind!r}")
    if kind == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"--quantize {kind} is a CPU option (torch's CPU kernels); use it with --device cpu")
    if options.cpu_kernel == "packed":
        raise ValueError(f"--quantize {kind} has its own {kind} kernels; use --cpu-kernel auto or torch with it")
    if dtype != torch.float32:
        raise ValueError(
            f"--quantize {kind} quantizes a float32 model (its activations stay float32), not {str(dtype)[6:]}; "
            "use it with --dtype float32 or auto"
        )


def text_config(config: Any) -> Any:
    """The config of the text decoder: ``config`` itself, or the text model's part of a model that
    also takes images or audio (Gemma-3 4B and larger, Gemma-4, Llama-4, Mistral-Small-3.1)."""
    return config.get_text_config(decoder=True)


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The model's decoder: transformers' ``get_decoder()``, which for a few causal LMs answers the
    model itself (Llama4ForCausalLM, whose base model prefix names the multimodal model's
    attribute): then its one child that is a model."""
    decoder = model.get_decoder()
    if decoder is model:
        inner = [child for child in model.children() if isinstance(child, PreTrainedModel)]
        if len(inner) == 1:
            return inner[0]
    return decoder


def keep_first_layers(model: PreTrainedModel, layers: int) -> None:
    """Cuts ``model`` to its first ``layers`` decoder layers, keeping the final norm and the LM
    head: an early-exit draft made of the target's own weights (LayerSkip's self-speculation
    without the extra training; how often it agrees with the full model is measured, not assumed).
    """
    config = text_config(model.config)
    count = config.num_hidden_layers
    decoder = decoder_of(model)
    stacks = [
        (name, child)
        for name, child in decoder.named_children()
        if isinstance(child, torch.nn.ModuleList) and len(child) == count
    ]
    if len(stacks) != 1:
        raise ValueError(
            f"{type(model).__name__}: no single stack of its {count} decoder layers was found to cut "
            "(--draft-layers); use a draft model instead"
        )
    name, stack = stacks[0]
    if not 0 < layers < count:
        raise ValueError(
            f"--draft-layers must be between 1 and {count - 1} for this model ({count} layers), got {layers}"
        )
    setattr(decoder, name, stack[:layers])
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]


def _check_runs_packed(model_id: str, model: torch.nn.Module, device: torch.device) -> None:
    """Runs a 2-token pass: a model whose own code reads a Linear layer's weight (its dtype, say)
    fails it, as PackedLinear keeps no dense weight; that is said at load, with the kernel to use."""
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[0, 1]], device=device), use_cache=False)
    except AttributeError as exc:
        if "PackedLinear" not in str(exc):
            raise
        raise ValueError(
            f"{model_id}'s code reads a Linear layer's weight ({exc}), which the packed CPU kernel does not "
            "keep; start it with --cpu-kernel torch"
        ) from exc


def _check_cache_rolls_back(model_id: str, config: Any) -> None:
    """Refuses a model whose KV cache keeps a recurrent state (Mamba or linear-attention layers:
    Mamba, Jamba, Qwen3-Next and the like): that state cannot be cut back to an earlier token,
    which speculative decoding does in every round a draft is rejected."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from specdec.runtime.cachelayers import new_cache

    layers = new_cache(config).layers
    recurrent = sum(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)
    if recurrent:
        kind = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ValueError(
            f"{model_id} ({kind}) keeps a recurrent state in {recurrent} of its {len(layers)} layers (Mamba or "
            "linear attention), which cannot be cut back to an earlier token as speculative decoding does "
            "whenever a draft is rejected; serve a model whose layers are all attention layers"
        )


def _context_len(config: Any, tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest sequence served: the model's positions (its tokenizer's limit where the config
    names none). A model with windowed attention is served to the same length: its caches' windowed
    layers can be cut back past the window (``cachelayers.WindowedLayer``)."""
    return int(getattr(text_config(config), "max_position_embeddings", 0) or tokenizer.model_max_length)


def packed_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``--cpu-kernel auto`` packs a model of ``dtype`` on ``device`` (the Benchmark's HF
    rows take the same kernel as the workers)."""
    return _wants_packed("auto", device, dtype)


def _wants_packed(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to pack the model's Linear layers; an explicit ``packed`` that cannot apply raises."""
    if choice == "torch":
        return False
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        problem = "is for float32 and bfloat16 models on the CPU"
    elif not packed_linear_available():
        problem = "needs a torch build with oneDNN (mkldnn)"
    elif dtype == torch.bfloat16 and not packed_bfloat16_available():
        problem = "needs a CPU on which oneDNN computes bfloat16 for a bfloat16 model"
    else:
        return True
    if choice == "packed":
        raise ValueError(f"--cpu-kernel packed {problem}; use auto or torch here")
    return False


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    candidates: list[Any] = []
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    candidates += [getattr(text_config(model.config), "eos_token_id", None), tokenizer.eos_token_id]
    for value in candidates:
        if value is None:
            continue
        ids = value if isinstance(value, list | tuple) else [value]
        return tuple(sorted({int(i) for i in ids}))
    return ()
