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

Losslessness (docs/scheduling.md, "Stale and live survivals"): a draft's confidence depends only on the drafts before
it (the DSpark head reads the previous token; the n-gram strata are fixed before drafting and the drafts are
deterministic), the budget is fixed before the live values are seen (async) or grows only while the rate improves
(sync), and allocation breaks ties by position, so whether a draft is verified never depends on its own value.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from dspark.core.scheduler import SchedulerOutput
from dspark.speculative.budget import (
    allocate,
    choose_budget,
    choose_budget_sync,
    drafting_verdict,
    initial_prior,
    update_prior,
)
from dspark.speculative.calibration import CalibrationMonitor
from dspark.speculative.cost_model import CostModel, RefinedCostModel
from dspark.speculative.regime import RegimeChooser, Verdict
from dspark.speculative.step_timer import StepTiming
from dspark.utils.transfer import download, upload, upload_tensor

MIN_CONFIDENCE = 1e-4  # a held draft keeps a positive survival: 0 means "no draft here" to allocate
PAYS_REUSE = 8  # steps a "does drafting pay" answer is reused for at the same number of requests
# ... and a plain answer priced with measured drafting costs (regime.Verdict with predictions): the level it is asked
# for follows it without exploring for many steps, so its host tensor work need not be redone every PAYS_REUSE steps.
PREDICTED_PLAIN_REUSE = 64


@dataclass
class PlannedStep:
    """What a planned step runs, as its timing needs it."""

    num_sampling: int  # requests that emit a token
    num_tokens: int  # tokens fed, verified drafts included
    verified_drafts: bool
    decode_only: bool  # every request fed one token besides its drafts (no prompt chunk)


@dataclass
class _Copy:
    """An asynchronous device-to-host copy of one step's survivals."""

    slots: list[int]  # the requests' rows in the planner's tables when the copy was made
    host: torch.Tensor  # [R, 2K]: the survivals, then the raw confidences (what record() reads)
    event: torch.cuda.Event | None  # None: the copy was synchronous (CPU)
    generations: np.ndarray  # [R] int64: each row's generation when the copy was made (a row released since moved on)


def _counts_without_live_values(caps: list[int], budget: int) -> list[int] | None:
    """The allocation where it cannot depend on the live survivals: nothing verified, everything verified, or one
    request (survivals never rise along a block and ties go to the earlier slot, so its top slots are its first
    ones). None otherwise. These cases skip the allocation's kernel, copies and wait, a large share of a small step."""
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
        # scatters over all its requests, not a loop of small tensor ops per request.
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
        # on the host, with no copy or device op of its own: gathers, a copy and a wait would cost a small step dearly.
        self._published: dict[str, tuple[_Copy, int]] = {}
        self._generation = np.zeros(0, dtype=np.int64)  # [N] times each row was released
        self._prior = initial_prior(num_spec_tokens)  # survivals assumed before any are seen
        # Conditional acceptance per stratum and position: reached (every earlier draft accepted) and accepted counts.
        self.reached = torch.zeros(num_strata, num_spec_tokens, dtype=torch.float64)
        self.accepted = torch.zeros(num_strata, num_spec_tokens, dtype=torch.float64)
        self.calibration = CalibrationMonitor()
        self.timing = StepTiming()
        self.regime = RegimeChooser()
        self.num_planned_steps = 0
        self.num_steps_without_drafting = 0  # steps where drafting would not have paid (high load)
        self.num_admitted = 0  # requests the engine has started running (the core counts them)
        self.sum_budget = 0
        self.plan_ms_total = 0.0  # wall time of plan() over planned steps: the budget choice and the allocation
        self.verify_len_hist = [0] * (num_spec_tokens + 1)  # requests that verified l drafts in a step, l = 0..K
        self.planned: PlannedStep | None = None  # the step plan() last planned (adaptive modes), for its timing
        # record(): the last verification's expected accepted drafts (the sum of the verified slots' survivals) and
        # accepted drafts, which the step's timing passes to the regime chooser (it takes them: one step's each)
        self.verified_expectation: tuple[float, int] | None = None
        # num requests -> (answer, steps it may still be reused, the cost model's surprises when it was computed)
        self._pays_cache: dict[int, tuple[Verdict, int, int]] = {}
        # prepare(): the step it expects (request ids, caps, requests sampling, other tokens) and the budget for it
        self._prepared: tuple[tuple[list[str], list[int], int, int], int] | None = None
        self.num_prepared_budgets = 0  # planned steps whose budget prepare() had chosen

    @property
    def adaptive(self) -> bool:
        return self.mode != "fixed"

    @property
    def has_pending_drafts(self) -> bool:
        """Some request holds drafts observed and not yet verified or dropped."""
        return bool(self._pending)

    # ---- 1. after drafting --------------------------------------------------------------------------------------

    def _rows(self, request_ids: list[str]) -> list[int]:
        """The requests' table rows; a request seen for the first time gets a free one (the tables grow by doubling)."""
        get = self._slot.get
        slots = [get(rid) for rid in request_ids]  # the usual case, every request known: one cheap pass
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
        # Learned rates are already averages over many blocks: smoothing them again only mixes in a stale stratum
        # (alpha 0 predicts n-gram acceptance best at every batch size).
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
            # Nothing harvests the copies in fixed mode (there is no budget to choose): kept, they would pile up,
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
        # Host arrays in numpy (views of the tables' memory): torch ops on small host arrays cost several times more,
        # on the critical path of a drafting step.
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
                self._prior = update_prior(self._prior, torch.from_numpy(host[held]))
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
        # knows what that step cost, not a step later, after one more drafting step.
        self.timing.harvest(cost, self.regime)
        n = len(request_ids)

        def model_says() -> Verdict:
            # The cost model's answer moves slowly (stale survivals, the load), and its host tensor work on [R, K] is
            # dear beside a small step: recomputed every few steps at a load, asked only when the regime's
            # measurements leave the choice open. A speculative step that the refined model mispredicted
            # (its first one, say) voids the cached answers: they priced drafting wrong.
            cached = self._pays_cache.get(n)
            if cached is None or cached[1] <= 0 or cached[2] != cost.num_surprises:
                verdict = drafting_verdict(self._stale_rows(self._rows(request_ids)), n, cost)
                # NOTE: the predictions count only where drafting's cost was measured at this load or a lower one
                # (else the profile's guess, or a cost measured at a higher load: a load that drops after a busy spell
                # would take the residual of its busy steps, and not explore drafting where it pays). A drafting
                # verdict there is still adopted: the regime then explores plain steps (cheap) in bursts and measured
                # rates decide.
                if not cost.measured_at_or_below(n):
                    verdict = Verdict(verdict.draft)
                reuse = PREDICTED_PLAIN_REUSE if verdict.rate is not None and not verdict.draft else PAYS_REUSE
                cached = (verdict, reuse, cost.num_surprises)
            self._pays_cache[n] = (cached[0], cached[1] - 1, cached[2])
            return cached[0]

        pays = self.regime.choose(n, model_says, arrivals=self.num_admitted)
        self.num_steps_without_drafting += not pays
        return pays

    # ---- 2. after scheduling ------------------------------------------------------------------------------------

    def plan(self, sched: SchedulerOutput) -> None:
        """Cut each scheduled request's drafts to the number it verifies this step (adaptive modes)."""
        # One pass over the requests here and one at the end: this runs on the critical path of a drafting step (the
        # device is idle while the host plans).
        items, caps, ids = [], [], []
        num_sampling = 0
        for s in sched.scheduled:
            num_sampling += s.samples
            if s.spec_token_ids:
                items.append(s)
                caps.append(len(s.spec_token_ids))
                ids.append(s.request.request_id)
        num_tokens = sched.num_tokens  # a sum over the requests: computed once
        num_other = num_tokens - sum(caps)
        decode_only = num_sampling == len(sched.scheduled) == num_other
        self.planned = PlannedStep(num_sampling, num_tokens, False, decode_only) if self.adaptive else None
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
        self.planned = PlannedStep(num_sampling, num_other + verified, verified > 0, decode_only)
        # Host time of the budget choice and the allocation, kernel and copy included (the device is idle here).
        self.plan_ms_total += (time.perf_counter() - started) * 1e3

    def pipelined_budget(self, request_ids: list[str], caps: list[int]) -> int:
        """B for a pipelined step (worker/spec_pipeline.py) of these requests, each decoding one token and verifying
        up to caps[i] drafts: in async mode from their stale survivals (observe_host), fixed mode every draft."""
        if not self.adaptive:
            return sum(caps)
        assert self.mode == "async", "synchronous verification reads live survivals on the host: not pipelined"
        n = len(request_ids)
        return self._stale_budget(self._rows(request_ids), caps, n, n)

    def observe_host(self, request_ids: list[str], host: np.ndarray) -> None:
        """A pipelined step's new drafts: their survivals and raw confidences ([R, 2K] float64, already on the host,
        EMA applied on the device). They become the stale rows later budgets read, and what record() reads when the
        drafts are verified."""
        if not request_ids:
            return
        k = self.k
        slots = self._rows(request_ids)
        rows = np.asarray(slots, dtype=np.int64)
        survivals = host[:, :k]
        held = survivals[:, 0] > 0
        self._stale.numpy()[rows[held]] = survivals[held]
        self._has_stale.numpy()[rows[held]] = True
        if held.any():
            self._prior = update_prior(self._prior, torch.from_numpy(survivals[held]))
        copy = _Copy(slots, torch.from_numpy(host), None, self._generation[rows])
        self._published.update((rid, (copy, i)) for i, rid in enumerate(request_ids))
        self._pending.update(request_ids)
        self._history.update(request_ids)

    def count_verified(self, num_verified: np.ndarray) -> None:
        """A pipelined step's verification lengths (the device allocated them), for the budget statistics."""
        self.num_planned_steps += 1
        self.sum_budget += int(num_verified.sum())
        for ell in num_verified.tolist():
            self.verify_len_hist[ell] += 1

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

        Every copy whose transfer has finished is taken in here, the newest too: plan() would take the same ones (it
        takes all but the newest, and the drafts being drafted now publish a newer one), so both choose from the same
        rows. The refined cost model is read as it is now, without the timing of the step that is drafting (one step
        of an average with decay 0.98). Choosing here takes most of plan()'s host work off the critical path."""
        self._prepared = None
        if self.mode != "async" or not request_ids:
            return
        self._harvest(newest_too=True)
        budget = self._stale_budget(self._rows(request_ids), caps, num_sampling, num_other)
        self._prepared = ((list(request_ids), list(caps), num_sampling, num_other), budget)

    # ---- 3. after verifying -------------------------------------------------------------------------------------

    def record(self, outcomes: list[tuple[str, int, int]], trace: bool = False) -> list[dict[str, object]]:
        """The step's verified blocks, (request id, drafts verified, drafts accepted) each, read against the survivals
        and confidences observe() copied to the host when they were drafted (that copy finished before verification
        did: no device op or wait here). Returns their trace records when asked (raw confidences, counts)."""
        self.verified_expectation = None  # a step whose timing never took its own (a fault) leaves none behind
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
        # Every request's outcome at once, in numpy: a per-request loop of small tensor ops, or torch ops on these
        # small arrays, cost several times the host time.
        strata = np.array([self._stratum.get(rid, 0) for rid, _, _ in known], dtype=np.int64)
        verified = np.array([v for _, v, _ in known], dtype=np.int64)[:, None]
        accepted = np.array([a for _, _, a in known], dtype=np.int64)[:, None]
        np.add.at(self.reached.numpy(), strata, ((positions < verified) & (positions <= accepted)).astype(np.float64))
        np.add.at(self.accepted.numpy(), strata, (positions < accepted).astype(np.float64))
        in_block = positions < verified  # [n, k]: the verified slots
        survivals = host_t[:, :k][in_block]
        self.calibration.add_blocks(survivals, (positions < accepted)[in_block], verified, accepted)
        self.verified_expectation = (float(survivals.sum()), int(np.minimum(accepted, verified).sum()))
        self.regime.learn_ratio(*self.verified_expectation)  # every verified step, timed or not
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
