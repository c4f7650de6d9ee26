"""The engine's side of adaptive verification (speculative/planner.py): stale budgets, live allocation, the EMA,
drafting only when it pays, online acceptance for drafters without confidences, and the online cost refinement."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dspark.config import SamplingParams
from dspark.core.request import Request
from dspark.core.scheduler import ScheduledRequest, SchedulerOutput
from dspark.speculative.budget import drafting_verdict
from dspark.speculative.cost_model import MIN_SPEC_STEPS, OUTLIER_RATIO, CostModel, RefinedCostModel
from dspark.speculative.planner import VerificationPlanner
from dspark.speculative.regime import BURST, FIRST_PERIOD
from dspark.speculative.step_timer import StepTimer

K = 4
CPU = torch.device("cpu")


def _request(rid: str) -> Request:
    req = Request(rid, None, [1, 2, 3, 4], SamplingParams(), 0, None)
    req.num_computed_tokens = 3  # the last token is fed this step, then its drafts
    return req


def _sched(reqs: list[Request], num_drafts: int = K) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(r, 1 + num_drafts, [7] * num_drafts) for r in reqs])


def _pays_for_sure_drafts() -> CostModel:
    """Each token adds a quarter of a one-token step: a draft pays when its survival is above 0.25."""
    return CostModel.from_points({1: 10.0, 2: 12.5, 64: 167.5}, {1: 0.0, 64: 0.0})


def _observe(planner: VerificationPlanner, rids: list[str], conf: float) -> None:
    planner.observe(rids, [K] * len(rids), torch.full((len(rids), K), conf))


def test_the_budget_comes_from_survivals_a_step_old_and_the_slots_from_live_ones() -> None:
    reqs = [_request("a")]
    planner = VerificationPlanner(K, "async", 0.0, _pays_for_sure_drafts(), CPU)
    _observe(planner, ["a"], 0.999)  # the block verified last step: sure drafts
    _observe(planner, ["a"], 0.05)  # this step's live drafts: hopeless, but the budget must not look at them
    sched = _sched(reqs)
    planner.plan(sched)
    assert len(sched.scheduled[0].spec_token_ids) == K  # paid for by the stale 0.999s, verified though live are 0.05

    planner = VerificationPlanner(K, "async", 0.0, _pays_for_sure_drafts(), CPU)
    _observe(planner, ["a"], 0.05)
    _observe(planner, ["a"], 0.999)
    sched = _sched(reqs)
    planner.plan(sched)
    assert sched.scheduled[0].spec_token_ids == []  # stale drafts were hopeless: nothing verified
    assert sched.scheduled[0].num_new_tokens == 1  # the token budget shrinks with the drafts


def test_sync_mode_plans_on_live_survivals() -> None:
    planner = VerificationPlanner(K, "sync", 0.0, _pays_for_sure_drafts(), CPU)
    _observe(planner, ["a"], 0.05)
    _observe(planner, ["a"], 0.999)
    sched = _sched([_request("a")])
    planner.plan(sched)
    assert len(sched.scheduled[0].spec_token_ids) == K


def test_fixed_mode_keeps_every_draft_and_counts_lengths() -> None:
    planner = VerificationPlanner(K, "fixed", 0.8, None, CPU)
    _observe(planner, ["a", "b"], 0.01)
    sched = _sched([_request("a"), _request("b")])
    planner.plan(sched)
    assert [len(s.spec_token_ids) for s in sched.scheduled] == [K, K]
    assert planner.verify_len_hist[K] == 2
    assert planner.should_draft(["a", "b"])


def test_the_ema_smooths_per_request_and_restarts_for_a_new_one() -> None:
    planner = VerificationPlanner(K, "fixed", 0.8, None, CPU)
    _observe(planner, ["a"], 1.0)
    _observe(planner, ["a"], 0.5)
    assert torch.allclose(planner.survivals("a"), torch.full((K,), 0.9).cumprod(0))  # 0.8 * 1 + 0.2 * 0.5
    planner.release("a")
    _observe(planner, ["a"], 0.5)
    assert torch.allclose(planner.survivals("a"), torch.full((K,), 0.5).cumprod(0))


def test_rows_are_reused_after_release_without_leaking_state() -> None:
    """Per-request state sits in rows of shared tables: more requests than the first capacity grow them, and a row
    freed by a finished request starts clean for the next one (no EMA history, no stale survivals)."""
    planner = VerificationPlanner(K, "async", 0.8, _pays_for_sure_drafts(), CPU)
    many = [f"r{i}" for i in range(40)]
    for conf in (0.9, 0.2):  # two blocks each: every request has an EMA history and a stale row
        _observe(planner, many, conf)
    _observe(planner, many[:1], 0.2)  # a newer copy, so the older ones are taken in
    planner.should_draft(many)
    for rid in many[1:]:
        live = planner.survivals(rid)
        assert live is not None and torch.allclose(live, torch.full((K,), 0.8 * 0.9 + 0.2 * 0.2).cumprod(0))
    planner.record([(rid, K, 0) for rid in many])
    assert planner.survivals("r5") is None  # verified: nothing pending
    for rid in many:
        planner.release(rid)
    _observe(planner, ["new"], 0.5)
    live = planner.survivals("new")
    assert live is not None and torch.allclose(live, torch.full((K,), 0.5).cumprod(0))  # no inherited history
    slot = planner._slot["new"]
    assert not bool(planner._has_stale[slot])  # nor an inherited stale row: the prior stands in until one arrives


def test_a_copy_from_before_a_release_is_not_taken_into_the_rows_next_life() -> None:
    """A survivals copy still in flight when its request finished must not become the stale row of whatever holds
    that row next: another request, or the same request id added again (the freed row is handed out first)."""
    for next_id in ("b", "a"):
        planner = VerificationPlanner(K, "async", 0.0, _pays_for_sure_drafts(), CPU)
        _observe(planner, ["a"], 0.999)  # a's copy, not taken in yet (no newer copy exists)
        slot = planner._slot["a"]
        planner.release("a")
        _observe(planner, [next_id], 0.01)  # the row's next life; its copy is the newest, so a's old one is harvested
        assert planner._slot[next_id] == slot
        planner.should_draft([next_id])  # harvests
        assert not bool(planner._has_stale[slot]), next_id  # a's 0.999s did not become this request's stale row
        sched = _sched([_request(next_id)])
        planner.plan(sched)
        # no stale row: the prior (0.5, 0.25, ...) chooses the budget, not a's sure drafts
        assert len(sched.scheduled[0].spec_token_ids) < K, next_id


def test_drafting_stops_when_the_drafter_costs_more_than_its_drafts_return() -> None:
    verify = {1: 10.0, 256: 10.0, 512: 20.0, 2048: 80.0}  # free up to 256 tokens
    cheap = CostModel.from_points(verify, {1: 0.1, 64: 0.5})
    dear = CostModel.from_points(verify, {1: 0.1, 64: 8.0})
    poor = torch.full((64, K), 0.1).cumprod(dim=1)  # 64 requests, 0.11 tokens per request from verifying every draft
    assert drafting_verdict(poor, 64, cheap).draft  # 71 tokens in 10.5 ms against 64 in 10
    assert not drafting_verdict(poor, 64, dear).draft  # 71 in 18 ms: no speculation is better
    good = torch.full((64, K), 0.9).cumprod(dim=1)
    assert drafting_verdict(good, 64, dear).draft  # 64 + 220 tokens in 18 ms


def test_drafts_without_confidences_learn_acceptance_per_stratum() -> None:
    planner = VerificationPlanner(K, "fixed", 0.0, None, CPU, num_strata=3)
    for _ in range(20):
        planner.observe(["long", "short"], [K, K], None, strata=[2, 1])
        planner.record([("long", K, K), ("short", K, 0)])
    planner.observe(["long", "short"], [K, K], None, strata=[2, 1])
    long_, short = planner.survivals("long"), planner.survivals("short")
    assert long_ is not None and short is not None
    assert float(long_[0]) > 0.9 and float(short[0]) < 0.1


def test_calibration_monitor_compares_predicted_and_realised() -> None:
    planner = VerificationPlanner(K, "fixed", 0.0, None, CPU)
    _observe(planner, ["a", "b"], 0.5)
    records = planner.record([("a", K, 2), ("b", 2, 0)], trace=True)
    assert planner.calibration.realised == 2
    assert planner.calibration.predicted == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625 + 0.5 + 0.25)
    assert records[0] == {
        "id": "a",
        "confidences": [0.5] * K,
        "stratum": 0,
        "num_drafts": K,
        "num_verified": K,
        "num_accepted": 2,
    }


def test_the_refined_cost_learns_the_overhead_outside_the_profile_per_regime() -> None:
    """Plain and speculative steps each get their residual (measured minus profiled, a + b * requests): a drafting step
    can pay far more outside the profile than a plain one, and one residual for both makes drafting look cheaper than
    it is. Until a speculative step is measured, its residual is the plain one's."""
    base = CostModel.from_points({1: 5.0, 1024: 5.0}, {1: 1.0, 1024: 1.0})
    refined = RefinedCostModel(base)
    assert refined.step_ms(8, 16) == base.step_ms(8, 16)
    for r in [1, 8, 64, 8, 1, 64] * 10:
        refined.observe(r, base.plain_step_ms(r, r), base.plain_step_ms(r, r) + 2.0 + 0.05 * r, speculative=False)
    assert not refined.spec.count
    assert refined.overhead_ms(32, speculative=False) == pytest.approx(2.0 + 0.05 * 32)
    assert refined.overhead_ms(32) == pytest.approx(2.0 + 0.05 * 32)  # speculative: the plain residual, for now
    assert refined.step_ms(32, 40) == pytest.approx(base.step_ms(32, 40) + 3.6)
    for r in [1, 8, 64, 8, 1, 64] * 10:
        refined.observe(r, base.step_ms(r, r), base.step_ms(r, r) + 6.0 + 0.1 * r, speculative=True)
    assert refined.spec.count
    assert refined.overhead_ms(32) == pytest.approx(6.0 + 0.1 * 32)
    assert refined.step_ms(32, 40) == pytest.approx(base.step_ms(32, 40) + 9.2)
    assert refined.plain_step_ms(32, 40) == pytest.approx(base.plain_step_ms(32, 40) + 3.6)
    assert float(refined.step_ms(32, torch.tensor([40]))[0]) == pytest.approx(base.step_ms(32, 40) + 9.2)
    assert float(refined.plain_step_ms(32, torch.tensor([40]))[0]) == pytest.approx(base.plain_step_ms(32, 40) + 3.6)


def test_a_plain_step_may_cost_less_than_its_profile_but_not_arbitrarily_less() -> None:
    """A pipelined plain step, timed host to host, may cost less than the profiled step run alone (its host work
    overlaps the device's): the plain residual may be negative, down to half the profiled time; a speculative one may
    not."""
    base = CostModel.from_points({1: 4.0, 1024: 4.0}, {1: 1.0, 1024: 1.0})
    refined = RefinedCostModel(base)
    for _ in range(20):
        refined.observe(4, 4.0, 3.0, speculative=False)
    assert refined.plain_step_ms(4, 4) == pytest.approx(3.0)
    for _ in range(200):
        refined.observe(4, 4.0, 0.5, speculative=False)
    assert refined.plain_step_ms(4, 4) == pytest.approx(2.0)  # MIN_PLAIN_FRACTION of the profile
    assert refined.step_ms(4, 4) == base.step_ms(4, 4)  # the speculative side never below its profile


def test_the_refined_cost_ignores_one_off_stalls_but_learns_a_regime_that_costs_that_much() -> None:
    """One step far slower than predicted (a kernel compiling, a GC pause) is not learned from; two in a row are: a
    drafting step at temperature 1 can cost several times its profile, and dropping such steps would keep the
    profile's "draft"."""
    base = CostModel.from_points({1: 5.0, 1024: 5.0}, {1: 1.0, 1024: 1.0})
    refined = RefinedCostModel(base)
    refined.observe(8, 6.0, 2000.0, speculative=True)  # a kernel compiling
    assert refined.overhead_ms(8) == 0.0 and not refined.spec.count
    refined.observe(8, 6.0, 7.0, speculative=True)
    assert refined.overhead_ms(8) == pytest.approx(1.0)
    refined.observe(8, 6.0, 7.0, speculative=True)
    for _ in range(2):  # drafting that really costs 7x what the model says
        refined.observe(8, 6.0, 49.0, speculative=True)
    assert refined.spec.count == 3  # the first 49 ms step waited for a second
    assert refined.overhead_ms(8) > 10.0


def test_drafting_costs_count_for_a_verdict_only_at_loads_at_or_above_where_they_were_measured() -> None:
    """The speculative residual is extrapolated; measured at a low load it errs low at a higher one (drafting only
    gets dearer with load), measured at a high load it errs high at a lower one."""
    base = CostModel.from_points({1: 5.0, 1024: 5.0}, {1: 1.0, 1024: 1.0})
    refined = RefinedCostModel(base)
    assert not refined.measured_at_or_below(1024)
    for _ in range(MIN_SPEC_STEPS - 1):
        refined.observe(256, 6.0, 9.0, speculative=True)
    assert not refined.measured_at_or_below(1000)  # too few: an engine's first drafting steps pay first-call costs
    refined.observe(256, 6.0, 9.0, speculative=True)
    assert refined.measured_at_or_below(256) and refined.measured_at_or_below(1000)
    assert not refined.measured_at_or_below(2)
    refined.observe(2, 6.0, 7.0, speculative=False)  # plain steps do not count
    assert not refined.measured_at_or_below(2)


def test_a_mispredicted_speculative_step_is_a_surprise_and_a_right_one_is_not() -> None:
    """The planner reuses the model's drafting verdict for a few steps; a surprise (a speculative step measured far
    from its refined prediction: the first one at T = 1, say) voids the reused verdicts."""
    base = CostModel.from_points({1: 2.0, 1024: 2.0}, {1: 1.0, 1024: 1.0})
    refined = RefinedCostModel(base)
    refined.observe(8, 3.0, 9.0, speculative=True)
    assert refined.num_surprises == 1
    refined.observe(8, 3.0, 9.2, speculative=True)  # as now predicted
    refined.observe(8, 3.0, 3.1, speculative=False)  # plain steps are never surprises
    assert refined.num_surprises == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _ramp(
    monkeypatch: pytest.MonkeyPatch,
    draft_cost: float | Callable[[int], float],
    conf: float,
    loads: list[int] | None = None,
    cost: CostModel | None = None,
) -> tuple[list[bool], VerificationPlanner]:
    """A sweep row's ramp through the planner, with measured step times: by default 2 steps each at 16, 40, 100 and 200
    requests, then 250 at 256. The default profile sees a drafting step as a plain one plus a little (verification
    nearly free, the drafter 0.1 ms); in fact a plain step takes 1 + 0.01 R ms, a step that drafts draft_cost times
    that (a function of R, or a number; a step that verifies too, 0.5 times more). The drafts' confidence is conf each,
    every draft accepted up to its first rejection as the survivals say (rounded). Returns the drafting choices (one
    per step) and the planner."""
    import dspark.speculative.planner as planner_module
    import dspark.speculative.step_timer as timer_module

    clock = _Clock()
    monkeypatch.setattr(planner_module, "time", clock)
    monkeypatch.setattr(timer_module, "time", clock)
    cost = cost or CostModel.from_points({1: 1.01, 1024: 11.24}, {1: 0.1, 1024: 0.2})
    planner = VerificationPlanner(K, "async", 0.0, cost, CPU)
    timer = StepTimer(planner)
    loads = loads or [16] * 2 + [40] * 2 + [100] * 2 + [200] * 2 + [256] * 250
    choices, drafted = [], False
    accepted = round(sum(conf ** (j + 1) for j in range(K)))
    for r in loads:
        reqs = [_request(f"r{i}") for i in range(r)]
        ids = [q.request_id for q in reqs]
        timer.step_started()
        sched = _sched(reqs) if drafted else SchedulerOutput([ScheduledRequest(q, 1) for q in reqs])
        planner.plan(sched)
        verified = [len(s.spec_token_ids) for s in sched.scheduled]
        if drafted:
            planner.record([(rid, v, min(v, accepted)) for rid, v in zip(ids, verified, strict=True)])
        plain_ms = 1.0 + 0.01 * r
        clock.now += (plain_ms * (1.5 if drafted else 1.0)) / 1e3
        emitted = r + sum(min(v, accepted) for v in verified)
        drafted = planner.should_draft(ids)
        if drafted:
            planner.observe(ids, [K] * r, torch.full((r, K), conf))
            factor = draft_cost(r) if callable(draft_cost) else draft_cost
            clock.now += (factor - 1.0) * plain_ms / 1e3
        timer.step_finished(drafted, emitted)
        choices.append(drafted)
    return choices, planner


@pytest.mark.parametrize("draft_cost", [4.0, 7.0])
def test_a_ramp_drafts_once_where_measured_drafting_costs_more_than_the_profile_says(
    monkeypatch: pytest.MonkeyPatch, draft_cost: float
) -> None:
    """A ramp to 256 requests crosses a new load level every few steps; the profile says drafting pays at each, and
    without measured costs each level would draft. Once MIN_SPEC_STEPS drafting steps have been measured, the model's
    drafting costs are measured ones: it says plain at the levels that follow, and they explore drafting only as
    rarely as the predicted rates say a burst may cost 1% of the time between (after ~200 steps here). Before that a
    level explores once, as with nothing measured: the first run and one burst. Here a drafting step costs 4x or 7x a
    plain one (7x is beyond the outlier ratio: it is learned from its second step) for ~2 tokens per request."""
    choices, planner = _ramp(monkeypatch, draft_cost=draft_cost, conf=0.5)
    assert planner.cost is not None and planner.cost.spec.count
    assert choices[0]  # the profile's verdict, before anything is measured
    first = 1 if draft_cost < OUTLIER_RATIO else 2  # the drafting run's steps before its cost is learned
    assert not any(choices[first : first + FIRST_PERIOD])
    assert sum(choices[first:200]) <= BURST, [i for i, c in enumerate(choices) if c]  # one burst
    assert sum(choices) <= first + BURST


def test_a_load_that_drops_after_a_busy_spell_drafts_where_drafting_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting measured only at a high load says nothing trustworthy about a low one: there the residual of the busy
    steps, extrapolated, would make drafting look dear, and a plain verdict with predictions would keep the level from
    exploring for hundreds of steps. Here drafting costs 4x a plain step with 256 requests
    and 1.3x with 2, for ~3.4 tokens per request."""
    choices, _ = _ramp(
        monkeypatch, draft_cost=lambda r: 4.0 if r > 64 else 1.3, conf=0.9, loads=[256] * 300 + [2] * 300
    )
    assert sum(choices[:300]) < 0.1 * 300  # plain at the busy load
    low = choices[300:]
    assert any(low[: 2 * BURST + 2])  # explored within the level's first steps, as with nothing to go on
    assert sum(low) > 0.8 * len(low)


def test_a_plain_verdict_of_the_profile_alone_still_explores_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any drafting step is measured the model's costs are the profile's guess: a plain verdict then carries no
    predictions, the level explores drafting after FIRST_PERIOD steps, and drafting that pays is found. Here the
    profile prices the drafter at 5-20 ms; in fact a drafting step costs 1.2x a plain one for ~3 more tokens."""
    profile = CostModel.from_points({1: 1.01, 1024: 11.24}, {1: 5.0, 1024: 20.0})
    choices, _ = _ramp(monkeypatch, draft_cost=1.2, conf=0.9, loads=[16] * 120, cost=profile)
    assert not any(choices[:FIRST_PERIOD])  # the profile says plain
    assert choices[FIRST_PERIOD]  # explored
    assert sum(choices) > 0.8 * len(choices)


def test_a_ramp_still_drafts_where_drafting_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ramp where a drafting step costs 1.2x a plain one for ~3.4 tokens per request: drafting wins, the
    measured costs say so, and the row drafts nearly throughout (plain steps only in short exploration bursts)."""
    choices, _ = _ramp(monkeypatch, draft_cost=1.2, conf=0.9)
    assert sum(choices) > 0.9 * len(choices)


def test_a_block_without_drafts_does_not_stop_drafting_for_good() -> None:
    """An n-gram miss gives a block of no drafts; its zeros must not become the request's stale survivals, or drafting
    would never pay again for it (and without drafts there is no newer block to correct that)."""
    cost = CostModel.from_points({1: 10.0, 64: 10.0}, {1: 1.0, 64: 1.0})  # verification free, drafting a 10th of a step
    planner = VerificationPlanner(K, "async", 0.0, cost, CPU)
    planner.observe(["a"], [0], torch.zeros(1, K))  # a miss
    planner.observe(["a"], [0], torch.zeros(1, K))  # another: the first is now old enough to be read
    assert planner.should_draft(["a"])


def test_continued_steps_price_both_regimes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: a continued step is timed host to host. A plain one feeds the plain residual; one after which
    the engine drafted (the first step of a drafting run, never event-timed) feeds the speculative one, so that the
    next choice already knows what drafting costs, not a step later, after one more drafting step."""
    import dspark.speculative.planner as planner_module
    import dspark.speculative.step_timer as timer_module

    clock = _Clock()
    monkeypatch.setattr(planner_module, "time", clock)
    monkeypatch.setattr(timer_module, "time", clock)
    cost = CostModel.from_points({1: 1.0, 64: 1.0}, {1: 0.5, 64: 0.5})
    planner = VerificationPlanner(K, "async", 0.0, cost, CPU)
    timer = StepTimer(planner)
    assert planner.cost is not None
    for ms, drafted in [(0.0, False), (0.8, False), (0.8, False), (6.0, True)]:
        clock.now += ms / 1e3
        timer.continued_step_finished(16, 16, chain_goes_on=not drafted, drafted=drafted)
    assert planner.cost.overhead_ms(16, speculative=False) == pytest.approx(-0.2)
    assert planner.cost.spec.count
    assert planner.cost.overhead_ms(16) == pytest.approx(6.0 - 1.5)  # measured minus the plain pass and drafting
    assert planner.cost.num_surprises == 1
    assert set(planner.regime.rates()[planner.regime.level(16)]) == {"plain"}  # a switching step: no spec rate


def test_a_step_with_a_prompt_chunk_is_not_a_regime_measurement() -> None:
    """A prefill step is slow for reasons neither regime has: counted as a plain step it would make plain decoding look
    slower than drafting (a level's first step is its requests' prefill). Decode steps do count."""
    planner = VerificationPlanner(K, "async", 0.0, _pays_for_sure_drafts(), CPU)
    timer = StepTimer(planner)
    prompt = Request("p", None, [1, 2, 3, 4, 5, 6], SamplingParams(), 0, None)  # nothing computed: a whole prompt
    decoding = _request("d")

    def step(sched: SchedulerOutput) -> None:
        timer.step_started()
        planner.plan(sched)
        timer.step_finished(drafted=False, num_emitted=len(sched.scheduled))

    step(SchedulerOutput([ScheduledRequest(prompt, 6), ScheduledRequest(decoding, 1)]))
    step(SchedulerOutput([ScheduledRequest(decoding, 1)]))
    planner.timing.harvest(planner.cost, planner.regime)  # type: ignore[arg-type]
    assert planner.timing.num_steps == 2  # both steps still refine the cost model
    # only the decode step measured the plain regime (level 1: one request)
    assert set(planner.regime.rates()) == {1}
    assert set(planner.regime.rates()[1]) == {"plain"}


def test_counts_without_live_values_are_the_allocation() -> None:
    """Where the planner skips the allocation kernel (and its device round trip), the counts are what the kernel's
    torch twin gives for any live survivals: no budget, a budget covering every draft, or a single request."""
    from dspark.speculative.budget import allocate_torch, slot_caps
    from dspark.speculative.planner import _counts_without_live_values

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(300):
        num_reqs = 1 + trial % 4
        caps = torch.randint(0, K + 1, (num_reqs,), generator=gen)
        conf = torch.rand(num_reqs, K, generator=gen)
        if trial % 5 == 0:
            conf = torch.ones(num_reqs, K)  # ties everywhere
        live = torch.where(torch.arange(K)[None, :] < caps[:, None], torch.cumprod(conf.clamp(1e-4, 1.0), 1), 0.0)
        budget = int(torch.randint(0, int(caps.sum()) + 2, (1,), generator=gen))
        fast = _counts_without_live_values(caps.tolist(), budget)
        if fast is None:
            assert num_reqs > 1 and 0 < budget < int(caps.sum())
            continue
        checked += 1
        assert fast == allocate_torch(live, budget, slot_caps(live, caps)).tolist(), (caps, budget)
    assert checked > 100


def test_runs_of_plain_steps_are_timed_only_every_few_steps() -> None:
    """On CUDA a plain step's timing costs ~4% of it, so a run of plain steps is sampled (every 4th); the plain steps
    right after steps with drafts are always timed, so a regime burst still measures plain decoding."""
    planner = VerificationPlanner(K, "async", 0.0, _pays_for_sure_drafts(), CPU)
    timer = StepTimer(planner)
    timer.plain_timing_every = 4  # as on CUDA
    req = _request("a")

    def plain_step() -> None:
        timer.step_started()
        planner.plan(SchedulerOutput([ScheduledRequest(req, 1)]))
        timer.step_finished(drafted=False, num_emitted=1)

    def timed() -> int:
        planner.timing.harvest(planner.cost, planner.regime)  # type: ignore[arg-type]
        return planner.timing.num_steps

    for _ in range(40):
        plain_step()
    assert timed() == 10  # one step in four
    _observe(planner, ["a"], 0.9)  # drafts to verify next step
    timer.step_started()
    sched = _sched([req])
    planner.plan(sched)
    planner.record([("a", len(sched.scheduled[0].spec_token_ids), 0)])
    timer.step_finished(drafted=False, num_emitted=1)
    assert timed() == 11  # a step with drafts is always timed
    for _ in range(4):
        plain_step()
    assert timed() == 15  # and so are the plain steps right after it
    for _ in range(8):
        plain_step()
    assert timed() == 17


@pytest.mark.parametrize("mode", ["fixed", "async", "sync"])
def test_published_copies_do_not_pile_up(mode: str) -> None:
    """Every drafting pass publishes its survivals to the host (pinned memory on CUDA); old copies are dropped in
    every mode, fixed mode too, where nothing harvests them: kept, they would pile up for the engine's life."""
    planner = VerificationPlanner(K, mode, 0.0, _pays_for_sure_drafts(), CPU)
    timer = StepTimer(planner)
    reqs = [_request("a"), _request("b")]
    for step in range(50):
        planner.observe(["a", "b"], [K, 2], torch.full((2, K), 0.5 + step / 200))
        timer.step_started()
        sched = _sched(reqs)
        planner.plan(sched)
        planner.should_draft(["a", "b"])
        planner.record([(s.request.request_id, len(s.spec_token_ids), 1) for s in sched.scheduled])
        timer.step_finished(drafted=True, num_emitted=4)
    assert len(planner._copies) <= 2
    assert planner.calibration.num_blocks > 0 and planner.calibration.predicted > 0


def test_a_budget_prepared_while_drafting_is_the_one_plan_would_choose() -> None:
    """The engine asks for the next step's budget while the drafting pass runs (prepare); plan() uses it only for the
    step it was prepared for. Step by step the cuts are those of a planner that was never asked to prepare: the same
    survivals feed both (prepare takes in the copies plan would), and a step that differs (a request finished, a
    prompt chunk the engine did not expect) or newer survivals taken in since make plan choose again."""
    gen = torch.Generator().manual_seed(3)
    cost = CostModel.from_points({1: 1.0, 64: 1.2, 512: 3.0}, {1: 0.5, 64: 0.8}, capture_limit=64)
    plain, prepared = (VerificationPlanner(K, "async", 0.5, cost, CPU) for _ in range(2))
    reqs = [_request(f"r{i}") for i in range(24)]
    differs = 0
    for step in range(80):
        conf = torch.rand(len(reqs), K, generator=gen) ** 0.5
        ids = [r.request_id for r in reqs]
        surprise = step % 7 == 3  # the engine expected a 400-token prompt chunk that the step does not have
        prepared.prepare(ids, [K] * len(ids), len(ids), len(ids) + 400 * surprise)
        for planner in (plain, prepared):
            planner.observe(ids, [K] * len(ids), conf)
            if step % 9 == 4:  # a second block of hopeless drafts: plan takes in the first, newer than prepare saw
                planner.observe(ids, [K] * len(ids), torch.full((len(ids), K), 0.01))
        if step % 11 == 5:  # a request finishes: the step differs from the one prepared for
            for planner in (plain, prepared):
                planner.release(reqs[-1].request_id)
            reqs = [*reqs[:-1], _request(f"n{step}")]
            continue
        cuts = []
        for planner in (plain, prepared):
            sched = _sched(reqs)
            planner.plan(sched)
            cuts.append([len(s.spec_token_ids) for s in sched.scheduled])
            planner.record([(s.request.request_id, len(s.spec_token_ids), 1) for s in sched.scheduled])
        assert cuts[0] == cuts[1], step
        known = plain._has_stale  # a released row's leftover values are never read
        assert torch.equal(known, prepared._has_stale) and torch.equal(plain._prior, prepared._prior)
        assert torch.equal(plain._stale[known], prepared._stale[known]), step
        differs += sum(cuts[0]) != prepared._stale_budget(prepared._rows(ids), [K] * len(ids), len(ids), len(ids) + 400)
    assert 30 < prepared.num_prepared_budgets < 80  # used where the step was the one expected, not elsewhere
    assert plain.num_prepared_budgets == 0
    assert differs > 10  # the surprise steps' prepared budgets would have been wrong


def test_the_engine_prepares_each_drafting_steps_budget_and_plans_the_same(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An adaptive DSpark engine (async mode, drafting every step) asks for the next budget while its drafting pass
    runs, and plan() uses it in steady decoding. With the online cost refinement held still (a prepared budget reads
    the refined cost as it was while drafting, one step's timing older, by design), the verification plans are those
    of the same engine never asked to prepare: the same budgets, cuts and outputs."""
    from dspark import LLM
    from dspark.models.loader import load_config
    from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
    from dspark.speculative.drafters.dspark.config import DSparkConfig

    model = tiny_model_dirs["llama"]
    cfg = DSparkConfig.for_target(load_config(model), num_layers=1, block_size=4, num_taps=2, markov_rank=8)
    drafter = str(save_drafter(random_drafter(cfg, seed=2), tmp_path / "drafter"))
    cost = CostModel.from_points({1: 4.0, 16: 7.75, 64: 19.75}, {1: 0.0, 64: 0.0})
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 9, 14, 6, 11, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def engine(spec: dict[str, object]) -> LLM:
        return LLM(
            model=str(model),
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=128,
            cost_model=cost,
            speculative_config=spec,
        )

    runs = []
    for prepare in (True, False):
        llm = engine({"method": "dspark", "model": drafter, "num_speculative_tokens": 4})
        planner = llm.engine.planner
        assert planner is not None and planner.mode == "async"
        planner.should_draft = lambda request_ids: True  # type: ignore[method-assign]
        assert planner.cost is not None
        planner.cost.observe = lambda *args, **kwargs: None  # type: ignore[method-assign]
        if not prepare:
            planner.prepare = lambda *args: None  # type: ignore[method-assign]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runs.append((outs, planner.sum_budget, planner.num_planned_steps, list(planner.verify_len_hist)))
        if prepare:
            assert planner.num_prepared_budgets > 0.5 * planner.num_planned_steps
    # the budgets bit: some drafts verified, not all of them (else any budget would give the same plans)
    assert 0 < runs[0][1] < 4 * len(prompts) * runs[0][2]
    assert runs[0] == runs[1]
    # n-gram drafts are on the host at once: nothing to overlap, so nothing is prepared (plan chooses as before)
    ngram = engine({"method": "ngram", "num_speculative_tokens": 4})
    planner = ngram.engine.planner
    assert planner is not None
    planner.should_draft = lambda request_ids: True  # type: ignore[method-assign]
    asked: list[int] = []
    planner.prepare = lambda *args: asked.append(1)  # type: ignore[method-assign]
    ngram.generate([p * 3 for p in prompts], params)
    assert planner.num_planned_steps > 0 and planner.sum_budget > 0 and not asked


def test_ending_work_is_taken_out_and_the_wait_it_ate_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling, steps of 1 ms with 0.6 ms of waiting for the device in each. A step that spends 3 ms ending
    requests is measured 4 ms host to host; the device ran the next step meanwhile, so that one waited 0 ms and took
    0.4. Both must read 1 ms: the ending work out of the first, the wait it ate given back to the second. A step that
    was nearly all ending work (4.9 of 5 ms) is no measurement at all. After a step launched alone that ended requests
    (its wait, its whole device time, says nothing of the next one's), the first continued step is not measured."""
    import dspark.speculative.planner as planner_module
    import dspark.speculative.step_timer as timer_module

    clock = _Clock()
    monkeypatch.setattr(planner_module, "time", clock)
    monkeypatch.setattr(timer_module, "time", clock)
    planner = VerificationPlanner(K, "async", 0.0, CostModel.from_points({1: 1.0, 64: 1.0}, {1: 0.5, 64: 0.5}), CPU)
    timer = StepTimer(planner)
    seen: list[float] = []
    observe = planner.regime.observe
    planner.regime.observe = lambda *a, **kw: (seen.append(a[4]), observe(*a, **kw))  # type: ignore[method-assign]

    def continued(interval: float, ending: float = 0.0, wait: float = 0.6) -> None:
        clock.now += interval / 1e3
        timer.continued_step_finished(16, 16, chain_goes_on=True, drafted=False, ending_ms=ending, wait_ms=wait)

    timer.step_finished(drafted=False, num_emitted=16, chain_starts=True, wait_ms=0.9)  # a run starts
    for interval, ending, wait in [(1.0, 0.0, 0.6), (4.0, 3.0, 0.6), (0.4, 0.0, 0.0), (1.0, 0.0, 0.6), (5.0, 4.9, 0.6)]:
        continued(interval, ending, wait)
    assert seen == pytest.approx([1.0, 1.0, 1.0, 1.0])
    continued(0.4, wait=0.0)  # the wait the dropped step's ending ate is still given back to the step after it
    assert seen[-1] == pytest.approx(1.0) and len(seen) == 5
    continued(0.9, ending=0.5, wait=0.6)  # the next step's wait does not shrink: nothing to give back to it
    continued(1.0)
    assert seen[-2:] == pytest.approx([0.4, 1.0])
    timer.step_finished(drafted=False, num_emitted=16, chain_starts=True, ending_ms=2.0, wait_ms=0.9)
    continued(0.4, wait=0.0)
    assert len(seen) == 7  # not measured
    continued(1.0)
    assert len(seen) == 8 and seen[-1] == pytest.approx(1.0)
