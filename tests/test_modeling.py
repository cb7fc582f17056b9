"""Model loading options: the packed oneDNN Linear kernel for CPU float32 and bfloat16 models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.runtime import modeling
from specdec.runtime.cachelayers import cache_argument
from specdec.runtime.modeling import (
    LoadOptions,
    PackedLinear,
    load_model,
    packed_linear_available,
    use_packed_linear,
)
from specdec.runtime.quantize import quantize_int8
from specdec.runtime.tokenizer import load_tokenizer
from tests.tiny_models import TinyModels, build_family, build_tokenizer, build_weight_reading

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48), (1, 1, 48), (300, 48)])
def test_packed_linear_computes_what_nn_linear_computes(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).requires_grad_(False)
    x = torch.randn(shape)
    packed = PackedLinear(linear)
    got = packed(x)
    assert got.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    assert "in_features=48, out_features=80" in repr(packed)


def _kernel_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts PackedLinear's kernel calls are given from now on (they still compute)."""
    kernel, seen = modeling._inner_product, []

    def spy(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(rows.shape[0])
        return kernel(rows, weight, bias)

    monkeypatch.setattr(modeling, "_inner_product", spy)
    return seen


@pytest.mark.parametrize(
    ("shape", "kernel_rows"),
    [((259, 96), 264), ((1, 259, 96), 264), ((2, 130, 96), 264), ((1, 264, 96), 264), ((1, 255, 96), 255)],
)
def test_long_passes_run_on_a_multiple_of_8_rows(
    shape: tuple[int, ...], kernel_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN's inner product has slow row counts (on an Intel Xeon guest the target's prefill of
    259 rows took 3.4-3.5 s, of 257 or 260 rows 2.3-2.5 s): a pass of 256 rows or more runs on a
    multiple of 8 rows (zeros added, then dropped), and the real rows come out bit for bit as
    the kernel computes them without the padding."""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(96, 160).requires_grad_(False))
    x = torch.randn(shape)
    kernel = modeling._inner_product
    unpadded = kernel(x.reshape(-1, 96), packed.packed_weight, packed.bias)
    seen = _kernel_rows(monkeypatch)
    got = packed(x)
    assert seen == [kernel_rows]
    assert got.shape == (*shape[:-1], 160)
    assert torch.equal(got.reshape(-1, 160), unpadded)


NO_BF16 = pytest.mark.skipif(not modeling.packed_bfloat16_available(), reason="oneDNN computes no bf16 on this CPU")
PACKED_DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16", marks=NO_BF16)]


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize(("rows", "kernel_rows"), [(1, 4), (2, 4), (3, 4), (4, 4), (5, 5)])
def test_short_passes_run_on_4_rows(
    rows: int, kernel_rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN computes one row with another kernel than several, slower on the memory-bound CPU
    host (the 1.5B target's one-token pass 1.14x the time of the same pass on 4 rows in float32,
    1.06x-1.20x in bfloat16 on a host with avx512_bf16): a pass of fewer than 4 rows runs on 4, zeros
    added, and its rows come out as the kernel computes them among others."""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(96, 160).to(dtype).requires_grad_(False))
    x = torch.randn(1, rows, 96, dtype=dtype)
    kernel = modeling._inner_product
    seen = _kernel_rows(monkeypatch)
    got = packed(x)
    assert seen == [kernel_rows]
    assert got.shape == (1, rows, 160)
    others = torch.randn(8, 96, dtype=dtype)
    assert torch.equal(got[0], kernel(torch.cat([x[0], others]), packed.packed_weight, packed.bias)[:rows])
    assert packed(x[:, :0]).shape == (1, 0, 160)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_a_row_comes_out_the_same_alone_and_in_a_verify_pass(dtype: torch.dtype) -> None:
    """At the 1.5B target's shapes oneDNN's one-row kernel rounds differently from its kernel for
    several rows; with short passes run on 4 rows, a position is scored bit for bit alike in a
    one-token step and in a pass of any length (before: the last bits differed)."""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(1536, 4096).to(dtype).requires_grad_(False))
    x = torch.randn(17, 1536, dtype=dtype)
    alone = packed(x[:1])
    for rows in (2, 5, 9, 17):
        assert torch.equal(alone, packed(x[:rows])[:1])


def _llama(tied: bool) -> LlamaForCausalLM:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_model_decodes_the_same_greedy_tokens(tied: bool) -> None:
    model = _llama(tied)
    prompt = torch.tensor([[1, 70, 71, 72, 73, 74]])
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    reference_logits = model(expected).logits
    dense = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    assert use_packed_linear(model) == dense == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(model(expected).logits, reference_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40), expected)
    # untied: the dense projection weights are gone (not kept beside the packed copies); tied: the
    # embedding keeps the shared matrix
    params = dict(model.named_parameters())
    assert not any(name.endswith("proj.weight") for name in params)
    assert ("model.embed_tokens.weight" in params) and ("lm_head.weight" not in params)


def _linear_types(tiny_models: TinyModels) -> Callable[[LoadOptions], set[type]]:
    """The kinds of Linear layer the tiny target has once loaded with the options given."""

    def linear_types(options: LoadOptions) -> set[type]:
        model = load_model(str(tiny_models.target), options).model
        return {type(m) for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}

    return linear_types


def test_load_options_choose_the_kernel(tiny_models: TinyModels) -> None:
    linear_types = _linear_types(tiny_models)
    assert linear_types(LoadOptions(device="cpu")) == {PackedLinear}
    assert linear_types(LoadOptions(device="cpu", cpu_kernel="torch")) == {torch.nn.Linear}
    assert linear_types(LoadOptions(device="cpu", cpu_kernel="packed")) == {PackedLinear}
    # float16 and int8 are not packed by auto, and refuse an explicit request
    assert linear_types(LoadOptions(device="cpu", dtype="float16")) == {torch.nn.Linear}
    with pytest.raises(ValueError, match="float32 and bfloat16 models on the CPU"):
        load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float16", cpu_kernel="packed"))
    with pytest.raises(ValueError, match="own int8 kernels"):
        load_model(str(tiny_models.target), LoadOptions(device="cpu", quantize="int8", cpu_kernel="packed"))


def test_an_int8_draft_of_another_dtype_is_refused_at_load(tiny_models: TinyModels) -> None:
    """int8 quantizes a float32 model: asked of a bfloat16 one it loaded, and its first pass (the
    worker's start-up) failed on "expected scalar type Float but found BFloat16"."""
    with pytest.raises(ValueError, match=r"quantizes a float32 model .* not bfloat16; use it with --dtype float32"):
        load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="bfloat16", quantize="int8"))


@pytest.mark.parametrize("amx", [True, False])
def test_a_bfloat16_model_is_packed_wherever_onednn_computes_bfloat16(
    tiny_models: TinyModels, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 Linear layers packed for oneDNN beat ``nn.Linear``'s with AMX and without it (the
    1.5B target on the 2-core Intel Xeon host, oneDNN capped to avx512_bf16 by
    ONEDNN_MAX_CPU_ISA: a one-token step 148 ms against 195, a 9-token verify 208 against 290;
    capped to avx512_core_vnni: 149 against 176, 700 against 861): ``auto`` packs a bfloat16 model
    wherever oneDNN computes bfloat16, whether the CPU has AMX or not (on main it packed only
    where it had AMX); an explicit ``packed`` likewise, and says so where oneDNN does not."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    linear_types = _linear_types(tiny_models)
    auto = LoadOptions(device="cpu", dtype="bfloat16")
    packed = LoadOptions(device="cpu", dtype="bfloat16", cpu_kernel="packed")
    if modeling.packed_bfloat16_available():
        assert linear_types(auto) == {PackedLinear}
        assert linear_types(packed) == {PackedLinear}
    else:
        assert linear_types(auto) == {torch.nn.Linear}
        with pytest.raises(ValueError, match="bfloat16"):
            load_model(str(tiny_models.target), packed)
    assert linear_types(LoadOptions(device="cpu", dtype="bfloat16", cpu_kernel="torch")) == {torch.nn.Linear}


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_a_packed_bfloat16_linear_computes_what_nn_linear_computes(rows: int) -> None:
    """Within bfloat16's rounding of the same product (both against float32 arithmetic on the same
    bfloat16 weights and inputs); where oneDNN has no bfloat16 kernel here, packing refuses."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    if not modeling.packed_bfloat16_available():
        with pytest.raises(RuntimeError):
            PackedLinear(linear)(x)
        return
    exact = x.float() @ linear.weight.float().T + linear.bias.float()
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(linear(x).float(), exact, rtol=2e-2, atol=2e-2)


def _verify_block_argmax(model: torch.nn.Module, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    out = model(ids[:, :prefix], use_cache=True)
    return model(ids[:, prefix:], **cache_argument(model, out.past_key_values)).logits.argmax(-1)


def test_packed_and_torch_kernels_agree_on_a_verify_block(tiny_models: TinyModels) -> None:
    """The target's block verification (several rows on a KV cache) sees the same argmaxes."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_models.target).eval().requires_grad_(False)
    packed = load_model(str(tiny_models.target), LoadOptions(device="cpu")).model
    ids = torch.tensor([[1, *range(80, 110)]])
    assert torch.equal(_verify_block_argmax(packed, ids, 20), _verify_block_argmax(reference, ids, 20))


def test_int8_gives_each_output_row_its_own_scale(tiny_models: TinyModels) -> None:
    """A weight's rows can differ in size by orders of magnitude (in Qwen2.5-Coder-0.5B the largest
    row's largest entry is up to 104x the median row's); one scale for the whole weight rounds the
    small rows away. Each row gets its own (per-channel), which made that draft agree with the
    1.5B target on 926 instead of 902 of 1,024 tokens at the same cost (docs/performance.md: CPU specifics)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8, bias=False).requires_grad_(False)
    linear.weight[4:] *= 1e-3  # half the rows a thousand times smaller than the others
    x = torch.randn(16, 64)
    exact = linear(x)
    got = quantize_int8(torch.nn.Sequential(linear))(x)
    small_error = (got[:, 4:] - exact[:, 4:]).norm() / exact[:, 4:].norm()
    assert small_error < 0.02  # one shared scale: 1.0 (every small weight rounds to zero)

    model = load_model(str(tiny_models.other), LoadOptions(device="cpu", quantize="int8")).model
    schemes = {m.weight().qscheme() for m in model.modules() if hasattr(m, "weight") and callable(m.weight)}
    assert schemes == {torch.per_channel_affine}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/no/such/model", "no such directory"),
        ("./models/qwen", "no such directory"),
        ("~/models/qwen", "no such directory"),
        ("models/qwen/", "no such directory"),
        ("FILE", "is a file"),
        ("EMPTY_DIR", "holds no tokenizer"),
        ("TOKENIZER_ONLY", "holds no config.json"),
    ],
)
def test_a_model_source_that_is_not_a_checkpoint_says_so(tmp_path, source: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    """A mistyped path is reported as such, before Hugging Face takes it for a hub id ("Repo id
    must use alphanumeric chars ...") or asks for sentencepiece to read a directory that holds
    no tokenizer at all."""
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "EMPTY_DIR").mkdir()
    build_tokenizer().save_pretrained(tmp_path / "TOKENIZER_ONLY")
    path = str(tmp_path / source) if source.isupper() else source
    with pytest.raises(ValueError, match=expected) as error:
        modeling.load_model(path, modeling.LoadOptions(device="cpu"))
    assert path in str(error.value)
    if source != "TOKENIZER_ONLY":  # a tokenizer directory is all a tokenizer needs
        with pytest.raises(ValueError, match=expected):
            load_tokenizer(path)
    else:
        assert len(load_tokenizer(path)) == len(build_tokenizer())


@pytest.mark.parametrize("arch", ["MambaConfig", "JambaConfig", "Qwen3NextConfig"])
def test_a_model_with_recurrent_layers_is_refused_at_load(tmp_path, arch: str) -> None:  # type: ignore[no-untyped-def]
    """A Mamba or linear-attention layer's state (every layer's, or some layers' as in Jamba and
    Qwen3-Next) cannot be cut back to an earlier token, which speculative decoding does in every
    round a draft is rejected: such a model is refused at load, saying why and what to serve
    instead (before: the worker's start-up failed on "'LinearAttentionLayer' object has no
    attribute 'keys'" while sizing its cache budget)."""
    tokenizer = build_tokenizer()
    small = {"vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 2, "pad_token_id": 0}
    if arch == "JambaConfig":  # one Mamba layer, one attention layer
        small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "num_experts": 2}
        small |= {"attn_layer_period": 2, "attn_layer_offset": 1, "use_mamba_kernels": False}
    if arch == "Qwen3NextConfig":  # gated delta-net (linear attention) layers and attention layers
        small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64}
        small |= {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8}
        small |= {"linear_value_head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1}
        small |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    config = getattr(transformers, arch)(**small)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="recurrent state") as error:
        modeling.load_model(str(tmp_path), modeling.LoadOptions(device="cpu"))
    assert str(tmp_path) in str(error.value) and "attention" in str(error.value)


def test_a_model_whose_code_reads_a_linear_weight_is_told_to_use_the_torch_kernel(
    tmp_path, tiny_models: TinyModels
) -> None:  # type: ignore[no-untyped-def]
    """The packed CPU kernel keeps no dense weight; a model whose own code reads a Linear layer's
    weight (its dtype, say) is refused at load with the kernel to use instead, and runs with it
    (before: start-up failed on "'PackedLinear' object has no attribute 'weight'")."""
    path = build_weight_reading(tiny_models.target, tmp_path / "reading")
    with pytest.raises(ValueError, match="--cpu-kernel torch") as error:
        load_model(str(path), LoadOptions(device="cpu", trust_remote_code=True))
    assert str(path) in str(error.value) and "weight" in str(error.value)
    loaded = load_model(str(path), LoadOptions(device="cpu", cpu_kernel="torch", trust_remote_code=True))
    assert loaded.model(torch.tensor([[5, 9]])).logits.shape[-1] == loaded.vocab_size


STACKS = ["LlamaConfig", "GptOssConfig", "DeepseekV3Config", "GPT2Config", "GPTBigCodeConfig", "GPTNeoXConfig"]
STACKS += ["FalconConfig", "BloomConfig", "OPTConfig"]  # families whose layer stacks are named otherwise
STACKS += ["Llama4TextConfig"]  # whose get_decoder() is the causal LM itself


@pytest.mark.parametrize("family", STACKS)
def test_an_early_exit_draft_is_its_checkpoints_first_layers(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    """``--draft-layers 1`` gives the logits of the same checkpoint loaded with one layer (the
    final norm and output layer kept), whatever the decoder calls its layer stack (``layers``,
    GPT-2's ``h``, OPT's ``decoder.layers``; before, those were refused as not decoder-only)."""
    path = build_family(tmp_path / family, family)
    draft = load_model(str(path), LoadOptions(device="cpu", layers=1))
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    one_layer = AutoModelForCausalLM.from_pretrained(path, config=config).eval()
    ids = torch.tensor([[5, 6, 7, 100, 3]])
    with torch.no_grad():
        torch.testing.assert_close(draft.model(ids).logits, one_layer(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="between 1 and 1"):
        load_model(str(path), LoadOptions(device="cpu", layers=2))
