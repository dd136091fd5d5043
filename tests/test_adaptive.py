"""Adaptive speculation's parts (``core.adaptive``, ``core.cost_profile``, ``serve.costs``): the cost model, the
acceptance estimates, the choice of k, the config and the eval rows. Losslessness under any k schedule, for every
drafter, is in ``test_contract.py`` (``auto``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftsmith.core.adaptive import (
    HOLD_DRIFT,
    HOLD_STEPS,
    PROBE_AFTER,
    PROBE_BACKOFF,
    PROBE_BACKOFF_MAX,
    PROBE_BUDGET,
    REALIZED_PRIOR,
    SPECULATE_MARGIN,
    AcceptanceEstimate,
    AdaptivePolicy,
    CostModel,
    expected_tokens,
)
from draftsmith.core.cost_profile import affine_fit
from draftsmith.drafters.speculative import SpeculativeConfig


def flat_cost(verify_ms=10.0, per_token_ms=0.0, draft_ms=0.0, batch_sizes=(1, 4)) -> CostModel:
    """Verify = verify_ms + per_token_ms * T per row-batch, draft = draft_ms * K (the same at every batch size)."""
    ts, ks = list(range(1, 10)), list(range(1, 9))
    return CostModel(
        list(batch_sizes),
        ts,
        [[(verify_ms + per_token_ms * t) / 1000 for t in ts] for _ in batch_sizes],
        ks,
        [[draft_ms * k / 1000 for k in ks] for _ in batch_sizes],
    )


def trained(policy: AdaptivePolicy, rate: float, steps: int = 200, k: int = 8) -> None:
    """Feed the engine estimate steps that accept each position with probability ``rate`` (deterministic)."""
    for step in range(steps):
        accepted = 0
        while accepted < k and (step * 7919 + accepted * 104729) % 1000 < rate * 1000:
            accepted += 1
        policy.observe(None, k, accepted)


def test_cost_model_interpolates_extrapolates_and_round_trips(tmp_path):
    cost = CostModel(
        [1, 4], [1, 3], [[0.010, 0.014], [0.020, 0.032]], [1, 2], [[0.002, 0.004], [0.003, 0.006]],
        start_s_per_position=5e-5,
    )  # fmt: skip
    assert cost.verify(1, 2) == pytest.approx(0.012)
    assert cost.verify(2, 1) == pytest.approx(0.010 + (0.020 - 0.010) / 3)
    assert cost.verify(8, 1) == pytest.approx(0.020 + 4 * (0.010 / 3))  # linear past the largest batch
    assert cost.draft(1, 0) == 0.0 and cost.draft(0, 3) == 0.0
    assert cost.draft(4, 4) == pytest.approx(0.012)
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json").to_dict() == cost.to_dict()
    assert AdaptivePolicy(CostModel.load(tmp_path / "c.json"), 2).start_s_per_position == 5e-5  # priced from the start
    (tmp_path / "bad.json").write_text(json.dumps({"batch_sizes": [1]}))
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.load(tmp_path / "bad.json")


def test_affine_fit_smooths_noise_and_never_slopes_down():
    assert affine_fit([1, 2, 3], [1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    smoothed = affine_fit([1, 2, 3, 4], [10.0, 14.0, 11.0, 13.0])
    assert smoothed == sorted(smoothed)
    assert affine_fit([1, 2, 3], [3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])


def test_acceptance_counts_follow_vllm_positions():
    est = AcceptanceEstimate(4, decay=1.0)
    est.observe(3, 1)  # position 1 accepted, 2 rejected, 3 not reached
    est.observe(2, 2)  # both accepted, nothing rejected
    assert est.tried == [2, 2, 0, 0] and est.accepted == [2, 1, 0, 0]
    rates = est.rates(None, strength=0.0 + 1e-9)
    assert rates[0] == pytest.approx(1.0) and rates[1] == pytest.approx(0.5)
    assert rates[2] == pytest.approx(rates[1]) and rates[3] == pytest.approx(rates[1])  # unseen: as the one before
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.5, 0.5], 0) == 1.0


def test_the_choice_follows_cost_and_acceptance():
    cheap = AdaptivePolicy(flat_cost(per_token_ms=0.1, draft_ms=0.1), 8)
    trained(cheap, 0.9)
    assert cheap.choose([(None, 8)]).k == 8  # verifying more costs nothing: draft all
    assert cheap.choose([(None, 2)]).k == 2  # capped by what the row may still emit
    dear = AdaptivePolicy(flat_cost(per_token_ms=2.0, draft_ms=4.0), 8)
    trained(dear, 0.2)
    assert dear.choose([(None, 8)]).k == 0  # acceptance too low for the cost: plain
    middle = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    trained(middle, 0.7)
    assert 1 <= middle.choose([(None, 8)]).k < 8
    assert sum(p.histogram[k] for p in (cheap, dear, middle) for k in range(9)) == 4


def test_a_probe_drafts_for_one_row_a_started_one_first():
    policy = AdaptivePolicy(flat_cost(per_token_ms=3.0, draft_ms=5.0), 8)
    trained(policy, 0.1)
    rows = [(None, 8, None, 200), (None, 8, None, 0), (None, 3, None, 0)]  # (estimate, cap, confidence, start)
    for _ in range(2000):
        choice = policy.choose(rows)
        if choice.probe:
            break
        assert choice.k == 0 and choice.rows is None
        policy.observe_step(3, 1, 0, 0, 0.013, 0.0)
    assert choice.probe and choice.k > 0 and choice.rows == (1,)


def test_the_batch_is_priced_with_the_requests_about_to_join():
    """Two rows running while 30 wait: drafting is chosen as for the 32-row batch they will decode in (dear to
    verify there), not as for 2 rows (free to verify)."""
    ts, ks = list(range(1, 10)), list(range(1, 9))
    cost = CostModel(
        [1, 2, 32],
        ts,
        [[0.010] * len(ts), [0.010] * len(ts), [0.030 * t for t in ts]],
        ks,
        [[0.0005 * k for k in ks]] * 3,
    )
    policy = AdaptivePolicy(cost, 8)
    trained(policy, 0.6)
    rows = [(None, 8), (None, 8)]
    assert policy.choose(rows).k > 0
    assert policy.choose(rows, batch_size=32).k == 0
    assert policy.choose(rows, batch_size=1).k > 0  # never below the rows running


def test_a_drafter_start_is_charged_over_the_tokens_left():
    """A row whose drafter has not started pays its start (measured per position) spread over the tokens it may
    still emit, not over the few it may draft this step: with most of its tokens ahead it drafts, near its end it
    stays plain."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    trained(policy, 0.7)
    policy.observe_step(1, 1, 0, 0, 0.011, 0.0, start_s=0.020, start_positions=200)  # 0.1 ms per position
    assert policy.start_s_per_position == pytest.approx(1e-4)
    assert policy.choose([(None, 8, None, 0, 200)]).k > 0  # started: nothing to pay
    assert policy.choose([(None, 2, None, 200, 3)]).k == 0  # 3 tokens left: most of the 20 ms start now
    assert policy.choose([(None, 8, None, 200, 200)]).k > 0  # 200 left (8 this step): a few percent of it
    many = [(None, 8, None, 200, 200)] * 8  # a batch of new rows, each with 200 tokens ahead, drafts from its start
    assert policy.choose(many, batch_size=8).k > 0
    policy.start_s_per_position = 1e-2  # a start of 2 s against ~11 ms steps: 200 tokens do not repay it
    assert policy.choose([(None, 8, None, 200, 200)]).k == 0


def test_a_drafter_start_is_spread_over_what_started_requests_drafted():
    """A start is spread over the tokens left times ``horizon``: what finished requests' drafting steps emitted after
    their drafters started, over what they could still emit then. Requests that drafted 2 steps and went plain make
    a new row's start dear; requests that drafted to their end keep it cheap; a row already started never pays."""
    from draftsmith.core.adaptive import HORIZON_PRIOR

    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    trained(policy, 0.7)
    policy.start_s_per_position = 5e-4  # 100 ms for a 200-position context, 10 ms for a 20-position one
    new_row, started_row = (None, 8, None, 200, 60), (None, 8, None, 0, 60)
    assert policy.horizon == 1.0 and policy.choose([new_row]).k > 0

    def serve(drafting_steps: int) -> None:
        request = policy.new_request()
        assert policy.choose([(request, 8, None, 20, 60)]).k > 0 and request.start_left == 60  # a short context
        for _ in range(drafting_steps):
            policy.observe(request, 3, 1)  # 2 tokens a drafting step
        policy.observe(request, 0, 0)  # then plain: nothing counted
        policy.finish(request)

    serve(2)
    assert policy.horizon == pytest.approx((4 + HORIZON_PRIOR) / (60 + HORIZON_PRIOR))
    for _ in range(10):
        serve(2)
    assert policy.horizon < 0.2
    assert policy.choose([new_row]).k == 0  # 60 tokens times ~0.15: its 100 ms start is not repaid
    assert policy.choose([started_row]).k > 0
    for _ in range(30):
        serve(30)  # 60 tokens, every one emitted by a drafting step
    assert policy.horizon > 0.9 and policy.choose([new_row]).k > 0
    policy.finish(None)  # a request without state, or whose drafter never started, changes nothing
    assert policy.horizon > 0.9


def test_a_marginal_gain_stays_plain():
    from draftsmith.core.adaptive import SPECULATE_MARGIN

    policy = AdaptivePolicy(flat_cost(verify_ms=10.0, per_token_ms=0.0, draft_ms=1.0), 1)
    for rate, want in ((0.3, 1), (0.13, 0)):  # expected gain (1 + a) / 1.1: 1.18x drafts, 1.03x stays plain
        policy.rates = lambda est, confidence=None, engine=None, rate=rate: [rate]
        gain = policy.throughput([([rate], 1)], 1) / policy.throughput([([rate], 1)], 0)
        assert (gain > 1 + SPECULATE_MARGIN) == (want == 1) and gain > 1.0
        assert policy.choose([(None, 1)]).k == want


def test_plain_holds_without_pricing_for_as_long_as_drafting_is_far_from_paying():
    """After two priced plain steps, the next steps of the same rows, caps, batch size and queue are plain without
    pricing, n of them while x / (1 - HOLD_DRIFT)^n < 1 (x: the best k's tokens/s over plain's x (1 + margin)), at
    most HOLD_STEPS; right below the margin every step is priced; any change in the batch prices at once."""

    def counted(rate: float, draft_ms: float) -> tuple[AdaptivePolicy, list, float]:
        policy = AdaptivePolicy(flat_cost(verify_ms=10.0, per_token_ms=0.0, draft_ms=draft_ms), 1)
        policy.rates = lambda est, confidence=None, engine=None: [rate]
        gain = policy.throughput([([rate], 1)], 1) / policy.throughput([([rate], 1)], 0)
        assert gain < 1 + SPECULATE_MARGIN  # plain every step
        priced, options = [], policy._options
        policy._options = lambda *a: priced.append(1) or options(*a)
        return policy, priced, gain / (1 + SPECULATE_MARGIN)

    def pricing(policy, priced, rows, steps: int) -> list[int]:
        """Which of ``steps`` plain steps were priced (1) or held (0)."""
        out = []
        for _ in range(steps):
            before = len(priced)
            assert policy.choose(rows).k == 0
            out.append(len(priced) - before)
        return out

    policy, priced, x = counted(0.14, 1.0)  # drafting 1.14 / 1.1 of plain: just below the margin
    assert x > 1 - HOLD_DRIFT
    assert pricing(policy, priced, [(policy.new_request(), 1) for _ in range(4)], 6) == [1] * 6

    for rate, draft_ms in ((0.1, 1.5), (0.0, 5.0)):  # drafting 1.1 / 1.15 of plain, then 1 / 1.5: by far
        policy, priced, x = counted(rate, draft_ms)
        n = min(HOLD_STEPS, int(math.log(x) / math.log(1 - HOLD_DRIFT)))
        assert 1 <= n and (n < HOLD_STEPS) == (rate > 0)
        rows = [(policy.new_request(), 1) for _ in range(4)]
        assert pricing(policy, priced, rows, 2 + n + 1) == [1, 1] + [0] * n + [1]  # the first plain step holds none
        assert policy.histogram[0] == 2 + n + 1  # held steps count as plain

    changes = (
        lambda: policy.choose(rows[:3] + [(policy.new_request(), 1)]),  # another request in a row
        lambda: policy.choose(rows[:3] + [(rows[3][0], 0)]),  # a row's cap shrank (its max_tokens is near)
        lambda: policy.choose(rows, waiting=1),  # a request in the queue
    )
    for change in changes:
        pricing(policy, priced, rows, 3)  # the same batch again: priced, then held
        before = len(priced)
        change()
        assert len(priced) == before + 1
    policy, priced, x = counted(0.14, 1.0)  # a request about to join keeps the step plain: held, whatever x
    rows = [(policy.new_request(), 1) for _ in range(4)]
    held = [policy.choose(rows, batch_size=5) for _ in range(2 + HOLD_STEPS + 1)]
    assert [c.k for c in held] == [0] * len(held) and len(priced) == 3


def test_a_request_estimate_pulls_away_from_the_engine():
    policy = AdaptivePolicy(flat_cost(per_token_ms=2.0, draft_ms=2.0), 8)
    trained(policy, 0.8)
    bad = policy.new_request()
    for _ in range(20):
        policy.observe(bad, 5, 0)
    assert policy.rates(bad)[0] < 0.3 < 0.5 < policy.rates(None)[0]  # the engine also saw those 20 steps
    assert policy.choose([(bad, 8)]).k == 0 and policy.choose([(policy.new_request(), 8)]).k > 0


def test_a_request_that_went_plain_drafts_again_as_its_text_moves_on():
    """A request's plain steps age its counts (``AcceptanceEstimate.age``): after a run of rejections it stays plain
    for a while, then its rates return towards the engine's and it drafts again, not plain to its end."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=2.0, draft_ms=2.0), 8)
    trained(policy, 0.8)
    dipped = policy.new_request()
    for _ in range(5):
        policy.observe(dipped, 5, 0)
    assert policy.choose([(dipped, 8)]).k == 0
    frozen = policy.rates(dipped)[0]
    plain_steps = 0
    while policy.choose([(dipped, 8)]).k == 0:
        policy.observe(dipped, 0, 0)  # what the decoder reports for a row that drafted nothing
        plain_steps += 1
        assert plain_steps < 40, "a dipped request never drafts again"
    assert plain_steps >= 2 and policy.rates(dipped)[0] > frozen
    assert policy.rates(dipped)[0] <= policy.rates(None)[0]  # towards the engine's, never past it


def test_probes_spend_at_most_the_budget_of_plain_time():
    """Where speculation does not pay, probes come after PROBE_AFTER plain steps at the earliest, and their extra
    seconds stay within PROBE_BUDGET of the plain decoding time: verify and draft modelled for the first probe,
    as measured after (here 2 ms dearer than modelled); the probed row's drafter start (here every request is new:
    500 positions to read) at its measured cost per position."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=3.0, draft_ms=5.0), 8)
    trained(policy, 0.1)
    plain_step, start_s, positions = 0.013, 0.05, 500
    plain_s, extra_s, probes = 0.0, 0.0, []
    for i in range(12000):
        choice = policy.choose([(None, 8, None, positions)])
        if not choice.probe:
            assert choice.k == 0
            policy.observe_step(1, 1, 0, 0, plain_step, 0.0)
            plain_s += plain_step
            continue
        probes.append(i)
        verify, draft = (12 + 3 * (1 + choice.k)) / 1000, 5 * choice.k / 1000
        policy.observe_step(1, 1 + choice.k, 1, choice.k, verify, draft, start_s, positions)
        policy.observe(None, choice.k, 0)
        extra_s += verify + draft + start_s - plain_step
    modelled = 0.008  # 3 ms more verify and 5 ms of drafts at k = 1, the best positive k at rate 0.1
    assert probes[0] >= PROBE_AFTER and probes[0] * plain_step * PROBE_BUDGET == pytest.approx(modelled, abs=2e-4)
    assert policy.start_s_per_position == pytest.approx(start_s / positions)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    probe = modelled + 0.002 + start_s  # as measured: verify 2 ms dearer, and the start
    budgets = [PROBE_BUDGET * PROBE_BACKOFF ** min(i + 1, PROBE_BACKOFF_MAX) for i in range(len(gaps))]
    assert len(probes) >= 5  # the budget halves per unanswered probe, to its floor
    spent = [gap * plain_step * budget for gap, budget in zip(gaps, budgets)]  # each gap's plain time x its budget
    assert spent == pytest.approx([probe] * len(gaps), abs=5e-4)
    assert extra_s <= PROBE_BUDGET * plain_s + probe  # the budget, give or take the probe in flight


def test_a_step_that_drafts_for_the_batch_restores_the_probe_budget():
    """Each probe since the last step that drafted for the batch halves the budget (PROBE_BACKOFF), at most
    PROBE_BACKOFF_MAX times: where probes keep finding that drafting loses, exploring costs less and less of plain
    decoding; once the prices choose drafting again, the next probes are as frequent as at first."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=3.0, draft_ms=5.0), 8)
    trained(policy, 0.1)
    assert policy.probe_budget == PROBE_BUDGET
    budgets = []
    for _ in range(20000):
        choice = policy.choose([(None, 8)])
        if choice.probe:
            policy.observe_step(1, 1 + choice.k, 1, choice.k, 0.02, 0.005)
            policy.observe(None, choice.k, 0)  # rejected: drafting still loses
            budgets.append(policy.probe_budget)
        else:
            policy.observe_step(1, 1, 0, 0, 0.013, 0.0)
    floor = PROBE_BUDGET * PROBE_BACKOFF**PROBE_BACKOFF_MAX
    halved = [PROBE_BUDGET * PROBE_BACKOFF ** (i + 1) for i in range(PROBE_BACKOFF_MAX)]
    assert budgets[:PROBE_BACKOFF_MAX] == pytest.approx(halved)
    assert len(budgets) > PROBE_BACKOFF_MAX
    assert budgets[PROBE_BACKOFF_MAX:] == pytest.approx([floor] * (len(budgets) - PROBE_BACKOFF_MAX))
    trained(policy, 0.95)  # the text got easy: the prices draft for the batch
    choice = policy.choose([(None, 8)])
    assert choice.k > 0 and not choice.probe and policy.probe_budget == PROBE_BUDGET


def test_measured_step_costs_rescale_the_model():
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    trained(policy, 0.7)
    before = policy.choose([(None, 8)]).k
    for _ in range(200):  # drafting measures 4x dearer than profiled, verifying as profiled
        policy.observe_step(1, 4, 1, 3, (10.0 + 4.0) / 1000, 4 * 3.0 / 1000)
    assert policy.verify_scale == pytest.approx(1.0) and policy.draft_scale == pytest.approx(4.0, rel=1e-3)
    assert policy.choose([(None, 8)]).k < before
    policy.observe_step(1, 1, 0, 0, 1e3, 0.0)  # an outlier moves a scale by at most one clipped step
    assert policy.verify_scale < 1.2


def test_the_first_measurements_of_a_cost_outweigh_the_profile():
    """The profile weighs as one measurement: after three drafting steps measured 2x dearer than profiled, their
    scale is most of the way there (a fixed 5% weight would still read ~1.14), and later steps weigh SCALE_WEIGHT."""
    from draftsmith.core.adaptive import SCALE_WEIGHT

    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    for _ in range(3):
        policy.observe_step(4, 4, 4, 3, 2 * 14.0 / 1000, 2 * 3.0 / 1000)
    assert policy.draft_scales[3] == pytest.approx(1.75) and policy.verify_scales[(4, 4)] == pytest.approx(1.75)
    for _ in range(100):
        policy.observe_step(4, 4, 4, 3, 14.0 / 1000, 3.0 / 1000)
    before = policy.draft_scales[3]
    policy.observe_step(4, 4, 4, 3, 14.0 / 1000, 4 * 3.0 / 1000)
    assert policy.draft_scales[3] - before == pytest.approx(SCALE_WEIGHT * (4.0 - before))


def test_a_verify_scale_learnt_at_one_batch_size_does_not_price_another():
    """Drafting measured at B = 4 as profiled, plain steps at B = 32 measured 1.8x the profile: an unmeasured
    2-token verify at B = 32 is priced with B = 32's scale (1.8x), not with the 2-token scale of B = 4 (1.0x)."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0, batch_sizes=(1, 4, 32)), 8)
    for _ in range(50):
        policy.observe_step(4, 2, 4, 1, 12.0 / 1000, 1.0 / 1000)  # as profiled
        policy.observe_step(32, 1, 0, 0, 1.8 * 11.0 / 1000, 0.0)
    assert policy.verify_scale_at(4, 2) == pytest.approx(1.0, abs=0.02)
    assert policy.verify_scale_at(32, 2) == pytest.approx(1.8, abs=0.02) == policy.verify_scale_at(40, 1)
    assert policy.step_seconds([([0.7] * 8, 1)] * 32, 1) == pytest.approx(1.8 * 0.012 + 0.001, rel=0.02)


def test_the_policy_measures_its_own_optimism_over_the_steps_that_draft():
    """The estimates read 0.7 per position but every drafting row accepts one draft (a winner's curse: fewer than
    the E(k) - 1 expected): ``realized`` becomes that ratio and prices every E(d) with it, so the policy drafts
    less."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=0.3, draft_ms=0.3), 8)
    policy.rates = lambda est, confidence=None, engine=None: [0.7] * 8
    rows = [(None, 8)] * 4
    first = policy.choose(rows).k
    k = first
    for _ in range(200):
        for _ in rows:
            policy.observe(None, k, 1 if k else 0)
        policy.observe_step(4, 1 + k, 4 if k else 0, k, 0.0103 + 0.0003 * k, 0.0003 * k)  # as modelled
        k = policy.choose(rows).k
    assert first > 2 and 0 < k < first
    assert policy.realized == pytest.approx(1 / sum(0.7**i for i in range(1, k + 1)), rel=0.05)


def test_plain_steps_return_the_policys_optimism_towards_one():
    """Recent drafting steps accepted 5 of the 45 drafts expected: ``realized`` reads ~0.2 and the policy goes plain
    (its rates held at 0.7). Its plain steps age the sums behind ``realized`` (as they age a request's counts), so
    it drafts again instead of staying plain on an estimate that nothing updates any more."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    policy.rates = lambda est, confidence=None, engine=None: [0.7] * 8
    rows = [(None, 8)]
    assert policy.choose(rows).k > 0
    policy._realized_sums = [5.0, 45.0]  # what those drafting steps left
    policy.realized = low = (5.0 + REALIZED_PRIOR) / (45.0 + REALIZED_PRIOR)
    plain_steps = 0
    while (choice := policy.choose(rows)).k == 0 or choice.probe:  # a probe would learn by drafting: not here
        policy.observe_step(1, 1, 0, 0, 0.011, 0.0)
        plain_steps += 1
        assert plain_steps < 200, "the policy's optimism never recovers from a dip while plain"
    assert policy.realized > low and plain_steps >= 5


def test_a_probes_outcome_does_not_move_the_policys_optimism():
    """``realized`` corrects steps taken because their estimates read high; a probe is taken when they read low, so a
    lucky probe (every draft accepted) leaves it where it was, while the rates learn from it as from any step."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=3.0, draft_ms=5.0), 8)
    trained(policy, 0.1)
    before, rate = policy.realized, policy.rates(None)[0]
    while not (choice := policy.choose([(None, 8)])).probe:
        policy.observe_step(1, 1, 0, 0, 0.013, 0.0)
    policy.observe(None, choice.k, choice.k)  # all accepted
    policy.observe_step(1, 1 + choice.k, 1, choice.k, 0.015 + 0.003 * choice.k, 0.005 * choice.k)
    assert policy.realized == before and policy.rates(None)[0] > rate


def test_the_drafters_confidence_is_calibrated_per_bin():
    policy = AdaptivePolicy(flat_cost(per_token_ms=2.0, draft_ms=2.0), 8)
    trained(policy, 0.5)
    for i in range(400):  # a confident head is right, an unsure one wrong
        est = policy.new_request()
        sure = i % 2 == 0
        policy.choose([(est, 8, 0.95 if sure else 0.15)])
        policy.observe(est, 3, 3 if sure else 0)
    assert policy.rates(None, 0.95)[0] > 0.9 and policy.rates(None, 0.15)[0] < 0.1
    assert policy.choose([(policy.new_request(), 8, 0.97)]).k > 0
    assert policy.choose([(policy.new_request(), 8, 0.12)]).k == 0


def test_a_tree_reads_topk_nodes_per_depth():
    policy = AdaptivePolicy(flat_cost(), 5, topk=4, num_nodes=12)
    assert [policy.reads(d) for d in range(5)] == [0, 4, 8, 12, 12]


def test_auto_in_the_speculative_config():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": "auto"}')
    assert spec.adaptive and spec.num_speculative_tokens == 8
    assert spec.to_dict()["num_speculative_tokens"] == "auto"
    assert SpeculativeConfig.parse(spec.to_dict()).adaptive
    assert not spec.with_k(3).adaptive and spec.with_k(3).with_k("auto").adaptive
    tree = SpeculativeConfig.parse(
        {
            "method": "eagle3",
            "model": "h",
            "num_speculative_tokens": "auto",
            "tree": "topk=2,num_steps=4,num_draft_tokens=8",
        }
    )
    assert tree.adaptive and tree.depth == 4 and tree.to_dict()["num_speculative_tokens"] == "auto"
    with pytest.raises(ValueError, match="static"):
        SpeculativeConfig.parse(
            {"method": "eagle3", "model": "h", "num_speculative_tokens": "auto", "speculative_token_tree": "[(0,)]"}
        )
    with pytest.raises(ValueError, match='integer >= 1 or "auto"'):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": "fast"}')


def test_profile_batch_sizes():
    from draftsmith.serve.costs import profile_batch_sizes

    assert profile_batch_sizes(1) == [1]
    assert profile_batch_sizes(6) == [1, 2, 4, 6]
    assert profile_batch_sizes(64) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_auto_adapts_a_trees_depth_losslessly(tmp_path, name):
    """A dynamic tree with ``"auto"``: the engine chooses each step's depth (0 included), greedy equals plain; under
    a random depth schedule in a batch, too."""
    import lossless
    from conftest import make_tiny_llama, make_word_tokenizer
    from draftsmith import drafters
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig, generate_plain
    from draftsmith.core.target import TargetModel
    from draftsmith.serve.engine import Engine

    model, tok = make_tiny_llama(seed=11, num_hidden_layers=8), make_word_tokenizer(96)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [20, 21, 22, 20, 21, 22, 23]]
    spec = drafters.get(name).example(model, tok, tmp_path).with_tree("topk=2,num_steps=3,num_draft_tokens=6")
    engine = Engine(model, tok, spec.with_k("auto"), max_num_seqs=2)
    assert engine.policy is not None and engine.policy.topk == 2 and engine.k == 3
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0)
    plain = [generate_plain(TargetModel(model, tok), p, cfg).tokens for p in prompts]
    assert [engine.generate(p, cfg).tokens for p in prompts] == plain
    schedule = lossless.RandomSchedule(3, seed=1)
    decoder = BatchDecoder(engine.target, engine.drafter.new_batch_proposer(), 3, tree=spec.tree, policy=schedule)
    seqs = [decoder.add(BatchSequence(p, cfg)) for p in prompts]
    decoder.run()
    assert [s.result.tokens for s in seqs] == plain and 0 in schedule.chosen
    assert sum(s.stats.num_drafts for s in seqs) > 0


def test_a_heads_recorded_acceptance_is_the_cold_engines_prior(monkeypatch):
    """An export's held-out acceptance per position (``draftsmith.json`` eval) becomes the engine's prior: the mean
    of its own rows over tasks, made conditional; a cold engine then drafts what that record says pays, where the
    optimistic default (``FIRST_PRIOR``) drafts at once."""
    from types import SimpleNamespace

    from draftsmith.export import metadata
    from draftsmith.serve.costs import recorded_acceptance

    record = {
        "tasks": {
            "a": {"eagle3": {"accepted_per_pos": [0.4, 0.2]}, "ngram": {"accepted_per_pos": [0.9, 0.9]}},
            "b": {"eagle3@k3": {"accepted_per_pos": [0.2, 0.1, 0.05]}, "eagle3@k1": {"accepted_per_pos": [0.3]}},
        }
    }
    monkeypatch.setattr(metadata, "read_metadata", lambda path: SimpleNamespace(eval=record))
    assert recorded_acceptance("head", "eagle3") == pytest.approx([0.3, 0.15 / 0.3])  # u = [0.3, 0.15]; a = u_i/u_i-1
    assert recorded_acceptance("head", "dflash") is None  # none of its own rows
    monkeypatch.setattr(metadata, "read_metadata", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert recorded_acceptance("reference-draft", "draft_model") is None  # a model name, no export

    cost = flat_cost(verify_ms=10.0, per_token_ms=1.0, draft_ms=2.0)
    rows = [(None, 8, None, 0)] * 4
    assert AdaptivePolicy(cost, 8).choose(rows).k > 0  # FIRST_PRIOR 0.6: drafts before it knows
    assert AdaptivePolicy(cost, 8, prior=[0.1] * 8).choose(rows).k == 0  # the head earned 0.1: plain
    assert AdaptivePolicy(cost, 8, prior=[0.9]).choose(rows).k >= 5  # later positions inherit the last one's 0.9
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        AdaptivePolicy(cost, 8, prior=[1.5])


def test_rows_sharing_rates_are_priced_as_each_alone():
    """Rows that share one rates list (requests that have not drafted share the engine's) are priced as a group:
    the same tokens/s, starts included, as when each row holds its own copy."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 8)
    policy.start_s_per_position = 5e-5
    shared = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    caps_starts = [(8, 0), (8, 200), (3, 150), (0, 90), (8, 0), (5, 300)]
    grouped = [(shared, cap, start) for cap, start in caps_starts]
    alone = [(list(shared), cap, start) for cap, start in caps_starts]
    for k in range(9):
        for batch_size in (None, 16):
            assert policy.throughput(grouped, k, batch_size) == pytest.approx(policy.throughput(alone, k, batch_size))
    fresh = policy.new_request()
    assert policy.rates(fresh, engine=shared) is shared  # a request that has not drafted: the engine's own list


def test_the_time_outside_the_decode_work_is_measured_and_priced(tmp_path):
    """The decoder reports each step's seconds emitting its tokens (a callback taking 10 ms per token here) and the
    seconds between steps (None after an idle spell); the policy prices the second per step and fits the first
    per chunk and per token. Time paid per step or per chunk favours the k that emits more tokens per step (a gain
    too small to draft on the forwards alone drafts once each step also pays 11 ms between steps); time paid per
    token does not."""
    import time

    from conftest import make_tiny_llama, make_word_tokenizer
    from draftsmith import drafters
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.core.target import TargetModel
    from lossless import ScriptedPolicy

    model, tok = make_tiny_llama(seed=3), make_word_tokenizer(96)
    policy = ScriptedPolicy()
    ngram = drafters.get("ngram")
    proposer = ngram.load(ngram.example(model, tok, tmp_path), model, tok).new_batch_proposer()
    decoder = BatchDecoder(TargetModel(model, tok), proposer, 3, policy=policy)
    cfg = GenerationConfig(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # two requests one after the other: the decoder is idle in between
        decoder.add(BatchSequence([5, 6, 7], cfg, on_tokens=lambda chunk: time.sleep(0.01 * len(chunk))))
        decoder.run()
    steps = [args[8:] for args in policy.steps]  # (between_s, emit_s, emitted) per step
    assert len(steps) == 6 and steps[0][0] is None and steps[3][0] is None
    assert all(between >= 0 for between, _, _ in steps[1:3] + steps[4:])
    assert all(emitted == 1 and emit_s >= 0.01 for _, emit_s, emitted in steps)  # plain: one token a step

    def marginal() -> AdaptivePolicy:
        adaptive = AdaptivePolicy(flat_cost(verify_ms=10.0, per_token_ms=1.0, draft_ms=0.5), 1)
        adaptive.rates = lambda est, confidence=None, engine=None: [0.18]
        return adaptive

    assert marginal().choose([(None, 1)]).k == 0  # (1 + 0.18) / (12.5 / 11) = 1.04x: below the margin
    per_step = marginal()
    for _ in range(100):
        per_step.observe_step(1, 1, 0, 0, 0.011, 0.0, 0.0, 0, 0.020, 0.0, 1)
    assert per_step.between_s == pytest.approx(0.011)  # capped at the step's own seconds
    assert per_step.choose([(None, 1)]).k == 1  # 1.18 / (23.5 / 22) = 1.10x
    plain_only = marginal()
    for _ in range(100):  # one token per chunk: the two parts cannot be told apart, so it is priced per chunk
        plain_only.observe_step(1, 1, 0, 0, 0.011, 0.0, 0.0, 0, 0.0, 0.011, 1)
    assert plain_only.emission.per_chunk == pytest.approx(0.011) and plain_only.emission.per_token == 0.0
    assert plain_only.choose([(None, 1)]).k == 1  # as per step: 1.10x
    per_token, per_chunk = marginal(), marginal()
    for i in range(100):  # chunks of 1, 2, 3 tokens: 3 ms a token, or 8 ms a chunk and 0.5 ms a token
        t = 1 + i % 3
        per_token.observe_step(1, 1, 0, 0, 0.011, 0.0, 0.0, 0, 0.0, 0.003 * t, t)
        per_chunk.observe_step(1, 1, 0, 0, 0.011, 0.0, 0.0, 0, 0.0, 0.008 + 0.0005 * t, t)
    assert per_token.emission.per_token == pytest.approx(0.003)
    assert per_token.emission.per_chunk == pytest.approx(0.0, abs=1e-9)
    assert per_chunk.emission.per_chunk == pytest.approx(0.008) and per_chunk.emission.per_token == pytest.approx(5e-4)
    assert per_token.choose([(None, 1)]).k == 0  # 1.18 / ((12.5 + 1.18 * 3) / 14) = 1.03x: plain
    assert per_chunk.choose([(None, 1)]).k == 1  # 1.18 / ((12.5 + 8 + 1.18 * 0.5) / 19.5) = 1.09x


def test_a_draft_the_drafter_did_not_make_counts_as_rejected(tmp_path):
    """The decoder reports the depth a row ASKED for, not the depth its drafter returned: a drafter returning one
    draft when asked for three (an n-gram match ending early) emits at most two tokens a step, and the estimate
    must count depth 2 as tried and rejected, not as never tried (then it would keep its prior, and the choice
    would price tokens the drafter never drafts). The row's output stays plain greedy's."""
    import torch

    from conftest import make_tiny_llama, make_word_tokenizer
    from draftsmith import drafters
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig, generate_plain
    from draftsmith.core.proposer import Proposal
    from draftsmith.core.target import TargetModel
    from lossless import ScriptedPolicy

    class OneDraft:  # the n-gram batch proposer, always drafting one token (0) however many are asked for
        def __init__(self, inner):
            self.inner, self.drafted = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def propose(self, keys, ks):
            self.drafted += [1] * len(keys)
            return [Proposal(torch.tensor([0]), None) for _ in keys]

    model, tok = make_tiny_llama(seed=3), make_word_tokenizer(96)
    ngram = drafters.get("ngram")
    proposer = OneDraft(ngram.load(ngram.example(model, tok, tmp_path), model, tok).new_batch_proposer())
    policy = ScriptedPolicy([3])
    target = TargetModel(model, tok)
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    decoder = BatchDecoder(target, proposer, 3, policy=policy)
    seq = decoder.add(BatchSequence(prompt, cfg))
    decoder.run()
    assert seq.result.tokens == generate_plain(target, prompt, cfg).tokens
    asked = [a for a, _ in policy.observed if a > 0]  # the last step has no drafts left to ask for
    assert len(asked) == len(proposer.drafted) and asked[0] == 3 and min(asked) >= 1  # 3 asked (fewer at the end)
    adaptive = AdaptivePolicy(flat_cost(), 3)
    adaptive.observe(None, 3, 1)  # one draft made and accepted, the second never made
    assert adaptive.engine.tried[:3] == [1.0, 1.0, 0.0] and adaptive.engine.accepted[:2] == [1.0, 0.0]


def test_an_ngram_confidence_is_its_match_length_known_for_every_row(tmp_path):
    """N-gram's confidence is its suffix match's length over prompt_lookup_max (0: it would draft nothing), and
    its catch-up is free, so with a policy the decoder keeps every row current: each row's confidence reaches the
    choice at every step after its first, also for rows that never drafted."""
    from conftest import make_tiny_llama, make_word_tokenizer
    from draftsmith import drafters
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig, generate_plain
    from draftsmith.core.target import TargetModel
    from draftsmith.drafters.ngram.proposer import NgramProposer
    from lossless import ScriptedPolicy

    ngram = NgramProposer(1, 4)
    ngram.start(torch.tensor([1, 2, 3, 9, 1, 2]), 3)  # suffix 1 2 3 repeats: a 3-gram match
    assert ngram.confidence() == 0.75 and ngram.propose(2).tokens.tolist() == [9, 1]
    ngram.start(torch.tensor([1, 2, 3]), 4)  # nothing repeats
    assert ngram.confidence() == 0.0 and ngram.propose(2).tokens.numel() == 0

    model, tok = make_tiny_llama(seed=3), make_word_tokenizer(96)
    loaded = drafters.get("ngram")
    proposer = loaded.load(loaded.example(model, tok, tmp_path), model, tok).new_batch_proposer()
    assert proposer.free_catch_up
    policy, target = ScriptedPolicy(), TargetModel(model, tok)
    decoder = BatchDecoder(target, proposer, 3, policy=policy)
    cfg = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6], [8, 9, 10]]
    seqs = [decoder.add(BatchSequence(p, cfg)) for p in prompts]
    decoder.run()
    assert [s.result.tokens for s in seqs] == [generate_plain(target, p, cfg).tokens for p in prompts]
    confidence = [[row[2] for row in rows] for rows in policy.rows]  # per step, each row's
    assert len(confidence) == 5 and all(c is not None and 0.0 <= c <= 1.0 for step in confidence for c in step)


def test_a_closed_batch_does_not_draft_where_its_slowest_row_would_finish_later():
    """With nobody waiting to join, a batch is done when its slowest row is (module docstring): drafting that wins
    the step's tokens/s from the rows that accept, while the row that does not pays dearer steps for its one token,
    is refused; with requests queued for a full batch (they take the finished rows' places), or every row
    accepting, it drafts; and while a queued request has a free row to join, its prefill waits on the step: plain."""
    policy = AdaptivePolicy(flat_cost(verify_ms=10.0, per_token_ms=1.0, draft_ms=1.0), 4)
    good, bad = policy.new_request(), policy.new_request()
    for _ in range(30):
        good.observe(4, 4)
        bad.observe(4, 0)
    left = 40
    closed = [(good, 4, None, 0, left)] * 3 + [(bad, 4, None, 0, left)]
    priced = [(policy.rates(est), cap, start, n) for est, cap, _, start, n in closed]
    plain_rate, plain_drain = policy.throughput(priced, 0), policy.drain_seconds(priced, 0)
    for k in range(1, 5):
        assert policy.throughput(priced, k) > (1 + SPECULATE_MARGIN) * plain_rate  # the step's tokens/s: draft
        assert policy.drain_seconds(priced, k) > plain_drain  # its slowest row: not
    assert policy.drain_seconds(priced, 0) == pytest.approx(left * 11e-3)  # 40 plain steps of 11 ms
    assert policy.choose(closed).k == 0
    assert policy.choose(closed, batch_size=4, waiting=4).k > 0  # a full batch with a queue: finishing makes room
    assert policy.choose([(good, 4, None, 0, left)] * 4).k > 0
    assert policy.choose([(good, 4, None, 0, left)] * 4, batch_size=8).k == 0  # four wait for free rows


def test_a_catch_up_is_measured_apart_from_the_drafts_and_fitted_per_row_and_position():
    """A step that resumes drafting after plain steps first catches its drafters up on the positions those left.
    Those seconds come apart from ``draft_s``, so the draft scales keep the drafts' own cost (inside ``draft_s``
    they read every drafting step ~2x dearer: EAGLE-3, code-foreign), and fit a part per row and per position."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 4)
    for i in range(100):
        rows, positions = 1 + i % 3, 4 + 5 * (i % 4)  # 2 ms a row, 0.1 ms a position
        policy.observe_step(
            4, 4, 4, 3, 0.013, 0.003,
            catch_up_s=0.002 * rows + 0.0001 * positions, catch_up_rows=rows, catch_up_positions=positions,
        )  # fmt: skip
    assert policy.draft_scales[3] == pytest.approx(1.0) and policy.draft_scale == pytest.approx(1.0)
    assert policy.catch_up.per_chunk == pytest.approx(0.002) and policy.catch_up.per_token == pytest.approx(1e-4)


def test_a_catch_up_is_spread_over_the_tokens_a_resumed_run_emits():
    """A row resuming after plain steps pays its catch-up spread over the tokens a drafting run that resumed emits
    (``run_tokens``, measured): long runs make a catch-up cheap and short ones dear; a row with nothing to catch up
    on pays nothing, and a row never started pays its start instead (``horizon``)."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 4)
    policy.catch_up.per_chunk, policy.catch_up.per_token = 0.002, 1e-4
    rates = [0.7] * 4
    current, behind = [(rates, 3, 0, 100, 0)], [(rates, 3, 0, 100, 40)]
    assert policy.throughput(behind, 0) == policy.throughput(current, 0)  # plain: nothing to catch up on
    assert policy.throughput(behind, 3) < policy.throughput(current, 3)
    dear = policy.throughput(behind, 3)
    request = policy.new_request()
    for _ in range(10):  # runs of 40 tokens: each resumes, drafts 10 steps of 4 tokens, then a plain step
        request.resuming = True
        for _ in range(10):
            policy.observe(request, 3, 3)
            request.resuming = False
        policy.observe(request, 0, 0)
    assert 30 < policy.run_tokens < 40
    assert dear < policy.throughput(behind, 3) < policy.throughput(current, 3)
    policy.observe(request, 0, 0)  # a plain step with no run under way counts no run
    probe = policy.new_request()
    probe.resuming, policy._probing = True, True
    policy.observe(probe, 3, 0)  # a probe is not a run
    assert probe.run is None


def test_rows_that_resume_after_plain_steps_have_their_own_realized_ratio():
    """Steps that resume drafting after plain steps accept less than the rows' rates say (code-edit: the text that
    made a row plain is still hard when its rates, aged towards the engine's, price drafting again), so their
    optimism is measured apart (``realized_resumed``) and prices only the rows that resume."""
    policy = AdaptivePolicy(flat_cost(per_token_ms=1.0, draft_ms=1.0), 4)
    policy.rates = lambda est, confidence=None, engine=None: [0.8] * 4
    current, behind = policy.new_request(), policy.new_request()
    for _ in range(50):
        choice = policy.choose([(current, 3, None, 0, 100, 0), (behind, 3, None, 0, 100, 10)], 2, waiting=4)
        k = choice.k
        assert k > 0 and behind.resuming and not current.resuming
        policy.observe(current, k, k)
        policy.observe(behind, k, 0)
        policy.observe_step(2, 1 + k, 2, k, 0.011 + 0.001 * k, 0.002 * k)
    assert policy.realized_resumed < 0.25 and policy.realized > 0.8
    resumed = policy.throughput([([0.8] * 4, 3, 0, 100, 10)], 3)
    assert resumed < policy.throughput([([0.8] * 4, 3, 0, 100, 0)], 3)
    assert policy.choose([(behind, 3, None, 0, 100, 10)]).k == 0


def test_the_decoder_offers_and_reports_the_positions_plain_steps_left(tmp_path):
    """With a drafter whose catch-up costs a forward, a row's plain steps leave positions its drafter has not read:
    the choice is offered them per row (the rows' 6th element), and the step that drafts again reports their
    accept apart (``catch_up_*``), not in ``draft_s``. Output stays plain greedy's."""
    from conftest import make_tiny_llama
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig, generate_plain
    from draftsmith.core.proposer import PerSequence
    from draftsmith.core.target import TargetModel
    from draftsmith.drafters.ngram.proposer import NgramProposer
    from lossless import ScriptedPolicy

    target = TargetModel(make_tiny_llama(seed=3))
    proposer = PerSequence.over(lambda _sampling: NgramProposer(1, 3))
    proposer.free_catch_up = False  # as a head's: rows that do not draft are not kept current
    policy = ScriptedPolicy([2, 0, 0, 2, 2])
    decoder = BatchDecoder(target, proposer, 2, policy=policy)
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4]]
    seqs = [decoder.add(BatchSequence(p, cfg)) for p in prompts]
    decoder.run()
    assert [s.result.tokens for s in seqs] == [generate_plain(target, p, cfg).tokens for p in prompts]
    catches = [[row[5] for row in rows] for rows in policy.rows]
    assert catches[0] == [0, 0] and catches[1] == [0, 0]  # not started, then current after drafting
    assert catches[2] == [1, 1] and catches[3] == [2, 2] and catches[4] == [0, 0]  # two plain steps, then current
    kwargs = policy.step_kwargs
    assert [kw["catch_up_rows"] for kw in kwargs[:5]] == [0, 0, 0, 2, 0]
    assert kwargs[3]["catch_up_positions"] == 4 and kwargs[3]["catch_up_s"] > 0
