"""Speculating at all, checked against measurement (speculative/regime.py): the faster regime wins once both are
measured, whatever the cost model said, and the slower one is still revisited, more rarely each time."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from dspark.speculative.regime import BURST, EXPLORE_SHARE, FIRST_PERIOD, MAX_PERIOD, RegimeChooser, Verdict


def _run(chooser: RegimeChooser, steps: int, model_says: bool, spec_rate: float, plain_rate: float) -> list[bool]:
    choices, previous = [], model_says
    for _ in range(steps):
        drafted = chooser.choose(16, model_says)
        # This step verified drafts iff the one before drafted; it is steady iff it also drafted.
        chooser.observe(16, previous, drafted, 16, 16 / (spec_rate if drafted else plain_rate))
        choices.append(drafted)
        previous = drafted
    return choices


def test_measurement_overrides_a_wrong_model() -> None:
    chooser = RegimeChooser()
    choices = _run(chooser, 400, model_says=True, spec_rate=0.8, plain_rate=1.0)  # the model is wrong: plain is faster
    assert all(choices[:FIRST_PERIOD])  # the model's choice until the first exploration
    late = choices[100:]
    assert sum(late) < 0.1 * len(late)  # then plain, with short spec bursts that keep its figure fresh
    assert 0 < sum(late)
    assert set(chooser.rates()[chooser.level(16)]) == {"spec", "plain"}


def test_measurement_confirms_a_right_model_and_explores_ever_more_rarely() -> None:
    chooser = RegimeChooser()
    choices = _run(chooser, 600, model_says=True, spec_rate=1.3, plain_rate=1.0)
    assert sum(choices) > 0.95 * len(choices)
    plain_runs = [i for i in range(1, len(choices)) if not choices[i] and choices[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(plain_runs)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # explorations thin out


def test_a_wrong_model_costs_a_new_level_two_drafting_steps() -> None:
    """The model cannot see a drafting step's host work, so at a new load level it may choose to draft where plain
    steps are 3x faster: the level measures both regimes within its first few steps and then stays plain for the rest
    of a 256-step sweep row (a longer first period would cost several drafting steps a row)."""
    chooser = RegimeChooser()
    choices = _run(chooser, 256, model_says=True, spec_rate=0.3, plain_rate=1.0)
    assert choices[:2] == [True, True]  # the model's choice: one step entering, one steady step measured
    assert sum(choices) == 2


def test_a_near_tie_keeps_the_regime_the_engine_is_in() -> None:
    """Within the 3% margin the engine stays where it is: drafting, where the model chose it before anything was
    measured; plain, where it got there from a level that measured plain faster, even though the model says draft
    (it leans to drafting: it cannot see a drafting step's host work)."""
    chooser = RegimeChooser()
    choices = _run(chooser, 300, model_says=True, spec_rate=1.0, plain_rate=1.01)
    assert sum(choices[100:]) > 0.9 * len(choices[100:])

    chooser = RegimeChooser()
    _run(chooser, 300, model_says=True, spec_rate=0.3, plain_rate=1.0)  # plain is settled
    asked = []

    def model() -> bool:
        asked.append(True)
        return True

    near = chooser.levels[chooser.level(16)]
    near.rate = {True: 1.0, False: 1.01}  # then the level measures a near tie
    near.ms = {True: 1.0, False: 1.0}
    choices = [chooser.choose(16, model) for _ in range(100)]
    assert not asked
    runs = [len(list(group)) for drafted, group in itertools.groupby(choices) if drafted]
    assert runs and all(n == BURST for n in runs)  # plain, drafting only in exploration bursts


def test_switching_steps_are_not_measured() -> None:
    chooser = RegimeChooser()
    chooser.observe(16, verified_drafts=True, drafted=False, tokens=16, ms=1.0)  # leaving spec: neither regime
    chooser.observe(16, verified_drafts=False, drafted=True, tokens=16, ms=1.0)  # entering spec: neither
    assert chooser.rates() == {}


def test_exploring_a_much_slower_regime_costs_at_most_about_one_percent() -> None:
    """Bursts are spaced by how much slower the other regime is: a drafter whose steps are 3x slower per token is
    revisited only every few hundred steps (bursts at a fixed period would cost several percent). The run is long
    enough that where its window cuts the bursts does not matter (each costs 1% of the ~700 steps before it)."""
    chooser = RegimeChooser()
    choices = _run(chooser, 20000, model_says=False, spec_rate=0.3, plain_rate=1.0)
    late = choices[200:]
    assert 0 < sum(late)  # still revisited
    lost = sum(late) * (1 / 0.3 - 1)  # plain steps' worth of time the spec steps cost beyond plain ones
    assert lost < 0.01 * len(late)


def test_the_model_is_asked_only_when_the_measurements_leave_the_choice_open() -> None:
    """Its answer costs host time at high load; once both regimes are measured and one is clearly faster, it is not
    computed at all."""
    chooser = RegimeChooser()
    asked = []

    def model() -> bool:
        asked.append(True)
        return False

    for _ in range(FIRST_PERIOD + 40):  # plain, then a spec burst that measures spec at a third of plain's rate
        drafted = chooser.choose(16, model)
        chooser.observe(16, drafted, drafted, 16, 16 / (0.3 if drafted else 1.0))
    before = len(asked)
    for _ in range(50):
        assert not chooser.choose(16, model)
    assert len(asked) == before  # measured: plain is 3x faster, nothing to ask
    tie = RegimeChooser()
    tie.choose(16, model)
    assert len(asked) == before + 1  # nothing measured yet: the model decides


def test_a_new_load_level_starts_from_a_lower_level_where_plain_won() -> None:
    """Plain measured faster at a low load carries up to a higher one (verifying only gets dearer with load), so the
    new level does not first draft for the model's sake; the reverse direction does not carry."""
    chooser = RegimeChooser()
    _run(chooser, 200, model_says=True, spec_rate=0.4, plain_rate=1.0)  # level of 16 requests: plain wins
    asked = []

    def model() -> bool:
        asked.append(True)
        return True

    assert not chooser.choose(200, model)  # a higher level: plain from the start, the model not asked
    assert not asked
    assert chooser.choose(4, model)  # a lower level: nothing carries down from a level where plain won
    assert asked


def test_a_level_following_its_neighbours_verdict_explores_at_its_neighbours_spacing() -> None:
    """A new level that starts plain from a lower level where plain won does not explore drafting after the first few
    steps, as a level with nothing to go on does: a burst there costs what it costs at the neighbour, so it comes no
    sooner than the neighbour's next burst, here its spacing (its period is shorter; the next test has a longer one).
    It is still explored, later."""
    chooser = RegimeChooser()
    _run(chooser, 400, model_says=True, spec_rate=0.3, plain_rate=1.0)  # level of 16 requests: plain 3x faster
    level = chooser.levels[chooser.level(16)]
    spacing = chooser._spacing(level)
    assert spacing > 50
    choices = []
    for _ in range(spacing + 2 * BURST + 2):
        drafted = chooser.choose(200, True)
        chooser.observe(200, False, drafted, 200, 200 / (0.3 if drafted else 1.0))
        choices.append(drafted)
    first = choices.index(True)
    assert first >= spacing  # not after FIRST_PERIOD steps
    assert sum(choices) >= 1  # but explored all the same


def test_a_level_with_no_verdict_to_follow_still_explores_early() -> None:
    """Nothing carries down from a level where plain won: a lower level explores after FIRST_PERIOD steps."""
    chooser = RegimeChooser()
    _run(chooser, 400, model_says=True, spec_rate=0.3, plain_rate=1.0)
    choices = [chooser.choose(2, False) for _ in range(FIRST_PERIOD + 1)]
    assert choices[FIRST_PERIOD]


def _burst_starts(choices: list[bool], regime: bool) -> list[int]:
    return [i for i in range(1, len(choices)) if choices[i] == regime and choices[i - 1] != regime]


def test_each_gap_between_bursts_doubles_the_last_once_the_spacing_rules() -> None:
    """Once both rates are known the spacing (a burst's cost at most 1% of the time between bursts) sets the first gap,
    and each later gap doubles the one before. Doubling only the small first period would leave the bursts at the
    spacing for round after round."""
    chooser = RegimeChooser()
    choices = _run(chooser, 6000, model_says=False, spec_rate=0.6, plain_rate=1.0)
    spacing = chooser._spacing(chooser.levels[chooser.level(16)])
    assert 50 < spacing < 400
    starts = _burst_starts(choices, True)
    gaps = [b - a - BURST for a, b in itertools.pairwise(starts)]
    assert len(gaps) >= 3
    assert gaps[0] >= spacing
    for before, after in itertools.pairwise(gaps):
        assert after >= 2 * before - 1


def test_a_new_level_waits_as_long_as_its_neighbour_whose_verdict_held() -> None:
    """A neighbour whose plain verdict several bursts confirmed has a long period; a higher level that inherits the
    verdict explores no sooner than that period, not after the neighbour's spacing alone: drafting costs more per plain
    step at a higher load, so a burst at the neighbour's spacing would cost the new level more than its share."""
    chooser = RegimeChooser()
    _run(chooser, 6000, model_says=False, spec_rate=0.6, plain_rate=1.0)
    neighbour = chooser.levels[chooser.level(16)]
    spacing = chooser._spacing(neighbour)
    assert neighbour.period > 4 * spacing
    choices = []
    for _ in range(neighbour.period + 2 * BURST):
        drafted = chooser.choose(200, True)
        chooser.observe(200, False, drafted, 200, 200 / (0.6 if drafted else 1.0))
        choices.append(drafted)
    assert choices.index(True) >= neighbour.period


def test_a_neighbours_gap_delays_only_a_levels_first_burst() -> None:
    """After its first burst a level has rates of its own, and its gaps grow from its own spacing: the neighbour's
    long period is not carried on as the level's own (it would keep the level from re-checking for good)."""
    chooser = RegimeChooser()
    _run(chooser, 6000, model_says=False, spec_rate=0.6, plain_rate=1.0)
    neighbour = chooser.levels[chooser.level(16)]
    assert neighbour.period >= MAX_PERIOD // 2
    choices, previous = [], False
    for _ in range(neighbour.period + 3000):
        drafted = chooser.choose(200, True)
        chooser.observe(200, previous, drafted, 200, 200 / (0.6 if drafted else 1.0))
        choices.append(drafted)
        previous = drafted
    starts = _burst_starts(choices, True)
    level = chooser.levels[chooser.level(200)]
    own = chooser._spacing(level)
    assert starts[0] >= neighbour.period  # the first burst waits for the neighbour's gap
    assert 0 < own < MAX_PERIOD // 4
    assert len(starts) >= 2 and starts[1] - starts[0] < 4 * own  # then the level's own gap


def _first_burst(chooser: RegimeChooser, verdict: bool | Verdict, steps: int, regime: bool) -> int | None:
    """The step at which a new level (16 requests, nothing measured) first runs `regime` against the model's verdict;
    steps are measured as spec at a third of plain's rate."""
    for i in range(steps):
        drafted = chooser.choose(16, verdict)
        chooser.observe(16, False, drafted, 16, 16 / (0.3 if drafted else 1.0))
        if drafted == regime:
            return i
    return None


def test_a_plain_verdict_with_predictions_explores_as_rarely_as_measured_rates_would() -> None:
    """Once the model's drafting costs are measured ones (the planner then passes its predictions), a plain verdict
    spaces the level's first drafting burst as measured rates would, not after FIRST_PERIOD steps: on a ramp through
    many levels, each would otherwise explore drafting early, at several times a plain step's cost."""
    verdict = Verdict(False, rate={True: 0.3, False: 1.0}, ms={True: 3.0, False: 1.0})
    chooser = RegimeChooser()
    chooser.choose(16, verdict)
    spacing = chooser._spacing(chooser.levels[chooser.level(16)])
    assert spacing == int(BURST * 3.0 * 0.7 / (EXPLORE_SHARE * 1.0))
    first = _first_burst(RegimeChooser(), verdict, 2 * spacing, regime=True)
    assert first is not None and first >= spacing  # still explored, after the spacing


def test_a_verdict_without_predictions_explores_after_the_first_period() -> None:
    """The profile's guess alone (no speculative step measured yet) earns no such trust."""
    for verdict in (False, Verdict(False)):
        assert _first_burst(RegimeChooser(), verdict, 10, regime=True) == FIRST_PERIOD


def test_a_drafting_verdict_with_predictions_still_explores_plain_early() -> None:
    """The model's error leans to drafting (it cannot see all of a drafting step's host work), so a drafting verdict
    with predictions is not trusted to delay the plain burst: plain steps are cheap to try."""
    verdict = Verdict(True, rate={True: 1.2, False: 1.0}, ms={True: 3.0, False: 1.0})
    assert _first_burst(RegimeChooser(), verdict, 10, regime=False) == FIRST_PERIOD


def test_a_plain_rate_pulled_under_the_level_belows_does_not_decide() -> None:
    """More requests a plain step do not make fewer tokens a millisecond, so a level's plain rate is never taken below
    the next level down's. Here level 7 (64-127 requests) reads plain decoding at 6 tokens/ms (say, steps that ended
    requests counted in) against 42 at level 6 and drafting's 25 at level 7, and alone would draft. With level 6's
    plain rate as a floor, level 7 stays plain."""
    chooser = RegimeChooser()
    for _ in range(20):  # level 6 (32-63 requests): plain measured at 42 tokens/ms, drafting at 12
        chooser.observe(48, False, False, 48, 48 / 42)
        chooser.observe(48, True, True, 48, 48 / 12)
    for _ in range(20):  # level 7: drafting at 25, plain pulled down to 6
        chooser.observe(64, True, True, 64, 64 / 25)
        chooser.observe(64, False, False, 64, 64 / 6)
    level = chooser.levels[chooser.level(64)]
    assert level.rate[False] == pytest.approx(6) and level.rate[True] == pytest.approx(25)
    choices = [chooser.choose(64, True) for _ in range(40)]
    assert sum(choices) <= 3  # plain, bar an exploration burst of drafting
    # without the level below, the same rates choose drafting
    alone = RegimeChooser()
    alone.levels[alone.level(64)] = level
    assert sum(alone.choose(64, True) for _ in range(40)) >= 37


def test_a_lower_loads_drafting_rate_does_not_make_a_level_draft() -> None:
    """Drafting's rate moves with acceptance (temperature, prompts): a lower load's, measured on easier text, must not
    keep a level drafting where its own measurements say plain steps are faster."""
    chooser = RegimeChooser()
    for _ in range(20):  # level 6: drafting measured at 60 tokens/ms on repetitive text, plain at 40
        chooser.observe(48, True, True, 48, 48 / 60)
        chooser.observe(48, False, False, 48, 48 / 40)
    for _ in range(20):  # level 7, later rows: drafting at 25, plain at 45
        chooser.observe(64, True, True, 64, 64 / 25)
        chooser.observe(64, False, False, 64, 64 / 45)
    assert sum(chooser.choose(64, True) for _ in range(40)) <= 3


def test_a_held_regime_is_every_choice_whatever_the_rates_and_the_model_say() -> None:
    """bench sweep's adaptive:plain arm holds an adaptive engine's regime plain to price its plain steps; drafting
    twice as fast as plain, with a model that says draft, must still give plain steps only, and no exploration."""
    chooser = RegimeChooser()
    chooser.held = False
    assert not any(_run(chooser, 200, model_says=True, spec_rate=2.0, plain_rate=1.0))
    assert chooser.num_explorations == 0
    chooser.held = True
    assert all(_run(chooser, 50, model_says=False, spec_rate=0.5, plain_rate=1.0))


def _noisy_run(
    chooser: RegimeChooser, steps: int, seed: int, good: float, spec_ms: float, plain_ms: float
) -> list[bool]:
    """Batch 1 with real acceptance: a drafting step makes 1 + accepted tokens, where text alternates between easy
    stretches (each draft accepted with probability `good`, up to 7) and hard ones of 4-12 steps where every draft is
    rejected (numbers, names), as DSpark's drafter on GSM8K on CPU did (runs of up to 7 one-token steps)."""
    rng = random.Random(seed)
    choices, previous, hard = [], True, 0
    for _ in range(steps):
        drafted = chooser.choose(1, True)
        if hard == 0 and rng.random() < 0.04:  # the text moves on whether the step drafts or not
            hard = rng.randint(4, 12)
        tokens = 1
        if hard:
            hard -= 1
        elif drafted and previous:
            while tokens < 8 and rng.random() < good:
                tokens += 1
        chooser.observe(1, previous, drafted, tokens, spec_ms if drafted else plain_ms)
        choices.append(drafted)
        previous = drafted
    return choices


@pytest.mark.parametrize("seed", range(5))
def test_runs_of_rejected_drafts_do_not_stop_a_drafter_that_pays(seed: int) -> None:
    """Drafting makes ~1.8x plain's tokens/ms over the run (2.74 tokens a 38 ms step against 1 a 25 ms step), but a
    hard stretch of one-token steps makes its recent steps' rate fall below plain's: the estimate of tokens per step
    must span such stretches, and a turn to plain must be revisited soon, or the engine goes plain and comes back only
    in rare bursts (on the CPU: 58-69 against 80-88 tok/s at batch 1; here, before: 17-251 drafting steps of 3,000).
    The first several hundred steps may go either way: a level's first drafting steps, and the two-step bursts that
    revisit it, can fall in hard stretches (one seed of ten stayed mostly plain for ~500 steps)."""
    choices = _noisy_run(RegimeChooser(), 3000, seed, good=0.72, spec_ms=38.0, plain_ms=25.0)
    assert sum(choices[600:]) > 0.95 * len(choices[600:])


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_drafter_that_does_not_pay_still_goes_plain(seed: int) -> None:
    """The same noise where drafting makes ~0.87x plain (1.32 tokens a 38 ms step): plain, with rare bursts."""
    choices = _noisy_run(RegimeChooser(), 3000, seed, good=0.3, spec_ms=38.0, plain_ms=25.0)
    assert sum(choices[500:]) < 0.1 * len(choices[500:])


@pytest.mark.parametrize("bad_steps", [200, 1000, 5000])
def test_one_burst_brings_back_a_drafter_that_pays_again(bad_steps: int) -> None:
    """Drafting gave 1 token a 38 ms step for a long stretch (plain: 1 a 25 ms step), so the level went plain; then
    drafting pays (3 tokens a step). The first drafting burst after the change turns the level back: the burst's two
    steady steps must move a tokens average that the long stretch filled (at most BURST_MEMORY steps of memory when a
    burst starts), or the level stays plain for several more bursts, each gap twice the last (1,361 steps after 1,000
    bad ones, against 110)."""
    chooser, previous, choices = RegimeChooser(), True, []
    for i in range(bad_steps + 8000):
        drafted = chooser.choose(1, True)
        tokens = 3 if i >= bad_steps and drafted and previous else 1
        chooser.observe(1, previous, drafted, tokens, 38.0 if drafted else 25.0)
        choices.append(drafted)
        previous = drafted
    after = choices[bad_steps:]
    first = after.index(True)
    assert all(after[first : first + 50])


def _batch_run(
    chooser: RegimeChooser, steps: int, rng: random.Random, good: float, spec_ms: float, plain_ms: float, n: int = 8
) -> list[bool]:
    """_noisy_run's text for n requests at once, each with hard stretches of its own: a step's tokens are their sum
    (good = 0.72: 21.9 a drafting step on average, standard deviation 6.2)."""
    choices, previous, hard = [], True, [0] * n
    for _ in range(steps):
        drafted = chooser.choose(n, True)
        tokens = 0
        for i in range(n):
            if hard[i] == 0 and rng.random() < 0.04:
                hard[i] = rng.randint(4, 12)
            made = 1
            if hard[i]:
                hard[i] -= 1
            elif drafted and previous:
                while made < 8 and rng.random() < good:
                    made += 1
            tokens += made
        chooser.observe(n, previous, drafted, tokens, spec_ms if drafted else plain_ms)
        choices.append(drafted)
        previous = drafted
    return choices


def test_a_drafter_that_pays_at_batch_8_is_not_left_for_its_first_steps_noise() -> None:
    """8 requests at once, drafting 1.15x plain (21.9 tokens a 95 ms step against 8 in 40 ms). A level that measured
    drafting from a step or two in a hard stretch spaced its next burst by that mean (100+ steps, then doubled): of 20
    runs, three drafted in 74%, 52% and 0.5% of steps 300-1,500. The bursts are spaced by an optimistic drafting rate
    (about two standard errors up): every run drafts in 97% of them or more (asserted with slack: 85%)."""
    fractions = []
    for seed in range(20):
        choices = _batch_run(RegimeChooser(), 1500, random.Random(seed), good=0.72, spec_ms=95.0, plain_ms=40.0)
        fractions.append(sum(choices[300:]) / len(choices[300:]))
    assert min(fractions) > 0.85, fractions


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_drafter_that_does_not_pay_at_batch_8_still_goes_plain(seed: int) -> None:
    """The same batch with drafting at 0.87x plain (14 tokens an 80 ms step): plain, with rare bursts."""
    choices = _batch_run(RegimeChooser(), 1500, random.Random(100 + seed), good=0.5, spec_ms=80.0, plain_ms=40.0)
    assert sum(choices[300:]) < 0.1 * len(choices[300:])


def _request_step(
    rng: random.Random, hard: list[int], i: int, good: float, bias: float, verifies: bool
) -> tuple[int, float]:
    """One request's step in _expected_run's model: the tokens it makes, and its verified block's expected accepted
    drafts (0 where the step verifies none). A hard stretch starts with probability 0.04 a step and lasts 4-12 steps;
    the drafter's confidence is good x bias (at most 0.98), or 0.2 in 60% of hard steps."""
    if hard[i] == 0 and rng.random() < 0.04:
        hard[i] = rng.randint(4, 12)
    confidence, made = min(good * bias, 0.98), 1
    if hard[i]:
        confidence = 0.2 if rng.random() < 0.6 else confidence
        hard[i] -= 1
    elif verifies:
        while made < 8 and rng.random() < good:
            made += 1
    return made, sum(confidence**j for j in range(1, 8)) if verifies else 0.0


def _report(
    chooser: RegimeChooser,
    n: int,
    verified: bool,
    drafted: bool,
    tokens: int,
    accepted: int,
    expected: float,
    ms: float,
    expectations: bool = True,
) -> None:
    """A simulated step to the chooser as the engine reports it: record()'s ratio, then the step's timing."""
    if verified and expectations:
        chooser.learn_ratio(expected, accepted)
    chooser.observe(
        n, verified, drafted, tokens, ms, expected=(expected, accepted) if verified and expectations else None
    )


def _expected_run(
    chooser: RegimeChooser,
    steps: int,
    seed: int,
    n: int,
    phases: list[tuple[int, float, float, float]],
    plain_ms: float,
    expectations: bool = True,
    held: bool | None = None,
) -> tuple[list[bool], float]:
    """_batch_run's text with what the planner knows: each verified block's expected accepted drafts, from a drafter
    whose confidence is good x bias (capped at 0.98) and, in 60% of a request's hard stretches, 0.2 (it sees those
    coming; the rest look like easy text). phases: (first step, good, drafting ms a step, bias). Returns the choices
    and the tokens/ms of steps 300 on."""
    rng = random.Random(seed)
    choices, previous, hard = [], True, [0] * n
    made_total, ms_total = 0, 0.0
    chooser.held = held
    for t in range(steps):
        good, spec_ms, bias = [p for p in phases if p[0] <= t][-1][1:]
        drafted = chooser.choose(n, True)
        tokens, accepted, expected = 0, 0, 0.0
        for i in range(n):
            made, block = _request_step(rng, hard, i, good, bias, previous)
            tokens, accepted, expected = tokens + made, accepted + made - 1, expected + block
        ms = spec_ms if drafted else plain_ms
        _report(chooser, n, previous, drafted, tokens, accepted, expected, ms, expectations)
        if t >= 300:
            made_total, ms_total = made_total + tokens, ms_total + ms
        choices.append(drafted)
        previous = drafted
    return choices, made_total / ms_total


def _over_plain(n: int, phases: list[tuple[int, float, float, float]], plain_ms: float, expectations: bool) -> float:
    """Mean over 20 seeds of tokens/ms (steps 300-1,500) over the same runs held plain."""
    ratios = []
    for seed in range(20):
        plain = _expected_run(RegimeChooser(), 1500, seed, n, phases, plain_ms, held=False)[1]
        ratios.append(_expected_run(RegimeChooser(), 1500, seed, n, phases, plain_ms, expectations)[1] / plain)
    return sum(ratios) / len(ratios)


@pytest.mark.parametrize("n, plain_ms, spec_ms", [(1, 25.0, 59.6), (2, 50.0, 119.1)])
def test_expected_acceptance_finds_a_drafter_that_pays_a_little_at_small_batches(
    n: int, plain_ms: float, spec_ms: float
) -> None:
    """Drafting at ~1.14x plain over the run at batch 1 and 2. From its realised tokens alone (a step's swing from 1 to
    8 a request) the level found the edge in few runs: 1.06x plain at batch 1 on average over 20 seeds, 1.08x at
    batch 2. With the drafts' expected acceptance (an expectation, averaged over a few steps, times a pooled
    realised / expected ratio) it takes more of it: 1.12x and 1.11x. Asserted: 1.10x, and 0.02 over realised alone."""
    phases = [(0, 0.72, spec_ms, 1.0)]
    realised = _over_plain(n, phases, plain_ms, expectations=False)
    expected = _over_plain(n, phases, plain_ms, expectations=True)
    assert expected > 1.10 and expected > realised + 0.02, (expected, realised)


@pytest.mark.parametrize("n, plain_ms, spec_ms", [(1, 25.0, 78.7), (8, 40.0, 125.0)])
def test_expected_acceptance_still_goes_plain_where_drafting_does_not_pay(
    n: int, plain_ms: float, spec_ms: float
) -> None:
    """Drafting at ~0.87x plain: within 1% of plain, as with realised tokens alone."""
    assert _over_plain(n, [(0, 0.72, spec_ms, 1.0)], plain_ms, expectations=True) > 0.99


def test_a_workload_where_drafting_stops_paying_is_left_within_a_few_steps() -> None:
    """Batch 8: drafting pays 1.15x for 600 steps, then the text turns to chat where it makes 0.68x (acceptance 0.45,
    the drafter overconfident by 15%). From realised tokens (a ~30-step memory) the level drafted in 18 of the 20
    steps after the change (median of 20 seeds); with expected acceptance, whose few-step average follows the
    drafter's own confidences, in 5-8 (asserted: at most 10, median at most 8)."""
    drafting = []
    for seed in range(20):
        choices, _ = _expected_run(RegimeChooser(), 700, seed, 8, [(0, 0.72, 95.0, 1.0), (600, 0.45, 95.0, 1.15)], 40.0)
        drafting.append(sum(choices[600:620]))
    assert max(drafting) <= 10 and sorted(drafting)[10] <= 8, drafting


@pytest.mark.parametrize("bias, spec_ms, drafts", [(1.35, 125.0, False), (0.6, 95.0, True)])
def test_the_realised_over_expected_ratio_corrects_miscalibrated_confidences(
    bias: float, spec_ms: float, drafts: bool
) -> None:
    """Batch 8. Confidences 35% too high make a drafter at 0.87x plain look like it pays about 2x; 40% too low make one
    at 1.15x look like it loses. The pooled ratio of realised to expected accepted drafts undoes either: over 20 seeds,
    plain in all but a few % of steps 300-1,500 in the first case; drafting in 98% of them on average in the second
    (asserted: 95%, and 75% in every run: one ran at 78%; from realised tokens alone the worst run drafted in 47%)."""
    shares = []
    for seed in range(20):
        chooser = RegimeChooser()
        choices, _ = _expected_run(chooser, 1500, seed, 8, [(0, 0.72, spec_ms, bias)], 40.0)
        shares.append(sum(choices[300:]) / len(choices[300:]))
        ratio = chooser.expectation_ratio()
        assert ratio is not None and (ratio[0] > 2.0 if bias < 1 else ratio[0] < 0.5), (seed, ratio)
    mean = sum(shares) / len(shares)
    assert (mean > 0.95 and min(shares) > 0.75) if drafts else max(shares) < 0.05, shares


def _turnover_run(
    seed: int,
    texts: list[tuple[float, float]],
    switches: tuple[int, ...],
    spec_ms: float,
    plain_ms: float,
    rounds: bool,
    arrivals: bool = True,
    held: bool | None = None,
    steps: int = 1500,
) -> tuple[list[bool], dict[tuple[int, int], float]]:
    """_expected_run's batch of 8 where requests come and go: each lives 128 steps (all at once: rounds, as a
    benchmark runs them; else staggered) and takes its text, texts[(good, bias)], from the number of switches passed
    when it arrived (alternating). Returns the choices and the tokens/ms before the last switch, in the 200 steps after
    it (300 on) and after those."""
    rng = random.Random(seed)
    chooser = RegimeChooser()
    chooser.held = held
    n, life_steps = 8, 128
    life = [life_steps if rounds else rng.randint(1, life_steps) for _ in range(n)]
    text, hard, num_arrived, previous = [0] * n, [0] * n, n, True
    last = switches[-1]
    windows = [(300, last), (last, last + 200), (last + 200, steps)]
    sums = {w: [0, 0.0] for w in windows}
    choices = []
    for t in range(steps):
        for i in range(n):
            if life[i] == 0:
                life[i], hard[i], num_arrived = life_steps, 0, num_arrived + 1
                text[i] = sum(t >= s for s in switches) % 2
        drafted = chooser.choose(n, True, arrivals=num_arrived if arrivals else None)
        tokens, accepted, expected = 0, 0, 0.0
        for i in range(n):
            made, block = _request_step(rng, hard, i, *texts[text[i]], previous)
            tokens, accepted, expected = tokens + made, accepted + made - 1, expected + block
            life[i] -= 1
        ms = spec_ms if drafted else plain_ms
        _report(chooser, n, previous, drafted, tokens, accepted, expected, ms)
        for w in windows:
            if w[0] <= t < w[1]:
                sums[w][0] += tokens
                sums[w][1] += ms
        choices.append(drafted)
        previous = drafted
    return choices, {w: made / ms for w, (made, ms) in sums.items()}


def _of_best(
    texts: list[tuple[float, float]], switches: tuple[int, ...], spec_ms: float, plain_ms: float, **kw: bool
) -> list[float]:
    """Per window, the mean over 20 seeds of tokens/ms over the better of the same runs held plain or held drafting."""
    shares: list[list[float]] = []
    for seed in range(20):
        plain = _turnover_run(seed, texts, switches, spec_ms, plain_ms, kw["rounds"], held=False)[1]
        draft = _turnover_run(seed, texts, switches, spec_ms, plain_ms, kw["rounds"], held=True)[1]
        rates = _turnover_run(seed, texts, switches, spec_ms, plain_ms, **kw)[1]
        shares.append([rates[w] / max(plain[w], draft[w]) for w in rates])
    return [sum(column) / len(column) for column in zip(*shares, strict=True)]


MATH, CHAT = (0.72, 1.0), (0.45, 1.15)  # drafting at ~1.15x plain, and at ~0.68x (the drafter overconfident by 15%)


@pytest.mark.parametrize("rounds", [False, True])
def test_new_requests_bring_back_drafting_where_it_paid_before(rounds: bool) -> None:
    """Batch 8: math (drafting pays 1.15x), chat from step 400, math again from 800. A level that went plain on chat
    explores drafting only as often as 1% of the time allows, so the second math stretch ran at 0.935x (staggered
    requests) and 0.951x (rounds) of the better held regime over steps 1,000-1,500. Once a whole batch of new requests
    has come since the level last drafted, and drafting won there before, it explores again: 0.995x and 0.998x
    (asserted: 0.98x, and 0.03 over the chooser told of no arrivals)."""
    kw = {"rounds": rounds}
    with_arrivals = _of_best([MATH, CHAT], (400, 800), 95.0, 40.0, **kw)
    without = _of_best([MATH, CHAT], (400, 800), 95.0, 40.0, arrivals=False, **kw)
    assert with_arrivals[2] > 0.98 and with_arrivals[2] > without[2] + 0.03, (with_arrivals, without)


@pytest.mark.parametrize("rounds", [False, True])
def test_exploring_on_new_requests_costs_little_where_drafting_stops_paying(rounds: bool) -> None:
    """Math then chat for good: every batch of new requests brings a drafting burst that loses (0.68x), bounded by
    NEW_TEXT_SHARE; over chat's steps the chooser keeps 98.3% and 98.6% of held plain's rate (99.4% and 99.3% without
    the new-text bursts). Asserted: 98%."""
    assert min(_of_best([MATH, CHAT], (600,), 95.0, 40.0, rounds=rounds)[1:]) > 0.98


def test_a_level_where_drafting_never_won_ignores_new_requests() -> None:
    """Drafting at 0.45x plain (a loaded GPU): new requests change nothing, step for step."""
    for seed in range(3):
        for rounds in (False, True):
            told = _turnover_run(seed, [MATH, MATH], (600,), 60.0, 10.0, rounds)[0]
            untold = _turnover_run(seed, [MATH, MATH], (600,), 60.0, 10.0, rounds, arrivals=False)[0]
            assert told == untold


def _stalled_chooser(regime: bool) -> tuple[RegimeChooser, dict[str, Any]]:
    """A chooser whose first steady step of `regime` after step 400 is measured at 30x its time."""
    chooser = RegimeChooser()
    observe, state = chooser.observe, {"steps": 0, "hit": False}

    def stalled(n: int, verified: bool, drafted: bool, tokens: int, ms: float, **kw: Any) -> None:
        state["steps"] += 1
        if not state["hit"] and state["steps"] > 400 and verified == drafted == regime:
            ms, state["hit"] = 30 * ms, True
        observe(n, verified, drafted, tokens, ms, **kw)

    chooser.observe = stalled  # type: ignore[method-assign]
    return chooser, state


@pytest.mark.parametrize("regime, spec_ms", [(True, 95.0), (False, 125.0)])
def test_one_stalled_step_does_not_turn_a_level(regime: bool, spec_ms: float) -> None:
    """Batch 8: one steady step of the faster regime, after step 400, takes 30x its time (the process paused). Where
    drafting pays 1.15x plain, a stalled drafting step taken whole turned every run of 20 plain for the remaining 1,100
    steps; where it makes 0.87x, a stalled plain step turned them to drafting. Counted as at most MS_OUTLIER x its
    regime's average, every run stays in the faster regime in 95% of them or more (asserted: 90%)."""
    for seed in range(20):
        chooser, state = _stalled_chooser(regime)
        choices, _ = _expected_run(chooser, 1500, seed, 8, [(0, 0.72, spec_ms, 1.0)], 40.0)
        faster = sum(choices[400:]) if regime else len(choices[400:]) - sum(choices[400:])
        assert state["hit"] and faster > 0.9 * len(choices[400:]), seed


def _contended_chooser(start: int, end: int, factor: float) -> RegimeChooser:
    """A chooser whose steps from `start` to `end` are measured at `factor` x their time (another process)."""
    chooser = RegimeChooser()
    observe, state = chooser.observe, {"steps": 0}

    def slowed(n: int, verified: bool, drafted: bool, tokens: int, ms: float, **kw: Any) -> None:
        state["steps"] += 1
        observe(n, verified, drafted, tokens, ms * factor if start <= state["steps"] < end else ms, **kw)

    chooser.observe = slowed  # type: ignore[method-assign]
    return chooser


@pytest.mark.parametrize("factor", [3.0, 6.0])
@pytest.mark.parametrize("drafting_pays, spec_ms", [(True, 95.0), (False, 125.0)])
def test_a_busy_machine_does_not_leave_a_level_in_the_slower_regime(
    factor: float, drafting_pays: bool, spec_ms: float
) -> None:
    """Batch 8, every step 3x or 6x slower from step 400 to 700, drafting at 1.15x or 0.87x plain. Only the running
    regime is measured meanwhile; priced as last measured, the other looked 3-6x cheaper than it was (or the running
    one, once the contention was over, as dear as during it), and of 20 runs some spent all of steps 700-1,500 in
    the slower regime. The regime not running is priced by the running one's cost drift and a much faster step starts
    an average again: each run then spends 94% or more of them in the faster regime, as runs without the contention
    do (asserted: 90%)."""
    for seed in range(20):
        chooser = _contended_chooser(400, 700, factor)
        choices, _ = _expected_run(chooser, 1500, seed, 8, [(0, 0.72, spec_ms, 1.0)], 40.0)
        after = choices[700:]
        faster = sum(after) if drafting_pays else len(after) - sum(after)
        assert faster > 0.9 * len(after), seed


def _varying_load_run(seed: int, steps: int, per_request_ms: tuple[float, float]) -> list[bool]:
    """_expected_run's text at 5-8 requests, one load level, their number redrawn every 1-20 steps; a step's time is
    its requests times per_request_ms (plain, drafting). Returns the choices."""
    rng = random.Random(seed)
    chooser, hard = RegimeChooser(), [0] * 8
    choices, previous, n, until = [], True, 8, 0
    for t in range(steps):
        if t >= until:
            n, until = rng.randint(5, 8), t + rng.randint(1, 20)
        drafted = chooser.choose(n, True)
        tokens, accepted, expected = 0, 0, 0.0
        for i in range(n):
            made, block = _request_step(rng, hard, i, 0.72, 1.0, previous)
            tokens, accepted, expected = tokens + made, accepted + made - 1, expected + block
        _report(chooser, n, previous, drafted, tokens, accepted, expected, n * per_request_ms[drafted])
        choices.append(drafted)
        previous = drafted
    return choices


@pytest.mark.parametrize("drafting_pays, spec_ms", [(True, 95.0 / 8), (False, 125.0 / 8)])
def test_requests_coming_and_going_within_a_level_do_not_read_as_a_busy_machine(
    drafting_pays: bool, spec_ms: float
) -> None:
    """5-8 requests (one load level), their number changing every 1-20 steps, each step's time in proportion; drafting
    at 1.15x or 0.87x plain (the busy-machine test's rates). The regime not running is priced by how far the running
    one's ms per request moved. Moved per step instead, fewer requests read as a faster machine and more as a busier
    one: where drafting pays, runs spent as little as 52% of steps 300-1,500 drafting (mean 75%). Per request, each of
    20 runs spends 91% or more of them in the faster regime, mean 96% (asserted: 85%)."""
    for seed in range(20):
        after = _varying_load_run(seed, 1500, (5.0, spec_ms))[300:]
        faster = sum(after) if drafting_pays else len(after) - sum(after)
        assert faster > 0.85 * len(after), (seed, faster / len(after))
