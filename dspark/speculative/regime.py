"""Whether to speculate at all, checked against measurement: the drafting and the plain regime's tokens per millisecond,
learned online per load level.

The cost model predicts a step from profiled dummy steps and cannot see what a real step also pays (per-request host
work that differs between verifying and plain sampling, real contexts, other processes), so where measurement
disagrees with the model the engine follows the measurement. Each load level (requests emitting a token, in powers of
two) keeps averages of ms/step (short) and tokens/step (long: see TOKENS_DECAY) for steady steps of each regime, and
their ratio as its tokens/ms: "spec" steps verified drafts and drafted again, "plain" steps did neither (a step that
switches regime is neither). A level's plain rate is
never taken below the plain rate one level down: a guard against a plain rate pulled down by a stalled host, at a
level that no longer runs plain steps to correct it.

Once both rates are known the faster wins; on a near tie (within MARGIN) the engine stays in the regime it is in
rather than ask the model, which cannot see a drafting step's host work and leans to drafting. Until both are known
the model decides, except that a level not measured yet starts from its nearest measured neighbour's verdict where
that transfers (plain measured faster at a lower load, or drafting at a higher one) and explores no sooner than that
neighbour would.

Every so often the other regime runs for a burst of BURST steps to keep its figure fresh. The first burst comes after
FIRST_PERIOD steps, so that a new level learns both rates in a handful of steps (and again whenever the measurements
turn the level to the other regime); then each gap doubles the last, and
once both rates are known a burst may cost at most EXPLORE_SHARE of the time between bursts. That cost is counted in
time, not steps: each millisecond of the slower regime loses (1 - slow rate / fast rate) of what the faster would have
made; the slower rate is taken about two standard errors up (its tokens per step swing), so a drafter measured
from a few steps in a hard stretch is revisited soon, not after a gap its unlucky mean earned. A level with nothing
measured whose model verdict is plain with predicted costs (a Verdict with rates) spaces its first burst as those
predictions would; the planner gives them only where drafting's cost was measured at this load or a lower one, so that
they err towards drafting being cheap. The asymmetry is deliberate: a plain verdict that knows drafting's measured cost
is the trustworthy side, and a drafting verdict still explores plain steps (cheap) early.

Drafting's tokens per step come from the drafts' expected acceptance where the planner has it (observe's expected:
the sum of the verified slots' survivals, and the accepted count): the tokens besides accepted drafts, plus the
expected accepted drafts times the realised / expected ratio of accepted drafts over every level's verified steps
(RATIO_DECAY, a prior of 1); both averages over a few steps (PREDICTED_DECAY). An expectation has none of acceptance's
step-to-step noise, so the short memory follows what the prompts are now; the pooled ratio corrects the confidences'
calibration (a control variate).

A level that went plain explores drafting at that cadence, a burst every few hundred steps, so text that makes
drafting pay again (a new kind of prompt) would wait that long. So once a whole batch of new requests has started since
the level last drafted (choose's arrivals), and measured drafting beat plain there before by MARGIN, it explores
drafting at once, if that costs at most NEW_TEXT_SHARE of the time between bursts. A level where drafting never won (a
loaded GPU) explores no more for new requests.

A busy machine (another process, a stalled host) slows both regimes, while only the running one is measured. So the
regime not running is priced at its measured ms times how far the running regime's ms per request has moved since
(common mode), and a steady step at most 1 / MS_RESET of its regime's average (the other work ended) starts that
average again. A simulated batch 8 with every step 6x slower for 300 steps then runs the faster regime for 94% or
more of the next 800 steps in each of 20 runs, as without the contention; before, some runs stayed in the slower
one for all of them.

The choice reads only past measurements (among them the survivals of drafts already verified) and the load, never a
draft it decides about, so verification stays lossless. See
docs/scheduling.md, "Whether to draft at all".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BURST = 3  # steps of the other regime per exploration: the first switches, the next are steady
FIRST_PERIOD, MAX_PERIOD = 2, 4096
EXPLORE_SHARE = 0.01  # once both rates are known: the most a burst of the slower regime may cost of the time between
MARGIN = 0.03
DECAY = 0.8  # ms per step: weight of the previous average per new steady step
MS_OUTLIER = 1.5  # a steady step's ms counts as at most this many times its regime's average (from the third step)
MS_RESET = 2.0  # a steady step this many times faster than its regime's average replaces it
# tokens per step: a longer memory. A drafting step's tokens swing from 1 to k + 1 and come in runs (a stretch of
# numbers or names rejects every draft for several steps), so a short average of them dips below plain's rate inside
# any hard stretch: at batch 1 on CPU, DSpark that makes ~2x plain's rate went plain after runs of 5-7 one-token steps
# and came back only in rare bursts (58-69 against 80-88 tok/s). ~30 steps span such runs; a step's cost, steadier and
# what load changes, keeps the short average.
TOKENS_DECAY = 0.97
BURST_MEMORY = 4  # an exploration burst's steady steps weigh as the 5th and later steps of a fresh average
# Drafting steps with expectations (the survivals of the drafts they verified): their expected accepted drafts, averaged
# over a short memory, times the realised / expected ratio of every level's verified steps, averaged over a long one.
PREDICTED_DECAY = 0.8
RATIO_DECAY = 0.995
# The ratio's prior: 1 (the drafter's confidences are calibrated), weighing as this many expected accepted drafts, each
# as uncertain as a fair coin
RATIO_PRIOR = 8.0
# A drafting burst for new text (choose's arrivals) may cost up to this share of the time between bursts (the spacing
# allows EXPLORE_SHARE)
NEW_TEXT_SHARE = 0.02


@dataclass(frozen=True)
class Verdict:
    """The cost model's answer to "does drafting pay at this load", with its predictions where the model measured
    speculative steps at this load or a lower one (None: the profile's guess, or a cost measured at higher loads)."""

    draft: bool
    rate: dict[bool, float] | None = None  # drafting? -> predicted tokens/ms
    ms: dict[bool, float] | None = None  # drafting? -> predicted ms per step


@dataclass
class _Level:
    rate: dict[bool, float] = field(default_factory=dict)  # drafting? -> tokens/ms (tokens / ms, averaged apart)
    ms: dict[bool, float] = field(default_factory=dict)  # drafting? -> ms per steady step
    tokens: dict[bool, float] = field(default_factory=dict)  # drafting? -> tokens per steady step
    square: dict[bool, float] = field(default_factory=dict)  # drafting? -> tokens^2 per steady step (its spread)
    count: dict[bool, int] = field(default_factory=dict)  # drafting? -> steady steps measured (capped by bursts)
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # drafting? -> steady steps ever
    # steady drafting steps with expectations: tokens besides the accepted drafts, and the expected accepted drafts
    unaccepted: float = 0.0
    expected: float = 0.0
    expected_long: float = 0.0  # the same over TOKENS_DECAY's memory: what the level's prompts expect on the whole
    num_expected: int = 0  # capped at a burst's start (both averages): the burst's steps weigh more
    drafted_at: int | None = None  # the engine's arrivals count when this level last drafted
    drafting_won: bool = False  # measured drafting beat plain here once by MARGIN: other text may make it pay again
    since: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # steps since each regime last ran
    period: int = FIRST_PERIOD
    burst: int = 0  # steps left in an exploration burst
    burst_regime: bool = False
    predicted: Verdict | None = None  # the model's last plain verdict with predictions, while nothing is measured
    current: bool | None = None  # the regime this level last chose outside a burst
    load: dict[bool, float] = field(default_factory=dict)  # drafting? -> requests a steady step (averaged as ms)
    # drafting? -> the other regime's ms per request when this one's ms was last measured: the regime not running is
    # priced at its measured ms times how far the running one's cost per request moved since (_effective)
    ref_cost: dict[bool, float] = field(default_factory=dict)


class RegimeChooser:
    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.num_explorations = 0
        self._current: bool | None = None  # the regime last chosen outside a burst
        self.num_chosen: dict[int, dict[str, int]] = {}  # level -> {"spec": steps that drafted, "plain": ...}
        # A diagnostic, not a policy: when set, every choice is this regime and nothing is explored (bench sweep's
        # adaptive:plain arm prices an adaptive engine's plain steps, the drafter's context kept, beside no-spec's)
        self.held: bool | None = None
        # A diagnostic: when False, expectations are ignored and drafting's tokens are the realised average alone
        # (benchmarks/drafter/shift_probe.py's A/B of the two estimates)
        self.expectations = True
        # A diagnostic: when False, choose() ignores arrivals (no drafting burst for new requests)
        self.new_text = True
        # realised / expected accepted drafts of verified steps at every level, averaged with RATIO_DECAY: weight,
        # squared weight, then the weighted sums of accepted, expected, accepted^2, accepted x expected, expected^2
        self._ratio = [0.0] * 7
        self.num_ratio_steps = 0

    @staticmethod
    def level(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()

    def choose(
        self,
        num_requests: int,
        model_says_draft: bool | Verdict | Callable[[], bool | Verdict],
        arrivals: int | None = None,
    ) -> bool:
        """model_says_draft: the cost model's answer, or a function computing it, asked only when the measured rates
        leave the choice to it (none measured yet and no neighbour's verdict): at high load its tensor ops cost more
        than a plain step, so a function keeps them off steps the measurements already decide.

        arrivals: how many requests the engine has taken in so far. A level running plain explores drafting as soon as
        a whole batch of new requests came since it last drafted (NEW_TEXT_SHARE bounds what that may cost): its
        drafting rate was measured on other text."""
        if self.held is not None:
            return self.held
        level = self.level(num_requests)
        lv = self.levels.setdefault(level, _Level())

        def ask() -> bool:
            answer = model_says_draft() if callable(model_says_draft) else model_says_draft
            verdict = answer if isinstance(answer, Verdict) else Verdict(bool(answer))
            lv.predicted = verdict if not verdict.draft and verdict.rate is not None else None
            return verdict.draft

        if lv.burst:
            lv.burst -= 1
            choice = lv.burst_regime
        else:
            rate = self._effective(lv)[0]
            measured = len(rate) == 2
            if measured:
                rate = {True: rate[True], False: self._plain_floor(level, rate[False])}
                spec, plain = rate[True], rate[False]
                if spec > plain * (1 + MARGIN) or plain > spec * (1 + MARGIN):
                    choice = spec > plain
                    lv.drafting_won |= choice  # by the margin: not a near tie, and not the model's lean to drafting
                else:  # a near tie: stay (hysteresis), the model only when nothing was chosen yet
                    choice = self._current if self._current is not None else ask()
            else:
                found = self._neighbour(level)
                if found is None:
                    choice = ask()
                else:
                    choice, lv.predicted = found[0], None
            self._current = choice
            if measured and lv.current is not None and choice != lv.current:
                # the measurements turned: the regime left is revisited soon again (the gaps doubled while it ruled
                # would otherwise keep a turn made by noise for thousands of steps)
                lv.period = FIRST_PERIOD
                # the regime taken up is measured from its price now; the one left was last measured at that price
                self._rebase(lv, choice)
                if choice in lv.ms:
                    lv.ref_cost[not choice] = self._cost(lv, choice)
            if measured:
                lv.current = choice
            other = not choice
            spacing = self._spacing(lv, rate)
            own = max(lv.period, spacing)
            due = lv.since[other] >= max(own, self._inherited_gap(lv, num_requests))
            if not self.new_text:
                arrivals = None
            if not due and other and arrivals is not None and lv.drafted_at is not None and lv.drafting_won:
                # new text: drafting's rate is stale, the plain one is not (it does not depend on the text). The spacing
                # makes a burst cost EXPLORE_SHARE of the gap: this one may cost NEW_TEXT_SHARE
                new_text = arrivals - lv.drafted_at >= num_requests
                due = new_text and lv.since[True] * NEW_TEXT_SHARE >= spacing * EXPLORE_SHARE
            if due:
                lv.burst, lv.burst_regime = BURST - 1, other
                # A burst's few steps must be able to move the long tokens average of a regime not run for long: a
                # drafter measured during a long hard stretch would otherwise need dozens of bursts to come back
                if other in lv.count:
                    lv.count[other] = min(lv.count[other], BURST_MEMORY)
                # Expectations have little of that noise: a burst's first steady step weighs as the second of a fresh
                # average, so that text that turned easy while the level ran plain shows within the burst
                if other:
                    lv.num_expected = min(lv.num_expected, 1)
                # NOTE: doubled from the gap just waited, not from the period: once the spacing exceeds the period,
                # doubling a small period would keep the bursts at the spacing for several more rounds. A neighbour's
                # gap only delays a level's first burst: after it the level has measured rates of its own.
                lv.period = min(2 * own, MAX_PERIOD)
                self.num_explorations += 1
                choice = other
        lv.since[choice] = 0
        lv.since[not choice] += 1
        if choice and arrivals is not None:
            lv.drafted_at = arrivals
        counts = self.num_chosen.setdefault(level, {"spec": 0, "plain": 0})
        counts["spec" if choice else "plain"] += 1
        return choice

    def _effective(self, lv: _Level) -> tuple[dict[bool, float], dict[bool, float]]:
        """The level's (rate, ms) of each regime, the one not running priced as of now: its measured ms scaled by how
        far the running regime's ms per request moved since (ref_cost). What slows the machine (another process,
        a stalled host) slows both. Priced as last measured instead, a plain level that another process held for a
        minute (plain steps at 103-147 ms against ~20, on CPU) then drafted at 0.71-0.76x of plain: its plain price
        was the contended one, and plain ran again only in rare bursts. A change in the other regime's own cost is
        found at its next burst."""
        rate, ms = dict(lv.rate), dict(lv.ms)
        current = lv.current
        if current is None or current not in lv.ms:
            return rate, ms
        other = not current
        ref = lv.ref_cost.get(other)
        if other in ms and ref:
            drift = self._cost(lv, current) / ref
            ms[other] *= drift
            rate[other] /= drift
        return rate, ms

    @staticmethod
    def _cost(lv: _Level, regime: bool) -> float:
        """A regime's ms per request a step: what load within the level (its requests come and go) moves less than a
        step's ms, and a busy machine moves as much."""
        return lv.ms[regime] / max(lv.load[regime], 1.0)

    def _rebase(self, lv: _Level, regime: bool) -> None:
        """Store the regime's ms (and rate) as _effective prices them now, before it is measured again."""
        ms = self._effective(lv)[1]
        if regime in ms and lv.ms[regime] > 0:
            drift = ms[regime] / lv.ms[regime]
            lv.ms[regime] *= drift
            lv.rate[regime] /= drift

    def _plain_floor(self, level: int, rate: float | None = None) -> float:
        """The level's plain rate, but never below the plain rate one level down: more requests a plain step do not
        make fewer tokens a millisecond, and a regime a level no longer runs is re-measured only in rare bursts.
        Only the plain rate, and only from the next level down: drafting's rate moves with acceptance (temperature,
        prompts), so a lower load's could keep a level drafting at a loss that no measurement there would undo; a
        floored plain rate errs at worst to plain steps, no-spec's speed. Without the floor, one level's plain rate read
        far too low keeps that level drafting for good, since it rarely runs plain steps to correct it."""
        rate = self.levels[level].rate[False] if rate is None else rate
        below = self.levels.get(level - 1)
        return max(rate, below.rate[False]) if below is not None and False in below.rate else rate

    def _neighbour(self, level: int) -> tuple[bool, _Level] | None:
        """For a level not measured yet: plain if a lower load measured plain clearly faster, drafting if a higher load
        measured drafting clearly faster (verification only gets dearer with load), with that neighbour; else None
        (ask the model). A level then starts with the regime its neighbour measured instead of the model's first
        choice, which leans to drafting."""
        for other in sorted(self.levels, key=lambda lvl: abs(lvl - level)):
            rate = self.levels[other].rate
            if other == level or len(rate) < 2:
                continue
            if other < level and rate[False] > rate[True] * (1 + MARGIN):
                return False, self.levels[other]
            if other > level and rate[True] > rate[False] * (1 + MARGIN):
                return True, self.levels[other]
        return None

    def _inherited_gap(self, lv: _Level, num_requests: int) -> int:
        """A level that follows its neighbour's verdict (not measured itself yet) explores no sooner than that neighbour
        would next explore (its spacing, or its period if longer): the verdict transfers, and so does the trust its
        bursts earned. The period counts too, not only the spacing: drafting gets dearer with load, so a burst at the
        new level costs more than the neighbour's spacing allowed for."""
        if len(lv.rate) == 2:
            return 0
        found = self._neighbour(self.level(num_requests))
        return 0 if found is None else max(self._spacing(found[1]), found[1].period)

    def _spacing(self, lv: _Level, rate: dict[bool, float] | None = None) -> int:
        """Steps of the faster regime between bursts so that a burst costs at most EXPLORE_SHARE of the time between
        them: a burst lasts BURST * slow_ms, and each of its milliseconds makes slow / fast of the faster regime's
        tokens. From the measured rates once both are known (rate: the ones the choice used, a floored plain rate with
        its step time scaled to match), the slower one taken optimistically (_optimism), and 0 (the period alone) where
        that reaches the faster; before that from the model's predictions where its plain verdict has them (Verdict),
        as they are; else 0."""
        own_rate, ms = self._effective(lv)
        floored = rate is not None and len(rate) == 2 and len(ms) == 2 and own_rate[False] > 0
        if floored and rate[False] != own_rate[False]:
            ms = {True: ms[True], False: ms[False] * own_rate[False] / rate[False]}  # the same tokens a step, faster
        rate = own_rate if rate is None else rate
        measured = len(rate) == 2 and len(ms) == 2
        if not measured:
            p = lv.predicted
            if p is None or p.rate is None or p.ms is None:
                return 0
            rate, ms = p.rate, p.ms
        if min(rate.values()) <= 0:
            return 0
        fast = max(rate, key=lambda regime: rate[regime])
        slow = not fast
        slow_rate = rate[slow] * self._optimism(lv, slow) if measured else rate[slow]
        if slow_rate >= rate[fast]:
            return 0  # the slower rate may be noise: the doubling period alone spaces the bursts
        lost_ms = BURST * ms[slow] * (1.0 - slow_rate / rate[fast])
        return min(int(lost_ms / (EXPLORE_SHARE * max(ms[fast], 1e-6))), MAX_PERIOD)

    def _optimism(self, lv: _Level, regime: bool) -> float:
        """About 1 + two standard errors of the regime's tokens per step, relative: a drafting rate measured from a few
        steps (whose tokens swing from 1 to k + 1 a request) could be much higher, and a gap spaced by its mean kept a
        drafter that pays off for hundreds of steps when its first steps hit a hard stretch (3 runs in 20 of a
        simulated batch 8 where drafting pays 1.15x). A heuristic, not an exact error: the spread is the population
        one (none after one step, or after steps that all made the same tokens), the sample size counts every step
        ever measured (a burst's steps weigh more), and it stays near 1 + spread / (4 x mean) once many are. Plain
        steps make a token a request: their spread is only the level's range of loads. Drafting estimated from
        expectations (_tokens): the ratio two standard errors up, times the larger of the short and the long average
        of the expectations (a drafter whose confidences dipped for a few steps of hard text is revisited soon)."""
        known = self.expectation_ratio() if regime and lv.num_expected else None
        if known is not None:
            tokens = self._tokens(lv, regime)
            expected = max(lv.expected, lv.expected_long)
            return (lv.unaccepted + (known[0] + 2.0 * known[1]) * expected) / tokens if tokens > 0 else 1.0
        mean = lv.tokens[regime]
        spread = max(lv.square[regime] - mean * mean, 0.0) ** 0.5
        samples = min(lv.seen[regime], (1 + TOKENS_DECAY) / (1 - TOKENS_DECAY))  # an average's effective size
        return 1.0 + 2.0 * spread / (mean * samples**0.5) if mean > 0 and samples else 1.0

    def observe(
        self,
        num_requests: int,
        verified_drafts: bool,
        drafted: bool,
        tokens: int,
        ms: float,
        expected: tuple[float, int] | None = None,
    ) -> None:
        """One finished step: it counts for a regime only if steady (verified drafts and drafted again, or neither).
        expected: for a step that verified drafts, their expected accepted count (the sum of their survivals) and how
        many were accepted: a steady drafting step's feeds its level's estimate of drafting's tokens per step
        (_tokens). The ratio learns from every verified step, timed or not (learn_ratio, from the planner)."""
        if not self.expectations:
            expected = None
        if verified_drafts != drafted or ms <= 0:
            return
        lv = self.levels.setdefault(self.level(num_requests), _Level())
        if lv.current is not None and drafted != lv.current:
            self._rebase(
                lv, drafted
            )  # a burst's step: blended into its regime's ms as priced now, not as last measured
        n = lv.count[drafted] = lv.count.get(drafted, 0) + 1
        if n > 2:
            # one stalled step (a pause of the process, a neighbour's burst) weighs as at most MS_OUTLIER x the average:
            # taken whole, a 30x one turned a level whose drafting paid 1.15x plain for good (its next burst came
            # hundreds of steps later, spaced by the rate that step made); clipped at 3x or 2x, it still turned some.
            # A step cost that really grew is followed at 1.1x a step (twice as dear within 7 steps), or, in a regime
            # revisited only in bursts (whose steps weigh 1/5 and 1/6), at about 1.2x a burst: such a regime can look
            # cheaper than it now is for a few bursts, and turns are revisited within the doubling period.
            ms = min(ms, MS_OUTLIER * lv.ms[drafted])
        # the plain mean of the first steps, then exponential: no first step weighs more than the ones after it
        w_ms, w_tokens = max(1 - DECAY, 1 / n), max(1 - TOKENS_DECAY, 1 / n)
        if n > 1 and ms * MS_RESET < lv.ms[drafted]:
            # nothing makes a step much faster than its cost, while a busy machine slows every step: a step at a
            # fraction of its regime's average (other work ended) starts the average again. Steps of one regime
            # differ less than that (a drafting step's verified drafts move its cost by less than 2x)
            w_ms = 1.0
        lv.ms[drafted] = (1 - w_ms) * lv.ms.get(drafted, 0.0) + w_ms * ms
        lv.load[drafted] = (1 - w_ms) * lv.load.get(drafted, 0.0) + w_ms * num_requests
        lv.tokens[drafted] = (1 - w_tokens) * lv.tokens.get(drafted, 0.0) + w_tokens * tokens
        lv.square[drafted] = (1 - w_tokens) * lv.square.get(drafted, 0.0) + w_tokens * tokens * tokens
        lv.seen[drafted] += 1
        if drafted and expected is not None:
            lv.num_expected += 1
            w = max(1 - PREDICTED_DECAY, 1 / lv.num_expected)
            lv.unaccepted = (1 - w) * lv.unaccepted + w * (tokens - expected[1])
            lv.expected = (1 - w) * lv.expected + w * expected[0]
            w_long = max(1 - TOKENS_DECAY, 1 / lv.num_expected)
            lv.expected_long = (1 - w_long) * lv.expected_long + w_long * expected[0]
        # NOTE: computed here, with the ratio as it is now; a level that runs plain keeps this rate until its next
        # drafting burst, whatever the ratio learns meanwhile elsewhere. Recomputed at every choice instead, it did
        # no better in simulation (an under-confident drafter at batch 8 lost one run of 20 for good)
        lv.rate[drafted] = self._tokens(lv, drafted) / lv.ms[drafted]
        if (not drafted) in lv.ms:
            lv.ref_cost[drafted] = self._cost(lv, not drafted)

    def learn_ratio(self, expected: float, accepted: int) -> None:
        """A verified step's expected and accepted drafts (planner.record), for the realised / expected ratio."""
        if not self.expectations:
            return
        d = RATIO_DECAY
        w, w2, a, e, aa, ae, ee = self._ratio
        self._ratio = [
            d * w + 1,
            d * d * w2 + 1,
            d * a + accepted,
            d * e + expected,
            d * aa + accepted * accepted,
            d * ae + accepted * expected,
            d * ee + expected * expected,
        ]
        self.num_ratio_steps += 1

    def expectation_ratio(self) -> tuple[float, float] | None:
        """The realised / expected ratio of accepted drafts and its standard error (a ratio estimator's, with the
        weights' effective sample size, and the prior's share); None before any verified step with expectations."""
        w, w2, a, e, aa, ae, ee = self._ratio
        if not self.num_ratio_steps:
            return None
        m = RATIO_PRIOR
        r = (a + m) / (e + m)
        residual = max(aa - 2 * r * ae + r * r * ee, 0.0)  # sum of w (accepted - r expected)^2
        return r, (residual * w2 / w + 0.25 * m) ** 0.5 / (e + m)

    def _tokens(self, lv: _Level, regime: bool) -> float:
        """A regime's tokens per steady step at a level. Drafting's, where the level has drafting steps with
        expectations: what they made besides accepted drafts plus their expected accepted drafts, both over a
        short memory, scaled by the ratio. An expectation has none of the acceptance's step-to-step noise, so the short
        memory follows what the prompts are now (a change of workload shows within a few steps, the level's realised
        tokens need ~30), and the ratio, pooled over every level and a long memory, corrects the survivals' calibration.
        Else the average of the tokens made (TOKENS_DECAY)."""
        known = self.expectation_ratio() if regime and lv.num_expected else None
        if known is None:
            return lv.tokens[regime]
        return lv.unaccepted + known[0] * lv.expected

    def rates(self) -> dict[int, dict[str, float]]:
        return {lvl: {("spec" if k else "plain"): v for k, v in lv.rate.items()} for lvl, lv in self.levels.items()}
