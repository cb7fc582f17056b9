"""Translating between two real tokenizers (Qwen2.5 and SmolLM2): the TLI id map, the per-session
text mirror a draft of another vocabulary keeps, and SLEM's re-tokenization."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from specdec.runtime.tokens import common_prefix_len, prefix_hash
from specdec.runtime.vocab import TextMirror, VocabBridge, token_keys
from tests.helpers import opcodes, real_tokenizer
from tests.tiny_models import build_byte_fallback_tokenizer, build_tokenizer

TEXT = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th number (naïve recursion)."""\n'
    "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # 世界 😀 𓀀 ᚠᛇᚻ warms\n"
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return real_tokenizer("smollm2-135m", tmp_path_factory)


@pytest.fixture(scope="module")
def bridge(qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase) -> VocabBridge:
    """SmolLM2 drafting for Qwen (the draft's output layer one row wider than its tokenizer)."""
    return VocabBridge(smollm, qwen, len(smollm) + 1, "slem")


def test_tokens_meet_by_their_bytes_and_special_tokens_by_content(
    bridge: VocabBridge, qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase
) -> None:
    for piece in ["Ġthe", "Ġcat", "hello", "Ċ", "ĠĠĠ", "<|im_end|>", "<|endoftext|>"]:
        draft_id = smollm.convert_tokens_to_ids(piece)
        assert int(bridge.draft_to_target[draft_id]) == qwen.convert_tokens_to_ids(piece), piece
    warms = smollm.convert_tokens_to_ids("Ġwarms")  # one SmolLM2 token, two Qwen tokens
    assert int(bridge.draft_to_target[warms]) == -1
    assert int(bridge.draft_to_target[len(smollm)]) == -1  # a padded output row is no token
    # every mapped pair stands for the same text
    mapped = (bridge.draft_to_target >= 0).nonzero().flatten().tolist()
    for draft_id in random.Random(0).sample(mapped, 300):
        target_id = int(bridge.draft_to_target[draft_id])
        assert smollm.convert_ids_to_tokens(draft_id) == qwen.convert_ids_to_tokens(target_id)
    assert 30_000 < bridge.shared_tokens < len(smollm)
    cpu = torch.device("cpu")
    assert bool(bridge.proposable(0, cpu)[smollm.convert_tokens_to_ids("Ġthe")])
    assert not bool(bridge.proposable(100, cpu)[smollm.convert_tokens_to_ids("Ġthe")])  # above the target's limit


def test_byte_level_keys_are_bytes() -> None:
    keys = token_keys(build_tokenizer())
    assert set(keys[:256]) == {bytes([b]) for b in range(256)}  # each byte token stands for its byte
    assert keys[257] == "special:</s>"


@pytest.mark.parametrize("seed", range(5))
def test_the_mirror_keeps_the_committed_text_and_the_drafts_tokens(
    bridge: VocabBridge, qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase, seed: int
) -> None:
    """Committed target ids arriving in random chunks (some ending inside a character): the text is
    always the decoded complete prefix, at most 3 ids wait for a character's end, and the draft's
    tokens spell the text (their tokenization of it, re-made at the end)."""
    ids = qwen.encode(TEXT * 2)
    rng = random.Random(seed)
    mirror = TextMirror(bridge)
    committed = 0
    while committed < len(ids):
        committed = min(len(ids), committed + rng.randint(1, 6))
        mirror.update(len(mirror.target_ids), ids[len(mirror.target_ids) : committed])
        assert mirror.target_ids == ids[:committed]
        assert mirror.text == qwen.decode(ids[: mirror.clean]) and mirror.pending <= 3
        assert smollm.decode(mirror.draft_ids) == mirror.text
        if rng.random() < 0.2:  # a draft's proposal was rejected: the coordinator syncs the same prefix again
            mirror.update(committed, [])
    assert mirror.text == TEXT * 2 and mirror.pending == 0
    assert mirror.draft_ids == smollm.encode(TEXT * 2)  # word boundaries: the same as tokenizing at once


@pytest.mark.parametrize("per_round", [1, 2, 5])
def test_the_mirror_spells_a_byte_fallback_target_s_characters_whole(per_round: int) -> None:
    """A target whose tokenizer spells characters as UTF-8 byte tokens (SentencePiece byte
    fallback, decoded a run at a time): the mirror's text, which the draft tokenizes, is the
    decode of the committed ids, not U+FFFD from a window that starts inside a run."""
    target, draft = build_byte_fallback_tokenizer(), build_tokenizer()
    mirror = TextMirror(VocabBridge(draft, target, len(draft), "slem"))
    text = "hello 字测试 world 测试的字hello 中文"
    ids = target(text, add_special_tokens=False)["input_ids"]
    for start in range(0, len(ids), per_round):
        mirror.update(start, ids[start : start + per_round])
        assert mirror.text == target.decode(ids[: mirror.clean])
    assert mirror.text == text and mirror.pending == 0


def test_the_mirror_starts_over_when_the_history_changes(bridge: VocabBridge, qwen: PreTrainedTokenizerBase) -> None:
    ids = qwen.encode(TEXT)
    mirror = TextMirror(bridge)
    mirror.update(0, ids)
    assert mirror.holds(len(ids), prefix_hash(ids))
    other = qwen.encode(" a different story")
    mirror.update(5, other)
    now = [*ids[:5], *other]
    assert mirror.text == qwen.decode(now) and mirror.target_ids == now
    assert mirror.holds(len(now), prefix_hash(now)) and not mirror.holds(len(now), prefix_hash(ids[: len(now)]))


def test_slem_tokenizes_the_drafts_text_as_the_target_would(
    bridge: VocabBridge, qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase
) -> None:
    mirror = TextMirror(bridge)
    mirror.update(0, qwen.encode("The sun"))
    drafted = smollm.encode(" warms the fibonacci")  # " warms" is one draft token, two target tokens
    assert mirror.slem_targets(drafted, 8) == qwen.encode(" warms the fibonacci")
    assert mirror.slem_targets(drafted, 2) == qwen.encode(" warms")  # at most K
    # The committed text ends inside a word ("sun" + "sh"): the draft's continuation is tokenized
    # with it, but a committed id is never changed; the proposal continues the committed ids.
    mirror.update(len(mirror.target_ids), [qwen.convert_tokens_to_ids("sh")])
    proposal = mirror.slem_targets(smollm.encode("ine today"), 8)
    assert qwen.decode([*mirror.target_ids, *proposal]) == "The sunshine today"


def test_slem_waits_while_the_text_ends_inside_a_character(
    bridge: VocabBridge, qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase
) -> None:
    ids = qwen.encode("é𓀀")  # the hieroglyph is three Qwen tokens
    partial = next(n for n in range(1, len(ids)) if qwen.decode(ids[:n]).endswith("\ufffd"))
    mirror = TextMirror(bridge)
    mirror.update(0, ids[:partial])
    assert mirror.pending > 0 and mirror.slem_targets(smollm.encode(" the"), 4) == []
    mirror.update(partial, ids[partial:])
    assert mirror.pending == 0 and mirror.slem_targets(smollm.encode(" the"), 4) == qwen.encode(" the")


def test_a_round_of_the_mirror_costs_the_same_in_a_long_session(
    bridge: VocabBridge, qwen: PreTrainedTokenizerBase
) -> None:
    """A round (the hash check of the committed prefix, 4 new ids, the draft's tokens compared with
    its cache) does work for what changed, not for the whole session: a cross-vocabulary draft's
    model thread was spending 33 ms a round on a 16,000-id session (scans from the start), 60 s
    over 32,000 ids."""
    ids = qwen.encode(TEXT * 400)
    assert len(ids) > 16_004
    work = []
    for length in (1_000, 16_000):
        mirror = TextMirror(bridge)
        for start in range(0, length, 500):
            mirror.update(start, ids[start : min(start + 500, length)])
        expected = prefix_hash(ids[:length])
        cache = [*mirror.draft_ids, 1, 2]  # the draft's cache: the mirrored tokens and a block drafted after them

        def round_at(
            mirror: TextMirror = mirror, length: int = length, expected: int = expected, cache: list[int] = cache
        ) -> None:
            assert mirror.holds(length, expected)
            mirror.update(length, ids[length : length + 4])
            common_prefix_len(cache, mirror.draft_ids)

        work.append(opcodes(round_at))
        assert mirror.text == qwen.decode(ids[: mirror.clean])
    assert work[1] < 2 * work[0], work
