"""Adaptive K and automatic fallback to target-only decoding.

``StepCosts`` (one per coordinator) learns what a round costs on the deployed hardware: draft
time per token, verification time by the number of tokens in the pass, and the per-round
overhead. ``KController`` (one per turn) learns the session's acceptance rate and picks, each
round, the K in [0, K_max] with the best expected tokens per second (Leviathan et al.: a round with
per-token acceptance a yields (1 - a^(K+1)) / (1 - a) tokens). K = 0 is target-only decoding; it is
chosen whenever speculation would be slower; then cheap probes (first after 4 target-only rounds,
the gap doubling up to ``probe_every``) keep the acceptance estimate fresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_EWMA = 0.2
_POOL_DECAY = 0.98  # per round: the global acceptance remembers roughly the last 50 rounds
_FIRST_PROBE = 4  # target-only rounds before the first probe; the gap doubles up to probe_every
_MAX_TOKENS = 64


def ewma(old: float | None, new: float) -> float:
    """Exponentially weighted moving average with weight 0.2 for ``new`` (``new`` itself at first)."""
    return new if old is None else old + _EWMA * (new - old)


@dataclass
class StepCosts:
    """Measured costs of the deployed models (milliseconds), shared by all sessions."""

    draft_per_token: float | None = None
    overhead: float | None = None
    verify: dict[int, float] = field(default_factory=dict)  # tokens in the pass -> ms
    # Per-token acceptance over all sessions (the prior of a new turn): decayed sums of accepted
    # drafts and of trials (accepted + the rejection that ended the round). Pooling the counts
    # matters: an average of per-round ratios is biased low (rounds 4/4 and 0/1 pool to 0.8,
    # their ratios average 0.5).
    _accepted: float = 0.0
    _trials: float = 0.0

    @property
    def alpha(self) -> float | None:
        return self._accepted / self._trials if self._trials > 0 else None

    def observe_acceptance(self, k: int, accepted: int) -> None:
        if k > 0:
            self._accepted = self._accepted * _POOL_DECAY + accepted
            self._trials = self._trials * _POOL_DECAY + accepted + (1 if accepted < k else 0)

    def observe_draft(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            self.draft_per_token = ewma(self.draft_per_token, ms / tokens)

    def observe_verify(self, tokens: int, ms: float) -> None:
        if 0 < tokens <= _MAX_TOKENS:
            self.verify[tokens] = ewma(self.verify.get(tokens), ms)

    def observe_overhead(self, ms: float) -> None:
        self.overhead = ewma(self.overhead, max(ms, 0.0))

    def verify_ms(self, tokens: int) -> float | None:
        """Measured, else linearly interpolated/extrapolated from the nearest measurements."""
        if tokens in self.verify:
            return self.verify[tokens]
        known = sorted(self.verify)
        if len(known) < 2:
            return None
        lower = [n for n in known if n < tokens][-2:] or known[:2]
        upper = [n for n in known if n > tokens][:2]
        a, b = (lower[-1], upper[0]) if lower and upper and lower[-1] < tokens < upper[0] else (known[-2], known[-1])
        if tokens < known[0]:
            a, b = known[0], known[1]
        slope = (self.verify[b] - self.verify[a]) / (b - a)
        return max(self.verify[a] + slope * (tokens - a), 0.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round commits on average: accepted drafts + the target's own token."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class KController:
    """Chooses each round's K for one turn."""

    k_max: int
    costs: StepCosts
    pipelined: bool = False
    probe_every: int = 32
    prior_alpha: float = 0.7
    prior_weight: float = 4.0
    decay: float = 0.9
    _accepted: float = 0.0
    _trials: float = 0.0
    _since_probe: int = 0
    _probe_gap: int = _FIRST_PROBE

    @property
    def alpha(self) -> float:
        """Per-token acceptance estimate: decaying counts of this turn on top of a prior (the
        acceptance measured over all sessions, else ``prior_alpha``)."""
        prior = self.costs.alpha if self.costs.alpha is not None else self.prior_alpha
        return (self._accepted + prior * self.prior_weight) / (self._trials + self.prior_weight)

    def observe(self, k: int, accepted: int) -> None:
        """Records a speculative round: ``accepted`` of ``k`` drafts taken (the first rejection ends it)."""
        if k == 0:
            return
        self.costs.observe_acceptance(k, accepted)
        self._accepted = self._accepted * self.decay + accepted
        self._trials = self._trials * self.decay + accepted + (1 if accepted < k else 0)

    def expected_ms(self, k: int) -> float | None:
        verify = self.costs.verify_ms(k + 1)
        if verify is None or self.costs.draft_per_token is None:
            return None
        draft = self.costs.draft_per_token * k
        if self.pipelined:  # a block drafted ahead costs nothing when the previous one was fully taken
            draft *= 1.0 - self.alpha ** (k + 1)
        return verify + draft + (self.costs.overhead or 0.0)

    def choose(self, budget: int) -> int:
        """K for the next round; ``budget`` = the most drafts that can still be used."""
        upper = min(self.k_max, budget)
        if upper <= 0:
            return 0
        if 1 not in self.costs.verify:
            return 0  # learn what target-only decoding costs first (one round per coordinator)
        rates = {k: expected_tokens(self.alpha, k) / ms for k in range(upper + 1) if (ms := self.expected_ms(k))}
        if len(rates) < 2:
            return upper  # speculative costs not measured yet: speculate at K_max to learn them
        best = max(rates, key=rates.__getitem__)
        if best > 0:
            self._since_probe, self._probe_gap = 0, min(_FIRST_PROBE, self.probe_every)
            return best
        # Off: probe with a short block, soon at first (acceptance often changes within a
        # response), then backing off (a useless draft costs ever less) up to probe_every.
        self._since_probe += 1
        if self._since_probe >= min(self._probe_gap, self.probe_every):
            self._since_probe, self._probe_gap = 0, min(self._probe_gap * 2, self.probe_every)
            return min(2, upper)
        return 0
