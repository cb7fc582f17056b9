"""Adaptive K: the cost model and the choice it makes."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.adaptive import (
    KController,
    LoadLimit,
    Plan,
    StepCosts,
    block_stop_for,
    expected_length,
    expected_tokens,
    lookup_key,
    lookup_score,
)


def costs(draft: float, verify: dict[int, float], overhead: float = 0.0) -> StepCosts:
    c = StepCosts()
    c.draft_per_token, c.overhead = draft, overhead
    c.verify.update(verify)
    return c


def test_the_load_limit_trips_only_above_a_set_limit() -> None:
    assert not LoadLimit().exceeded(1000)  # no limit set
    assert not LoadLimit(8).exceeded(8)  # at the limit: still speculating
    assert LoadLimit(8).exceeded(9)
    assert LoadLimit().coordinator_id != LoadLimit().coordinator_id  # each coordinator its own


async def test_a_verify_that_fails_over_counts_its_own_request_on_the_new_replica() -> None:
    """The turns a verify tells a replica (for --speculation-max-requests) include the session's
    own when the verify moves it there from a replica that failed: it is counted on the new
    replica only once the verify has succeeded, so that call, and the sum the replica sent
    back, was one request short (main: 0 of 1 request told to the new replica)."""
    from prometheus_client import CollectorRegistry

    from coordinator.worker_session import Decoding, WorkerSession
    from specdec.runtime.sampling import Warp
    from specdec.serving.metrics import CoordinatorMetrics
    from specdec.state.base import CacheLocation
    from specdec.v1 import common_pb2
    from tests.fakes import FakeTarget, FakeTargets

    down, up = FakeTarget("down:1", fails=True), FakeTarget("up:1")
    metrics = CoordinatorMetrics(CollectorRegistry())
    limit = LoadLimit(max_requests=1)
    session = WorkerSession(
        "s",
        FakeTargets(down, up),  # type: ignore[arg-type]
        None,
        metrics,
        5.0,
        None,
        coordinator_id=limit.coordinator_id,
    )
    session.restore(CacheLocation("down:1", 0), None)  # the session's cache is on the replica that fails
    assert session.target_requests == 1 and (down.turns, up.turns) == (1, 0)
    await session.verify([5, 17, 99], common_pb2.DraftBlock(), Decoding(Warp(), 0))
    assert up.sent == [1]
    assert session.target_address == "up:1" and (down.turns, up.turns) == (0, 1)
    assert session.target_requests == 1 and not limit.exceeded(session.target_requests)
    await session.verify([5, 17, 99, 7], common_pb2.DraftBlock(), Decoding(Warp(), 0))
    assert up.sent == [1, 1]  # on its own replica: counted there already
    session.unbind()
    assert (down.turns, up.turns) == (0, 0)


def test_expected_tokens_matches_the_closed_form() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 0) == 1.0


def test_with_a_confidence_stop_blocks_and_rounds_are_shorter() -> None:
    """c = the chance that the draft goes on after a token; c = 1 is the closed form above."""
    assert expected_tokens(0.5, 2, 1.0) == expected_tokens(0.5, 2)
    assert expected_tokens(0.5, 2, 0.5) == pytest.approx(1 + 0.5 + 0.25 * 0.5)
    assert expected_tokens(1.0, 3, 0.5) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert expected_length(4, 1.0) == 4.0 and expected_length(3, 0.5) == pytest.approx(1.75)


def test_sure_and_unsure_tokens_are_priced_apart() -> None:
    """Position i adds (c a_s)^(i-1) (c a_s + (1 - c) a_u); with a_u = a_s it is the pooled form."""
    assert expected_tokens(0.9, 2, 0.5, 0.3) == pytest.approx(1 + 0.6 + 0.45 * 0.6)
    assert expected_tokens(0.8, 5, 0.6, None) == pytest.approx(expected_tokens(0.8, 5, 0.6))
    assert expected_tokens(0.8, 5, 0.6, 0.8) == pytest.approx(expected_tokens(0.8, 5, 0.6))


def test_a_stopped_block_counts_its_sure_tokens_and_the_unsure_one_apart() -> None:
    """The token a stop ended the block on counts for the unsure rate, and only where the target
    got to it; the tokens before it, and every token of a block the stop did not end, are sure."""
    controller = KController(k_max=8, costs=costs(10, {1: 100, 9: 200}), confidence_stop=True)
    controller.observe(4, 3, asked=8, ends_unsure=True)  # 3 sure taken, the unsure 4th rejected
    sure, unsure = controller.costs.sure, controller.costs.unsure
    assert (sure.accepted, sure.trials, unsure.accepted, unsure.trials) == (3, 3, 0, 1)
    controller.observe(4, 1, asked=8, ends_unsure=True)  # rejected at the 2nd: the unsure one never reached
    assert (sure.accepted, sure.trials, unsure.trials) == pytest.approx((3 * 0.98 + 1, 3 * 0.98 + 2, 1))
    controller.observe(8, 8, asked=8)  # ran to the cap: all sure
    assert sure.accepted == pytest.approx((3 * 0.98 + 1) * 0.98 + 8)


def _block_stopping(evidence: list[tuple[int, int]]) -> KController:
    controller = KController(k_max=16, costs=costs(20, {1: 100, 17: 260}), confidence_stop=True, block_stop=0.5)
    for k, accepted in evidence:
        controller.observe(k, accepted, asked=16, ends_unsure=True)
    return controller


def test_with_the_block_stop_the_stop_bounds_a_model_block() -> None:
    """Rates that pool the sure tokens price a long block at their average odds and pick a short
    cap; with the block stop the draft's own odds end the block, so it is asked for the most."""
    calibrated = _block_stopping([(6, 5), (3, 3), (9, 8), (5, 2)] * 2)  # sure runs mostly taken whole
    assert calibrated.block_stop_bounds_blocks
    assert calibrated.plan(16) == Plan("model", 16)
    pooled = KController(k_max=16, costs=calibrated.costs, confidence_stop=True)  # the token stop: rates pick K
    assert 1 <= pooled.plan(16).k < 16


def test_an_overconfident_draft_gets_the_k_the_rates_choose() -> None:
    """Sure runs the target rarely takes whole (the draft's odds are wrong): K from the rates."""
    overconfident = _block_stopping([(9, 1), (8, 2), (10, 0), (9, 3)])
    assert not overconfident.block_stop_bounds_blocks
    assert overconfident.plan(16).k < 16


def test_a_draft_that_stops_itself_is_asked_for_longer_blocks() -> None:
    """Blocks asked for 8 that the draft ends itself after 3 tokens on average, each fully
    accepted: asking for 8 costs only what the draft runs, so the cap stays at 8. The same three
    accepted tokens per round from a draft that runs all 8 (and is rejected at the 4th) make long
    blocks expensive and unlikely: a shorter cap."""
    stopping = KController(k_max=8, costs=costs(40, {1: 100, 9: 260}), confidence_stop=True)
    for length in [3, 2, 4] * 10:
        stopping.observe(length, length, asked=8)
    assert 0.5 < stopping.going_on < 0.8
    running = KController(k_max=8, costs=costs(40, {1: 100, 9: 260}))
    for _ in range(30):
        running.observe(8, 3)  # the same three accepted tokens per round; the whole block drafted
    assert running.going_on == 1.0
    assert stopping.choose(100) == 8 > running.choose(100)


def test_verify_cost_interpolates_between_measurements() -> None:
    c = costs(10, {1: 100.0, 5: 180.0})
    assert c.verify_ms(3) == pytest.approx(140.0)
    assert c.verify_ms(9) == pytest.approx(260.0)  # extrapolated
    assert c.verify_ms(5) == 180.0
    assert StepCosts().verify_ms(2) is None
    assert c.verify_at(2.5) == pytest.approx(130.0) and c.verify_at(5.0) == 180.0


def _learn(c: StepCosts, verify: dict[int, float], draft: float) -> None:
    for _ in range(7):
        for tokens, ms in verify.items():
            c.observe_verify(tokens, ms)
        c.observe_draft(1, draft)
        c.observe_overhead(10.0)


def test_costs_learned_under_load_do_not_price_a_lone_request() -> None:
    """A round's costs are its share of the passes it was in, and with 16 requests at once a
    target-only step shared a pass with 15 others: 37 ms where it costs 330 alone. Priced by
    those shares (and by the waits of rounds under load), a lone request after two bursts of 16
    requests on a coordinator with --speculation-max-requests 8 (the 1.5B target on a 2-core
    host) decoded 26 of its 38 rounds target-only, 3.31 tok/s where the one before the bursts made
    4.45. Costs are kept apart by how many requests were in flight; a load never seen takes the
    nearest one's."""
    load = [1]
    c = StepCosts(load=lambda: load[0])
    _learn(c, {1: 330.0, 6: 450.0}, draft=55.0)
    load[0] = 16
    assert c.verify_ms(1) == 330.0  # none measured at this load yet: the nearest load's
    _learn(c, {1: 37.0, 6: 150.0}, draft=20.0)
    assert (c.verify_ms(1), c.verify_ms(6), c.draft_per_token) == (37.0, 150.0, 20.0)
    load[0] = 1
    assert (c.verify_ms(1), c.verify_ms(6), c.draft_per_token) == (330.0, 450.0, 55.0)
    load[0] = 12
    assert c.verify_ms(1) == 37.0
    controller = KController(k_max=5, costs=c)
    for _ in range(20):
        controller.observe(5, 4)
    assert controller.choose(budget=100) == 0  # at 16 requests target-only is cheaper: 1 token in 47 ms
    load[0] = 1
    assert controller.choose(budget=100) >= 4  # alone, speculation pays: 1 token in 340 ms, ~3.7 in 735


def test_unmeasured_costs_are_learned_target_only_first_then_at_the_maximum() -> None:
    assert KController(k_max=6, costs=StepCosts()).choose(budget=100) == 0
    only_target_measured = costs(0, {1: 400.0})
    only_target_measured.draft_per_token = None
    assert KController(k_max=6, costs=only_target_measured).choose(budget=100) == 6
    assert KController(k_max=6, costs=only_target_measured).choose(budget=3) == 3


def test_high_acceptance_and_cheap_draft_pick_a_long_block() -> None:
    controller = KController(k_max=8, costs=costs(10, {1: 400, 9: 700}))
    for _ in range(20):
        controller.observe(8, 8)
    assert controller.alpha > 0.95
    assert controller.choose(100) >= 6


def test_useless_draft_turns_speculation_off_and_probes_now_and_then() -> None:
    controller = KController(k_max=4, costs=costs(60, {1: 400, 5: 700}), probe_every=8)
    for _ in range(30):
        controller.observe(4, 0)
    choices = [controller.choose(100) for _ in range(16)]
    assert [i for i, k in enumerate(choices) if k] == [3, 11]  # after 4 rounds, then every 8 (the cap)
    assert set(choices) == {0, 2}
    controller = KController(k_max=4, costs=costs(60, {1: 400, 5: 700}), probe_every=32)
    for _ in range(30):
        controller.observe(4, 0)
    probes = [i for i in range(100) if controller.choose(100)]
    assert probes == [3, 11, 27, 59, 91]  # gaps 4, 8, 16, 32, 32: a useless draft costs ever less


def test_a_successful_probe_turns_speculation_back_on() -> None:
    controller = KController(k_max=4, costs=costs(40, {1: 340, 5: 700}))
    for _ in range(3):
        controller.observe(4, 0)
    assert controller.choose(100) == 0
    for _ in range(3):
        controller.choose(100)
    for _ in range(3):  # probes and rounds that find the draft agreeing again
        controller.observe(2, 2)
    assert controller.choose(100) > 0


def test_global_acceptance_pools_counts_instead_of_averaging_ratios() -> None:
    c = StepCosts()
    c.observe_acceptance(4, 4)
    c.observe_acceptance(4, 0)
    assert c.alpha == pytest.approx((4 * 0.98) / (4 * 0.98 + 1))  # ~0.8, not (1 + 0) / 2
    assert KController(k_max=4, costs=c).alpha == pytest.approx(c.alpha)  # the prior of a fresh turn


def test_acceptance_estimate_follows_a_change() -> None:
    controller = KController(k_max=4, costs=costs(10, {1: 400, 5: 500}))
    for _ in range(40):
        controller.observe(4, 4)
    high = controller.alpha
    for _ in range(40):
        controller.observe(4, 0)
    assert high > 0.9 and controller.alpha < 0.3


def test_pipelining_makes_longer_blocks_worth_it() -> None:
    c = costs(100, {1: 400, 2: 450, 3: 500, 4: 550, 5: 600})
    sequential, pipelined = KController(4, c), KController(4, c, pipelined=True)
    for ctl in (sequential, pipelined):
        for _ in range(10):
            ctl.observe(4, 4)
    assert pipelined.choose(100) >= sequential.choose(100)


def test_a_lookup_that_keeps_matching_is_preferred_to_the_model() -> None:
    controller = KController(k_max=4, costs=costs(60, {1: 400, 5: 500, 9: 600}))
    for _ in range(10):
        controller.observe(8, 8, "ngram")
    plan = controller.plan(model=4, lookup=8)
    assert plan.method == "ngram" and plan.k >= 6
    assert controller.plan(model=4, lookup=0).method == "model"  # no match this round: the model drafts


def test_a_failing_lookup_is_never_tried() -> None:
    """Rounds that did not use the lookup still score it (against the tokens the target committed),
    so a lookup that keeps failing needs no probe rounds: each would cost a verify."""
    controller = KController(k_max=4, costs=costs(60, {1: 400, 5: 700, 9: 1000}), probe_every=8)
    for _ in range(30):
        controller.observe(4, 0, "ngram")
        controller.observe(4, 3, "model")
    plans = [controller.plan(model=4, lookup=8) for _ in range(20)]
    assert {plan.method for plan in plans} == {"model"}


def test_a_lookup_scored_in_other_rounds_takes_over_when_it_starts_matching() -> None:
    controller = KController(k_max=4, costs=costs(60, {1: 400, 5: 700, 9: 1000}))
    for _ in range(10):
        controller.observe(4, 0, "ngram")
        controller.observe(4, 3, "model")
    assert controller.plan(model=4, lookup=8).method == "model"
    for _ in range(5):  # model rounds whose committed tokens the lookup had proposed
        controller.observe(5, 5, "ngram")
    assert controller.plan(model=4, lookup=8).method == "ngram"


@pytest.mark.parametrize(
    ("lookup", "committed", "scored"),
    [
        ([1, 2, 3], [1, 2, 9, 4], (3, 2)),  # the third token differs: 2 taken, then the rejection
        ([1, 2, 3], [1, 2], (2, 2)),  # the round committed 2: the third is not known yet
        ([7, 2], [1, 2, 3], (2, 0)),  # wrong at once (the later match does not count)
        ([], [1], (0, 0)),
    ],
)
def test_a_lookup_is_scored_against_the_committed_tokens(
    lookup: list[int], committed: list[int], scored: tuple[int, int]
) -> None:
    assert lookup_score(lookup, committed) == scored


def test_without_a_model_a_useful_lookup_still_speculates() -> None:
    c = costs(0, {1: 400, 3: 430})
    c.draft_per_token = None  # no draft worker: its cost is never measured
    controller = KController(k_max=4, costs=c)
    for _ in range(5):
        controller.observe(2, 2, "ngram")
    assert controller.plan(model=0, lookup=2) == Plan("ngram", 2)
    assert controller.plan(model=0, lookup=0) == Plan("none", 0)


def test_lookup_acceptance_is_kept_apart_from_the_model_s() -> None:
    c = StepCosts()
    c.observe_acceptance(4, 4, "ngram")
    c.observe_acceptance(4, 0, "model")
    assert c.acceptance["ngram"].rate == 1.0 and c.alpha == 0.0


def test_rounds_without_a_draft_call_have_their_own_overhead() -> None:
    c = StepCosts()
    c.observe_overhead(30.0, drafted=True)
    assert c.overhead_ms(drafted=False) == 30.0  # unmeasured: the other kind stands in
    c.observe_overhead(5.0, drafted=False)
    assert (c.overhead_ms(drafted=True), c.overhead_ms(drafted=False)) == (30.0, 5.0)


def test_one_stalled_call_is_not_a_cost_but_a_lasting_change_is() -> None:
    """Each cost is the lower median of its last 7 samples: a stall (50x) leaves it where it was;
    four samples at a new level move it there."""
    c = StepCosts()
    for _ in range(6):
        c.observe_draft(4, 10.0)
        c.observe_verify(5, 3.0)
        c.observe_overhead(4.0)
        c.observe_overhead(2.0, drafted=False)
    c.observe_draft(4, 500.0)
    c.observe_verify(5, 150.0)
    c.observe_overhead(200.0)
    c.observe_overhead(100.0, drafted=False)
    assert (c.draft_per_token, c.verify[5], c.overhead, c.local_overhead) == (2.5, 3.0, 4.0, 2.0)
    first = StepCosts()
    first.observe_draft(1, 90.0)  # the very first call stalled: it stands until the next one
    assert first.draft_per_token == 90.0
    first.observe_draft(1, 3.0)
    assert first.draft_per_token == 3.0
    steady = StepCosts()
    for _ in range(7):
        steady.observe_draft(1, 2.5)
    for _ in range(3):
        steady.observe_draft(2, 12.0)
        assert steady.draft_per_token == 2.5
    steady.observe_draft(2, 12.0)
    assert steady.draft_per_token == 6.0


def _play(controller: KController, k: int, taken: int, draft_slow: float = 1.0, verify_slow: float = 1.0) -> None:
    """Records a round of K ``k`` (``taken`` drafts accepted) at costs with a fixed part per call:
    draft 6 + 1 ms a token, verify 5 + 1 ms a row, 3 ms a round; each pass ``*_slow`` times that."""
    costs = controller.costs
    if k:
        costs.observe_draft(k, draft_slow * (6.0 + k))
        controller.observe(k, taken, asked=k)
    costs.observe_verify(k + 1, verify_slow * (5.0 + (k + 1)))
    costs.observe_overhead(3.0, drafted=bool(k))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_slow_first_block_does_not_hold_k_below_the_best_for_good(pipelined: bool) -> None:
    """A draft that is always right, costs with a fixed part per call (draft 6 + 1 ms a token,
    verify 5 + 1 ms a row, 3 ms a round): K 4 is the best. The first block at K 4 took three
    times its cost (a busy host), and the controller moved to shorter blocks; the wide pass is
    re-measured now and then (after 4 rounds, the gap doubling), so K comes back to 4. Before, its
    one slow sample stood for good (K 4 was never chosen again to replace it) and short blocks
    measured a higher cost per draft token (the fixed part over fewer tokens): K stayed at 2 for
    the rest of the turn, and of every later turn of the coordinator."""
    costs = StepCosts()
    ks = []
    for _turn in range(2):  # two turns of one coordinator
        controller = KController(k_max=4, costs=costs, pipelined=pipelined)
        for _ in range(24):
            k = controller.choose(100)
            slow = 3.0 if k and not any(ks) else 1.0
            ks.append(k)
            _play(controller, k, taken=k, draft_slow=slow, verify_slow=slow)
    assert ks[:2] == [0, 4]
    assert ks[-30:].count(4) >= 27, ks  # the second turn and the end of the first: K 4 but for re-measuring


def test_the_longest_block_is_drafted_again_after_4_rounds_below_it_then_ever_more_rarely() -> None:
    """Where shorter blocks are truly best (a draft right half the time), the longest block is
    drafted again after 4 rounds below it, then after 8, 16, ... rounds, up to ``probe_every``
    (a smaller ``probe_every`` caps the first gap too)."""
    for probe_every, expected in [(32, [3, 11, 27, 59, 91]), (2, [1, 3, 5, 7, 9])]:  # gaps 4, 8, 16, 32, 32
        controller = KController(k_max=4, costs=costs(10, {1: 100, 2: 110, 5: 400}), probe_every=probe_every)
        for _ in range(20):
            controller.observe(4, 1)
        choices = [controller.choose(100) for _ in range(100)]
        assert set(choices) == {1, 4} and [i for i, k in enumerate(choices) if k == 4][:5] == expected, choices


def test_the_confidence_stop_is_dropped_when_the_draft_is_right_where_it_is_unsure() -> None:
    """Blocks the draft ended on an unsure token that the target took anyway, round after round
    (a badly calibrated draft): the stop only loses tokens and is dropped for the turn. Where the
    unsure tokens are mostly rejected it stays."""
    calibrated, miscalibrated = (
        KController(k_max=8, costs=costs(10, {1: 100, 9: 200}), confidence_stop=True) for _ in range(2)
    )
    assert calibrated.confidence_stop_pays and miscalibrated.confidence_stop_pays  # no evidence yet
    for _ in range(2):
        miscalibrated.observe(1, 1, asked=8, ends_unsure=True)
    assert miscalibrated.confidence_stop_pays  # too little evidence
    miscalibrated.observe(1, 1, asked=1, ends_unsure=True)  # K = 1 asked: the draft still says it was unsure
    assert not miscalibrated.confidence_stop_pays and not miscalibrated.stopping
    assert miscalibrated.going_on == 1.0  # without the stop the draft runs every block to K
    for _ in range(10):
        calibrated.observe(4, 3, asked=8, ends_unsure=True)  # stopped after 4; the unsure 4th token rejected
        calibrated.observe(8, 8, asked=8)  # confident all the way: taken
    assert calibrated.confidence_stop_pays and calibrated.stopping


def test_a_high_block_stop_whose_last_tokens_are_taken_less_often_than_the_sure_ones_is_kept() -> None:
    """At a block stop near 0.9 (a pipelined turn's) blocks are a token or two and the token a
    block ends on is taken nearly as often as the draft's tokens overall, yet clearly less often
    than the tokens it went on after: the stop still separates them and stays. Compared with the
    tokens overall (as before), the check switched it off, and an emulated pipelined service
    (scripts/pipelined_emulation.py's pair at 12 ms a step) decoded 5% slower for it. A draft
    whose last tokens are taken as often as the sure ones still loses the stop."""

    def controller() -> KController:
        return KController(k_max=8, costs=costs(10, {1: 100, 9: 200}), confidence_stop=True, block_stop=0.9)

    separating, blind = controller(), controller()
    kept = {"separating": 0, "blind": 0}
    for round_ in range(20):
        separating.observe(2, 1 if round_ % 6 == 3 else 2, asked=8, ends_unsure=True)  # the 2nd taken 5 in 6
        blind.observe(2, 0 if round_ % 6 == 3 else 2, asked=8, ends_unsure=True)  # the 2nd taken wherever the 1st
        if round_ >= 3:  # after the evidence the check waits for
            kept["separating"] += separating.confidence_stop_pays
            kept["blind"] += blind.confidence_stop_pays
    assert kept["separating"] >= 15 and kept["blind"] <= 2, kept  # of 17 rounds


def test_a_confidence_stop_switched_off_goes_on_hearing_where_it_would_end_blocks_and_comes_back() -> None:
    """Three unsure tokens taken in a row switch the stop off (by chance, under sampling: replaying
    the T 1.0 run's `complete` replies, scripts/sampled_stop.py's draws, the rule switched it off in
    21% of the turns, at the 4th round in the median, though the stop's blocks made 1.08x the best
    fixed K there). Without the stop no block ends unsure, so that record stood for the whole turn;
    then the stop was tried again now and then (blocks ended early to learn). Now the draft reports
    where the stop would have ended each block it drafts without it (``unsure_at``): where that
    token is rejected, the stop is back on after one round, where it is taken, it stays off, and
    no block is ended early to find out."""

    def controller() -> KController:
        return KController(k_max=8, costs=costs(10, {1: 100, 9: 200}), confidence_stop=True, block_stop=0.3)

    wrong = controller()
    for _ in range(3):
        wrong.observe(3, 3, asked=8, ends_unsure=True)
    assert not wrong.confidence_stop_pays and not wrong.stopping
    on = []
    for _ in range(40):
        wrong.plan(8)
        on.append(wrong.stopping)
        if wrong.stopping:
            wrong.observe(3, 2, asked=8, ends_unsure=True)  # the unsure 3rd token rejected
        else:
            wrong.observe(8, 2, asked=8, unsure_at=3)  # a block of K; where the stop would have ended it, rejected
    assert on == [False] + [True] * 39
    right = controller()
    for _ in range(3):
        right.observe(3, 3, asked=8, ends_unsure=True)
    for _ in range(40):
        right.plan(8)
        assert not right.stopping  # never tried: the reports say it would still lose tokens
        right.observe(8, 8, asked=8, unsure_at=3)
    assert not right.confidence_stop_pays
    calibrated = controller()
    for _ in range(40):
        calibrated.plan(8)
        assert calibrated.stopping
        calibrated.observe(3, 2, asked=8, ends_unsure=True)


def test_a_reported_stop_counts_as_the_block_it_would_have_left() -> None:
    """A block drafted with the stops only reported feeds the stops' records (the tokens a stop
    ends blocks on, the tokens before it, the rate of going on) as the block the stop would have
    drafted: its first ``unsure_at`` tokens; the acceptance of the draft's tokens counts all of
    them. A report past the block (``unsure_at`` > k) or none leaves a whole block."""
    reported, stopped = (
        KController(k_max=8, costs=costs(10, {1: 100, 9: 200}), confidence_stop=True, block_stop=0.3) for _ in range(2)
    )
    rounds = [(8, 5, 3), (8, 1, 4), (8, 8, 0), (8, 8, 6), (6, 2, 9)]
    for k, accepted, at in rounds:
        reported.observe(k, accepted, asked=8, unsure_at=at)
        if 0 < at <= k:
            stopped.observe(at, min(accepted, at), asked=8, ends_unsure=True)
        else:
            stopped.observe(k, accepted, asked=8)
    for name in ("_unsure", "_sure_seen", "_unsure_seen", "_sure_runs", "_going_on"):
        mine, theirs = getattr(reported, name), getattr(stopped, name)
        assert (mine.accepted, mine.trials) == pytest.approx((theirs.accepted, theirs.trials)), name
    plain = KController(k_max=8, costs=costs(10, {1: 100, 9: 200}))
    for k, accepted, _ in rounds:
        plain.observe(k, accepted)
    mine, theirs = reported._seen["model"], plain._seen["model"]
    assert (mine.accepted, mine.trials) == pytest.approx((theirs.accepted, theirs.trials))


def test_the_confidence_stop_is_dropped_when_only_whole_blocks_pay() -> None:
    """Where a round's fixed cost is high (here the draft call's overhead), blocks the stop ends
    after one token do not pay and the controller would turn speculation off before the unsure
    tokens' record could show the stop is not worth it. If whole blocks would pay, it drops the
    stop instead; a draft that is wrong stays off, with its stop."""
    right, wrong = (
        KController(k_max=4, costs=costs(10, {1: 100, 5: 140}, overhead=100), confidence_stop=True) for _ in range(2)
    )
    for controller, accepted in ((right, 1), (wrong, 0)):
        controller.costs.local_overhead = 0.0
        for _ in range(2):
            controller.observe(1, accepted, asked=4, ends_unsure=True)
        assert controller.stopping  # too little evidence for the unsure-token rule
    assert right.plan(4) == Plan("model", 4) and not right.stopping and right.going_on == 1.0
    assert wrong.plan(4) == Plan("none", 0) and wrong.stopping


def test_replies_drafted_again_do_not_make_session_lookups_look_good() -> None:
    """A reply index that drafts retried requests whole (every token taken) has a rate of its own:
    a new turn's lookup in its own tokens keeps the prior of session lookups (here failing), not
    the retries' (measured: pooled, two failed lookup rounds on each fresh request)."""
    shared = costs(60, {1: 400, 5: 700, 9: 1000})
    for _ in range(10):  # earlier turns: own-session lookups failed; reply-index drafts all taken
        earlier = KController(k_max=4, costs=shared)
        earlier.observe(8, 0, "ngram")
        earlier.observe(8, 8, "reply")
        earlier.observe(8, 8, "reply")
        earlier.observe(4, 3, "model")
    fresh = KController(k_max=4, costs=shared)
    assert fresh.plan(model=4, lookup=8).method == "model"  # its own tokens' lookup: priced as those fail
    assert fresh.plan(model=4, lookup=8, lookup_source="reply").method == "ngram"  # a stored reply: as those pay


def test_lookups_are_priced_by_the_length_of_their_match() -> None:
    """A session lookup's acceptance is kept per match length: a 5-token match in a reply that
    copies its prompt is usually right, a 2-token one in fresh code rarely is. Pooled (measured on
    the benchmark: edit prompts' copies made a new completion's 2-token matches look good), each
    fresh `complete` request spent 2-3 verify passes on lookups of which none was taken."""
    shared = costs(60, {1: 400, 5: 700, 9: 1000, 17: 1300})
    for _ in range(10):  # earlier turns: long matches copied whole, short ones failed
        earlier = KController(k_max=16, costs=shared)
        earlier.observe(16, 16, lookup_key(5))
        earlier.observe(16, 16, lookup_key(5))
        earlier.observe(16, 0, lookup_key(2))
        earlier.observe(4, 3, "model")
    fresh = KController(k_max=16, costs=shared)
    assert fresh.plan(model=16, lookup=16, lookup_source=lookup_key(2)).method == "model"
    long = fresh.plan(model=16, lookup=16, lookup_source=lookup_key(5))
    assert long.method == "ngram" and long.k == 16
    assert lookup_key(3, from_replies=True) == "reply"  # replies keep one rate of their own


def test_prefill_rates_come_from_passes_that_computed_a_prefix() -> None:
    """Passes of fewer than PREFILL_MIN_TOKENS are a round's work (fixed costs dominate): not a rate."""
    from coordinator.adaptive import PREFILL_MIN_TOKENS

    costs = StepCosts()
    costs.observe_prefill(PREFILL_MIN_TOKENS - 1, 500.0)
    assert costs.prefill_per_token is None
    costs.observe_prefill(200, 100.0)
    costs.observe_prefill(400, 80.0, draft=True)
    assert costs.prefill_per_token == 0.5 and costs.draft_prefill_per_token == 0.2


async def test_a_call_that_prefills_gets_the_time_its_tokens_take() -> None:
    from coordinator.worker_session import WorkerSession

    costs = StepCosts()
    session = WorkerSession("s", None, None, None, 2.0, None, costs=costs)  # type: ignore[arg-type]
    assert session.time_left(prefill=3000) == 2.0  # nothing measured yet: the timeout alone
    costs.observe_prefill(200, 100.0)  # 0.5 ms a token
    assert session.time_left(prefill=10) == 2.0  # a round's work
    assert session.time_left(prefill=3000) == 2.0 + 4 * 3000 * 0.5 / 1000
    # each token also costs 0.1 ms per 1,000 tokens before it: 3,000 tokens after 1,000 cached
    # have 2,500 before them on average
    costs.prefill_per_1k_context = 0.1
    assert session.time_left(prefill=3000, context=4000) == pytest.approx(2.0 + 4 * 3000 * (0.5 + 0.25) / 1000)
    assert costs.prefill_ms(3000, 4000, draft=True) is None  # the draft's rates are its own
    # prefills sent to the replica ahead of it are computed first: 1 s of them
    expected = 2.0 + 4 * (3000 * 0.75 + 1000) / 1000
    assert session.time_left(prefill=3000, context=4000, ahead_ms=1000) == pytest.approx(expected)
    assert session.time_left(prefill=10, context=4000, ahead_ms=1000) == 2.0  # a round waits for one chunk at most


async def test_a_prefix_answered_after_its_turn_ended_still_times_the_draft_s_prefill() -> None:
    """A finished turn leaves the draft the prefix it sent without waiting, and the answer is
    read in the background: that pass (a prompt, a history) is the draft's prefill like one a turn
    reads, so it feeds the rate the next calls' time limits allow for (main: only answers read in
    a turn did; a chat whose turns all end first kept the rate the draft timed at start-up)."""
    from coordinator.worker_session import Proposal, WorkerSession
    from specdec.v1 import common_pb2

    costs = StepCosts()
    session = WorkerSession("s", None, None, None, 2.0, None, costs=costs)  # type: ignore[arg-type]
    answer = Proposal(common_pb2.DraftBlock(token_ids=[7]), cache_len=301, start=300, compute_ms=600.0, computed=301)
    session._catch_up = asyncio.get_running_loop().create_future()
    session._catch_up.set_result(answer)
    assert await session._finish_catch_up()
    assert costs.draft_prefill_per_token == pytest.approx(600.0 / 301)
    assert costs.prefill_per_token is None  # the target's rate is its own


def test_a_replica_counts_the_prefills_sent_to_it_until_they_are_answered() -> None:
    from coordinator.workers import PrefillQueue

    queue = PrefillQueue()
    with queue.holding(300.0):
        with pytest.raises(RuntimeError), queue.holding(200.0):
            assert queue.ahead_ms == 500.0
            raise RuntimeError("the call failed")
        assert queue.ahead_ms == 300.0
    assert queue.ahead_ms == 0.0


def test_a_slow_first_target_only_round_does_not_keep_a_useless_draft_on() -> None:
    """A draft that is never right, costs with a fixed part per call (draft 6 + 1 ms a token,
    verify 5 + 1 ms a row, 3 ms a round): target-only decoding is the best (9 ms a token against
    17 at K 1). The first target-only round took four times its cost (a busy host), so K 1 looked
    cheaper, and target-only decoding, never chosen again, was never timed again: the turn drafted
    at K 1 to the end (CI: 117 of 120 rounds of test_pipelining's useless draft). Where the plan
    chosen expects so few tokens a round that the costs alone decide, target-only decoding is timed
    again now and then (after 4 rounds, the gap doubling), and speculation goes off."""
    controller = KController(k_max=4, costs=StepCosts())
    ks: list[int] = []
    for _ in range(60):
        k = controller.choose(100)
        slow = 4.0 if k == 0 and 0 not in ks else 1.0
        ks.append(k)
        _play(controller, k, taken=0, verify_slow=slow)
    assert ks[:2] == [0, 4]
    assert ks[-40:].count(0) >= 35, ks  # target-only but for the model's probes


def test_target_only_decoding_is_not_timed_again_while_the_draft_pays() -> None:
    """A draft right half the time at K 4 (about 1.9 tokens a round): speculation's lead does not
    hang on the target-only cost, so no round is given to timing it again."""
    controller = KController(k_max=4, costs=costs(10, {1: 100, 2: 110, 5: 150}), probe_every=8)
    for _ in range(20):
        controller.observe(4, 1)
    choices = [controller.choose(100) for _ in range(100)]
    assert 0 not in choices, choices


def test_on_the_h200_s_measured_costs_the_model_draft_is_off_and_a_matching_lookup_on() -> None:
    """Costs as measured on an H200 with eager passes (docs/benchmarks.md, On a GPU): the 1.5B
    target's pass 26.9 ms for one row and ~30 ms for 2-9, the 0.5B draft 21.9 ms a token, 3.3 ms
    of the service's own a round. At the pair's CPU-measured agreement (0.75) a model block
    costs more than the tokens it wins (K = 1: 1.75 tokens in 54.8 ms against 1 in 30.2), so the
    default decodes target-only there, while a lookup (free to draft) that matches still pays; a
    draft of 8 ms a token would be drafted with at K = 3."""
    verify = {1: 26.9, 2: 29.6, 3: 30.1, 5: 29.7, 9: 30.1}
    cheaper = KController(k_max=8, costs=costs(8.0, verify, overhead=3.3))
    controller = KController(k_max=8, costs=costs(21.9, verify, overhead=3.3))
    for _ in range(40):
        for ctl in (controller, cheaper):
            ctl.observe(4, 3)  # 3 of 4 drafted tokens taken a round
    assert 0.7 < controller.alpha < 0.8
    assert controller.plan(model=8, lookup=0).k == 0
    assert cheaper.plan(model=8, lookup=0) == Plan("model", 3)
    for _ in range(10):
        controller.observe(8, 8, "ngram")
    plan = controller.plan(model=8, lookup=8)
    assert plan.method == "ngram" and plan.k >= 6


def test_the_block_stop_follows_the_measured_costs() -> None:
    """Twice a drafted token's cost (a draft step and a verify row) over a round's fixed cost (the
    one-token verify and the overhead), in [0.05, 0.9]: the configured stop until both are measured,
    and always for a request's own stop."""
    measured = costs(30, {1: 250, 17: 250 + 16 * 8}, overhead=10)
    follows = KController(k_max=16, costs=measured, confidence_stop=True, block_stop=0.5, block_from_costs=True)
    assert follows.block_threshold == pytest.approx(2 * (30 + 8) / (250 + 10))
    assert block_stop_for(30 + 8, 260) == pytest.approx(follows.block_threshold)
    assert block_stop_for(0.1, 260) == 0.05 and block_stop_for(200, 260) == 0.9  # clamped
    assert block_stop_for(30, 0.0) == 0.9  # a round that cost nothing: the tightest stop, not a division by 0
    own = KController(k_max=16, costs=measured, confidence_stop=True, block_stop=0.5)  # the request set 0.5
    assert own.block_threshold == 0.5
    off = KController(k_max=16, costs=measured, confidence_stop=True, block_stop=0.0, block_from_costs=True)
    assert off.block_threshold == 0.0  # 0 turns the stop off whatever the costs
    unmeasured = KController(k_max=16, costs=costs(30, {}), confidence_stop=True, block_stop=0.5, block_from_costs=True)
    unmeasured.costs.draft_per_token = None
    assert unmeasured.block_threshold == 0.5
    one_width = KController(
        k_max=16, costs=costs(30, {1: 250}), confidence_stop=True, block_stop=0.5, block_from_costs=True
    )
    assert one_width.block_threshold == pytest.approx(2 * 30 / 250)  # no verify row measured yet: the step alone


def test_a_pipelined_turn_s_block_stop_follows_the_costs_at_three_times_the_ratio() -> None:
    """Pipelined rounds use the block drafted ahead only after a block kept whole, so the stop is
    set higher for the same costs: three times the ratio, in the same [0.05, 0.9]; the configured
    stop until the costs are measured, a request's own as set."""
    measured = costs(5, {1: 25, 17: 25 + 16 * 0.4}, overhead=1)
    pipelined = KController(
        k_max=16, costs=measured, pipelined=True, confidence_stop=True, block_stop=0.5, block_from_costs=True
    )
    assert pipelined.block_threshold == pytest.approx(3 * (5 + 0.4) / (25 + 1))
    assert block_stop_for(5.4, 26, pipelined=True) == pytest.approx(pipelined.block_threshold)
    sequential = KController(k_max=16, costs=measured, confidence_stop=True, block_stop=0.5, block_from_costs=True)
    assert sequential.block_threshold == pytest.approx(2 * (5 + 0.4) / (25 + 1))
    assert block_stop_for(0.1, 260, pipelined=True) == 0.05 and block_stop_for(30, 26, pipelined=True) == 0.9
    own = KController(k_max=16, costs=measured, pipelined=True, confidence_stop=True, block_stop=0.5)
    assert own.block_threshold == 0.5
    unmeasured = KController(
        k_max=16, costs=costs(5, {}), pipelined=True, confidence_stop=True, block_stop=0.5, block_from_costs=True
    )
    unmeasured.costs.draft_per_token = None
    assert unmeasured.block_threshold == 0.5


def test_the_sure_runs_check_uses_the_block_stop_the_costs_set() -> None:
    """Sure runs taken whole 20% of the time (decayed: 0.198): enough for a stop at 0.312 (half of it
    0.156), too few for 0.5 (0.25)."""
    evidence = [(5, 0), (5, 0), (5, 4), (5, 0), (5, 0)] * 2  # 2 of 10 sure runs of 4 taken whole
    base = {1: 250.0, 17: 250.0 + 16 * 8}
    cheap = KController(k_max=16, costs=costs(31, base, 0), confidence_stop=True, block_stop=0.5, block_from_costs=True)
    for k, accepted in evidence:
        cheap.observe(k, accepted, asked=16, ends_unsure=True)
    assert cheap.block_threshold == pytest.approx(0.312)
    assert cheap.block_stop_bounds_blocks
    fixed = KController(k_max=16, costs=cheap.costs, confidence_stop=True, block_stop=0.5)
    for k, accepted in evidence:
        fixed.observe(k, accepted, asked=16, ends_unsure=True)
    assert not fixed.block_stop_bounds_blocks
