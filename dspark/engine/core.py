"""EngineCore: the step loop. Scheduler, model runner and speculative planning, in token ids only.

Each step: schedule (or continue the step launched ahead), plan the verification budget, launch on the device, launch
the next step before this one's tokens reach the host where nothing the host decides can change it (async
scheduling), collect, append each request's tokens (ending those a token ends: EOS, a stop token id, max_tokens,
max_model_len), draft for the next step, and time the step for the planner. Its inputs (EngineCoreRequest, aborts,
stops) and outputs (EngineCoreOutput) are plain data: text is the front's (engine/output_processor.py), so the core
can run in its own process.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.config import EngineConfig
from dspark.core.kv_cache import KVCacheManager
from dspark.core.request import Request, RequestStatus
from dspark.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from dspark.engine.messages import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from dspark.engine.policy import StepPolicy
from dspark.errors import DSparkError
from dspark.models.registry import resolve_model
from dspark.sample.sampler import SampledRow
from dspark.speculative.cost_model import CostModel
from dspark.speculative.planner import VerificationPlanner
from dspark.speculative.step_timer import StepTimer
from dspark.speculative.trace import TraceWriter
from dspark.worker.model_runner import Launched, RunnerOutput
from dspark.worker.profiler import load_or_profile
from dspark.worker.spec_pipeline import SpecResult
from dspark.worker.worker import Worker

logger = logging.getLogger("dspark")


def step_kind(has_chunk: bool, verified: bool, drafted: bool) -> str:
    """ "prefill" (the step fed a prompt chunk), else "plain", "verify+draft", "verify" or "draft"."""
    if has_chunk:
        return "prefill"
    if verified:
        return "verify+draft" if drafted else "verify"
    return "draft" if drafted else "plain"


class EngineCore:
    def __init__(self, config: EngineConfig, cost_model: CostModel | None = None) -> None:
        """cost_model: the step-cost curves adaptive verification plans with; None: profiled at start-up (or loaded
        from the cache, where this model, drafter, device and grid were profiled before)."""
        # An earlier engine's objects were frozen (below): thaw and collect them, so that its memory (and its
        # device memory, for the KV-cache sizing) is back before this one is built.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.config = config
        self.worker = worker = Worker(config)
        self.device, self.dtype = worker.device, worker.dtype
        self.max_model_len = worker.max_model_len
        self.num_spec_tokens = worker.num_spec_tokens
        self.runner = worker.runner
        self.spec = config.spec
        self.kv = KVCacheManager(worker.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, worker.num_lookahead_tokens
        )
        self.planner = self._make_planner(cost_model) if self.spec is not None else None
        self.timer = StepTimer(self.planner) if self.planner is not None else None
        self.trace = (
            TraceWriter(Path(self.spec.trace_path), self._trace_header())
            if self.spec is not None and self.spec.trace_path
            else None
        )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.policy = StepPolicy(self)
        # Everything built so far (model, graphs, caches) lives as long as the engine. Frozen, the cyclic GC stops
        # re-scanning it on the collections the per-step objects trigger (vLLM freezes after start-up too). A frozen
        # cycle is never collected, so the next engine's construction thaws everything first.
        gc.collect()
        gc.freeze()
        self.last_step_kind = ""  # what the last step ran (step_kind)
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._inflight: Launched | None = None  # async scheduling: a step launched and not collected yet
        self._ending_ms = 0.0  # the last step's host time spent ending requests (see _finish)
        # The last step, until end_step() times it: (continued, requests served, tokens emitted, drafted, wait ms,
        # drafts verified by a pipelined step)
        self._ended: tuple[bool, int, int, bool, float, int] | None = None
        self._pipelined_ids: list[str] = []  # the requests of the last pipelined step (their drafts are on the device)
        self.stats = {
            "num_generation_tokens": 0,
            "num_steps": 0,
            "num_pipelined_steps": 0,  # steps launched before the previous one was collected (async scheduling)
            "spec_decode_num_drafts": 0,
            "spec_decode_num_draft_tokens": 0,
            "spec_decode_num_accepted_tokens": 0,
        }
        self.accepted_per_pos = [0] * self.num_spec_tokens

    @property
    def info(self) -> EngineCoreInfo:
        mcfg = self.worker.model_config
        return EngineCoreInfo(
            mcfg.vocab_size,
            self.max_model_len,
            mcfg.eos_token_id,
            self.num_spec_tokens,
            str(self.device),
            str(self.dtype),
        )

    def _make_planner(self, cost_model: CostModel | None) -> VerificationPlanner:
        spec, worker = self.spec, self.worker
        assert spec is not None
        mode = spec.adaptive_verification_mode if spec.enable_adaptive_verification else "fixed"
        if mode != "fixed" and cost_model is None:
            identity: dict[str, Any] = {
                "model": str(resolve_model(self.config.model)),
                "drafter": spec.method + (f":{worker.drafter_path()}" if spec.method == "dspark" else ""),
                "verify": self.runner.verify_method,
                "dtype": str(self.dtype),
                "max_model_len": self.max_model_len,
            }
            if self.config.batch_invariant and self.device.type == "cuda":  # other kernels, other step costs
                identity["batch_invariant"] = True
            cost_model = load_or_profile(
                self.runner,
                self.num_spec_tokens,
                self.config.max_num_seqs,
                self.config.max_num_batched_tokens,
                identity,
                log=lambda msg: logger.info(msg),
            )
        strata = getattr(self.runner.drafter, "num_strata", 1)
        return VerificationPlanner(
            self.num_spec_tokens, mode, spec.adaptive_verification_ema_alpha, cost_model, self.device, strata
        )

    def _trace_header(self) -> dict[str, Any]:
        assert self.spec is not None and self.planner is not None
        cfg = self.worker.dspark_model.config if self.worker.dspark_model is not None else None
        return {
            "K": self.num_spec_tokens,
            "method": self.spec.method,
            "drafter": str(self.worker.drafter_path()) if self.spec.method == "dspark" else None,
            # The confidences are recorded calibrated: what undoes them (train/calibrate.py) must know with what.
            "sts_by_temperature": cfg.sts_table.to_json() if cfg is not None else None,
            "model": self.config.model,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "mode": self.planner.mode,
        }

    # ---- requests -------------------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front has checked (engine/input_processor.py)."""
        req = Request(
            request.request_id,
            None,
            request.prompt_token_ids,
            request.sampling_params,
            request.seed,
            request.eos_token_id,
            request.arrival_time,
        )
        req.end_at = min(req.end_at, self.max_model_len)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, stops: Sequence[tuple[str, int]]) -> None:
        """The front ended these requests (a stop string, or a fault in its output): (request id, how many of the
        tokens it was sent it dropped: those past the stop in the output it ended the request with, or, from a front
        in another process, those made before the stop reached the core). Those tokens are not counted as generated;
        a request still running is finished now."""
        for rid, num_dropped in stops:
            self.stats["num_generation_tokens"] -= num_dropped
            req = self.requests.get(rid)
            if req is not None:
                start = time.perf_counter()
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                self._ending_ms += (time.perf_counter() - start) * 1e3

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one batch; return an output for every request that emitted tokens the front reads now (Request.streams)
        or finished. The step is timed once end_step() says its outputs are processed (the next step() does it
        otherwise).

        A fault of the step (the model runner, drafting) propagates from here, leaving the requests in flight to the
        caller, who aborts them; the core then serves new requests."""
        if self._ended is not None:
            self.end_step()
        try:
            return self._step()
        except BaseException:
            # A step launched ahead (async scheduling) continues one that was not processed: run after a fault, its
            # tokens would take the place of the lost ones. Dropped, the requests recompute from what they have.
            self._inflight = None
            raise

    def end_step(self, front_ending_ms: float = 0.0) -> None:
        """The last step's outputs are processed: time it for the planner. An in-process front processes them inside
        the step's measured time, as a plain engine would; front_ending_ms is what it spent ending requests (their
        final text and output), which like the core's own ending work every regime pays once per request."""
        ended, self._ended = self._ended, None
        if ended is None or self.timer is None:
            return
        continued, num_live, num_emitted, drafted, wait_ms, num_verified = ended
        ending_ms = self._ending_ms + front_ending_ms
        chained = self._inflight is not None
        if continued:
            self.timer.continued_step_finished(
                num_live, num_emitted, chained, drafted, ending_ms=ending_ms, wait_ms=wait_ms, num_verified=num_verified
            )
        else:
            self.timer.step_finished(drafted, num_emitted, chain_starts=chained, ending_ms=ending_ms, wait_ms=wait_ms)

    def _step(self) -> list[EngineCoreOutput]:
        launched, continued = self._take_inflight(), True
        if launched is None:
            launched, continued = self._launch_fresh(), False
            if launched is None:
                return []
        sched = launched.sched
        verified = not sched.continued and any(s.spec_token_ids for s in sched.scheduled)
        # A request past its prefill feeds one token (its last) besides its drafts; any other feeds a prompt chunk.
        has_chunk = not sched.continued and any(
            not s.continues and s.request.num_computed_tokens + 1 < s.request.num_tokens for s in sched.scheduled
        )
        # Async scheduling: the next step is launched now, before this one's tokens reach the host, so that the device
        # runs it while the host processes these. A refused continuation may carry the drafting choice it asked for.
        draft_choice = None
        nxt = self.policy.next_step(launched)
        if isinstance(nxt, bool):
            draft_choice = nxt
        elif nxt is not None:
            draft_choice = False
            if self.timer is not None and not continued:
                self.timer.skip_timing()  # its measured time would include the next step's launch
            if nxt.pipelined is not None:
                self._inflight = self.runner.launch_pipelined(nxt, launched, *nxt.pipelined)
            else:
                self._inflight = self.runner.launch(nxt, previous=launched)
        waited = time.perf_counter()
        result = self.runner.collect(launched)
        wait_ms = (time.perf_counter() - waited) * 1e3  # the timing of the next continued step needs it
        self.stats["num_steps"] += 1
        self.stats["num_pipelined_steps"] += continued
        records = self._record_verification(sched, result) if verified and self.planner is not None else []
        self._ending_ms = 0.0
        # A pipelined step drafted on the device already (launched.spec.drafted).
        may_draft = self.spec is not None and draft_choice is not False and launched.spec is None
        drafting: list[Request] | None = [] if may_draft else None
        outputs: list[EngineCoreOutput] = []
        num_verified = 0
        if result.spec is not None:
            num_live, num_emitted, num_verified, records = self._update_pipelined(sched, result.spec, outputs)
            verified = num_verified > 0
        elif result.tokens is not None:
            num_live = self._update_continued(sched.scheduled, result.tokens, outputs, drafting)
            num_emitted = num_live
        else:
            num_live, num_emitted = self._update(sched, result, outputs, drafting)
        if draft_choice is None:
            draft_choice = bool(drafting) and (
                self.planner is None or self.planner.should_draft([r.request_id for r in drafting or ()])
            )
        drafted = draft_choice and bool(drafting) and not self.policy.pipeline_takes_over(drafting)
        if drafted:
            assert drafting is not None
            self._draft(drafting)
        if launched.spec is not None:
            drafted = launched.spec.drafted
        self.last_step_kind = step_kind(has_chunk, verified, drafted)
        self._ended = (continued, num_live, num_emitted, drafted, wait_ms, num_verified)
        if self.trace is not None and records:
            self.trace.step(
                self.stats["num_steps"], sched.num_tokens - sum(r["num_verified"] for r in records), records
            )
        return outputs

    def _take_inflight(self) -> Launched | None:
        """The step launched ahead, unless every request of it has ended since (EOS, a stop, an abort): then nothing
        is collected. Dropped uncollected (the device runs it before anything queued later), it neither delays the
        next request by a step nor reaches the regime as a plain step lasting the whole idle gap since."""
        launched, self._inflight = self._inflight, None
        if launched is not None and all(s.request.status.finished for s in launched.sched.scheduled):
            if self.timer is not None:
                self.timer.skip_timing()
            return None
        return launched

    def _launch_fresh(self) -> Launched | None:
        """Schedule, plan and launch a step that continues nothing; None when there is nothing to run."""
        if self._pipelined_ids and self.planner is not None:  # a pipeline ended: its last drafts are not verified
            for rid in self._pipelined_ids:
                self.planner.drop_drafts(rid)
        self._pipelined_ids = []
        sched = self.scheduler.schedule()
        for rid in sched.preempted:  # their drafts were dropped; so go the distributions they were drawn from
            self.runner.release(rid, finished=False)
            if self.planner is not None:
                self.planner.drop_drafts(rid)
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                raise DSparkError("scheduler made no progress: the KV cache cannot hold even one request")
            return None
        now = time.monotonic()
        admitted = 0
        for s in sched.scheduled:
            if not s.request.first_scheduled_time:
                s.request.first_scheduled_time = now
                admitted += 1
        if self.planner is not None:
            self.planner.num_admitted += admitted  # new text for the regime chooser (RegimeChooser.choose's arrivals)
            assert self.timer is not None
            self.timer.step_started()
            self.planner.plan(sched)  # adaptive verification: cut each request's drafts to those worth verifying
        return self.runner.launch(sched)

    def _record_verification(self, sched: SchedulerOutput, result: RunnerOutput) -> list[dict[str, object]]:
        """The planner's record of what the step verified (before finished requests are released)."""
        assert self.planner is not None
        outcomes = [
            (s.request.request_id, len(s.spec_token_ids), result.num_accepted.get(s.request.request_id, 0))
            for s in sched.scheduled
            if s.spec_token_ids
        ]
        return self._with_temperatures(sched, self.planner.record(outcomes, trace=self.trace is not None))

    @staticmethod
    def _with_temperatures(sched: SchedulerOutput, records: list[dict[str, object]]) -> list[dict[str, object]]:
        """Trace records with each request's sampling temperature (0: greedy): its confidences were calibrated with
        the drafter's fit at that temperature, which train/calibrate.py must know to undo them."""
        if records:
            params = {s.request.request_id: s.request.sampling_params for s in sched.scheduled}
            for r in records:
                p = params[str(r["id"])]
                r["temperature"] = 0.0 if p.greedy else p.temperature
        return records

    def _update(
        self,
        sched: SchedulerOutput,
        result: RunnerOutput,
        outputs: list[EngineCoreOutput],
        drafting: list[Request] | None,
    ) -> tuple[int, int]:
        """A step's results, request by request: computed tokens, accepted drafts, the emitted tokens. Requests still
        running that may draft go to `drafting` (None: the step's drafting choice is made, plain). Returns the number
        of requests the step served and of the tokens they emitted (a voided token is neither)."""
        now = time.monotonic()
        num_live = num_emitted = 0
        prompt_logprobs = result.prompt_logprobs
        for s in sched.scheduled:
            req = s.request
            if req.status.finished:  # stopped or aborted after its continued step was launched: that token is void
                continue
            num_live += 1
            if prompt_logprobs and req.request_id in prompt_logprobs:
                start, entries = prompt_logprobs[req.request_id]
                # After a preemption the prompt is computed again, in chunks that may end elsewhere: only the entries
                # past those already kept are new.
                kept = req.prompt_logprobs
                if kept is not None and start <= len(kept) < start + len(entries):
                    kept += entries[len(kept) - start :]
            sampled = result.sampled.get(req.request_id)
            num_rejected = 0
            if s.spec_token_ids:
                num_accepted = result.num_accepted[req.request_id]
                num_rejected = len(s.spec_token_ids) - num_accepted
                self._count_spec(req, len(s.spec_token_ids), num_accepted)
            if req.spec_token_ids:
                req.spec_token_ids = []
            # Rejected drafts' KV stays where it is, past num_computed_tokens, to be overwritten later.
            req.num_computed_tokens += s.num_new_tokens - num_rejected
            if sampled is None:  # a prompt chunk: its tokens are all known already
                self.kv.cache_computed_blocks(req)
                continue
            num_emitted += len(sampled)
            req.first_token_time = req.first_token_time or now
            out = self._append(req, [row.token_id for row in sampled], sampled, now)
            if out is not None:
                outputs.append(out)
            if drafting is not None and not req.status.finished and req.sampling_params.max_speculative_tokens != 0:
                drafting.append(req)
        return num_live, num_emitted

    def _update_continued(
        self,
        scheduled: list[ScheduledRequest],
        tokens: list[int],
        outputs: list[EngineCoreOutput],
        drafting: list[Request] | None,
    ) -> int:
        """A continued step's tokens, one plain token per request in the step's order: what _update does, less what
        such a step cannot hold (drafts, prompt chunks, logprobs). Returns the number of live requests (each emitted a
        token). The steady state at high load: a token that cannot end its request is appended in place, and only
        requests whose tokens the front reads every step get an output."""
        quiet: list[Request] = []  # appended in place; their filled blocks registered from `done` on
        done = num_live = 0
        try:
            for s, token in zip(scheduled, tokens, strict=True):
                req = s.request
                if req.status.finished:  # stopped or aborted after this step was launched: its token is void
                    continue
                num_live += 1
                req.num_computed_tokens += 1  # first_token_time: set when the step it continues was collected
                all_ids = req.all_token_ids
                if token not in req.ends_on and len(all_ids) + 1 < req.end_at:
                    all_ids.append(token)
                    quiet.append(req)
                    if req.streams:  # a plain output: its counters cannot have changed since the last full one
                        outputs.append(EngineCoreOutput(req.request_id, [token]))
                else:
                    # The quiet requests before this one first, in step order: a block they filled is registered
                    # before one this request fills with the same tokens, as _append for each in turn would.
                    done = self._quiet_done(quiet, done)
                    out = self._append(req, (token,), None, time.monotonic())
                    if out is not None:
                        outputs.append(out)
                    if req.status.finished:
                        continue
                if drafting is not None and req.sampling_params.max_speculative_tokens != 0:
                    drafting.append(req)
        finally:  # a fault that propagates still counts the tokens appended
            self._quiet_done(quiet, done)
        return num_live

    def _update_pipelined(
        self, sched: SchedulerOutput, result: SpecResult, outputs: list[EngineCoreOutput]
    ) -> tuple[int, int, int, list[dict[str, object]]]:
        """A pipelined step's results, one row per request in the step's order: the drafts it verified and accepted,
        then its emitted tokens appended (a request ended since has its row voided). Returns the requests it served,
        the tokens they emitted, the drafts verified and the planner's trace records."""
        reqs = [s.request for s in sched.scheduled]
        live = [i for i, r in enumerate(reqs) if not r.status.finished]
        num_emitted = result.num_emitted
        num_verified = result.num_verified
        records: list[dict[str, object]] = []
        if self.planner is not None:  # before finished requests are released
            verified = [i for i in live if num_verified[i]]
            outcomes = [(reqs[i].request_id, int(num_verified[i]), int(num_emitted[i]) - 1) for i in verified]
            records = self._with_temperatures(sched, self.planner.record(outcomes, trace=self.trace is not None))
            self.planner.count_verified(num_verified[live])
        now = time.monotonic()
        tokens = result.tokens.tolist()
        total = 0
        for i in live:
            req = reqs[i]
            n = int(num_emitted[i])
            ell = int(num_verified[i])
            if ell:
                self._count_spec(req, ell, n - 1)
            req.num_computed_tokens += n  # its last token and the accepted drafts
            total += n
            out = self._append(req, tokens[i][:n], None, now)
            if out is not None:
                outputs.append(out)
        going_on = [i for i in live if not reqs[i].status.finished]
        self._pipelined_ids = [reqs[i].request_id for i in going_on]
        if self.planner is not None and result.survivals is not None:
            self.planner.observe_host(self._pipelined_ids, result.survivals[going_on])
        return len(live), total, int(num_verified[live].sum()), records

    def _quiet_done(self, quiet: list[Request], done: int) -> int:
        """Count quiet[done:]'s tokens (one each) and register the blocks they filled; returns len(quiet)."""
        if len(quiet) > done:
            self.stats["num_generation_tokens"] += len(quiet) - done
            self.kv.cache_computed_blocks_of(quiet[done:] if done else quiet)
        return len(quiet)

    def _append(
        self, req: Request, tokens: Sequence[int], rows: list[SampledRow] | None, now: float
    ) -> EngineCoreOutput | None:
        """Append this step's tokens in order; the first that ends the request finishes it (the rest are dropped).
        rows: the tokens' sampled rows (their logprobs, if any), or None (a continued step's: none)."""
        all_ids = req.all_token_ids
        num_prompt = len(req.prompt_token_ids)
        p = req.sampling_params
        status = None
        num_appended = 0
        for token in tokens:
            all_ids.append(token)
            num_appended += 1
            if token in req.ends_on and len(all_ids) - num_prompt >= p.min_tokens:
                status = RequestStatus.FINISHED_STOPPED
                if token != req.eos_token_id or p.ignore_eos:
                    req.stop_reason = token
                break
            if len(all_ids) >= req.end_at:
                status = RequestStatus.FINISHED_LENGTH
                break
        self.stats["num_generation_tokens"] += num_appended
        new_ids = list(tokens[:num_appended]) if req.streams else []
        logprobs: list[TokenLogprobs] | None = None
        if rows is not None and p.logprobs is not None:
            logprobs = [(r.logprob or 0.0, r.rank or 1, r.top_logprobs or []) for r in rows[:num_appended]]
        # After the accepted drafts are appended (a block's hash needs its tokens), before finishing frees it.
        self.kv.cache_computed_blocks(req)
        if status is None:
            return self._output(req, new_ids, logprobs) if req.streams else None
        start = time.perf_counter()
        try:
            self._finish(req, status, now)
            if not req.streams:  # the front gets its tokens only now
                new_ids = all_ids[num_prompt:]
            return self._output(req, new_ids, logprobs)
        finally:
            self._ending_ms += (time.perf_counter() - start) * 1e3

    def _output(
        self, req: Request, new_ids: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> EngineCoreOutput:
        prompt_logprobs = None
        if req.sampling_params.prompt_logprobs is not None and req.prompt_logprobs is not None:
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # with the first output only
        return EngineCoreOutput(
            req.request_id,
            new_ids,
            logprobs,
            req.finish_reason,
            req.stop_reason,
            req.first_scheduled_time,
            req.first_token_time,
            req.finished_time,
            req.num_cached_tokens,
            req.num_preemptions,
            req.spec_num_drafts,
            req.spec_num_draft_tokens,
            req.spec_num_accepted_tokens,
            prompt_logprobs,
        )

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """Finish the request: free its blocks and every piece of per-request state (ending work, which every
        regime pays once per request: the planner's timing takes it out of the step's measured time)."""
        self.scheduler.finish(req, status)
        self.runner.release(req.request_id)
        if self.planner is not None:
            self.planner.release(req.request_id)
        req.finished_time = now or time.monotonic()
        self.requests.pop(req.request_id, None)

    def _count_spec(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """vLLM's counting: a draft is one request's proposal verified in one step."""
        self.stats["spec_decode_num_drafts"] += 1
        self.stats["spec_decode_num_draft_tokens"] += num_drafts
        self.stats["spec_decode_num_accepted_tokens"] += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        req.spec_num_drafts += 1
        req.spec_num_draft_tokens += num_drafts
        req.spec_num_accepted_tokens += num_accepted

    def _draft(self, requests: list[Request]) -> None:
        """Propose the drafts each request verifies next step, cut to what it could still emit."""
        proposal = self.runner.propose(requests)  # queued on the device; the tokens reach the host when first read
        rooms = []
        for req in requests:
            # verified tokens plus the bonus must fit (end_at: max_tokens and max_model_len)
            room = req.end_at - len(req.all_token_ids) - 1
            cap = req.sampling_params.max_speculative_tokens
            if cap is not None:
                room = min(room, cap)
            rooms.append(max(0, room))
        if self.planner is not None and not proposal.on_host:
            self._prepare_budget(requests, rooms)  # host work while the drafting pass runs on the device
        for req, tokens, room in zip(requests, proposal.token_ids, rooms, strict=True):  # the wait for the drafts
            req.spec_token_ids = tokens[:room]
        if self.planner is not None:
            self.planner.observe(
                [r.request_id for r in requests],
                [len(r.spec_token_ids) for r in requests],
                proposal.confidences,
                proposal.strata,
            )

    def _prepare_budget(self, requests: list[Request], rooms: list[int]) -> None:
        """Adaptive verification (async mode): the next step's budget, chosen now for the step expected if nothing
        changes: every running request decodes one token and verifies its drafts (the drafter's full count, within
        its room). plan() chooses again if the step differs."""
        assert self.planner is not None and self.runner.drafter is not None
        if self.planner.mode != "async":
            return
        running = self.scheduler.running
        if self.scheduler.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
            return  # an admission or a prompt chunk would change the step
        k = self.runner.drafter.max_num_tokens
        caps = [min(k, room) for room in rooms]
        ids = [r.request_id for r, c in zip(requests, caps, strict=True) if c]
        self.planner.prepare(ids, [c for c in caps if c], len(running), len(running))

    # ---- metrics --------------------------------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, Any]:
        drafts = self.stats["spec_decode_num_drafts"]
        return {
            **self.stats,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage_perc": self.kv.usage,
            "kv_num_blocks": self.kv.num_blocks,
            "kv_num_used_blocks": self.kv.num_used_blocks,
            "prefix_cache_queries": self.kv.num_prefix_queries,
            "prefix_cache_hits": self.kv.num_prefix_hits,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_mean_acceptance_length": (
                1 + self.stats["spec_decode_num_accepted_tokens"] / drafts if drafts else None
            ),
            **(self.planner.metrics() if self.planner is not None else {}),
        }
