"""Guessing ahead in the draft worker (``--guess-tokens``): a pass also runs the tokens that
followed the session's last n-gram earlier on; where the draft samples them, their passes are
saved. The production jobs (``propose_job``, ``lookahead_job``) on a real tiny model: the blocks
(tokens and the distributions reported with them) are those drafted one token per pass, in fewer
passes, for greedy and sampled drafts, with and without the confidence stop and top-n proposals.
The sampled output's exactness through the whole production path is in
tests/test_exactness_production.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.worker_session import prefix_sync
from draft_worker.engine import Block, DraftParams, Resync, lookahead_job, propose_job
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.runtime.sampling import Warp
from specdec.runtime.scheduler import Job
from specdec.runtime.tokens import common_prefix_len
from tests.helpers import run_steps
from tests.tiny_models import TinyModels, build_variant

SAMPLED = Warp(temperature=0.8, top_k=4, top_p=0.9)


@pytest.fixture(scope="module")
def drafts(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LoadedModel]]:
    """The bigram model (its next token depends on the last one only, so its output repeats
    what the prompt holds) and a noisy copy of it (its samples leave the guesses now and then)."""
    options = LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch")
    noisy = build_variant(tiny_models.bigram, Path(tmp_path_factory.mktemp("noisy-bigram")), noise=0.03)
    yield {"bigram": load_model(str(tiny_models.bigram), options), "noisy": load_model(str(noisy), options)}


def chain_prompt(draft: LoadedModel, length: int = 6) -> list[int]:
    """(7, 3, c1..cn, 7, 3): c1..cn is the draft's greedy chain after 3, so the prompt ends with
    a bigram whose earlier occurrence is followed by what the draft will draw."""
    chain = [3]
    with torch.inference_mode():
        for _ in range(length):
            chain.append(int(draft.model(torch.tensor([[chain[-1]]])).logits[0, -1].argmax()))
    return [7, *chain, 7, 3]


def run_counting(job: Job[Block | Resync] | Job[Block | None], caches: SessionCaches) -> tuple[Block, int]:
    """Runs a job's steps as the scheduler does; returns its block (there is one) and its number of passes."""
    block, passes = run_steps(job, caches)
    assert isinstance(block, Block)
    return block, passes


def draft_session(draft: LoadedModel, params: DraftParams, rounds: int) -> tuple[list[Block], int]:
    """``rounds`` rounds of a session: a block, the block drafted ahead of it, then half of the
    block and a token of the target's (0) committed, as after a rejection."""
    caches = SessionCaches(draft, 2, 600)
    committed, cached, blocks, passes = chain_prompt(draft), 0, [], 0
    for _ in range(rounds):
        block, n = run_counting(propose_job(caches, draft, "s", prefix_sync(committed, cached), params), caches)
        ahead, m = run_counting(lookahead_job(caches, draft, "s", block, params), caches)
        blocks += [block, ahead]
        passes += n + m
        committed += [*block.token_ids[: len(block.token_ids) // 2 + 1], 0]
        cached = min(common_prefix_len(caches.get("s").tokens, committed), len(committed) - 1)  # type: ignore[union-attr]
    return blocks, passes


@pytest.mark.parametrize(
    ("draft", "warp", "top_n", "block_confidence"),
    [
        pytest.param("bigram", Warp(), 0, 0.0, id="greedy"),
        pytest.param("noisy", Warp(), 0, 0.05, id="greedy-block-stop"),
        pytest.param("noisy", SAMPLED, 0, 0.0, id="sampled-dense"),
        pytest.param("noisy", SAMPLED, 3, 0.003, id="sampled-top-n-block-stop"),
    ],
)
def test_guessing_ahead_saves_passes_and_drafts_the_same_blocks(
    drafts: dict[str, LoadedModel], draft: str, warp: Warp, top_n: int, block_confidence: float
) -> None:
    params = DraftParams(8, warp, seed=11, top_n=top_n, min_block_confidence=block_confidence)
    plain, plain_passes = draft_session(drafts[draft], params, rounds=10)
    guessing, passes = draft_session(drafts[draft], dataclasses.replace(params, guess_tokens=8), rounds=10)
    assert [b.token_ids for b in guessing] == [b.token_ids for b in plain]
    for got, want in zip(guessing, plain, strict=True):
        assert (got.start, got.assumed, got.cache_len, got.ends_unsure) == (want.start, want.assumed, want.cache_len,
                                                                           want.ends_unsure)  # fmt: skip
        for g, w in zip(got.samples, want.samples, strict=True):
            assert (g.ids is None) == (w.ids is None) and (g.probs is None) == (w.probs is None)
            if g.ids is not None and w.ids is not None:
                assert torch.equal(g.ids, w.ids)
            if g.probs is not None and w.probs is not None:
                torch.testing.assert_close(g.probs, w.probs, rtol=0, atol=1e-5)
    taken = sum(b.guesses_taken for b in guessing)
    assert taken > 0 and passes == plain_passes - taken  # each right guess saved one pass
    assert all(b.guessed == b.guesses_taken == 0 for b in plain)
    if draft == "noisy":
        assert sum(b.guessed for b in guessing) > taken  # some guesses were wrong and cut away


@pytest.mark.parametrize("warp", [Warp(0.7, top_k=1), Warp(1.0, min_p=1.0)], ids=["top-k-1", "min-p-1"])
def test_a_sampled_warp_that_leaves_one_token_drafts_the_greedy_blocks_stops_included(
    drafts: dict[str, LoadedModel], warp: Warp
) -> None:
    """Such a warp draws the draft's argmax, as greedy decoding does, and its block stop reads the
    draft's softmax as greedy's does: the same blocks, cut where greedy's are (before, every
    token counted as certain and each block ran to its K)."""
    params = DraftParams(8, Warp(), seed=11, top_n=64, min_block_confidence=0.05)
    greedy, _ = draft_session(drafts["noisy"], params, rounds=10)
    sampled, _ = draft_session(drafts["noisy"], dataclasses.replace(params, warp=warp), rounds=10)
    assert [b.token_ids for b in sampled] == [b.token_ids for b in greedy]
    assert [b.ends_unsure for b in sampled] == [b.ends_unsure for b in greedy]
    assert any(b.ends_unsure for b in greedy) and any(len(b.token_ids) < 8 for b in greedy)


@pytest.mark.parametrize("warp", [Warp(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stop", [{"min_block_confidence": 0.05}, {"min_confidence": 0.3}], ids=["block", "token"])
def test_stops_only_reported_draft_the_whole_block_and_say_where_they_would_end_it(
    drafts: dict[str, LoadedModel], warp: Warp, stop: dict[str, float]
) -> None:
    """``report_stops_only`` (what a coordinator asks once it switched the stops off for a turn):
    the block is the one drafted without the stops (K tokens, the same draws and distributions,
    guessing ahead or not), and ``unsure_at`` is where the stops would have ended it: the length
    of the block they draft, where it ended unsure; 0 where they let it run to K."""
    draft, prompt = drafts["noisy"], chain_prompt(drafts["noisy"])
    reported_somewhere = 0
    for seed, guess in ((seed, guess) for seed in range(12) for guess in (0, 8)):
        plain = DraftParams(8, warp, seed=seed, top_n=3, guess_tokens=guess)
        stopped, reported = (dataclasses.replace(plain, **stop, report_stops_only=only) for only in (False, True))
        blocks = {}
        for name, params in (("plain", plain), ("stopped", stopped), ("reported", reported)):
            caches = SessionCaches(draft, 2, 600)
            blocks[name], _ = run_counting(propose_job(caches, draft, "s", prefix_sync(prompt, 0), params), caches)
        short, whole, block = blocks["stopped"], blocks["plain"], blocks["reported"]
        assert block.token_ids == whole.token_ids and not block.ends_unsure
        for got, want in zip(block.samples, whole.samples, strict=True):
            for mine, theirs in ((got.ids, want.ids), (got.probs, want.probs)):  # None: greedy's one-hot
                assert (mine is None and theirs is None) or (
                    mine is not None and theirs is not None and torch.equal(mine, theirs)
                )
        assert short.token_ids == whole.token_ids[: len(short.token_ids)]
        assert block.unsure_at == (len(short.token_ids) if short.ends_unsure else 0), (seed, guess)
        assert short.unsure_at == block.unsure_at  # an applied stop reports where it ended the block too
        reported_somewhere += 0 < block.unsure_at < 8
    assert reported_somewhere >= 6  # most blocks would have ended early


def test_a_job_cancelled_before_its_first_pass_leaves_no_index_ahead_of_the_cache(
    drafts: dict[str, LoadedModel],
) -> None:
    """The index is extended with the committed tail before the pass that runs it; if the job
    is closed first, the next sync (the same prefix again) drops the index instead of keeping
    tokens the cache lacks."""
    draft, params = drafts["bigram"], DraftParams(4, Warp(), seed=0, top_n=0, guess_tokens=4)
    caches, prompt = SessionCaches(draft, 2, 600), chain_prompt(draft)
    run_counting(propose_job(caches, draft, "s", prefix_sync(prompt[:4], 0), params), caches)
    job = propose_job(caches, draft, "s", prefix_sync(prompt, 3), params)
    next(job)
    job.close()
    entry = caches.get("s")
    assert entry is not None and entry.guesses is not None and len(entry.guesses) > len(entry.tokens)
    block, _ = run_counting(propose_job(caches, draft, "s", prefix_sync(prompt, 3), params), caches)
    assert entry.guesses is not None and len(entry.guesses) == len(prompt)  # rebuilt from the cache and tail
    assert block.guesses_taken > 0
