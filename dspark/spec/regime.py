"""Whether to speculate at all, checked against measurement: the drafting and the plain regime's tokens per
millisecond, learned online per load level.

The cost model predicts a step from profiled dummy steps; a real step also pays what the profile cannot see (per-request
host work that differs between verifying and plain sampling, real contexts, other processes). Where the model says
drafting pays but plain steps are in fact faster (or the reverse), the engine should follow the measurement. Each
load level (requests emitting a token, in powers of two) keeps an exponential average of tokens/ms for steady steps of
each regime: "spec" steps verified drafts and drafted again, "plain" steps did neither (a step that switches regime is
neither). Once both are known the faster wins (a 3% margin keeps the model's choice on a near tie); until then, and
between measurements, the model decides. Every so often the other regime runs for a short burst to keep its figure
fresh, at first soon and then more rarely (8 steps doubling to 256), so a level costs a few steps of the slower
regime to learn.

The choice reads only past measurements and the load, never a draft, so verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BURST = 3  # steps of the other regime per exploration: the first switches, the next are steady
FIRST_PERIOD, MAX_PERIOD = 8, 256
MARGIN = 0.03
DECAY = 0.8  # weight of the previous average per new steady step


@dataclass
class _Level:
    rate: dict[bool, float] = field(default_factory=dict)  # drafting? -> tokens/ms
    since: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # steps since each regime last ran
    period: int = FIRST_PERIOD
    burst: int = 0  # steps left in an exploration burst
    burst_regime: bool = False


class RegimeChooser:
    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.num_explorations = 0

    @staticmethod
    def level(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()

    def choose(self, num_requests: int, model_says_draft: bool) -> bool:
        lv = self.levels.setdefault(self.level(num_requests), _Level())
        if lv.burst:
            lv.burst -= 1
            choice = lv.burst_regime
        else:
            if len(lv.rate) == 2:
                spec, plain = lv.rate[True], lv.rate[False]
                choice = spec > plain * (1 + MARGIN) or (model_says_draft and spec * (1 + MARGIN) >= plain)
            else:
                choice = model_says_draft
            other = not choice
            if lv.since[other] >= lv.period:
                lv.burst, lv.burst_regime = BURST - 1, other
                lv.period = min(2 * lv.period, MAX_PERIOD)
                self.num_explorations += 1
                choice = other
        lv.since[choice] = 0
        lv.since[not choice] += 1
        return choice

    def observe(self, num_requests: int, verified_drafts: bool, drafted: bool, tokens: int, ms: float) -> None:
        """One finished step: it counts for a regime only if steady (verified drafts and drafted again, or neither)."""
        if verified_drafts != drafted or ms <= 0:
            return
        lv = self.levels.setdefault(self.level(num_requests), _Level())
        rate = tokens / ms
        lv.rate[drafted] = rate if drafted not in lv.rate else DECAY * lv.rate[drafted] + (1 - DECAY) * rate

    def rates(self) -> dict[int, dict[str, float]]:
        return {lvl: {("spec" if k else "plain"): v for k, v in lv.rate.items()} for lvl, lv in self.levels.items()}
