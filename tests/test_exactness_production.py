"""Sampled output follows the target distribution exactly, through the production code path.

The workers' own jobs run on real (tiny) models and their KV caches: the draft's ``propose_job``
and ``lookahead_job`` (per-position generators, the top-n proposal), the wire encoding of the
block (``encode_block`` -> protobuf bytes -> the target's ``decode_block``), and the target's
``verify_job`` (per-position generators, rejection sampling, cache rollback), for several rounds,
with and without blocks drafted ahead (pipelining), with temperature != 1, top-k and top-p, for
K in {1, 4, 8}. Only gRPC and the scheduler thread are left out: a job's steps are run here
directly, as the scheduler runs them, 64 requests at a time whose steps share batched passes
(``extend_many``, the pass the scheduler runs for concurrent sessions; the samples are those of
one request at a time, where no reply index links the requests). A chi-square test with pooling
(tests/spec_oracle.py) compares the first three tokens with the exactly enumerated target
distribution; a power check shows that the same test catches a planted bug in the production
sampler.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch

import draft_worker.engine as draft_engine
import target_worker.engine as target_engine
from coordinator.worker_session import lookup_proposal, prefix_sync
from draft_worker.engine import Block, DraftParams, lookahead_job, propose_job, translated_propose_job
from specdec.runtime.grammar import constrain as real_constrain
from specdec.runtime.grammar import grammar_of
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.logprobs import LogprobsAsk
from specdec.runtime.lookup import NgramIndex, ReplyIndex, lookup_draft
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.runtime.processing import NO_PROCESSING, Processing, process_logits
from specdec.runtime.proposals import encode_block
from specdec.runtime.sampling import Verdict, Warp, warped_probs
from specdec.runtime.scheduler import Extend, Job, _batchable
from specdec.runtime.tokens import common_prefix_len
from specdec.runtime.vocab import VocabBridge
from specdec.v1 import common_pb2
from tests.helpers import draft_vocab_file, in_two_processes, real_tokenizer
from tests.spec_oracle import PASS_P, PLANTED_P, chi_square_pvalue, reference_grammar, reference_processing
from tests.tiny_models import TinyModels, build_text_bigram, build_variant

pytestmark = pytest.mark.alone  # the chi-square loops keep both cores busy (in_two_processes)

PROMPT = (5, 17, 99, 3)
WARP = Warp(temperature=0.8, top_k=4, top_p=0.9)
LENGTH = 3  # tokens whose joint distribution is tested (support <= 4^3)
NO_LOGPROBS = LogprobsAsk()
T = TypeVar("T")


# A request's steps: each job step it waits on, with the caches (the model) it runs on
Steps = Generator[tuple[SessionCaches, Extend], torch.Tensor, T]


def run_job(job: Job[T], caches: SessionCaches) -> Steps[T]:
    """A job's Extend steps handed to ``together``, which runs each in a pass with the steps of
    the other requests in flight; the job's result."""
    try:
        step = next(job)
        while True:
            step = job.send((yield caches, step))
    except StopIteration as done:
        return done.value


def together(requests: Iterable[Steps[T]], width: int) -> list[T]:
    """Runs ``requests`` ``width`` at a time, as the workers' schedulers run concurrent sessions:
    each round takes the step every request in flight waits on, and per model runs the steps the
    scheduler batches (short, no earlier rows) in one ``extend_many`` pass and any other alone. The
    requests' results, in their order. (Deterministic: the same requests make the same passes.)"""
    results: dict[int, T] = {}
    running: dict[int, Steps[T]] = {}  # request number -> the request
    waiting: dict[int, tuple[SessionCaches, Extend]] = {}  # request number -> the step it waits on

    def advance(number: int, logits: torch.Tensor | None) -> None:
        try:
            waiting[number] = running[number].send(logits)  # type: ignore[arg-type]  # None starts it
        except StopIteration as done:
            del running[number]
            waiting.pop(number, None)
            results[number] = done.value

    queued = enumerate(requests)
    while True:
        for number, request in itertools.islice(queued, width - len(running)):
            running[number] = request
            advance(number, None)
        if not running:
            return [results[number] for number in range(len(results))]
        by_model: dict[SessionCaches, dict[int, Extend]] = collections.defaultdict(dict)
        for number, (caches, step) in waiting.items():
            by_model[caches][number] = step
        for caches, steps in by_model.items():
            shared = [number for number, step in steps.items() if _batchable(step)]
            ops = [(steps[number].entry, steps[number].token_ids, steps[number].num_logits) for number in shared]
            logits = dict(zip(shared, caches.extend_many(ops), strict=True)) if ops else {}
            for number, step in steps.items():
                if number not in logits:
                    logits[number] = caches.extend(step.entry, step.token_ids, step.num_logits, step.earlier)
            for number in steps:
                advance(number, logits[number])


def on_the_wire(block: Block) -> common_pb2.DraftBlock:
    """What the target receives: the draft's encoding, serialised and parsed again."""
    return common_pb2.DraftBlock.FromString(encode_block(list(block.samples)).SerializeToString())


@dataclass
class Tally:
    """What the requests of a Speculation did, summed over them."""

    ahead_used: int = 0  # rounds that verified a block drafted ahead
    lookup_rounds: int = 0
    lookup_accepted: int = 0
    reply_rounds: int = 0
    proposed: int = 0  # rounds that had a draft
    accepted: int = 0  # of those, rounds whose first draft token was accepted
    # model blocks asked for K, by length
    block_lengths: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    guesses_taken: int = 0  # draft tokens whose pass a right guess saved

    def add(self, other: Tally) -> None:
        for name in (f.name for f in dataclasses.fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Speculation:
    """The coordinator's round loop over the workers' production jobs, for ``width`` requests at
    once (each its own session on either worker)."""

    target: LoadedModel
    draft: LoadedModel
    k: int
    top_n: int
    pipelined: bool
    warp: Warp = WARP
    processing: Processing = NO_PROCESSING
    prompt: tuple[int, ...] = PROMPT
    lookup: bool = False  # draft by n-gram lookup in the committed tokens (one-hot), as the coordinator does
    replies: ReplyIndex | None = None  # with lookup: also match the earlier requests' replies (the reply index)
    bridge: VocabBridge | None = None  # the draft has another tokenizer: its worker translates (TLI / SLEM)
    min_confidence: float = 0.0  # the draft's confidence stops (blocks of 1 to K tokens)
    min_block_confidence: float = 0.0
    guess_tokens: int = 0  # the draft worker's --guess-tokens
    width: int = 64  # requests in flight at once (sessions whose steps share passes)

    def __post_init__(self) -> None:
        self.target_caches = SessionCaches(self.target, self.width, 600)
        self.draft_caches = SessionCaches(self.draft, self.width, 600)
        self.tally = Tally()

    def generate(self, seed: int, max_new: int, stop_after: int) -> Steps[list[int]]:
        """Request number ``seed`` (its session id and its seed). ``max_new`` sets K's budget as
        in a request; the loop stops once ``stop_after`` tokens are committed (later rounds
        cannot change them)."""
        session = f"s{seed}"
        committed, generated = list(self.prompt), 0
        target_len = draft_len = 0
        ahead: Block | None = None  # the block drafted ahead (pipelining), if any
        while generated < min(max_new, stop_after):
            k = min(self.k, max_new - generated - 1)  # as the coordinator caps K by the budget
            if self.lookup:
                wire = self._lookup_block(committed, k)
            else:
                block = (yield from self._block(session, committed, draft_len, k, seed, ahead)) if k > 0 else None
                ahead = None
                if block is not None and self.pipelined:  # drafted while the target verifies `block`
                    job = lookahead_job(self.draft_caches, self.draft, session, block, self._params(k, seed))
                    ahead = yield from run_job(job, self.draft_caches)
                    self.tally.guesses_taken += ahead.guesses_taken if ahead is not None else 0
                wire = common_pb2.DraftBlock() if block is None else on_the_wire(block)
                wire = _first(wire, k)
                if k == self.k:
                    self.tally.block_lengths[len(wire.token_ids)] += 1
            sync = prefix_sync(committed, target_len)
            result = yield from run_job(
                target_engine.verify_job(
                    self.target_caches, self.target, session, sync, wire, self.warp, seed, self.processing, NO_LOGPROBS
                ),
                self.target_caches,
            )
            tokens = list(result.token_ids)[: max_new - generated]
            if self.lookup and wire.token_ids:
                self.tally.lookup_rounds += 1
                self.tally.lookup_accepted += result.num_accepted
            if wire.token_ids:
                self.tally.proposed += 1
                self.tally.accepted += result.num_accepted > 0
            start = len(committed)
            committed += tokens
            generated += len(tokens)
            target_len = min(result.cache_len, len(committed))
            if self.bridge is not None:  # its cache is in its own ids: it holds the prefix it drafted after
                draft_len = start
            else:
                draft_entry = self.draft_caches._entries.get(session)
                draft_tokens = draft_entry.tokens if draft_entry is not None else []
                draft_len = min(common_prefix_len(draft_tokens, committed), len(committed) - 1)
        self.target_caches.release(session)
        self.draft_caches.release(session)
        if self.replies is not None:  # as the coordinator does with a finished reply
            self.replies.add("", self.prompt, committed[len(self.prompt) :])
        return committed[len(self.prompt) :]

    def _lookup_block(self, committed: list[int], k: int) -> common_pb2.DraftBlock:
        """The coordinator's lookup draft (n from 1, so the prompt's repeats match), on the wire."""
        found = lookup_draft(NgramIndex(1, 3, committed), self.replies, "", committed, k)
        self.tally.reply_rounds += found.from_replies
        draft = found.token_ids
        block = lookup_proposal(draft, len(committed)).block if draft else common_pb2.DraftBlock()
        return common_pb2.DraftBlock.FromString(block.SerializeToString())

    def _params(self, k: int, seed: int) -> DraftParams:
        return DraftParams(
            k, self.warp, seed, self.top_n, self.target.vocab_size, self.processing, self.min_confidence,
            self.min_block_confidence, self.guess_tokens,
        )  # fmt: skip

    def _block(
        self, session: str, committed: list[int], draft_len: int, k: int, seed: int, ahead: Block | None
    ) -> Steps[Block]:
        if ahead is not None and ahead.samples and list(ahead.assumed) == committed[ahead.start - len(ahead.assumed) :]:
            self.tally.ahead_used += 1
            return ahead  # the previous block was fully taken and the guessed token was right
        if self.bridge is not None:
            sync = prefix_sync(committed, draft_len)
            params = self._params(k, seed)
            job = translated_propose_job(self.draft_caches, self.draft, self.bridge, session, sync, params)
            translated = yield from run_job(job, self.draft_caches)
            assert isinstance(translated, Block)
            return translated
        sync = prefix_sync(committed, draft_len)
        job = propose_job(self.draft_caches, self.draft, session, sync, self._params(k, seed))
        block = yield from run_job(job, self.draft_caches)
        assert isinstance(block, Block)
        self.tally.guesses_taken += block.guesses_taken
        return block


def _first(block: common_pb2.DraftBlock, k: int) -> common_pb2.DraftBlock:
    from coordinator.worker_session import _first as first

    return first(block, k)


def exact_distribution(
    target: LoadedModel,
    reference: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor] | None = None,
    prompt: tuple[int, ...] = PROMPT,
) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) under the warped target, enumerated over its (top-k) support;
    ``reference(logits, sequence)`` processes each position's logits first (a plain forward pass
    over the whole sequence, no cache and no speculation)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == LENGTH:
            out[prefix] = prob
            return
        with torch.inference_mode():
            logits = target.model(torch.tensor([[*prompt, *prefix]])).logits[0, -1]
        if reference is not None:
            logits = reference(logits, (*prompt, *prefix))
        p = warped_probs(logits, WARP if reference is None else PENALISED_WARP)
        for token in torch.nonzero(p).flatten().tolist():
            walk((*prefix, token), prob * float(p[token]))

    walk((), 1.0)
    return out


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> Iterator[dict[str, LoadedModel]]:
    options = LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch")
    names = ("target", "noisy", "other", "same", "bigram")
    yield {name: load_model(str(getattr(tiny_models, name)), options) for name in names}


# A block drafted ahead decides tested tokens only when the first round commits fewer than
# LENGTH tokens even if fully taken: K = 1 (two tokens) is the pipelined case that matters here.
CASES = [
    pytest.param(1, 0, False, "other", 1500, id="K1-dense-sequential-unrelated-draft"),
    pytest.param(1, 3, True, "noisy", 1500, id="K1-sparse-pipelined"),
    pytest.param(4, 64, False, "noisy", 1500, id="K4-sparse-sequential"),
    pytest.param(8, 0, True, "noisy", 1000, id="K8-dense-pipelined"),
]


def sample_counts(speculation: Speculation, n: int) -> collections.Counter[tuple[int, ...]]:
    """The first LENGTH tokens of ``n`` requests (seed = request number), each started with a
    full first block of K drafts. Half the requests run in a forked process beside this one (each
    request is decided by its seed alone; with a reply index each half's requests see the replies
    of the requests of their own half that finished before they started); their tallies are added
    to ``speculation``'s."""

    def requests(seeds: range) -> tuple[collections.Counter[tuple[int, ...]], Tally]:
        speculation.tally = Tally()
        budget = max(speculation.k + 1, LENGTH + 1)
        pending = (speculation.generate(seed, max_new=budget, stop_after=LENGTH) for seed in seeds)
        counts = collections.Counter(tuple(reply[:LENGTH]) for reply in together(pending, speculation.width))
        return counts, speculation.tally

    (first, first_tally), (second, second_tally) = in_two_processes(requests, n)
    second_tally.add(first_tally)
    speculation.tally = second_tally
    counts = first + second
    assert counts.total() == n
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(("k", "top_n", "pipelined", "draft", "n"), CASES)
def test_production_path_follows_the_target_distribution(
    models: dict[str, LoadedModel], k: int, top_n: int, pipelined: bool, draft: str, n: int
) -> None:
    speculation = Speculation(models["target"], models[draft], k, top_n, pipelined)
    samples = sample_counts(speculation, n)
    if pipelined and k == 1:
        assert speculation.tally.ahead_used > 100  # blocks drafted ahead decided many of the tested tokens
    assert chi_square_pvalue(samples, exact_distribution(models["target"]), sum(samples.values())) > PASS_P


def _residual_from_p(target_logits, draft_tokens, draft_probs, warp, generator) -> Verdict:  # type: ignore[no-untyped-def]
    """The planted bug: after a rejection, the recovered token is drawn from p instead of
    norm(max(0, p - q)) (every draw keyed as in production)."""
    k = draft_tokens.shape[0]
    p = warped_probs(target_logits, warp)
    for i in range(k):
        x = int(draft_tokens[i])
        u = float(torch.rand((), generator=generator[i]))
        if u * float(draft_probs[i, x]) >= float(p[i, x]):
            return Verdict(i, [*draft_tokens[:i].tolist(), int(torch.multinomial(p[i], 1, generator=generator[i]))])
    return Verdict(k, [*draft_tokens.tolist(), int(torch.multinomial(p[k], 1, generator=generator[k]))])


@pytest.mark.slow
def test_the_production_path_test_catches_a_planted_bug(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first case's setting (K = 1, dense, an unrelated draft), 3000 requests (twice the
    first case's, still a minute of CPU): the planted bug is rejected at p < 1e-6."""
    monkeypatch.setattr(target_engine, "rejection_sample", _residual_from_p)
    speculation = Speculation(models["target"], models["other"], 1, 0, False)
    samples = sample_counts(speculation, 3000)
    assert chi_square_pvalue(samples, exact_distribution(models["target"]), sum(samples.values())) < PLANTED_P


STOPS = {"token": {"min_confidence": 0.3}, "block": {"min_block_confidence": 0.15}}


def confident_speculation(models: dict[str, LoadedModel], stop: str) -> Speculation:
    """K = 4, pipelined, with one of the draft's confidence stops (after a token drawn with
    probability < 0.3, or once the block's product of probabilities is < 0.15): blocks of every
    length from 1 to 4."""
    return Speculation(models["target"], models["noisy"], 4, 0, True, **STOPS[stop])


@pytest.mark.slow
@pytest.mark.parametrize("stop", list(STOPS))
def test_blocks_ended_by_the_draft_s_confidence_follow_the_target_distribution(
    models: dict[str, LoadedModel], stop: str
) -> None:
    """The draft ends a block where it is unsure (the block's length depends on the draft's draws
    only): rejection sampling at each position and the bonus token after a short block keep the
    target's distribution; blocks drafted ahead stop the same way."""
    speculation = confident_speculation(models, stop)
    samples = sample_counts(speculation, 1500)
    lengths = speculation.tally.block_lengths
    assert set(lengths) == {1, 2, 3, 4} and lengths[4] < sum(lengths.values()) / 2, lengths
    assert speculation.tally.ahead_used > 50
    assert chi_square_pvalue(samples, exact_distribution(models["target"]), sum(samples.values())) > PASS_P


_draft_block = draft_engine._draft_block  # the production loop, kept before the patch


def _unsure_made_greedy(entry, feed, params, start, device, meter, shape=None):  # type: ignore[no-untyped-def]
    """The planted bug: the token a block ends on (the draft was unsure of it) is swapped for the
    draft's most likely one, while the block still reports the distribution it drew from."""
    drafted = yield from _draft_block(entry, feed, params, start, device, meter, shape)
    samples, last = drafted.samples, drafted.samples[-1]
    if len(samples) < params.k and last.probs is not None:
        ids = last.ids if last.ids is not None else torch.arange(last.probs.shape[0])
        samples[-1] = dataclasses.replace(last, token_id=int(ids[int(last.probs.argmax())]))
    return drafted


@pytest.mark.slow
@pytest.mark.parametrize("stop", list(STOPS))
def test_the_confidence_stop_test_catches_a_planted_bug(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """The same settings and number of requests: the planted bug is rejected at p < 1e-6."""
    monkeypatch.setattr(draft_engine, "_draft_block", _unsure_made_greedy)
    speculation = confident_speculation(models, stop)
    samples = sample_counts(speculation, 1500)
    assert chi_square_pvalue(samples, exact_distribution(models["target"]), sum(samples.values())) < PLANTED_P


# Penalties strong enough to move the tested distribution a lot: a history-dependent processing
# bug (a row that does not see the drafts before it) changes which tokens follow a repeat.
PENALISED_WARP = Warp(temperature=0.9, top_k=4, min_p=0.3)


def penalties(banned: int) -> Processing:
    return Processing(
        repetition_penalty=1.8,
        presence_penalty=0.7,
        frequency_penalty=1.5,
        logit_bias=((7, 1.5), (40, -2.0)),
        reply_start=len(PROMPT),
        min_tokens=2,
        banned_until_min=(banned,),
    )


def _stale_history(logits, tokens, first_position, processing, kept=None):  # type: ignore[no-untyped-def]
    """The planted bug: every row of a verify pass is processed with the committed history only
    (the drafts before the row are not counted), as a processor that ignores speculation does."""
    rows = [process_logits(logits[r : r + 1], tokens, first_position, processing, kept) for r in range(logits.shape[0])]
    return torch.cat(rows)


def _favourite(target: LoadedModel) -> int:
    with torch.inference_mode():
        return int(target.model(torch.tensor([PROMPT])).logits[0, -1].argmax())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "pipelined", "draft"),
    [pytest.param(4, False, "noisy", id="K4-sequential"), pytest.param(1, True, "noisy", id="K1-pipelined")],
)
def test_penalties_follow_the_exact_penalised_distribution(
    models: dict[str, LoadedModel], k: int, pipelined: bool, draft: str
) -> None:
    """Repetition, presence and frequency penalties, logit bias, min_tokens (banning the target's
    favourite first token) and min_p, through the production jobs: the first three tokens follow
    the distribution a plain, non-speculative pass with the same processing gives."""
    target = models["target"]
    processing = penalties(_favourite(target))
    speculation = Speculation(target, models[draft], k, 0, pipelined, PENALISED_WARP, processing)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(target, reference_processing(processing, len(PROMPT)))
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P


@pytest.mark.slow
def test_the_penalty_test_catches_processing_on_the_wrong_history(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power check: the same test rejects a target that processes every row with the committed
    history only (drafts from the target's own copy, so rows past the first decide tokens)."""
    monkeypatch.setattr(target_engine, "process_logits", _stale_history)
    target = models["target"]
    processing = penalties(_favourite(target))
    speculation = Speculation(target, models["same"], 4, 0, False, PENALISED_WARP, processing)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(target, reference_processing(processing, len(PROMPT)))
    impossible = sum(n for outcome, n in samples.items() if exact.get(outcome, 0.0) == 0.0)
    # Sequences the exact processing can never produce (min-p / top-k cut them) are proof enough;
    # otherwise the chi-square test must reject.
    assert impossible > 0 or chi_square_pvalue(samples, exact, sum(samples.values())) < PLANTED_P


# A language whose next character depends on the ones before it (after "a": "b" or a digit; after
# "ab": "x"), so a mask that ignores the drafts before its row allows what the grammar does not.
GRAMMAR_REGEX = r"(ab|ba|cc)x|[a-c][0-9]"


def constrained(target: LoadedModel) -> tuple[Processing, Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]]:
    """The regex constraint as the coordinator sends it, and its independent reference mask."""
    grammar = grammar_of(common_pb2.StructuredOutput(regex=GRAMMAR_REGEX))
    model_dir = target.model_id
    reference = reference_grammar(grammar, model_dir, target.vocab_size, list(target.eos_token_ids), len(PROMPT))
    return Processing(reply_start=len(PROMPT), grammar=grammar), reference


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "pipelined", "draft"),
    [pytest.param(4, False, "noisy", id="K4-sequential"), pytest.param(1, True, "noisy", id="K1-pipelined")],
)
def test_structured_output_follows_the_exact_constrained_distribution(
    models: dict[str, LoadedModel], k: int, pipelined: bool, draft: str
) -> None:
    """A regex constraint through the production jobs (the draft masks its proposals too): the
    first three tokens follow the distribution a plain pass with a fresh matcher per position
    gives, and every sample is in the language."""
    target = models["target"]
    processing, reference = constrained(target)
    speculation = Speculation(target, models[draft], k, 0, pipelined, PENALISED_WARP, processing)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(target, reference)
    assert sum(n for outcome, n in samples.items() if outcome not in exact) == 0
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P
    assert speculation.tally.accepted > 0.5 * speculation.tally.proposed  # the draft's masks keep acceptance up


def _grammar_on_the_committed_history(logits, state, tokens, first_position, grammar, reply_start, *, strict):  # type: ignore[no-untyped-def]
    """The planted bug: every row of a verify pass is masked with the grammar's state after the
    committed tokens only (the drafts before the row are not consumed; a reply that left the
    grammar is then not masked at all)."""
    rows = [
        real_constrain(logits[r : r + 1], state, tokens, first_position, grammar, reply_start, strict=False)
        for r in range(logits.shape[0])
    ]
    return torch.cat(rows)


@pytest.mark.slow
def test_the_structured_output_test_catches_masks_on_the_wrong_history(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power check: the same test rejects a target that masks every row with the committed
    history's state (drafts from the target's own copy, so rows past the first decide tokens)."""
    monkeypatch.setattr(target_engine, "constrain", _grammar_on_the_committed_history)
    target = models["target"]
    processing, reference = constrained(target)
    speculation = Speculation(target, models["same"], 4, 0, False, PENALISED_WARP, processing)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(target, reference)
    impossible = sum(n for outcome, n in samples.items() if exact.get(outcome, 0.0) == 0.0)
    assert impossible > 0 or chi_square_pvalue(samples, exact, sum(samples.values())) < PLANTED_P


def _lookup_prompt(target: LoadedModel) -> tuple[int, ...]:
    """(3, a, b, c, 3) where a, b, c are the bigram target's favourite successors of 3, a and b: a
    lookup after the prompt proposes a, b, c, each likely but far from certain (accepted some of
    the time, rejected the rest: both branches of the one-hot rejection sampling decide tokens)."""
    chain = [3]
    with torch.inference_mode():
        for _ in range(3):
            chain.append(int(target.model(torch.tensor([[chain[-1]]])).logits[0, -1].argmax()))
    return (*chain, 3)


def _reply_index(source: str) -> ReplyIndex | None:
    """``replies``: lookups also match the earlier requests' sampled replies (the reply index,
    n-grams of 1 to 3 tokens as the session's own lookup here); ``session``: only its own tokens."""
    return ReplyIndex(1, 3, 4096) if source == "replies" else None


@pytest.mark.slow
@pytest.mark.parametrize(("k", "source"), [(1, "session"), (4, "session"), (4, "replies")])
def test_lookup_drafts_follow_the_target_distribution(models: dict[str, LoadedModel], k: int, source: str) -> None:
    """One-hot lookup drafts (the coordinator's n-gram index, reply index and block encoding, the
    target's verify_job): a draft token x is accepted with probability p(x), else the token comes
    from p without x; the first three tokens follow the exact distribution. With the reply index
    each request is drafted what earlier sampled requests replied (the prompt's last tokens lead
    into every stored reply, so it matches longer than the session's own tokens)."""
    target = models["bigram"]
    prompt = _lookup_prompt(target)
    speculation = Speculation(target, models["noisy"], k, 0, False, prompt=prompt, lookup=True,
                              replies=_reply_index(source))  # fmt: skip
    samples = sample_counts(speculation, 1500)
    tally = speculation.tally
    assert tally.lookup_rounds > 1000 and 0.1 < tally.lookup_accepted / tally.lookup_rounds < 0.9
    assert (tally.reply_rounds > 1000) == (source == "replies")
    exact = exact_distribution(target, prompt=prompt)
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P


@pytest.mark.slow
@pytest.mark.parametrize("source", ["session", "replies"])
def test_the_lookup_test_catches_a_planted_bug(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Power check: after a rejected lookup token, drawing from p (the rejected token included)
    instead of p without it is rejected at p < 1e-6."""
    monkeypatch.setattr(target_engine, "rejection_sample", _residual_from_p)
    target = models["bigram"]
    prompt = _lookup_prompt(target)
    speculation = Speculation(target, models["noisy"], 1, 0, False, prompt=prompt, lookup=True,
                              replies=_reply_index(source))  # fmt: skip
    samples = sample_counts(speculation, 1500)
    assert chi_square_pvalue(samples, exact_distribution(target, prompt=prompt), sum(samples.values())) < PLANTED_P


@pytest.mark.slow
def test_a_draft_that_scores_only_some_tokens_follows_the_target_distribution(
    models: dict[str, LoadedModel], tiny_models: TinyModels, tmp_path: Path
) -> None:
    """The draft worker's model loaded with a draft vocabulary of the even ids (``--draft-vocab``):
    it proposes only those (the others' logits are -inf, probability 0 in the distribution the
    target verifies against), so the target's odd tokens come only from rejections' residuals
    and bonus tokens. K = 4, dense proposals, 1500 requests."""
    speculation = Speculation(models["target"], _even_ids_draft(tiny_models, tmp_path), 4, 0, False)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(models["target"])
    assert any(token % 2 for tokens in exact for token in tokens)  # the target has tokens the draft cannot propose
    assert speculation.tally.accepted > 300  # and the draft is still right often
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P


def _even_ids_draft(tiny_models: TinyModels, tmp_path: Path) -> LoadedModel:
    path = draft_vocab_file(tmp_path / "even.json", tiny_models.noisy)
    options = LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch", output_vocab=str(path))
    return load_model(str(tiny_models.noisy), options)


_sample_draft_token = draft_engine.sample_draft_token


def _other_tokens_keep_their_share(logits, warp, top_n, generator):  # type: ignore[no-untyped-def]
    """The planted bug: the draft samples among the tokens it scores but reports a distribution
    in which the others keep a share (0.4, spread over the odd ids): a valid distribution, not the
    one the token came from. (Reporting the kept tokens' probabilities unnormalised is refused by
    the target's check that a proposal sums to 1.)"""
    sample = _sample_draft_token(logits, warp, top_n, generator)
    if sample.probs is None or sample.ids is not None:
        return sample
    odd = torch.zeros_like(sample.probs)
    odd[1::2] = 1.0
    return dataclasses.replace(sample, probs=sample.probs * 0.6 + odd / odd.sum() * 0.4)


@pytest.mark.slow
def test_the_draft_vocabulary_test_catches_a_planted_bug(
    models: dict[str, LoadedModel], tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same settings and number of requests: the planted bug is rejected at p < 1e-6."""
    monkeypatch.setattr(draft_engine, "sample_draft_token", _other_tokens_keep_their_share)
    speculation = Speculation(models["target"], _even_ids_draft(tiny_models, tmp_path), 4, 0, False)
    samples = sample_counts(speculation, 1500)
    assert chi_square_pvalue(samples, exact_distribution(models["target"]), sum(samples.values())) < PLANTED_P


@pytest.fixture(scope="module")
def sure_bigram(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The bigram target with its output layer tripled: a draft surer of its favourites than
    the target, so the tokens it draws as guessed are often rejected (q(x) > p(x)), and what it
    sends with them decides the output."""
    path = build_variant(tiny_models.bigram, tmp_path_factory.mktemp("sure-bigram"), noise=0.0, scale=3.0)
    return load_model(str(path), LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch"))


def _guess_prompt(target: LoadedModel, draft: LoadedModel) -> tuple[int, ...]:
    """(7, a, b, c, d, 7, a): a is the token whose successor the target is surest of, b, c, d the
    draft's favourite successors of a, b and c. The draft's guess after the prompt is b, c, d; it
    draws b almost always and the target keeps it most of the time, so the tokens drawn from the
    rows computed for the guess (c, d) decide the output's second and third tokens often."""
    with torch.inference_mode():
        rows = target.model(torch.arange(target.vocab_size)[:, None]).logits[:, -1]
        chain = [int(warped_probs(rows, WARP).max(-1).values.argmax())]
        for _ in range(3):
            chain.append(int(draft.model(torch.tensor([[chain[-1]]])).logits[0, -1].argmax()))
    return (7, *chain, 7, chain[0])


def guessing_speculation(models: dict[str, LoadedModel], draft: LoadedModel, pipelined: bool) -> Speculation:
    """K = 4, top-3 proposals, the draft guessing up to 8 tokens ahead (the default)."""
    prompt = _guess_prompt(models["bigram"], draft)
    return Speculation(models["bigram"], draft, 4, 3, pipelined, prompt=prompt, guess_tokens=8)


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_drafts_that_guess_ahead_follow_the_target_distribution(
    models: dict[str, LoadedModel], sure_bigram: LoadedModel, pipelined: bool
) -> None:
    """The draft worker guessing ahead (``--guess-tokens``): tokens drawn from rows computed for
    a guess, guesses cut away after a different draw, blocks drafted ahead; 1500 requests."""
    speculation = guessing_speculation(models, sure_bigram, pipelined)
    samples = sample_counts(speculation, 1500)
    tally = speculation.tally
    assert tally.guesses_taken > 500 and tally.accepted < tally.proposed  # rejections too
    exact = exact_distribution(models["bigram"], prompt=speculation.prompt)
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P


class _GuessProposedUndrawn:
    """The planted bug: where a guess is run, the guessed token is proposed as if the draft had
    drawn it (with the distribution of its position), not the token the draft drew: a shortcut
    that is right for a greedy draft only. Kept per session: requests' passes interleave."""

    def __init__(self) -> None:
        self.pending: dict[int, list[int]] = {}  # per cache: the guess its last pass ran, a token per draw to come
        self.drawing: int | None = None  # the cache whose position is being drawn

    def worth_running(self, entry, guess):  # type: ignore[no-untyped-def]
        self.pending[id(entry)] = list(_worth_running(entry, guess))
        return list(self.pending[id(entry)])

    def processed(self, entry, logits, params, position):  # type: ignore[no-untyped-def]
        self.drawing = id(entry)  # the draft shapes a position's logits right before it draws there
        return _processed(entry, logits, params, position)

    def sample(self, logits, warp, top_n, generator):  # type: ignore[no-untyped-def]
        drawn = _sample_draft_token(logits, warp, top_n, generator)
        pending = self.pending.get(self.drawing, []) if self.drawing is not None else []
        return dataclasses.replace(drawn, token_id=pending.pop(0)) if pending else drawn


_worth_running = draft_engine._worth_running
_processed = draft_engine._processed


@pytest.mark.slow
def test_the_guessing_test_catches_a_planted_bug(
    models: dict[str, LoadedModel], sure_bigram: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same settings (sequential) and number of requests: the planted bug is rejected at p < 1e-6."""
    bug = _GuessProposedUndrawn()
    monkeypatch.setattr(draft_engine, "_worth_running", bug.worth_running)
    monkeypatch.setattr(draft_engine, "_processed", bug.processed)
    monkeypatch.setattr(draft_engine, "sample_draft_token", bug.sample)
    speculation = guessing_speculation(models, sure_bigram, False)
    samples = sample_counts(speculation, 1500)
    exact = exact_distribution(models["bigram"], prompt=speculation.prompt)
    assert chi_square_pvalue(samples, exact, sum(samples.values())) < PLANTED_P


# Drafting across tokenizers: a draft with SmolLM2's tokenizer for a target with Qwen2.5's (tiny
# models of one text, tokenized differently: some words are one token in one and two in the other).
CROSS_TEXT = " the cat sat on a mat and warms fibonacci recursion with blue sky over green rollback hills"


@pytest.fixture(scope="module")
def cross_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    qwen = real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)
    smollm = real_tokenizer("smollm2-135m", tmp_path_factory)
    root = tmp_path_factory.mktemp("cross-exactness")
    options = LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch")
    # weak preferences: each position's top-4 spread out, and the draft's differ from the target's
    target = load_model(str(build_text_bigram(root / "target", qwen, CROSS_TEXT, 0, 1.5, 1.0)), options)
    draft = load_model(str(build_text_bigram(root / "draft", smollm, CROSS_TEXT, 1, 1.5, 1.0)), options)
    return {"target": target, "draft": draft, "qwen": qwen, "smollm": smollm, "prompt": tuple(qwen.encode(" the cat"))}


def cross_speculation(models: dict[str, object], method: str, k: int) -> Speculation:
    target, draft = models["target"], models["draft"]
    assert isinstance(target, LoadedModel) and isinstance(draft, LoadedModel)
    bridge = VocabBridge(models["smollm"], models["qwen"], draft.vocab_size, method)  # type: ignore[arg-type]
    prompt = models["prompt"]
    assert isinstance(prompt, tuple)
    return Speculation(target, draft, k, 0, False, prompt=prompt, bridge=bridge)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "k"), [("tli", 2), ("slem", 3)])
def test_drafts_of_another_tokenizer_follow_the_target_distribution(
    cross_models: dict[str, object], method: str, k: int
) -> None:
    """The draft worker's translated_propose_job (TLI: its distribution restricted to the shared
    tokens, in target ids; SLEM: its greedy text re-tokenized, one-hot) and the target's
    verify_job, 1000 requests (a 152k-token vocabulary makes each slow): the first three tokens
    follow the exact target distribution."""
    speculation = cross_speculation(cross_models, method, k)
    samples = sample_counts(speculation, 1000)
    tally = speculation.tally
    assert 0.1 < tally.accepted / tally.proposed < 0.9  # acceptance and rejection both decide tokens
    target = cross_models["target"]
    assert isinstance(target, LoadedModel)
    exact = exact_distribution(target, prompt=speculation.prompt)
    assert chi_square_pvalue(samples, exact, sum(samples.values())) > PASS_P


_in_target_ids = draft_engine._in_target_ids  # the production mapping, kept before the patch


def _misaligned(sample, draft_to_target):  # type: ignore[no-untyped-def]
    """The planted bug: the proposal's probabilities land on the wrong target ids (rotated by one
    among the proposed ids), so the target verifies against a q the token was not drawn from."""
    mapped = _in_target_ids(sample, draft_to_target)
    if mapped.probs is None:
        return mapped
    return type(mapped)(token_id=mapped.token_id, ids=mapped.ids, probs=mapped.probs.roll(1))


@pytest.mark.slow
def test_the_tli_test_catches_a_planted_bug(cross_models: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check: TLI with the proposal's ids and probabilities misaligned is rejected at p < 1e-6
    (the same number of requests)."""
    monkeypatch.setattr(draft_engine, "_in_target_ids", _misaligned)
    speculation = cross_speculation(cross_models, "tli", 2)
    samples = sample_counts(speculation, 1000)
    target = cross_models["target"]
    assert isinstance(target, LoadedModel)
    assert chi_square_pvalue(samples, exact_distribution(target, prompt=speculation.prompt), 1000) < PLANTED_P
