"""Tiny random Llama-style models and a byte-level tokenizer, built from a config (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<s>", "</s>", "<pad>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: 256 byte tokens + <s>, </s>, <pad> (259 ids)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for name in SPECIALS:
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE: a few words, every other character as UTF-8 byte tokens
    (<0x00>..<0xFF>), "▁" for spaces; decoding strips the first space and turns a run of byte
    tokens into its characters, or one U+FFFD per byte where the run is not valid UTF-8."""
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "▁a", "▁the", "▁hello", "▁world", "中", "文"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(
    path: Path,
    seed: int,
    hidden: int,
    layers: int,
    vocab: int,
    init_range: float = 0.02,
    context: int = 256,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Saves a random Llama with ``tokenizer`` (default: the byte tokenizer) at ``path``."""
    tokenizer = tokenizer or build_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_variant(target: Path, path: Path, noise: float, scale: float = 1.0) -> Path:
    """The target with its output layer changed: ``noise < 0`` negates it (its favourite token is
    the target's least likely); ``noise > 0`` adds Gaussian noise (right some of the time);
    ``scale`` multiplies it (> 1: surer of its favourites than the target)."""
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.mul_(scale)
        if noise < 0:
            weight.neg_()
        else:
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * noise)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def build_sharp(target: Path, path: Path) -> Path:
    """A draft sure where it is right: the target's output layer noised and sharpened (it agrees
    on about 71% of the tiny target's greedy tokens, 92% of its guesses above 0.8 right, 43% of
    those at 0.4-0.6), where the noisy model's probabilities, all below 0.25, say little."""
    return build_variant(target, path, noise=0.2, scale=5)


def build_on_int4_grid(source: Path, path: Path, group: int = 32) -> Path:
    """``source`` with every Linear weight rounded to the grid ``--quantize int4`` keeps (each group
    of ``group`` inputs 16 levels from its least to its greatest value, the scale and the offset in
    bfloat16), as a checkpoint dequantized from 4-bit GGUF is (the benchmark's): int4 then keeps
    its weights as they are, where the tiny models' random ones lose enough to flip their near ties."""
    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                out, inputs = module.weight.shape
                groups = module.weight.reshape(out, inputs // group, group)
                low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
                scale = ((high - low) / 15).to(torch.bfloat16).float()
                offset = (low + 8 * scale).to(torch.bfloat16).float()
                levels = ((groups - offset) / scale + 8).round().clamp(0, 15)
                module.weight.copy_(((levels - 8) * scale + offset).reshape(out, inputs))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def build_bigram(target: Path, path: Path) -> Path:
    """The target with every attention output projection zeroed: each position sees only its own
    token, so the next-token distribution depends on the last token alone. Its greedy output
    soon cycles, which a lookup draft predicts (the copy-heavy text real lookup drafts are for)."""
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@dataclass(frozen=True)
class TinyModels:
    target: Path
    same: Path  # a copy of the target: every draft token is accepted
    other: Path  # an unrelated, smaller random model with the same tokenizer
    adversarial: Path  # proposes the target's least likely token: every greedy draft is rejected
    noisy: Path  # the target with a perturbed output layer: right some of the time
    bigram: Path  # the target without attention: the next token depends on the last one only


def build_tiny_models(root: Path) -> TinyModels:
    vocab = len(build_tokenizer())
    target = build_model(root / "target", seed=0, hidden=64, layers=2, vocab=vocab, init_range=0.2)
    same = build_model(root / "same", seed=0, hidden=64, layers=2, vocab=vocab, init_range=0.2)
    other = build_model(root / "other", seed=1, hidden=32, layers=1, vocab=vocab, init_range=0.2)
    adversarial = build_variant(target, root / "adversarial", noise=-1)
    noisy = build_variant(target, root / "noisy", noise=0.03)
    bigram = build_bigram(target, root / "bigram")
    return TinyModels(target=target, same=same, other=other, adversarial=adversarial, noisy=noisy, bigram=bigram)


_CRASHY_CODE = '''
"""A Llama whose forward pass raises when it sees a chosen token id (fault-injection tests)."""
from transformers import LlamaConfig, LlamaForCausalLM


class CrashyConfig(LlamaConfig):
    model_type = "crashy_llama"

    def __init__(self, crash_token_id=13, **kwargs):
        self.crash_token_id = crash_token_id
        super().__init__(**kwargs)


class CrashyLlamaForCausalLM(LlamaForCausalLM):
    config_class = CrashyConfig

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == self.config.crash_token_id).any()):
            raise RuntimeError("injected failure inside the forward pass")
        return super().forward(input_ids=input_ids, **kwargs)
'''


_STALLING_CODE = '''
"""A Llama whose forward pass sleeps once, on its Nth call of a given width (a worker's CPU stalled),
pass_s in every pass (a larger model's usual cost) and wide_s in every pass of at least wide_from
tokens (a prompt's prefill on slow hardware)."""
import time

from transformers import LlamaConfig, LlamaForCausalLM


class StallingConfig(LlamaConfig):
    model_type = "stalling_llama"

    def __init__(self, stall_call=10, stall_s=0.3, stall_width=1, pass_s=0.0, wide_from=0, wide_s=0.0, **kwargs):
        self.stall_call = stall_call
        self.stall_s = stall_s
        self.stall_width = stall_width
        self.pass_s = pass_s
        self.wide_from = wide_from
        self.wide_s = wide_s
        super().__init__(**kwargs)


class StallingLlamaForCausalLM(LlamaForCausalLM):
    config_class = StallingConfig
    calls = 0  # of the stall width

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[-1] == self.config.stall_width:
            StallingLlamaForCausalLM.calls += 1
            if StallingLlamaForCausalLM.calls == self.config.stall_call:
                time.sleep(self.config.stall_s)
        if self.config.pass_s:
            time.sleep(self.config.pass_s)
        if self.config.wide_s and input_ids is not None and input_ids.shape[-1] >= self.config.wide_from:
            time.sleep(self.config.wide_s)
        return super().forward(input_ids=input_ids, **kwargs)
'''


_WEIGHT_READING_CODE = '''
"""A Llama whose forward pass reads a Linear layer's weight (its dtype), as some model code does."""
from transformers import LlamaConfig, LlamaForCausalLM


class ReadingConfig(LlamaConfig):
    model_type = "reading_llama"


class ReadingLlamaForCausalLM(LlamaForCausalLM):
    config_class = ReadingConfig

    def forward(self, input_ids=None, **kwargs):
        assert self.model.layers[0].mlp.down_proj.weight.dtype.is_floating_point
        return super().forward(input_ids=input_ids, **kwargs)
'''


_PLAIN_CODE = '''
"""A Llama whose forward pass takes only the arguments model code written before transformers'
``logits_to_keep`` took (and computes every position's logits)."""
from transformers import LlamaConfig, LlamaForCausalLM


class PlainConfig(LlamaConfig):
    model_type = "plain_llama"


class PlainLlamaForCausalLM(LlamaForCausalLM):
    config_class = PlainConfig

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=use_cache,
        )
'''


def build_plain_forward(source: Path, path: Path) -> Path:
    """A copy of ``source`` whose forward pass takes no ``logits_to_keep`` (nor ``**kwargs``)."""
    return _with_code(source, path, _PLAIN_CODE, "plain")


def _with_code(source: Path, path: Path, code: str, name: str, **config_values: object) -> Path:
    """A copy of ``source`` (same weights and tokenizer) whose model class is ``name`` Llama, defined
    by ``code`` (loaded with --trust-remote-code)."""
    import json
    import shutil

    shutil.copytree(source, path)
    module = f"modeling_{name}"
    (path / f"{module}.py").write_text(code)
    config = json.loads((path / "config.json").read_text())
    title = name.capitalize()
    config.update(
        model_type=f"{name}_llama",
        architectures=[f"{title}LlamaForCausalLM"],
        auto_map={
            "AutoConfig": f"{module}.{title}Config",
            "AutoModelForCausalLM": f"{module}.{title}LlamaForCausalLM",
        },
        **config_values,
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def build_crashy(source: Path, path: Path, crash_token_id: int) -> Path:
    """A copy of ``source`` whose forward raises on ``crash_token_id``."""
    return _with_code(source, path, _CRASHY_CODE, "crashy", crash_token_id=crash_token_id)


def build_weight_reading(source: Path, path: Path) -> Path:
    """A copy of ``source`` whose forward pass reads an MLP projection's weight."""
    return _with_code(source, path, _WEIGHT_READING_CODE, "reading")


def build_stalling(
    source: Path,
    path: Path,
    stall_call: int,
    stall_s: float,
    width: int = 1,
    pass_s: float = 0.0,
    wide_from: int = 0,
    wide_s: float = 0.0,
) -> Path:
    """A copy of ``source`` whose forward sleeps ``stall_s`` once, on its ``stall_call``-th call of
    ``width`` tokens (1: a draft's one-token steps; K + 1: a target's verify pass of a K block; a
    worker's start-up passes count, one of each width up to its --warm-up-widths),
    ``pass_s`` in every pass (a target that costs more than its draft, as a deployed one does) and
    ``wide_s`` in every pass of at least ``wide_from`` tokens (a draft on a CPU beside a GPU target:
    its prompt's prefill is slow, its steps are not)."""
    config = {
        "stall_call": stall_call, "stall_s": stall_s, "stall_width": width, "pass_s": pass_s,
        "wide_from": wide_from, "wide_s": wide_s,
    }  # fmt: skip
    return _with_code(source, path, _STALLING_CODE, "stalling", **config)


# What every pass of a deployed-like target costs on top of its own (build_dearer_target).
TARGET_EXTRA_PASS_S = 0.012


def build_dearer_target(source: Path, path: Path) -> Path:
    """A copy of ``source`` whose every pass takes TARGET_EXTRA_PASS_S more, as a deployed target
    costs several times its draft. With a draft as costly as its target (the tiny target's own
    weights), speculation leads target-only decoding by little, so a busy host makes some rounds
    target-only on their merits: tests that count an adaptive turn's rounds use this target."""
    return build_stalling(source, path, stall_call=0, stall_s=0.0, pass_s=TARGET_EXTRA_PASS_S)


def build_resized(source: Path, path: Path, vocab: int, extra_scale: float | None = None) -> Path:
    """``source`` with its embedding and output layer padded (or cut) to ``vocab`` rows, as padded
    checkpoints of one model family differ (the same tokenizer). With ``extra_scale``, the extra
    output rows are copies of the first rows times it (above 1: the padded ids often win); else
    they keep transformers' initialisation of new rows (the mean row: rarely the top)."""
    model = LlamaForCausalLM.from_pretrained(source)
    old = model.config.vocab_size
    with torch.no_grad():
        lm_head = model.lm_head.weight.clone()
        model.resize_token_embeddings(vocab)
        if vocab > old and extra_scale is not None:
            extra = vocab - old
            model.lm_head.weight[old:] = lm_head[:extra] * extra_scale
            model.get_input_embeddings().weight[old:] = model.get_input_embeddings().weight[:extra]
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _save_random(
    path: Path, config: object, tokenizer: PreTrainedTokenizerBase, seed: int, std: float | None = None
) -> Path:
    """Saves a model of ``config`` with random weights (seeded; with ``std``, every matrix drawn
    anew with that standard deviation, so that its logits are far from flat) and ``tokenizer``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if std is not None:
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() > 1:
                    weight.normal_(std=std)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_sliding(
    path: Path, arch: str, seed: int, window: int = 16, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """A tiny random model of an architecture whose attention is windowed in some layers
    (``mistral``, ``gemma2``, ``gemma3``, ``phi3``: a sliding window; ``llama4``: chunks of
    ``window`` positions, one layer of four whole; ``gemma4``: windowed and whole layers, the last
    two of four reading the keys and values of earlier ones), with ``tokenizer`` (default: the
    byte tokenizer)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        Gemma4TextConfig,
        Llama4TextConfig,
        MistralConfig,
        Phi3Config,
    )

    tokenizer = tokenizer or build_tokenizer()
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "sliding_window": window,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    configs = {
        "mistral": lambda: MistralConfig(**common),
        "gemma2": lambda: Gemma2Config(head_dim=8, **common),
        "gemma3": lambda: Gemma3TextConfig(head_dim=8, sliding_window_pattern=2, **common),
        "phi3": lambda: Phi3Config(**common),
        "llama4": lambda: Llama4TextConfig(
            **{**common, "sliding_window": None, "num_hidden_layers": 4},
            head_dim=8,
            attention_chunk_size=window,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        "gemma4": lambda: Gemma4TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=8,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=len(tokenizer),
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    }
    return _save_random(path, configs[arch](), tokenizer, seed)


_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}
_MLA = {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64, "q_lora_rank": 16}
_MLA |= {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4}
_MLA |= {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
# Model families by transformers config class, with the fields a tiny one needs beyond the common ones.
FAMILIES: dict[str, dict[str, object]] = {
    "LlamaConfig": _ATTENTION,
    "Qwen2Config": _ATTENTION,
    "Qwen3MoeConfig": {
        **_ATTENTION,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "MixtralConfig": {**_ATTENTION, "num_local_experts": 4, "num_experts_per_tok": 2},
    "GemmaConfig": {**_ATTENTION, "head_dim": 8},
    "PhiConfig": {"num_attention_heads": 4, "intermediate_size": 64},  # partial rotary, parallel blocks
    "GPT2Config": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256},  # learned absolute positions
    "GPTNeoXConfig": {"num_attention_heads": 4, "intermediate_size": 64},
    "FalconConfig": {"num_attention_heads": 4, "new_decoder_architecture": True, "num_kv_heads": 2},
    "BloomConfig": {"n_head": 4},  # ALiBi
    "OPTConfig": {"ffn_dim": 64, "num_attention_heads": 4, "word_embed_proj_dim": 32},
    "CohereConfig": _ATTENTION,
    "SmolLM3Config": _ATTENTION,  # some layers without rotary positions
    "DeepseekV3Config": _MLA,  # multi-head latent attention, routed experts
    "Starcoder2Config": {**_ATTENTION, "sliding_window": 16},
    "GptOssConfig": {
        **_ATTENTION,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
    },
    "Cohere2Config": {**_ATTENTION, "sliding_window": 16},
    "Qwen3Config": {**_ATTENTION, "head_dim": 8},
    "Olmo2Config": _ATTENTION,
    "GraniteConfig": _ATTENTION,
    "Glm4Config": _ATTENTION,
    "Phi3Config": _ATTENTION,
    "StableLmConfig": _ATTENTION,
    "GPTBigCodeConfig": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "Exaone4Config": {**_ATTENTION, "sliding_window": 16},
    "ApertusConfig": _ATTENTION,
    "HunYuanDenseV1Config": {**_ATTENTION, "head_dim": 8},
    "Ernie4_5Config": _ATTENTION,
    "SeedOssConfig": {**_ATTENTION, "head_dim": 8},
    "DeepseekV2Config": _MLA,
    # routed experts and layers without rotary positions; its causal LM's get_decoder() is the model itself
    "Llama4TextConfig": {**_ATTENTION, "head_dim": 8, "intermediate_size_mlp": 64, "num_local_experts": 2}
    | {"num_experts_per_tok": 1},
    # the last two of four layers read the keys and values of earlier ones (KV sharing), windowed and whole
    "Gemma4TextConfig": {**_ATTENTION, "head_dim": 8, "num_hidden_layers": 4, "num_kv_shared_layers": 2}
    | {"sliding_window": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 259}
    | {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "Gemma3nTextConfig": {**_ATTENTION, "head_dim": 8, "num_hidden_layers": 4, "num_kv_shared_layers": 2}
    | {"sliding_window": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 259}
    | {"layer_types": ["sliding_attention", "full_attention"] * 2, "altup_num_inputs": 2, "laurel_rank": 4}
    | {"activation_sparsity_pattern": [0.0] * 4},
}


def build_family(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random model of a FAMILIES config class (2 layers, 32 wide, 256 positions; weights
    drawn with standard deviation 0.2, so that its logits are far from flat), with the byte
    tokenizer."""
    import transformers

    tokenizer = build_tokenizer()
    common = {"vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 2, "max_position_embeddings": 256}
    common |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = getattr(transformers, family)(pad_token_id=tokenizer.pad_token_id, **{**common, **FAMILIES[family]})
    return _save_random(path, config, tokenizer, seed, std=0.2)


def build_gemma3_with_vision(path: Path, seed: int = 0) -> Path:
    """A tiny Gemma-3 as its 4B and larger checkpoints come: a text decoder (windowed and whole
    layers, 16 positions) with a vision tower, whose config keeps the text model's fields (EOS,
    positions, layers) in ``text_config``. AutoModelForCausalLM loads it as
    Gemma3ForConditionalGeneration."""
    import transformers

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    text = transformers.Gemma3TextConfig(
        **_ATTENTION,
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        head_dim=8,
        sliding_window=16,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        **ids,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 2,
        eoi_token_index=vocab - 3,
    )
    return _save_random(path, config, tokenizer, seed, std=0.2)


def build_text_bigram(
    path: Path, tokenizer: PreTrainedTokenizerBase, text: str, seed: int, strength: float, noise: float
) -> Path:
    """A model of ``text`` read in a loop, for drafting across tokenizers: the next token depends on
    the last one only; after each token of ``tokenizer.encode(text)`` its successor in the text (the
    last one's is the first) gets logit ``strength`` plus Gaussian ``noise``, the other tokens of the
    text get ``noise`` alone, every other id about -100. Two of these over one text and two
    tokenizers are a target and a draft that agree on the text but not on its tokens.

    Built from the weights: one layer with its attention and MLP outputs zeroed; the embedding of
    the i-th text token is e_i + e_c (c a constant dimension) and the LM head reads the table off it.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(set(ids)) != len(ids):
        raise ValueError("every token of the text must occur once")
    hidden = -(-(len(ids) + 1) // 8) * 8  # 4 attention heads of an even size
    const = hidden - 1
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    scale = (hidden / 2) ** 0.5  # RMS-normalising e_i + e_c multiplies it by this
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.lm_head.weight
        embed.zero_()
        embed[:, const] = 1.0
        head.zero_()
        head[:, const] = -100.0 / scale
        for row, token in enumerate(ids):
            embed[token, row] = 1.0
            head[token, const] = 0.0
        for row, _ in enumerate(ids):
            successor = ids[(row + 1) % len(ids)]
            column = torch.randn(len(ids), generator=generator) * noise
            for j, token in enumerate(ids):
                head[token, row] = (column[j] + (strength if token == successor else 0.0)) / scale
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
