"""The engine's side of confidence-scheduled verification: per-request confidence state, the step's verify counts,
and the online record of how well the confidences predicted what verification then accepted.

Each step:
1. `observe` (after drafting): confidences (the drafter's, calibrated; or, for a drafter without them, the online
   conditional acceptance rate of each position within its stratum, e.g. the n-gram match length) are smoothed per
   request and position (EMA), turned into live survivals, and copied to the host asynchronously. The copy lands in
   a queue that `plan` reads only once a newer copy exists, so the budget always comes from survivals one or two
   steps old and never waits for the device.
2. `plan` (after scheduling): async mode picks B* on the host from the stale survivals (choose_budget) and allocates
   the live ones (allocate); sync mode runs Algorithm 1 on the live ones. The scheduled drafts are cut to the counts.
   In async mode the engine asks for B* earlier, while the drafting pass runs on the device (`prepare`), and plan
   uses that answer when the step is the one it was asked for.
3. `record` (after verifying): per-position outcomes feed the conditional acceptance rates, the calibration monitor
   (predicted vs realised accepted drafts, ECE of the survivals of verified slots) and the trace.

Losslessness (DESIGN.md section 4): a draft's confidence depends only on the drafts before it (the DSpark head reads
the previous token; the n-gram strata are fixed before drafting and the drafts are deterministic), the budget is
fixed before the live values are seen (async) or grows only while the rate improves (sync), and allocation breaks
ties by position, so whether a draft is verified never depends on its own value.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.core.scheduler import SchedulerOutput
from dspark.speculative.budget import allocate, choose_budget, choose_budget_sync, drafting_verdict
from dspark.speculative.calibration import CalibrationMonitor
from dspark.speculative.cost_model import CostModel, RefinedCostModel
from dspark.speculative.regime import RegimeChooser, Verdict
from dspark.utils.transfer import download, upload, upload_tensor

MIN_CONFIDENCE = 1e-4  # a held draft keeps a positive survival: 0 means "no draft here" to allocate
PAYS_REUSE = 8  # steps a "does drafting pay" answer is reused for at the same number of requests
# ... and a plain answer priced with measured drafting costs (regime.Verdict with predictions): the level it is asked
# for follows it without exploring for many steps. One verdict took ~0.2 ms at R = 256 on the 2-vCPU machine (cProfile
# of benchmarks/host_step.py --spec --model-verdict: 109 calls, 22.6 ms), ~0.03 ms a plain step when recomputed every 8.
PREDICTED_PLAIN_REUSE = 64
# CUDA: a plain step is timed only every few steps, except just after steps with drafts (a regime burst's plain steps
# must be measured). Its two timing events, their query and the bookkeeping took 0.07 ms of a 1.9 ms plain step at
# C = 16 on the H200 (benchmarks/gpu/step_profile.py: step_started 0.02, step_finished 0.05).
PLAIN_TIMING_EVERY = 4
TIMED_AFTER_DRAFTS = 4  # plain steps after a step with drafts that are always timed (at least a burst's length)


@dataclass
class _Copy:
    """An asynchronous device-to-host copy of one step's survivals."""

    slots: list[int]  # the requests' rows in the planner's tables when the copy was made
    host: torch.Tensor  # [R, 2K]: the survivals, then the raw confidences (what record() reads)
    event: torch.cuda.Event | None  # None: the copy was synchronous (CPU)
    generations: np.ndarray  # [R] int64: each row's generation when the copy was made (a row released since moved on)


ENDING_MIN_SHARE = 0.2  # a step whose measured time is ending work beyond this share is not a measurement


def without_ending(measured_ms: float, ending_ms: float, shortened_ms: float = 0.0) -> float | None:
    """A step's measured time less the host time it spent ending requests, which every regime pays once per request,
    plus what the previous step's ending work took off this step's wait (async scheduling: the device ran this step
    while the host ended those requests). None where ending work was nearly all of the step: what is left is noise.

    Both ways of timing a step hold its ending work serially: a continued step's interval runs from the end of the
    previous step's processing to the end of this one's; an event pair spans the host's processing, during which the
    device has nothing queued (its next launch comes after)."""
    if not ending_ms and not shortened_ms:
        return measured_ms
    rest = measured_ms - ending_ms
    return rest + shortened_ms if rest >= ENDING_MIN_SHARE * measured_ms else None


@dataclass
class _Timed:
    num_requests: int
    base_ms: float  # the profiled curves' prediction
    refined_ms: float  # with the online overhead term
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    verified_drafts: bool
    drafted: bool
    num_emitted: int
    decode_only: bool  # every request fed one token besides its drafts (no prompt chunk)
    ending_ms: float = 0.0  # host time the step spent ending requests: taken out of its measured time


@dataclass
class StepTiming:
    """Predicted vs measured step times, for the profiled curves and for the online-refined ones. On CUDA the
    measurement is a pair of events, read back only once the later one has completed (never a sync)."""

    pending: deque[_Timed] = field(default_factory=deque)
    num_steps: int = 0
    sum_error: list[float] = field(default_factory=lambda: [0.0] * 4)  # floats: a tensor op per step costs more

    def harvest(self, cost: RefinedCostModel, regime: RegimeChooser) -> None:
        while self.pending:
            t = self.pending[0]
            if isinstance(t.end, torch.cuda.Event):
                if not t.end.query():
                    return
                assert isinstance(t.start, torch.cuda.Event)
                measured = t.start.elapsed_time(t.end)
            else:
                measured = (t.end - float(t.start)) * 1e3
            self.pending.popleft()
            kept = without_ending(measured, t.ending_ms)
            if kept is None:
                continue
            measured = kept
            base = (t.base_ms - measured) / max(measured, 1e-6)
            refined = (t.refined_ms - measured) / max(measured, 1e-6)
            self.num_steps += 1
            self.sum_error = [
                a + b for a, b in zip(self.sum_error, (base, abs(base), refined, abs(refined)), strict=True)
            ]
            # NOTE: the speculative residual learns from steps that drafted (after verifying or not): a step that only
            # verified, leaving a drafting run, has no drafting pass, and averaged in it made the next level's drafting
            # look cheap again. Such steps teach neither residual.
            if t.drafted or not t.verified_drafts:
                cost.observe(t.num_requests, t.base_ms, measured, speculative=t.drafted)
            # NOTE: a step with a prompt chunk says nothing about either regime's decode rate. Counted as a plain step,
            # a level's first step (its requests' prefill: 16 tokens in ~15 ms at C = 16 on the H200) made plain
            # decoding look slower than drafting, and the level then drafted for most of a sweep row.
            if t.decode_only:
                regime.observe(t.num_requests, t.verified_drafts, t.drafted, t.num_emitted, measured)

    def mean_errors(self) -> list[float]:
        """Mean relative error (predicted - measured) / measured: profiled, |profiled|, refined, |refined|."""
        return [e / self.num_steps for e in self.sum_error] if self.num_steps else [0.0] * 4


def _counts_without_live_values(caps: list[int], budget: int) -> list[int] | None:
    """The allocation where it cannot depend on the live survivals: nothing verified, everything verified, or one
    request (survivals never rise along a block and ties go to the earlier slot, so its top slots are its first
    ones). None otherwise. NOTE: at C = 1 on the H200 the allocation's kernel, copies and wait were 0.9 ms of a
    5.2 ms adaptive drafting step (benchmarks/gpu/step_profile.py)."""
    if budget <= 0:
        return [0] * len(caps)
    if len(caps) == 1 or budget >= sum(caps):
        return [min(c, budget) for c in caps]
    return None


class VerificationPlanner:
    def __init__(
        self,
        num_spec_tokens: int,
        mode: str,  # "fixed" (verify every draft), "async" or "sync"
        ema_alpha: float,
        cost: CostModel | None,
        device: torch.device,
        num_strata: int = 1,
    ) -> None:
        assert mode == "fixed" or cost is not None, "adaptive verification needs a cost model"
        self.k = num_spec_tokens
        self.mode = mode
        self.alpha = ema_alpha
        self.cost = RefinedCostModel(cost) if cost is not None else None
        if self.adaptive and device.type == "cuda":  # compile the allocation kernel now, not in the first busy step
            allocate(torch.ones(2, num_spec_tokens, device=device), 1, torch.ones(2, dtype=torch.int64, device=device))
        self.device = device
        # Per-request state lives in rows of persistent tables, so that a step's bookkeeping is a few gathers and
        # scatters over all its requests: with a tensor per request a drafting step's bookkeeping took 8.9 ms at
        # R = 256, now 1.6 ms (benchmarks/planner_host.py, CPU).
        self._slot: dict[str, int] = {}  # request id -> its row
        self._free: list[int] = []
        self._smoothed = torch.zeros(0, num_spec_tokens, device=device)  # [N, K] smoothed confidences
        self._live = torch.zeros(0, num_spec_tokens, device=device)  # [N, K] survivals of the pending drafts
        self._stale = torch.zeros(0, num_spec_tokens, dtype=torch.float64)  # [N, K] host survivals, a step or two old
        self._has_stale = torch.zeros(0, dtype=torch.bool)  # [N] host: the row of _stale is known
        self._history: set[str] = set()  # requests with a smoothed row (the EMA has a previous value)
        self._pending: set[str] = set()  # requests with live drafts not yet verified or dropped
        self._stratum: dict[str, int] = {}
        self._copies: deque[_Copy] = deque()
        # request id -> (the copy of its pending drafts' survivals and confidences, its row there): what record() reads
        # on the host, with no copy or device op of its own (on the H200 its gathers, copy and wait took 0.54 ms of a
        # fixed-7 step at C = 1 in session 3, and record() 0.12-0.15 ms with this: benchmarks/gpu/step_profile.py)
        self._published: dict[str, tuple[_Copy, int]] = {}
        self._generation = np.zeros(0, dtype=np.int64)  # [N] times each row was released
        self._prior = 0.5 ** torch.arange(1, num_spec_tokens + 1, dtype=torch.float64)  # before any survival is seen
        # Conditional acceptance per stratum and position: reached (every earlier draft accepted) and accepted counts.
        self.reached = torch.zeros(num_strata, num_spec_tokens, dtype=torch.float64)
        self.accepted = torch.zeros(num_strata, num_spec_tokens, dtype=torch.float64)
        self.calibration = CalibrationMonitor()
        self.timing = StepTiming()
        self.regime = RegimeChooser()
        self.num_planned_steps = 0
        self.num_steps_without_drafting = 0  # steps where drafting would not have paid (high load)
        self.sum_budget = 0
        self.plan_ms_total = 0.0  # wall time of plan() over planned steps: the budget choice and the allocation
        self.verify_len_hist = [0] * (num_spec_tokens + 1)  # requests that verified l drafts in a step, l = 0..K
        self._shape: tuple[int, int] | None = None  # this step's (requests that sample, tokens), once planned
        self._verified_drafts = False
        self._decode_only = False
        self._step_start: float | torch.cuda.Event | None = None
        self.plain_timing_every = PLAIN_TIMING_EVERY if device.type == "cuda" else 1
        self._since_drafts = TIMED_AFTER_DRAFTS + 1  # steps since one with drafts to verify
        self._since_timed = 0
        # num requests -> (answer, steps it may still be reused, the cost model's surprises when it was computed)
        self._pays_cache: dict[int, tuple[Verdict, int, int]] = {}
        # prepare(): the step it expects (request ids, caps, requests sampling, other tokens) and the budget for it
        self._prepared: tuple[tuple[list[str], list[int], int, int], int] | None = None
        self.num_prepared_budgets = 0  # planned steps whose budget prepare() had chosen
        self._last_continued: float | None = None  # when the last continued step was collected, in a run of them
        # The last step's ending work and wait: its ending work may have taken some of the next continued step's wait
        # (None: unknown, so the next continued step is not measured).
        self._before: tuple[float, float] | None = (0.0, 0.0)

    @property
    def adaptive(self) -> bool:
        return self.mode != "fixed"

    # ---- 1. after drafting --------------------------------------------------------------------------------------

    def _rows(self, request_ids: list[str]) -> list[int]:
        """The requests' table rows; a request seen for the first time gets a free one (the tables grow by doubling)."""
        get = self._slot.get
        slots = [get(rid) for rid in request_ids]  # NOTE: the usual case, every request known: one cheap pass
        if None not in slots:
            return slots  # type: ignore[return-value]
        for i, rid in enumerate(request_ids):
            if slots[i] is None:
                if not self._free:
                    self._grow()
                slots[i] = self._slot[rid] = self._free.pop()
        return slots  # type: ignore[return-value]

    def _grow(self) -> None:
        n = self._live.shape[0]
        more = max(n, 16)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(more, *t.shape[1:])])

        self._smoothed, self._live = pad(self._smoothed), pad(self._live)
        self._stale, self._has_stale = pad(self._stale), pad(self._has_stale)
        self._generation = np.concatenate([self._generation, np.zeros(more, dtype=np.int64)])
        self._free.extend(range(n + more - 1, n - 1, -1))

    def observe(
        self,
        request_ids: list[str],
        num_drafts: list[int],
        confidences: torch.Tensor | None,  # [R, >=max drafts] calibrated, or None: the drafter has none
        strata: list[int] | None = None,  # per request, for drafters without confidences
    ) -> None:
        if not request_ids:
            return
        k = self.k
        slots = self._rows(request_ids)
        if confidences is None:
            rates = (self.accepted + 1.0) / (self.reached + 2.0)  # Beta(1, 1) prior: 0.5 before any outcome
            rows = torch.tensor(strata or [0] * len(request_ids), dtype=torch.int64).clamp_(0, rates.shape[0] - 1)
            current = upload_tensor(rates[rows].float(), self.device)
            if strata is not None:
                self._stratum.update(zip(request_ids, strata, strict=True))
        else:
            current = confidences[:, :k].float()
            if current.shape[1] < k:
                current = torch.cat([current, current.new_zeros(current.shape[0], k - current.shape[1])], dim=1)
        current = current.clamp(MIN_CONFIDENCE, 1.0)
        packed = upload(slots + num_drafts, torch.int64, current.device)  # one pinned copy, not two
        index = packed[: len(slots)]
        held = torch.arange(k, device=current.device)[None, :] < packed[len(slots) :, None]
        # NOTE: learned rates are already averages over many blocks: smoothing them again only mixes in a stale
        # stratum (measured: alpha 0 predicts n-gram acceptance best at every batch size, README).
        has = [rid in self._history for rid in request_ids]
        if confidences is not None and self.alpha > 0 and any(has):
            prev = self._smoothed[index]
            mixed = self.alpha * prev + (1.0 - self.alpha) * current
            smoothed = (
                mixed if all(has) else torch.where(upload(has, torch.bool, current.device)[:, None], mixed, current)
            )
        else:
            smoothed = current
        live = torch.where(held, torch.cumprod(smoothed, dim=1), 0.0)
        self._smoothed[index] = smoothed
        self._live[index] = live
        self._history.update(request_ids)
        self._pending.update(request_ids)
        copy = self._publish(slots, torch.cat([live, current], dim=1))
        for i, rid in enumerate(request_ids):
            self._published[rid] = (copy, i)

    def _publish(self, slots: list[int], both: torch.Tensor) -> _Copy:
        if not self.adaptive:
            # NOTE: nothing harvests the copies in fixed mode (there is no budget to choose); they used to pile up,
            # [R, 2K] of pinned memory a step, for as long as the engine ran. record() keeps its own references.
            self._copies.clear()
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            copy = _Copy(slots, host, event, self._generation[slots])
        else:
            copy = _Copy(slots, both.clone(), None, self._generation[slots])
        self._copies.append(copy)
        return copy

    def _harvest(self, newest_too: bool = False) -> int:
        """Take in the copies older than the newest one (with newest_too, the newest as well) whose transfer has
        finished (never waits); how many were taken. Taking any voids a prepared budget."""
        # NOTE: host arrays in numpy (views of the tables' memory): with torch ops the harvests of a drafting step
        # took 0.43 ms at R = 1024 on the 2-vCPU machine, against 2.9 ms for all of plan() (benchmarks/planner_host.py).
        taken = 0
        keep = 0 if newest_too else 1
        while len(self._copies) > keep and (self._copies[0].event is None or self._copies[0].event.query()):
            copy = self._copies.popleft()
            taken += 1
            host = copy.host.numpy()[:, : self.k]
            # NOTE: a block without drafts (no n-gram match) says nothing about how good drafts would be; taken in,
            # its zeros would stop drafting for the request for good (no draft, no newer block to learn from).
            held = host[:, 0] > 0
            rows = np.asarray(copy.slots, dtype=np.int64)
            # A row released since the copy was made may belong to another request now (or to the same request id,
            # added again): its generation moved on.
            take = held & (self._generation[rows] == copy.generations)
            index = rows[take]
            self._stale.numpy()[index] = host[take]
            self._has_stale.numpy()[index] = True
            if held.any():  # requests without a stale row start from the recent mean
                self._prior = 0.9 * self._prior + 0.1 * torch.from_numpy(host[held]).double().mean(dim=0)
        if taken:
            self._prepared = None  # chosen from the rows as they were before
        return taken

    def _stale_rows(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), K] host float64: each row's stale survivals, or the prior where none is known yet."""
        index = np.asarray(slots, dtype=np.int64)
        known = self._has_stale.numpy()[index]
        return torch.from_numpy(np.where(known[:, None], self._stale.numpy()[index], self._prior.numpy()))

    def should_draft(self, request_ids: list[str]) -> bool:
        """Adaptive modes: whether drafting for these requests pays at all: the cost model's answer
        (scheduling.drafting_verdict, from their stale survivals and a decode step of them), checked against the
        measured tokens/ms of each regime at this load (speculative/regime.py)."""
        if not self.adaptive or not request_ids:
            return True
        assert self.cost is not None
        cost = self.cost
        self._harvest()
        # The last drafting step's time, when it has completed: the verdict after a level's first drafting step then
        # knows what that step cost (without this it was learned a step later, after one more drafting step).
        self.timing.harvest(cost, self.regime)
        n = len(request_ids)

        def model_says() -> Verdict:
            # NOTE: the cost model's answer moves slowly (stale survivals, the load); recomputed every few steps at a
            # load, it costs ~1% of a small step instead of ~30% (host tensor work on [R, K]). The regime asks only
            # when its measurements leave the choice open. A speculative step that the refined model mispredicted
            # (its first one, say) voids the cached answers: they priced drafting wrong.
            cached = self._pays_cache.get(n)
            if cached is None or cached[1] <= 0 or cached[2] != cost.num_surprises:
                verdict = drafting_verdict(self._stale_rows(self._rows(request_ids)), n, cost)
                # NOTE: the predictions count only where drafting's cost was measured at this load or a lower one
                # (else the profile's guess, or a cost measured at a higher load: a load that drops after a busy spell
                # would take the residual of its busy steps, and not explore drafting where it pays).
                # NOTE: a drafting verdict there is still adopted (the regime then explores plain steps in bursts
                # and measured rates decide). Session 7 tried plain instead, with drafting explored in bursts
                # (5516a56: a fresh H200 engine's first T = 1 row drafted 1-9 steps a round at C = 256, of 10-28 ms
                # against 2.7 ms plain ones). It was reverted untried on the GPU; see that session's results README.
                if not cost.measured_at_or_below(n):
                    verdict = Verdict(verdict.draft)
                reuse = PREDICTED_PLAIN_REUSE if verdict.rate is not None and not verdict.draft else PAYS_REUSE
                cached = (verdict, reuse, cost.num_surprises)
            self._pays_cache[n] = (cached[0], cached[1] - 1, cached[2])
            return cached[0]

        pays = self.regime.choose(n, model_says)
        self.num_steps_without_drafting += not pays
        return pays

    # ---- 2. after scheduling ------------------------------------------------------------------------------------

    def plan(self, sched: SchedulerOutput) -> None:
        """Cut each scheduled request's drafts to the number it verifies this step (adaptive modes)."""
        # NOTE: one pass over the requests here and one at the end: at R = 1024 each pass costs 40-100 us of host time,
        # on the critical path of a drafting step (the device is idle while the host plans).
        items, caps, ids = [], [], []
        num_sampling = 0
        for s in sched.scheduled:
            num_sampling += s.samples
            if s.spec_token_ids:
                items.append(s)
                caps.append(len(s.spec_token_ids))
                ids.append(s.request.request_id)
        num_tokens = sched.num_tokens  # a sum over the requests: computed once
        self._shape = (num_sampling, num_tokens) if self.adaptive else None
        self._verified_drafts = False
        num_other = num_tokens - sum(caps)
        self._decode_only = num_sampling == len(sched.scheduled) == num_other
        if not items:
            return
        hist = self.verify_len_hist
        if not self.adaptive:
            for c in caps:
                hist[c] += 1
            return
        assert self.cost is not None
        started = time.perf_counter()
        slots = self._rows(ids)
        if self.mode == "async":
            self._harvest()  # anything it takes voids the prepared budget
            prepared, self._prepared = self._prepared, None
            if prepared is not None and prepared[0] == (ids, caps, num_sampling, num_other):
                budget = prepared[1]  # chosen while the drafts were being drafted, from the same stale survivals
                self.num_prepared_budgets += 1
            else:
                budget = self._stale_budget(slots, caps, num_sampling, num_other)
            counts = _counts_without_live_values(caps, budget)
            if counts is None:
                cap = np.asarray(caps, dtype=np.int64)
                rows = upload_tensor(torch.from_numpy(np.asarray(slots, dtype=np.int64)), self.device)
                live = self._live[rows]
                counts = download(allocate(live, budget, upload_tensor(torch.from_numpy(cap), live.device)))[0]
        else:
            live = self._live[upload(slots, torch.int64, self.device)]
            cap_t = upload(caps, torch.int64, live.device)
            counts = download(choose_budget_sync(live, num_sampling, num_other, self.cost, cap_t))[0]
        for s, c, n in zip(items, caps, counts, strict=True):
            if n < c:
                s.num_new_tokens -= c - n
                s.spec_token_ids = s.spec_token_ids[:n]
            hist[n] += 1
        verified = sum(counts)
        self.num_planned_steps += 1
        self.sum_budget += verified
        self._shape = (num_sampling, num_other + verified)
        self._verified_drafts = verified > 0
        # Host time of the budget choice and the allocation, kernel and copy included (the device is idle here).
        self.plan_ms_total += (time.perf_counter() - started) * 1e3

    def _stale_budget(self, slots: list[int], caps: list[int], num_sampling: int, num_other: int) -> int:
        """B* from the rows' stale survivals, each cut to the drafts its request holds."""
        assert self.cost is not None
        cap = np.asarray(caps, dtype=np.int64)
        stale = np.where(np.arange(self.k)[None, :] < cap[:, None], self._stale_rows(slots).numpy(), 0.0)
        return choose_budget(torch.from_numpy(stale), num_sampling, num_other, self.cost)

    def prepare(self, request_ids: list[str], caps: list[int], num_sampling: int, num_other: int) -> None:
        """Async mode: choose the next step's budget now, while the drafting pass runs on the device, for the step the
        engine expects (these requests verifying up to `caps` drafts, num_sampling requests sampling, num_other plain
        tokens). plan() uses it if that is the step it gets and no newer survivals arrived meanwhile; else it chooses
        again. Either way the budget reads only survivals of drafts already verified, never the ones being drafted.

        NOTE: every copy whose transfer has finished is taken in here, the newest too: plan() would take the same ones
        (it takes all but the newest, and the drafts being drafted now publish a newer one), so both choose from the
        same rows. The refined cost model is read as it is now, without the timing of the step that is drafting (one
        step of an average with decay 0.98). At R = 1024 on the 2-vCPU machine the choice and its harvest were ~0.7
        of plan()'s 1.9 ms."""
        self._prepared = None
        if self.mode != "async" or not request_ids:
            return
        self._harvest(newest_too=True)
        budget = self._stale_budget(self._rows(request_ids), caps, num_sampling, num_other)
        self._prepared = ((list(request_ids), list(caps), num_sampling, num_other), budget)

    def step_started(self) -> None:
        """Before planning: the step's measured time includes the planning."""
        if not self.adaptive:
            return
        self._since_drafts = 0 if self._pending else self._since_drafts + 1
        self._since_timed += 1
        if self._since_drafts > TIMED_AFTER_DRAFTS and self._since_timed < self.plain_timing_every:
            self._step_start = None  # a plain step in a run of them: not timed (PLAIN_TIMING_EVERY)
            return
        self._since_timed = 0
        if self.device.type == "cuda":
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        else:
            self._step_start = time.perf_counter()

    def step_finished(
        self, drafted: bool, num_emitted: int, chain_starts: bool = False, ending_ms: float = 0.0, wait_ms: float = 0.0
    ) -> None:
        """After the step's drafting: its measured time against the cost model's prediction for what it ran (the
        target pass, and the drafter's pass if it drafted), which also refines the model online.

        chain_starts: the next step was launched before this one was collected (async scheduling), so this one is not
        timed; the next is, from now, as continued steps are timed from one another (continued_step_finished).
        NOTE: without it the first continued step of every pipelined run went unmeasured, and a regime burst of plain
        steps (a switching step, then two plain ones, the first launched alone) measured none: on the H200 at T = 1
        a fresh engine's C = 64 row, whose model said draft, found no plain rate at its level for 20 steps and
        drafted in 25 of them (session 7's t1-check, 0.69x of no-spec).

        ending_ms: the host time the step spent ending requests (engine._process), not part of either regime's cost.
        wait_ms: the host's wait for the step's outputs (the runner's collect). With async scheduling the device runs
        the next step during this one's ending work, so that step waits less, and its time is short by as much; see
        continued_step_finished. A step launched alone waits for its whole device time, which says nothing of the
        next step's usual wait: after one that ended requests, the first continued step is not measured."""
        self._last_continued = time.perf_counter() if chain_starts else None
        self._before = None if ending_ms else (0.0, wait_ms)
        if self._shape is None or self._step_start is None or self.cost is None:
            return
        num_requests, num_tokens = self._shape
        base = self.cost.base.step_ms(num_requests if drafted else 0, num_tokens)
        if drafted:
            refined = base + self.cost.overhead_ms(num_requests)
        else:  # the plain prediction with its floor, as planning uses it
            refined = self.cost.plain_step_ms(num_requests, num_tokens)
        if isinstance(self._step_start, torch.cuda.Event):
            end: torch.cuda.Event | float = torch.cuda.Event(enable_timing=True)
            end.record()  # type: ignore[union-attr]
        else:
            end = time.perf_counter()
        timed = _Timed(
            num_requests,
            base,
            refined,
            self._step_start,
            end,
            self._verified_drafts,
            drafted,
            num_emitted,
            self._decode_only,
            ending_ms,
        )
        self.timing.pending.append(timed)
        self.timing.harvest(self.cost, self.regime)
        self._step_start = self._shape = None

    def skip_timing(self) -> None:
        """The step is not timed: the next step was launched before it was collected (async scheduling), so its
        measured time would hold that launch."""
        self._step_start = self._shape = None
        self._last_continued = None
        self._before = (0.0, 0.0)

    def continued_step_finished(
        self,
        num_requests: int,
        num_emitted: int,
        chain_goes_on: bool,
        drafted: bool,
        ending_ms: float = 0.0,
        wait_ms: float = 0.0,
    ) -> None:
        """A continued step (async scheduling: launched before its predecessor was collected) was collected. Such steps
        verify no drafts; their cost is the host wall time from one's collection to the next's (the device runs one
        while the host processes the other, so no pair of events brackets a step). A plain one feeds the plain
        regime's rate and the cost model's plain residual; one that drafted (the regime chose to draft after it, ending
        the run) switches regime and is not a measurement of either regime's rate, but feeds the speculative
        residual.

        ending_ms, wait_ms: as step_finished's. The previous step's ending work ran while the device ran this step,
        so this step waited less than the previous one did, by at most that work: what its wait lost is given back to
        its time (a review's finding: with the ending work only taken out of the step that did it, that step read D and
        the next D - ending, a bias to high plain rates)."""
        now = time.perf_counter()
        before, self._before = self._before, (ending_ms, wait_ms)
        start, self._last_continued = self._last_continued, now if chain_goes_on else None
        if start is None or not self.adaptive or self.cost is None:
            return
        self.timing.harvest(self.cost, self.regime)  # older event-timed steps first: the regime sees steps in order
        if before is None:  # what the previous step's ending work took from this one is unknown
            return
        shortened = min(before[0], max(0.0, before[1] - wait_ms))
        ms = without_ending((now - start) * 1e3, ending_ms, shortened)
        if ms is None:  # nearly all ending work
            return
        self.regime.observe(num_requests, False, drafted, num_emitted, ms)
        # NOTE: and the cost model: what a plain step costs in a pipelined run (its host work overlaps the device's,
        # unlike the profiled step run alone) is what drafting must beat; one that drafted is the first step of a
        # drafting run, priced as the profile's plain pass plus drafting. That first step is continued, so it was
        # never timed, and the model learned drafting's cost from the next step's timing, read only after the
        # choice that followed that step. On the H200 at T = 1, C = 64 (session 6) a row drafted in 6 steps
        # (2 entering, 3 verifying and drafting, 1 leaving: 5.3, 8.0 and 4.8 ms medians against 1.4 ms plain
        # steps), 0.93x of no-spec; with the first step measured, a run that should not draft can end after it.
        # Only below OUTLIER_RATIO: a first step at 5x its refined prediction or more waits for a second one.
        base = self.cost.base
        if drafted:
            self.cost.observe(num_requests, base.step_ms(num_requests, num_requests), ms, True)
        else:
            self.cost.observe(num_requests, base.plain_step_ms(num_requests, num_requests), ms, False)

    # ---- 3. after verifying -------------------------------------------------------------------------------------

    def record(self, outcomes: list[tuple[str, int, int]], trace: bool = False) -> list[dict[str, object]]:
        """The step's verified blocks, (request id, drafts verified, drafts accepted) each, read against the survivals
        and confidences observe() copied to the host when they were drafted (that copy finished before verification
        did: no device op or wait here). Returns their trace records when asked (raw confidences, counts)."""
        known = [(rid, v, a) for rid, v, a in outcomes if rid in self._pending]
        if not known:
            return []
        self._pending.difference_update(rid for rid, _, _ in known)
        held = [self._published.pop(rid) for rid, _, _ in known]
        first = held[0][0]
        if all(c is first for c, _ in held):  # drafted in one pass (the steady state): one gather
            if first.event is not None:
                first.event.synchronize()  # NOTE: done long ago (the verification's wait came after it)
            host_t = first.host.numpy()[[i for _, i in held]].astype(np.float64)
        else:
            for c, _ in held:
                if c.event is not None:
                    c.event.synchronize()
            host_t = np.stack([c.host.numpy()[i] for c, i in held]).astype(np.float64)
        k = self.k
        positions = np.arange(k)
        # Every request's outcome at once, in numpy: a per-request loop of small tensor ops cost ~70 us a request (H200
        # host), and with torch ops on these small arrays record() took 98-100 us at R = 1 against 36-37 us now
        # (benchmarks/planner_host.py on the 2-vCPU machine, bd523c8 and this alternating, two runs each).
        strata = np.array([self._stratum.get(rid, 0) for rid, _, _ in known], dtype=np.int64)
        verified = np.array([v for _, v, _ in known], dtype=np.int64)[:, None]
        accepted = np.array([a for _, _, a in known], dtype=np.int64)[:, None]
        np.add.at(self.reached.numpy(), strata, ((positions < verified) & (positions <= accepted)).astype(np.float64))
        np.add.at(self.accepted.numpy(), strata, (positions < accepted).astype(np.float64))
        in_block = positions < verified  # [n, k]: the verified slots
        self.calibration.add_blocks(host_t[:, :k][in_block], (positions < accepted)[in_block], verified, accepted)
        records: list[dict[str, object]] = []
        if trace:
            for i, (rid, num_verified, num_accepted) in enumerate(known):
                num_drafts = int((host_t[i, :k] > 0).sum())
                records.append(
                    {
                        "id": rid,
                        "confidences": [round(c, 6) for c in host_t[i, k : k + num_drafts].tolist()],
                        "stratum": int(strata[i]),
                        "num_drafts": num_drafts,
                        "num_verified": num_verified,
                        "num_accepted": num_accepted,
                    }
                )
        return records

    def survivals(self, request_id: str) -> torch.Tensor | None:
        """The live survivals ([K]) of the request's pending drafts; None when it has none."""
        return self._live[self._slot[request_id]] if request_id in self._pending else None

    def drop_drafts(self, request_id: str) -> None:
        """The request's pending drafts were dropped (preemption); its smoothing history stays."""
        self._pending.discard(request_id)
        self._published.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request finished: forget everything about it (the EMA restarts for a new request)."""
        slot = self._slot.pop(request_id, None)
        self._prepared = None
        if slot is not None:
            self._has_stale[slot] = False
            self._free.append(slot)
            self._generation[slot] += 1
        self._history.discard(request_id)
        self._pending.discard(request_id)
        self._published.pop(request_id, None)
        self._stratum.pop(request_id, None)

    def metrics(self) -> dict[str, object]:
        cal = self.calibration
        if self.cost is not None:
            self.timing.harvest(self.cost, self.regime)
        base, base_abs, refined, refined_abs = self.timing.mean_errors()
        return {
            "adaptive_verification_mode": self.mode,
            "spec_decode_verify_budget_mean": self.sum_budget / self.num_planned_steps if self.num_planned_steps else 0,
            "spec_decode_plan_ms_total": self.plan_ms_total,
            "spec_decode_verify_len_hist": list(self.verify_len_hist),
            "spec_decode_num_steps_without_drafting": self.num_steps_without_drafting,
            "spec_decode_regime_explorations": self.regime.num_explorations,
            "spec_decode_regime_tokens_per_ms": self.regime.rates(),
            "spec_decode_regime_steps": {lvl: dict(n) for lvl, n in self.regime.num_chosen.items()},
            "spec_decode_predicted_accepted_tokens": cal.predicted,
            "spec_decode_realised_accepted_tokens": cal.realised,
            "spec_decode_calibration_error": cal.ece,
            # (predicted - measured) / measured step time, mean over steps: the profiled curves, then with the online
            # overhead term that planning actually uses
            "spec_decode_cost_model_error": base,
            "spec_decode_cost_model_abs_error": base_abs,
            "spec_decode_refined_cost_model_error": refined,
            "spec_decode_refined_cost_model_abs_error": refined_abs,
            # the online residual at one request, of plain and of speculative steps
            "spec_decode_cost_model_overhead_ms": self.cost.overhead_ms(1, False) if self.cost is not None else 0.0,
            "spec_decode_cost_model_spec_overhead_ms": self.cost.overhead_ms(1) if self.cost is not None else 0.0,
        }
