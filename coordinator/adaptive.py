"""Adaptive K, the choice of proposer per round, and automatic fallback to target-only decoding.

``StepCosts`` (one per coordinator) learns what a round costs on the deployed hardware: draft time
per token, verification time by the number of tokens in the pass, and the per-round overhead (with
and without a call to the draft worker), each the median of its last samples, kept apart by the
number of requests in flight when measured. ``KController`` (one
per turn) learns the session's acceptance rate of each proposer and picks, each round, the proposer
and K with the best expected tokens per second (Leviathan et al.: a round with per-token acceptance
a yields (1 - a^(K+1)) / (1 - a) tokens; with the draft's confidence stop, which ends a block
early, K is a cap and the rate c at which the draft goes on after a token enters too: the block
holds on average 1 + c + ... + c^(K-1) tokens. Under a stop the tokens the draft went on after (it
was sure of them) and the token a stop ended the block on are taken at different rates, a_s and
a_u, so position i adds (c a_s)^(i-1) (c a_s + (1 - c) a_u): a long run of sure tokens is worth
what it is, where one pooled rate would price every position after the first at the unsure tokens'
odds too). The proposers: ``model`` (the draft worker; costs draft time per token) and ``ngram``
(lookup in the session's own tokens; free to draft, only where the suffix matches). K = 0 is
target-only decoding; it is chosen whenever speculation would be slower; then cheap probes (first
after 4 target-only rounds, the gap doubling up to ``probe_every``) keep the acceptance estimate
fresh. Target-only decoding's cost is timed only by target-only rounds, so while the plan chosen
expects so few tokens a round that its lead is the costs' alone, a round decodes target-only now
and then (the same backoff) to time it again. A lookup draft needs no probes: it costs nothing
to make, so a round that did not use it still scores it against the tokens the target committed
(``lookup_score``), and a lookup that keeps failing is not tried at all.
"""

from __future__ import annotations

import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median_low

from specdec.averages import ewma

EWMA_WEIGHT = 0.2  # a new timing's weight in the coordinator's moving averages
# A round's costs are the lower median of their last samples: a call that stalled (a throttled
# CPU, a paused process, a busy host) is one sample, not the cost; a lasting change moves it
# after 4 samples of its own.
_COST_SAMPLES = 7
_POOL_DECAY = 0.98  # per round: the global acceptance remembers roughly the last 50 rounds
_FIRST_PROBE = 4  # rounds a proposer stays unused before the first probe; the gap doubles up to probe_every
# A plan that expects fewer tokens a round than this beats target-only decoding by its costs alone
# (a draft right a third of the time at K 1 adds 0.33 a round), so those costs must stay current.
_THIN_LEAD_TOKENS = 1.5
_MAX_TOKENS = 64
# A pass that computed at least this many tokens (a prompt, a resync) measures the prefill rate;
# fewer are dominated by the pass's fixed costs.
PREFILL_MIN_TOKENS = 64
MODEL, NGRAM, NONE = "model", "ngram", "none"
# Where a lookup draft came from, each with acceptance counts of its own: the session's own tokens
# (NGRAM, kept per match length: see lookup_key) or an earlier request's reply (REPLY, the reply
# index). A retried request is drafted its earlier reply whole; that rate says nothing of how often
# a session's tokens repeat.
REPLY = "reply"
# The confidence stop is judged after this many blocks it ended; it stays while the tokens it ends
# blocks on are taken less than this share of the draft's per-token acceptance.
_UNSURE_EVIDENCE = 2.5  # about three blocks (the counts decay)
_UNSURE_MARGIN = 0.9


def typical(samples: deque[float], new: float) -> float:
    """Adds ``new`` to ``samples`` (a window of the last ones) and returns their lower median."""
    samples.append(new)
    return median_low(samples)


def _cost_window() -> deque[float]:
    return deque(maxlen=_COST_SAMPLES)


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and of trials (accepted + the rejection that ended a
    round). Pooling the counts matters: an average of per-round ratios is biased low (rounds 4/4
    and 0/1 pool to 0.8, their ratios average 0.5)."""

    decay: float
    accepted: float = 0.0
    trials: float = 0.0

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            self.accepted = self.accepted * self.decay + accepted
            self.trials = self.trials * self.decay + accepted + (1 if accepted < k else 0)

    @property
    def rate(self) -> float | None:
        return self.accepted / self.trials if self.trials > 0 else None


@dataclass(frozen=True)
class ConfidenceStop:
    """Where the draft model ends a block early (each 0 = off): after a token it proposed with a
    probability below ``token`` (HF's assistant confidence threshold), or after the token that takes
    the product of the block's probabilities, its estimate of the chance that the target keeps the
    whole block, below ``block``. Speed only: the target verifies whatever was proposed."""

    token: float = 0.0
    block: float = 0.0
    # the server's block stop, which an adaptive turn sets from the measured costs
    # (``block_stop_for``), ``block`` until they are measured; a request's own is used as set
    block_from_costs: bool = False
    # the stops only report where they would end a block (``ProposeRequest.report_stops_only``):
    # an adaptive turn that switched them off still learns whether they would pay
    report_only: bool = False

    @property
    def on(self) -> bool:
        return self.token > 0 or self.block > 0


NO_STOP = ConfidenceStop()

# The block stop for a round's costs: drafting one more token costs a draft step and a verify row,
# and pays where the draft's odds that the whole block is kept are above about twice that cost over
# a round's fixed cost (the one-row verify and the overhead). Replaying the target's greedy replies
# to 16 code prompts through the int8 draft (scripts/draft_ceiling.py's pricing) at the fair
# benchmark's costs with the draft step scaled 0.25x-2x and the verify row 0.25x-4x (ratios
# 0.03-0.37, 24 cases), the best of 14 thresholds lay at 1.4x-3.9x the ratio (the optimum is flat),
# twice the ratio came within 2.4% of that best in every case, a fixed 0.5 within 15.1%.
# Pipelined rounds (the draft drafts the next block while the target verifies; a round costs the
# longer of the two where the block drafted ahead is used) keep the same ratio at a higher factor:
# a block the stop ends sooner is kept whole more often, and only then is the block drafted ahead
# used. The same replay priced as pipelined rounds (draft step 1-40 ms, one-row verify 25-250 ms,
# a verify row 0.5-3.2% of it, 63 cases): three times the ratio came within 1.6% of the best of 13
# thresholds in every case (twice within 3.6%), and priced 0.99x-1.28x a fixed 0.5, median 1.08x.
_BLOCK_STOP_PER_COST = 2.0
_BLOCK_STOP_PER_COST_PIPELINED = 3.0
_BLOCK_STOP_RANGE = (0.05, 0.9)


def block_stop_for(token_ms: float, round_ms: float, pipelined: bool = False) -> float:
    """The block stop's threshold for a drafted token costing ``token_ms`` (draft step + verify row)
    in rounds whose fixed cost is ``round_ms``; ``pipelined``: rounds that draft ahead."""
    low, high = _BLOCK_STOP_RANGE
    per_cost = _BLOCK_STOP_PER_COST_PIPELINED if pipelined else _BLOCK_STOP_PER_COST
    return min(max(per_cost * token_ms / max(round_ms, 1e-9), low), high)


@dataclass
class _Backoff:
    """Rounds until something is due again: first after ``_FIRST_PROBE``, then the gap doubling
    up to a cap (the controller's ``probe_every``)."""

    since: int = 0
    gap: int = _FIRST_PROBE

    def due(self, cap: int) -> bool:
        """Counts a round; True (and the gap doubles) when it is the one due."""
        self.since += 1
        if self.since < min(self.gap, cap):
            return False
        self.since, self.gap = 0, min(self.gap * 2, cap)
        return True

    def reset(self) -> None:
        self.since, self.gap = 0, _FIRST_PROBE


@dataclass(frozen=True)
class Plan:
    """A round's proposer (``model``, ``ngram`` or ``none``) and its K (0 with ``none``)."""

    method: str
    k: int


TARGET_ONLY = Plan(NONE, 0)


@dataclass(frozen=True)
class LoadLimit:
    """Speculation off while more than ``max_requests`` requests are generating (0 = no limit),
    as vLLM's ``speculative_disable_by_batch_size``. A batched pass costs a part every pass pays
    (reading the weights) and a part per row: on a CPU target many requests decoding one token
    each share one pass, while speculating requests drift out of step and each pays more of its
    passes, so beyond some load target-only decoding serves more tokens per second (see
    docs/benchmarks.md, Under load). A round's choice prices only its own session's costs, not what it adds
    to the passes others share, so this bound is the operator's, from the benchmark's sweep.

    The requests counted are those on the target replica that verifies the session: this
    coordinator's turns there or, when more, those of every coordinator that uses it, as its
    last verify reply reported them (each verify tells the replica ``coordinator_id`` and this
    coordinator's turns on it). Requests on other replicas share none of its passes."""

    max_requests: int = 0
    coordinator_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def exceeded(self, requests: int) -> bool:
        """``requests``: those generating on the session's target replica."""
        return 0 < self.max_requests < requests


def drafting_method(wanted: str, has_draft_model: bool) -> str:
    """The method ``model``, ``ngram`` or ``hybrid`` that runs when ``wanted`` is asked for: without a
    draft model only the lookup can draft."""
    return wanted if has_draft_model else NGRAM


LOAD_BUCKETS = 5  # requests in flight, as costs are kept apart: 1, 2-3, 4-7, 8-15, 16 or more


def load_bucket(in_flight: int) -> int:
    """The class (1 to LOAD_BUCKETS) of a number of requests in flight that costs are kept by."""
    return min(max(in_flight, 1).bit_length(), LOAD_BUCKETS)


# Each load class's classes, nearest first (itself, then by distance, the lower first).
_NEAREST = {
    now: sorted(range(1, LOAD_BUCKETS + 1), key=lambda b, now=now: (abs(b - now), b))
    for now in range(1, LOAD_BUCKETS + 1)
}


class _LoadCost:
    """A cost of ``StepCosts`` kept per load: read, the one measured at the load now (else at the
    nearest load measured; None: none yet); set, the load now's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, costs: StepCosts | None, owner: type | None = None) -> float | None:
        return None if costs is None else costs._scalar(self.name)

    def __set__(self, costs: StepCosts, value: float | None) -> None:
        costs._set_scalar(self.name, value)


@dataclass
class StepCosts:
    """Measured costs of the deployed models (milliseconds), shared by all sessions.

    A round's model costs are its share of the passes it was in, and a share depends on how many
    sessions the passes served: with 16 requests at once a target-only step cost 37 ms of a pass
    it would pay 330 ms for alone. So the round costs (draft, verify, overheads) are kept apart
    by ``load`` (the requests in flight on this coordinator when measured, in LOAD_BUCKETS
    classes), and a round is priced with those of the load now, or of the nearest load measured.
    """

    load: Callable[[], int] = field(default=lambda: 1, repr=False)
    prefill_per_token: float | None = None  # the target's ms per token of a pass that computed a prefix too
    draft_prefill_per_token: float | None = None  # the same for the draft model
    # what a prefill token costs more per 1,000 tokens before it (the workers' start-up timing)
    prefill_per_1k_context: float = 0.0
    draft_prefill_per_1k_context: float = 0.0
    # Per-token acceptance of each proposer (MODEL or a lookup_key) over all sessions (the prior of a new turn).
    acceptance: dict[str, Acceptance] = field(default_factory=lambda: defaultdict(lambda: Acceptance(_POOL_DECAY)))
    # How often the draft model, asked for more, went on after a proposed token (its confidence
    # stop ends a block early otherwise), over all sessions.
    continuation: Acceptance = field(default_factory=lambda: Acceptance(_POOL_DECAY))
    # The model draft's acceptance split by the stop: the tokens it went on after (sure), and the
    # token a confidence stop ended a block on (unsure; counted where the target got to it).
    sure: Acceptance = field(default_factory=lambda: Acceptance(_POOL_DECAY))
    unsure: Acceptance = field(default_factory=lambda: Acceptance(_POOL_DECAY))
    # Per load bucket: the last samples behind draft_per_token, verify and the overheads (see
    # ``typical``), and what they give.
    _samples: dict[tuple[int, str | int], deque[float]] = field(
        default_factory=lambda: defaultdict(_cost_window), repr=False
    )
    _verify: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(dict), repr=False)
    _scalars: dict[int, dict[str, float | None]] = field(default_factory=lambda: defaultdict(dict), repr=False)
    # What _known last gave: (requests in flight, _version, verify, scalars). A round's plan reads the
    # costs of every K of every proposer; merging the load classes on each read made it 4x slower.
    _version: int = field(default=0, repr=False)  # bumped by every change to the costs
    _view: tuple[int, int, dict[int, float], dict[str, float]] | None = field(default=None, repr=False)

    def _known(self) -> tuple[dict[int, float], dict[str, float]]:
        """Every verify cost (by block size) and every other cost measured at some load, each
        from the nearest load it was measured at."""
        in_flight, view = self.load(), self._view
        if view is not None and view[0] == in_flight and view[1] == self._version:
            return view[2], view[3]
        verify: dict[int, float] = {}
        scalars: dict[str, float] = {}
        for bucket in reversed(_NEAREST[load_bucket(in_flight)]):
            verify.update(self._verify[bucket])
            scalars.update((name, v) for name, v in self._scalars[bucket].items() if v is not None)
        self._view = (in_flight, self._version, verify, scalars)
        return verify, scalars

    def _scalar(self, name: str) -> float | None:
        return self._known()[1].get(name)

    def _set_scalar(self, name: str, value: float | None) -> None:
        self._scalars[load_bucket(self.load())][name] = value
        self._version += 1

    # costs read at the load now (else the nearest load measured) and set at the load now
    draft_per_token = _LoadCost()
    overhead = _LoadCost()  # a round's time besides model time, rounds that call the draft worker
    local_overhead = _LoadCost()  # the same for rounds that do not (lookup drafts, target-only)

    @property
    def verify(self) -> dict[int, float]:
        """Tokens in the pass -> ms, measured at the load now (the dict itself: setting it sets them)."""
        self._version += 1  # the caller may change it
        return self._verify[load_bucket(self.load())]

    def verify_measured(self, tokens: int) -> bool:
        return tokens in self._known()[0]

    def verify_measured_ms(self) -> dict[int, float]:
        """Tokens in the pass -> ms, for the pass sizes measured (each at the nearest load measured)."""
        return dict(self._known()[0])

    @property
    def alpha(self) -> float | None:
        """The model draft's acceptance over all sessions."""
        return self.acceptance[MODEL].rate

    def observe_acceptance(self, k: int, accepted: int, method: str = MODEL) -> None:
        self.acceptance[method].observe(k, accepted)

    def _typical(self, key: str | int, ms: float) -> float:
        return typical(self._samples[load_bucket(self.load()), key], ms)

    def observe_draft(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            self.draft_per_token = self._typical("draft", ms / tokens)

    def observe_verify(self, tokens: int, ms: float) -> None:
        if 0 < tokens <= _MAX_TOKENS:
            self.verify[tokens] = self._typical(tokens, ms)

    def observe_prefill(self, tokens: int, ms: float, draft: bool = False) -> None:
        """A pass of the target (or the draft) that computed ``tokens`` with a prefix among them
        (a prompt, a resync): the per-token cost that later calls' time limits allow for."""
        if tokens < PREFILL_MIN_TOKENS:
            return
        if draft:
            self.draft_prefill_per_token = ewma(self.draft_prefill_per_token, ms / tokens, EWMA_WEIGHT)
        else:
            self.prefill_per_token = ewma(self.prefill_per_token, ms / tokens, EWMA_WEIGHT)

    def prefill_ms(self, tokens: int, context: int, draft: bool = False) -> float | None:
        """The expected milliseconds of a pass of the target (or the draft) that computes
        ``tokens`` and leaves ``context`` tokens in the cache: each token costs the per-token rate
        plus the context rate times the tokens before it (None: no rate known yet)."""
        per_token = self.draft_prefill_per_token if draft else self.prefill_per_token
        if not per_token:
            return None
        per_1k = self.draft_prefill_per_1k_context if draft else self.prefill_per_1k_context
        before = max(context - tokens / 2, 0.0)  # on average over the pass's tokens
        return tokens * (per_token + per_1k * before / 1000)

    def observe_overhead(self, ms: float, drafted: bool = True) -> None:
        """A round's time besides model time; ``drafted``: the round called the draft worker."""
        if drafted:
            self.overhead = self._typical("overhead", max(ms, 0.0))
        else:
            self.local_overhead = self._typical("local_overhead", max(ms, 0.0))

    def overhead_ms(self, drafted: bool) -> float:
        own = self.overhead if drafted else self.local_overhead
        return own if own is not None else (self.overhead or self.local_overhead or 0.0)

    def verify_at(self, tokens: float) -> float | None:
        """``verify_ms`` at a fractional number of tokens (an expected block length), interpolated."""
        low = int(tokens)
        below = self.verify_ms(low)
        if low == tokens or below is None:
            return below
        above = self.verify_ms(low + 1)
        return None if above is None else below + (above - below) * (tokens - low)

    def verify_ms(self, tokens: int) -> float | None:
        """Measured, else linearly interpolated/extrapolated from the nearest measurements."""
        verify = self._known()[0]
        if tokens in verify:
            return verify[tokens]
        known = sorted(verify)
        if len(known) < 2:
            return None
        lower = [n for n in known if n < tokens][-2:] or known[:2]
        upper = [n for n in known if n > tokens][:2]
        a, b = (lower[-1], upper[0]) if lower and upper and lower[-1] < tokens < upper[0] else (known[-2], known[-1])
        if tokens < known[0]:
            a, b = known[0], known[1]
        slope = (verify[b] - verify[a]) / (b - a)
        return max(verify[a] + slope * (tokens - a), 0.0)


def lookup_key(match_len: int, from_replies: bool = False) -> str:
    """The acceptance counts a lookup draft is judged by: the reply index's (REPLY), or those of
    the session lookups whose suffix matched ``match_len`` tokens (``ngram:N``). How often a
    lookup is right depends on how much of the context it matched: on the benchmark's prompts, a
    5-token match in a reply that copies its prompt ran on for 16 tokens more often than not,
    while 2-token matches in fresh code were mostly wrong at once; one pooled rate let a copying
    request's long matches price another request's short ones."""
    return REPLY if from_replies else f"{NGRAM}:{match_len}"


def lookup_score(lookup: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """How a lookup draft that a round did not use would have fared: (tokens of it the round's
    committed tokens can judge, tokens of it the target would have taken), for ``observe``. A
    one-hot draft token x is taken with probability p(x), the chance that the target's own token
    at that position is x (greedy: exactly when it is), so the committed tokens score it without a
    verify pass; positions past the round's tokens stay unknown."""
    judged = min(len(lookup), len(committed))
    taken = next((i for i in range(judged) if lookup[i] != committed[i]), judged)
    return judged, taken


def expected_tokens(alpha: float, k: int, going_on: float = 1.0, unsure: float | None = None) -> float:
    """Tokens a round commits on average: accepted drafts + the target's own token. ``going_on``:
    the chance that the draft proposes the next token after one (below 1 with its confidence stop);
    ``alpha``: the acceptance of the tokens it goes on after, ``unsure`` that of the token a stop
    ends the block on (default: the same)."""
    if going_on >= 1.0:
        if k == 0:
            return 1.0
        if alpha >= 1.0:
            return float(k + 1)
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    unsure = alpha if unsure is None else unsure
    chain, last = going_on * alpha, going_on * alpha + (1.0 - going_on) * unsure
    return 1.0 + sum(chain ** (i - 1) * last for i in range(1, k + 1))


def expected_length(k: int, going_on: float) -> float:
    """Tokens a block asked for ``k`` holds on average (the first always, each next one if the draft goes on)."""
    return float(sum(going_on**i for i in range(k)))


@dataclass
class KController:
    """Chooses each round's proposer and K for one turn."""

    k_max: int
    costs: StepCosts
    pipelined: bool = False
    probe_every: int = 32
    prior_alpha: float = 0.7
    prior_weight: float = 4.0
    decay: float = 0.9
    confidence_stop: bool = False  # the turn's requests ask the draft model to stop where it is unsure
    block_stop: float = 0.0  # the block stop's threshold (0 = none): it bounds a block's length itself
    block_from_costs: bool = False  # the threshold follows the measured costs (``block_threshold``)
    _seen: dict[str, Acceptance] = field(init=False)
    _going_on: Acceptance = field(init=False)
    _unsure: Acceptance = field(init=False)  # the tokens the draft ended a block on, unsure: taken?
    _sure_seen: Acceptance = field(init=False)  # acceptance of the tokens the draft went on after
    _sure_runs: Acceptance = field(init=False)  # block-stop blocks: the draft's sure run taken whole?
    _unsure_seen: Acceptance = field(init=False)  # of the token a stop ended a block on, where reached
    _stop_dropped: bool = field(default=False, init=False)  # only whole blocks paid: the turn drafts without it
    _probes: _Backoff = field(default_factory=_Backoff, init=False)  # rounds since the model was used or probed
    _widest: _Backoff = field(default_factory=_Backoff, init=False)  # model rounds below the longest block allowed
    _untimed: _Backoff = field(default_factory=_Backoff, init=False)  # thin-lead rounds since target-only was timed

    def __post_init__(self) -> None:
        self._seen = defaultdict(lambda: Acceptance(self.decay))
        self._going_on = Acceptance(self.decay)
        self._unsure = Acceptance(self.decay)
        self._sure_seen = Acceptance(self.decay)
        self._sure_runs = Acceptance(self.decay)
        self._unsure_seen = Acceptance(self.decay)

    @property
    def alpha(self) -> float:
        """The model draft's per-token acceptance estimate."""
        return self.alpha_of(MODEL)

    def alpha_of(self, method: str) -> float:
        """Per-token acceptance estimate of a proposer: decaying counts of this turn on top of a
        prior (the acceptance measured over all sessions, else ``prior_alpha``)."""
        return self._estimate(self.costs.acceptance[method], self._seen[method], self.prior_alpha)

    @property
    def going_on(self) -> float:
        """The chance that the draft model proposes another token after one, when asked for more:
        1 without its confidence stop; this turn's counts on top of the rate over all sessions."""
        if not self.stopping:
            return 1.0
        return self._estimate(self.costs.continuation, self._going_on, 1.0)

    def observe(
        self,
        k: int,
        accepted: int,
        method: str = MODEL,
        asked: int | None = None,
        ends_unsure: bool = False,
        unsure_at: int = 0,
    ) -> None:
        """Records a speculative round: ``accepted`` of ``k`` drafts taken (the first rejection ends
        it); ``method``: ``model``, or the source of a lookup draft (a ``lookup_key``);
        ``asked``: the block length asked of the draft model (more than ``k`` if it stopped
        early); ``ends_unsure``: the draft proposed the last token below its confidence stop;
        ``unsure_at``: where in a block whose stops were only reported (1 = its first token) they
        would have ended it, 0 = nowhere. The stops' own records then take the block they would
        have left: its first ``unsure_at`` tokens, ending unsure."""
        if k == 0:
            return
        self.costs.observe_acceptance(k, accepted, method)
        self._seen[method].observe(k, accepted)
        if method != MODEL:
            return
        if 0 < unsure_at <= k and not ends_unsure:
            k, accepted, ends_unsure = unsure_at, min(accepted, unsure_at), True
        if asked is not None and asked > 1:
            self.costs.continuation.observe(asked - 1, k - 1)
            self._going_on.observe(asked - 1, k - 1)
        if ends_unsure:  # one trial: the block's last token, taken or not
            self._unsure.observe(1, int(accepted == k))
        self._observe_split(k, accepted, ends_unsure)
        if self.block_stop > 0 and (run := k - 1 if ends_unsure else k):
            self._sure_runs.observe(1, int(accepted >= run))

    def _observe_split(self, k: int, accepted: int, ends_unsure: bool) -> None:
        """The round's sure tokens (all but the last where a stop ended the block) and its unsure
        one, counted where the target got to it (every token before it taken)."""
        sure, unsure = (self.costs.sure, self._sure_seen), (self.costs.unsure, self._unsure_seen)
        if not ends_unsure:
            for counts in sure:
                counts.observe(k, accepted)
            return
        if k > 1:
            for counts in sure:
                counts.observe(k - 1, min(accepted, k - 1))
        if accepted >= k - 1:
            for counts in unsure:
                counts.observe(1, int(accepted == k))

    def _estimate(self, pooled: Acceptance, seen: Acceptance, fallback: float) -> float:
        """This turn's decaying counts on top of a prior: the rate over all sessions, else ``fallback``."""
        rate = pooled.rate
        prior = rate if rate is not None else fallback
        return (seen.accepted + prior * self.prior_weight) / (seen.trials + self.prior_weight)

    @property
    def stopping(self) -> bool:
        """Whether this round's model block is asked to end where the draft is unsure."""
        return self.confidence_stop and not self._stop_dropped and self.confidence_stop_pays

    @property
    def confidence_stop_pays(self) -> bool:
        """Whether the draft's confidence stop is kept for this turn: while the tokens it ends
        blocks on are taken clearly less often than the tokens it went on after. A draft that is
        right where it is unsure (a badly calibrated one) would otherwise lose every token after
        them; without the stop its blocks run to K (and c returns to 1), while the draft still reports
        where the stop would have ended them (``observe``'s ``unsure_at``), so the record goes on
        and the stop comes back once the tokens it would end blocks on are rejected again.
        Compared with the draft's tokens overall instead, which hold the unsure ones too, a high
        block stop (a pipelined turn's, near 0.9: blocks of a token or two) was switched off while
        it paid: an emulated pipelined service (``scripts/pipelined_emulation.py`` at 12 ms a
        draft step) decoded 5% faster with this comparison."""
        unsure = self._unsure
        if unsure.trials < _UNSURE_EVIDENCE:
            return True
        return unsure.accepted / unsure.trials < _UNSURE_MARGIN * self._sure_alpha

    def expected_ms(self, k: int, method: str = MODEL) -> float | None:
        if method != MODEL:  # a lookup draft costs nothing to make (nor does none)
            verify = self.costs.verify_ms(k + 1)
            return None if verify is None else verify + self.costs.overhead_ms(drafted=False)
        length = expected_length(k, self.going_on)  # the draft may end the block before k
        verify = self.costs.verify_at(length + 1)
        if verify is None or self.costs.draft_per_token is None:
            return None
        draft = self.costs.draft_per_token * length
        if self.pipelined:  # a block drafted ahead costs nothing when the previous one was fully taken
            draft *= 1.0 - self.alpha ** (k + 1)
        return verify + draft + self.costs.overhead_ms(drafted=True)

    def choose(self, budget: int) -> int:
        """K for the next round with the model draft only; ``budget`` = the most drafts that can still be used."""
        return self.plan(min(self.k_max, budget)).k

    def plan(self, model: int, lookup: int = 0, lookup_source: str = NGRAM) -> Plan:
        """The next round's proposer and K. ``model``: the most drafts the draft worker may be
        asked for (0 = not usable); ``lookup``: tokens a lookup draft has ready (0 = no match),
        whose acceptance counts are ``lookup_source``'s (the session's tokens by match length, or
        the reply index: see ``lookup_key``)."""
        limits = {MODEL: model, NGRAM: lookup}
        if max(limits.values()) <= 0:
            return TARGET_ONLY
        if not self.costs.verify_measured(1):
            return TARGET_ONLY  # learn what target-only decoding costs first (one round per coordinator)
        rates = {TARGET_ONLY: self._rate(TARGET_ONLY)}
        for method, upper in limits.items():
            for k in range(1, upper + 1):
                rates[Plan(method, k)] = self._rate(Plan(method, k), lookup_source)
        known = {plan: rate for plan, rate in rates.items() if rate is not None}
        unmeasured = [m for m in (MODEL, NGRAM) if limits[m] and Plan(m, limits[m]) not in known]
        if unmeasured:  # speculative costs not measured yet: speculate at the most to learn them
            return Plan(unmeasured[0], limits[unmeasured[0]])
        best = max(known, key=lambda plan: known[plan])
        if best.method == NONE and limits[MODEL] and self.stopping:
            best = self._without_stop(limits[MODEL], known[TARGET_ONLY]) or best
        if best.method == MODEL and self.block_stop_bounds_blocks:
            best = Plan(MODEL, limits[MODEL])
        self._reset(best.method)
        if (retime := self._retime_target_only(best, lookup_source)) is not None:
            return retime
        # With speculation off, the model is probed with a short block, soon at first (acceptance
        # often changes within a response), then backing off (a useless draft costs ever less).
        if best.method == NONE and limits[MODEL] and (probe := self._probe(limits[MODEL])):
            return probe
        if best.method == MODEL and (widest := self._remeasure(best.k, limits[MODEL])):
            return widest
        return best

    @property
    def block_stop_bounds_blocks(self) -> bool:
        """Whether the block stop, not K, decides how long a model block runs: the draft ends it
        once its own odds that the target keeps the whole block fall below the threshold, so a
        long block is one the draft is sure of throughout, which one acceptance rate per
        position cannot tell apart (replaying the benchmark's draft, the longest cap measured best
        with the block stop; caps of 4-6, what the rates chose, lost 6-13% of that).
        Kept while the draft's odds hold: the sure runs the stop leaves (all of a block but the
        token it ended on) are taken whole at least half as often as the threshold says; an
        overconfident draft falls back to the K the rates choose."""
        if not (self.stopping and self.block_stop > 0):
            return False
        runs = self._sure_runs
        return runs.trials < _UNSURE_EVIDENCE or runs.accepted / runs.trials >= self.block_threshold / 2

    @property
    def block_threshold(self) -> float:
        """The block stop for the next model block: ``block_stop``, or with ``block_from_costs``
        ``block_stop_for`` the measured costs (``block_stop`` until the draft's step and the one-row
        verify are measured), at the pipelined factor on a pipelined turn."""
        costs = self.costs
        one, step = costs.verify_ms(1), costs.draft_per_token
        if not (self.block_from_costs and self.block_stop > 0) or one is None or step is None:
            return self.block_stop
        measured = costs.verify_measured_ms()
        widest = max(measured)
        row = max(measured[widest] - one, 0.0) / (widest - 1) if widest > 1 else 0.0
        return block_stop_for(step + row, one + costs.overhead_ms(drafted=True), self.pipelined)

    def _without_stop(self, model: int, target_only: float) -> Plan | None:
        """Where blocks the stop cuts short do not pay, speculation would go off before the unsure
        tokens' record could show whether the stop is worth it: if whole blocks beat target-only
        decoding, the turn drops the stop instead (None: they do not either; the stop stays)."""
        self._stop_dropped = True
        rates = {plan: self._rate(plan) for plan in (Plan(MODEL, k) for k in range(1, model + 1))}
        known = {plan: rate for plan, rate in rates.items() if rate is not None and rate > target_only}
        self._stop_dropped = bool(known)
        return max(known, key=lambda plan: known[plan]) if known else None

    def _rate(self, plan: Plan, lookup_source: str = NGRAM) -> float | None:
        ms = self.expected_ms(plan.k, plan.method)
        return self._tokens(plan, lookup_source) / ms if ms else None

    @property
    def _sure_alpha(self) -> float:
        """Acceptance of the tokens the draft model went on after (not ending a block unsure)."""
        return self._estimate(self.costs.sure, self._sure_seen, self.alpha_of(MODEL))

    def _tokens(self, plan: Plan, lookup_source: str = NGRAM) -> float:
        """The tokens a round of ``plan`` is expected to commit."""
        if plan.method == MODEL and self.stopping:
            sure = self._sure_alpha
            unsure = self._estimate(self.costs.unsure, self._unsure_seen, self.alpha_of(MODEL))
            return expected_tokens(sure, plan.k, self.going_on, unsure)
        alpha = self.alpha_of(lookup_source if plan.method == NGRAM else plan.method) if plan.k else 0.0
        return expected_tokens(alpha, plan.k, self.going_on if plan.method == MODEL else 1.0)

    def _reset(self, method: str) -> None:
        if method == MODEL:
            self._probes.reset()

    def _remeasure(self, k: int, upper: int) -> Plan | None:
        """Model blocks shorter than the longest allowed: now and then the longest again (after 4
        such rounds, then the gap doubling up to ``probe_every``). Only a round at a width
        measures its cost, so one slow sample there (a busy host) would otherwise stand for good,
        and shorter blocks, over which a call's fixed cost is spread less, look no cheaper."""
        if k >= upper:
            self._widest.reset()
            return None
        return Plan(MODEL, upper) if self._widest.due(self.probe_every) else None

    def _retime_target_only(self, best: Plan, lookup_source: str) -> Plan | None:
        """Target-only decoding now and then (after 4 such rounds, then the gap doubling up to
        ``probe_every``) while the plan chosen expects fewer than _THIN_LEAD_TOKENS tokens a round:
        its lead is then the costs' alone, and target-only's cost is measured only by rounds that
        decode target-only, so one slow sample (a busy host) would stand for good and keep a useless
        draft on. A plan that expects more does not hang on it: no round is given to timing it."""
        if best.method == NONE or self._tokens(best, lookup_source) >= _THIN_LEAD_TOKENS:
            self._untimed.reset()
            return None
        return TARGET_ONLY if self._untimed.due(self.probe_every) else None

    def _probe(self, upper: int) -> Plan | None:
        return Plan(MODEL, min(2, upper)) if self._probes.due(self.probe_every) else None
