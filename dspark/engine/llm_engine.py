"""LLMEngine: add_request / step / abort over the scheduler and the model runner, plus output processing."""

from __future__ import annotations

import copy
import gc
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.config import EngineConfig, SamplingParams
from dspark.core.kv_cache import KVCacheManager
from dspark.core.request import Request, RequestStatus
from dspark.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from dspark.engine.detokenizer import IncrementalDetokenizer
from dspark.errors import ConfigError, DSparkError
from dspark.models.loader import load_model
from dspark.models.registry import SHIPPED_DRAFTERS, resolve_model, shipped_drafter
from dspark.models.tokenizer import load_tokenizer
from dspark.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from dspark.sample.sampler import SampledRow
from dspark.speculative.cost_model import CostModel
from dspark.speculative.drafters.base import make_drafter
from dspark.speculative.drafters.dspark.model import DSparkModel
from dspark.speculative.planner import VerificationPlanner
from dspark.speculative.trace import TraceWriter
from dspark.utils.platform import pick_device, pick_dtype, triton_available
from dspark.worker.model_runner import Launched, ModelRunner, kv_bytes_per_block, make_backend
from dspark.worker.profiler import load_or_profile

logger = logging.getLogger("dspark")


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # visible text so far (stop strings cut it)
    # Tokens not yet detokenised: a final_only request without stop strings is decoded once, when it finishes.
    deferred: list[int] | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    # Where text is deferred: a token outside `ends_on` (its EOS unless ignored, its stop token ids) that leaves the
    # request under `end_at` tokens (its max_tokens, max_model_len) cannot end it, so a continued step appends it
    # without _process (engine._process_continued). Both are conservative: min_tokens is _process's to apply.
    ends_on: frozenset[int] = frozenset()
    end_at: int = 0
    margin: int = 0  # SamplingParams.stop_text_margin, once (a property: a call per output otherwise)


def _reads_tokens(p: SamplingParams) -> bool:
    """Sampling that reads the request's tokens or returns logprobs: its next step cannot be launched before its last
    token reaches the host."""
    return p.has_penalties or p.logprobs is not None


def step_kind(has_chunk: bool, verified: bool, drafted: bool) -> str:
    """ "prefill" (the step fed a prompt chunk), else "plain", "verify+draft", "verify" or "draft"."""
    if has_chunk:
        return "prefill"
    if verified:
        return "verify+draft" if drafted else "verify"
    return "draft" if drafted else "plain"


class LLMEngine:
    def __init__(self, config: EngineConfig, cost_model: CostModel | None = None) -> None:
        """cost_model: the step-cost curves adaptive verification plans with; None: profiled at start-up (or loaded
        from the cache, where this model, drafter, device and grid were profiled before)."""
        # An earlier engine's objects were frozen (below): thaw and collect them, so that its memory (and its
        # device memory, for the KV-cache sizing below) is back before this one is built.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if self.device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
            # NOTE: with the model on the GPU, the host's tensor work is small ([R, K] survivals, sampling rows), and a
            # pool of CPU threads per op only adds wake-ups and contention with other processes (on the H200 host,
            # adaptive's C = 512 rows went from 0.28x to 0.92x of no-spec with the lazy drafting choice; the two
            # were not measured apart). OMP_NUM_THREADS set by the user wins.
            logger.info("CUDA engine: torch CPU threads %d -> 1 (OMP_NUM_THREADS overrides)", torch.get_num_threads())
            torch.set_num_threads(1)
        path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else path)
        self.model = load_model(path, self.dtype, self.device)
        if self.device.type == "cuda":  # one GEMM for q/k/v and one for gate/up (the CUDA path's fused kernels)
            self.model.fuse_weights()
            if config.batch_invariant:
                if not triton_available() or config.attention_backend == "torch":
                    raise ConfigError(
                        "batch_invariant",
                        True,
                        "on CUDA it needs Triton and attention_backend auto or triton (its kernels are what make a "
                        "row independent of its batch)",
                    )
                self.model.use_batch_invariant_gemms()
        self.model_config = self.model.config
        mcfg = self.model_config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                "max_model_len",
                self.max_model_len,
                f"at most the model's context length, {mcfg.max_position_embeddings}",
            )
        self.spec = config.spec
        self.dspark_model = self._load_dspark() if self.spec is not None and self.spec.method == "dspark" else None
        if self.dspark_model is not None and self.device.type == "cuda":
            for layer in self.dspark_model.layers:
                layer.fuse_weights()
            self.dspark_model.fuse_context_weights()
        self.num_spec_tokens = self._num_spec_tokens()
        lookahead = self.dspark_model.config.block_size if self.dspark_model is not None else 0
        num_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        if num_blocks * config.block_size < self.max_model_len + lookahead:
            raise ConfigError(
                "max_model_len",
                self.max_model_len,
                f"at most the KV cache's {num_blocks * config.block_size - lookahead} tokens "
                f"({num_blocks} blocks of {config.block_size}"
                + (f", less {lookahead} drafter lookahead slots" if lookahead else "")
                + "); lower max_model_len or give the cache more memory",
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, lookahead)
        drafter = None
        if self.spec is not None:
            drafter = make_drafter(
                self.spec,
                self.num_spec_tokens,
                self.model,
                self.dspark_model,
                num_blocks,
                config.block_size,
                self.device,
                self.dtype,
                make_backend(config.attention_backend, self.device),
            )
        verify_method = self.spec.verify_method if self.spec is not None else "strict"
        self.runner = ModelRunner(
            config,
            self.model,
            self.device,
            self.dtype,
            num_blocks,
            drafter,
            verify_method,
            self.max_model_len,
            self.num_spec_tokens,
        )
        self.planner = self._make_planner(cost_model) if self.spec is not None else None
        self.trace = (
            TraceWriter(Path(self.spec.trace_path), self._trace_header())
            if self.spec and self.spec.trace_path
            else None
        )
        self.eos_token_id = (
            self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else mcfg.eos_token_id
        )
        self._rng = random.Random(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._counter = 0
        # NOTE: everything built so far (model, tokenizer, graphs, caches) lives as long as the engine. Frozen, the
        # cyclic GC stops re-scanning it on the collections the per-step objects trigger (vLLM freezes after
        # start-up too; benchmarks/host_step.py --thaw: 1.5-6% of the host step at 256 requests on CPU). A frozen
        # cycle is never collected, so the next engine's construction thaws everything first.
        gc.collect()
        gc.freeze()
        self.last_step_kind = ""  # what the last step ran (step_kind)
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._inflight: Launched | None = None  # async scheduling: a step launched and not collected yet
        self._ending_ms = 0.0  # this step's host time spent ending requests (their final output): see _process
        self.stats = {
            "num_requests_finished": 0,
            "num_requests_aborted": 0,
            "num_requests_failed": 0,
            "num_prompt_tokens": 0,
            "num_generation_tokens": 0,
            "num_steps": 0,
            "num_pipelined_steps": 0,  # steps launched before the previous one was collected (async scheduling)
            "spec_decode_num_drafts": 0,
            "spec_decode_num_draft_tokens": 0,
            "spec_decode_num_accepted_tokens": 0,
        }
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def _load_dspark(self) -> DSparkModel:
        from dspark.speculative.drafters.dspark.checkpoint import load_drafter

        assert self.spec is not None
        return load_drafter(self._drafter_path(), self.model_config, self.dtype, self.device)

    def _drafter_path(self) -> Path:
        """The spec's drafter directory, or the one shipped for the target alias when it names none."""
        assert self.spec is not None
        if self.spec.model is not None:
            return resolve_model(self.spec.model)
        shipped = shipped_drafter(self.config.model)
        if shipped is None:
            raise ConfigError(
                "speculative_config.model",
                None,
                f"the 'dspark' method needs a drafter directory for {self.config.model!r} (one ships only for "
                f"{', '.join(SHIPPED_DRAFTERS)}); or use the 'ngram' method",
            )
        return shipped

    def _make_planner(self, cost_model: CostModel | None) -> VerificationPlanner:
        assert self.spec is not None
        mode = self.spec.adaptive_verification_mode if self.spec.enable_adaptive_verification else "fixed"
        if mode != "fixed" and cost_model is None:
            identity = {
                "model": str(resolve_model(self.config.model)),
                "drafter": self.spec.method + (f":{self._drafter_path()}" if self.spec.method == "dspark" else ""),
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
            self.num_spec_tokens, mode, self.spec.adaptive_verification_ema_alpha, cost_model, self.device, strata
        )

    def _trace_header(self) -> dict[str, Any]:
        assert self.spec is not None and self.planner is not None
        return {
            "K": self.num_spec_tokens,
            "method": self.spec.method,
            "drafter": str(self._drafter_path()) if self.spec.method == "dspark" else None,
            # The confidences are recorded calibrated: what undoes them (train/calibrate.py) must know with what.
            "sts_temperatures": self._scaling("sts_temperatures"),
            "sts_biases": self._scaling("sts_biases"),
            "model": self.config.model,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "mode": self.planner.mode,
        }

    def _scaling(self, key: str) -> list[float] | None:
        cfg = self.dspark_model.config if self.dspark_model is not None else None
        values = getattr(cfg, key, None)
        return None if values is None else list(values)

    def _num_spec_tokens(self) -> int:
        if self.spec is None:
            return 0
        k = self.spec.num_speculative_tokens
        if self.dspark_model is not None:
            block = self.dspark_model.config.block_size
            if k is not None and k > block:
                raise ConfigError(
                    "speculative_config.num_speculative_tokens", k, f"at most the drafter's block size, {block}"
                )
            return k or block
        return k or 4

    def _kv_blocks_that_fit(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.dspark_model is not None:  # the drafter's context cache shares the block tables
            per_block += kv_bytes_per_block(self.dspark_model.config.layer_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for the largest step's vocabulary-sized tensors: the captured logits and their graph's
            # scratch, the sampler's processed copies and verification's fp64 CDF (about 8 fp32 copies per row; at 2
            # copies, a verify step of 8192 tokens ran out of memory on an H200), the drafter's distributions
            # (static and returned copies), and CUDA-graph pools.
            vocab_row = self.model_config.vocab_size * 4
            drafts = self.config.max_num_seqs * self.num_spec_tokens
            reserve = 8 * self.config.max_num_batched_tokens * vocab_row + 2 * drafts * vocab_row + (2 << 30)
            budget = total * self.config.gpu_memory_utilization - (total - free) - reserve
        else:
            budget = self.config.kv_cache_memory_gb * (1 << 30)
        return max(1, int(budget // per_block))

    # ---- requests -------------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        # NOTE: the request's own copy: a continued step does not check again what its requests passed when the chain
        # began (engine._continuation), so a caller's later change to a shared SamplingParams must not reach it.
        params = copy.deepcopy(params) if params is not None else SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ConfigError("prompt_token_ids", bad, f"token ids must be integers in [0, {vocab})")
        if not ids:
            raise ConfigError("prompt", prompt, "must not be empty")
        vocab = self.model_config.vocab_size
        bad_stop = next((t for t in params.stop_token_ids or [] if t >= vocab), None)
        if bad_stop is not None:
            raise ConfigError("stop_token_ids", bad_stop, f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                "prompt",
                f"<{len(ids)} tokens>",
                f"at most max_model_len - 1 = {self.max_model_len - 1} tokens, so that one can be generated",
            )
        if request_id is None:
            request_id = f"req-{self._counter}"
        if request_id in self._tracked:
            raise ConfigError("request_id", request_id, "must be unique among unfinished requests")
        self._counter += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, text, ids, params, seed, self.eos_token_id)
        # NOTE: nobody reads the text of a final_only request before it ends, and without stop strings nothing checks
        # it: deferring it took the host step from 1.98 to 1.50 ms (benchmarks/host_step.py, C = 256, CPU).
        defer = params.output_kind == "final_only" and not params.stop
        tracked = _Tracked(req, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
        tracked.margin = params.stop_text_margin
        if defer:
            tracked.deferred = []
            eos = () if params.ignore_eos or req.eos_token_id is None else (req.eos_token_id,)
            tracked.ends_on = frozenset((*eos, *params.stop_token_ids))
            limit = self.max_model_len
            tracked.end_at = limit if params.max_tokens is None else min(limit, len(ids) + params.max_tokens)
        self._tracked[request_id] = tracked
        self.scheduler.add(req)
        self.stats["num_prompt_tokens"] += len(ids)
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                self._finish(tracked.request, RequestStatus.FINISHED_ABORTED)
                self.stats["num_requests_aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # ---- the step -------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced a token or finished (for output_kind
        "final_only", only for those that finished).

        A fault while one request's output is processed (its detokenizer, say) finishes that request alone, with
        finish_reason "error" and its blocks freed; it is logged with its traceback. A fault of the step itself (the
        model runner, drafting) propagates from here, leaving the requests in flight to the caller, who aborts them;
        the engine then serves new requests."""
        try:
            return self._step()
        except BaseException:
            # NOTE: a step launched ahead (async scheduling) continues one that was not processed: run after a fault,
            # its tokens would take the place of the lost ones. Dropped, the requests recompute from what they have.
            self._inflight = None
            raise

    def _step(self) -> list[RequestOutput]:
        launched, self._inflight = self._inflight, None
        if launched is not None and all(s.request.status.finished for s in launched.sched.scheduled):
            # NOTE: every request of the step launched ahead ended since (EOS, a stop string, an abort): nothing to
            # collect. Dropped uncollected (the device runs it before anything queued later), it neither delays the
            # next request by a step nor reaches the regime as a plain step lasting the whole idle gap since.
            launched = None
            if self.planner is not None:
                self.planner.skip_timing()
        continued = launched is not None  # launched by the previous call, before it collected its own step
        if launched is None:
            sched = self.scheduler.schedule()
            for rid in sched.preempted:  # their drafts were dropped; so go the distributions they were drawn from
                self.runner.release(rid, finished=False)
                if self.planner is not None:
                    self.planner.drop_drafts(rid)
            if not sched.scheduled:
                if self.scheduler.has_unfinished():
                    raise DSparkError("scheduler made no progress: the KV cache cannot hold even one request")
                return []
            now = time.monotonic()
            for s in sched.scheduled:
                s.request.first_scheduled_time = s.request.first_scheduled_time or now
            if self.planner is not None:
                self.planner.step_started()
                self.planner.plan(sched)  # adaptive verification: cut each request's drafts to those worth verifying
            launched = self.runner.launch(sched)
        sched = launched.sched
        num_held = (
            {}
            if sched.continued
            else {s.request.request_id: len(s.spec_token_ids) for s in sched.scheduled if s.spec_token_ids}
        )
        # A request past its prefill feeds one token (its last) besides its drafts; any other feeds a prompt chunk.
        has_chunk = not sched.continued and any(
            not s.continues and s.request.num_computed_tokens + 1 < s.request.num_tokens for s in sched.scheduled
        )
        # Async scheduling: the next step is launched now, before this one's tokens reach the host, so that the device
        # runs it while the host processes these.
        draft_choice = None
        nxt = self._continuation(launched)
        if isinstance(nxt, bool):  # not continued: the drafting choice it was refused for
            draft_choice = nxt
        elif nxt is not None:
            draft_choice = False
            if self.planner is not None and not continued:
                self.planner.skip_timing()  # its measured time would include the next step's launch
            self._inflight = self.runner.launch(nxt, previous=launched)
        waited = time.perf_counter()
        result = self.runner.collect(launched)
        wait_ms = (time.perf_counter() - waited) * 1e3  # the planner's timing of the next continued step needs it
        self.stats["num_steps"] += 1
        self.stats["num_pipelined_steps"] += continued
        now = time.monotonic()
        outputs = []
        drafting: list[Request] = []
        records = []
        if self.planner is not None:  # before finished requests are released
            outcomes = [
                (s.request.request_id, len(s.spec_token_ids), result.num_accepted.get(s.request.request_id, 0))
                for s in sched.scheduled
                if s.request.request_id in num_held
            ]
            records = self.planner.record(outcomes, trace=self.trace is not None)
        num_live = num_emitted = 0  # the requests this step served, and their tokens (a voided token is neither)
        # NOTE: what runs between step() calls (an abort's freeing, the caller's own work) is not counted: it is outside
        # an event-timed step, though inside a continued step's interval.
        self._ending_ms = 0.0
        # NOTE: a continued step's drafting choice is made (plain): no list of who would draft. At C = 1024 its appends
        # were most of what adaptive's plain step added on the host: _step's own time 0.71 against no-spec's 0.60 ms a
        # step (cProfile of benchmarks/host_step.py --spec --async-scheduling, 2-vCPU machine).
        may_draft = self.spec is not None and draft_choice is not False
        if result.tokens is not None:
            num_live = num_emitted = self._process_continued(
                sched.scheduled, result.tokens, now, outputs, drafting if may_draft else None
            )
        else:
            for s in sched.scheduled:
                req = s.request
                if req.status.finished:  # stopped or aborted after its continued step was launched: that token is void
                    continue
                num_live += 1
                sampled = result.sampled.get(req.request_id)
                num_rejected = 0
                if s.spec_token_ids:
                    num_rejected = len(s.spec_token_ids) - result.num_accepted[req.request_id]
                    self._count_spec(req, len(s.spec_token_ids), result.num_accepted[req.request_id])
                if req.spec_token_ids:
                    req.spec_token_ids = []
                # Rejected drafts' KV stays where it is, past num_computed_tokens, to be overwritten later.
                req.num_computed_tokens += s.num_new_tokens - num_rejected
                if sampled is None:  # a prompt chunk: its tokens are all known already
                    self.kv.cache_computed_blocks(req)
                else:
                    num_emitted += len(sampled)
                    req.first_token_time = req.first_token_time or now
                    out = self._process_guarded(req, [row.token_id for row in sampled], sampled, now)
                    if out is not None:
                        outputs.append(out)
                    if may_draft and not req.status.finished and req.sampling_params.max_speculative_tokens != 0:
                        drafting.append(req)
        if draft_choice is None:
            draft_choice = bool(drafting) and (
                self.planner is None or self.planner.should_draft([r.request_id for r in drafting])
            )
        drafted = draft_choice and bool(drafting)
        if drafted:
            self._draft(drafting)
        # What the step ran, for diagnosis (bench sweep times each kind): "prefill" if it fed a prompt chunk, else
        # whether it verified drafts and whether it drafted.
        self.last_step_kind = step_kind(has_chunk, bool(num_held), drafted)
        if self.planner is not None:
            if continued:
                self.planner.continued_step_finished(
                    num_live, num_emitted, bool(self._inflight), drafted, ending_ms=self._ending_ms, wait_ms=wait_ms
                )
            else:
                self.planner.step_finished(
                    drafted,
                    num_emitted,
                    chain_starts=self._inflight is not None,
                    ending_ms=self._ending_ms,
                    wait_ms=wait_ms,
                )
        if self.trace is not None and records:
            self.trace.step(
                self.stats["num_steps"], sched.num_tokens - sum(r["num_verified"] for r in records), records
            )
        return outputs

    def _continuation(self, launched: Launched) -> SchedulerOutput | bool | None:
        """Async scheduling: the step that continues `launched` (collected next), or None where the next step needs
        the host: a prompt chunk, drafts, preemption, a waiting request with a free seat, penalties or logprobs (they
        read the tokens), running requests left out. False or True: the drafting choice for `launched`'s requests when
        it is what refused (adaptive speculation asked now, before the step is collected; the step keeps that answer).

        Every request of `launched` continues unless that step ends it by length; one that stops otherwise (EOS, a
        stop string, an abort) has its continued token dropped when that step is collected (the KV it wrote lies past
        the request's tokens, in blocks freed with it, and the device runs anything later written there after it)."""
        sched = launched.sched
        # A waiting request that could be admitted now goes first; one that could not (every seat taken) does not
        # stop the overlap: a saturated server always has a queue.
        admissible = self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.max_num_seqs
        if not self.async_scheduling or launched.tokens is None or admissible or sched.preempted:
            return None
        active = [s.request for s in sched.scheduled if not s.request.status.finished]
        # NOTE: a continued step's requests passed these checks when it was built, and nothing in them changes (a
        # request's sampling parameters are fixed): not asked again, request by request, every step.
        if len(active) != len(self.scheduler.running) or (
            not sched.continued
            and not all(
                s.samples and s.num_new_tokens == 1 and not _reads_tokens(s.request.sampling_params)
                for s in sched.scheduled
            )
        ):
            return None
        # launched's token is not appended yet: a request continues if it may emit at least one more after it. NOTE:
        # num_tokens and num_output_tokens spelled out (lengths; properties cost a call per request and step).
        max_model_len = self.max_model_len
        going_on = []
        for r in active:
            n = len(r.all_token_ids) + 1
            max_tokens = r.sampling_params.max_tokens
            if n < max_model_len and (max_tokens is None or n - len(r.prompt_token_ids) < max_tokens):
                going_on.append(r)
        if not going_on:
            return None
        if self.spec is not None:
            drafting = [r.request_id for r in going_on if r.sampling_params.max_speculative_tokens != 0]
            if drafting and (self.planner is None or self.planner.should_draft(drafting)):
                return True
        # The KV of launched's token and of this one's, and the drafter's lookahead past them: the regime may choose
        # to draft after this step (without the lookahead that drafting ran past the block table, on the H200).
        lookahead = self.scheduler.num_lookahead_tokens
        if not self.kv.allocate_decode(going_on, 2, lookahead=lookahead):
            return False if self.spec is not None else None  # the drafting choice was asked: plain
        if sched.continued and len(going_on) == len(sched.scheduled):
            # NOTE: the same requests in the same order (going_on keeps sched's order): a continued step's entries are
            # all alike (one token, no drafts, continues, samples) and nothing changes them (planning cuts drafts of
            # steps launched alone only), so they serve again instead of 1024 new ones a step at C = 1024.
            return SchedulerOutput(sched.scheduled, continued=True)
        return SchedulerOutput([ScheduledRequest(r, 1, continues=True) for r in going_on], continued=True)

    def _process_continued(
        self,
        scheduled: list[ScheduledRequest],
        tokens: list[int],
        now: float,
        outputs: list[RequestOutput],
        drafting: list[Request] | None,
    ) -> int:
        """A continued step's tokens, one plain token per request in the step's order: what the general loop of _step
        does, less what such a step cannot hold (drafts, prompt chunks, logprobs). Outputs go to `outputs`; requests
        still running that may draft, to `drafting` (None: the step's drafting choice is made, plain). Returns the
        number of live requests (each emitted a token).

        NOTE: the steady state at high load, request by request: at C = 1024 about half of a plain step's host work
        (host_step.py), most of it _process's calls. A final_only request whose text is deferred, with a token that
        cannot end it (_Tracked.ends_on, end_at), only appends it: nothing else of _process applies to it."""
        tracked_of = self._tracked
        quiet: list[Request] = []  # appended without _process; counted and their blocks registered from `done` on
        done = num_live = 0
        try:
            for s, token in zip(scheduled, tokens, strict=True):
                req = s.request
                if req.status.finished:  # stopped or aborted after this step was launched: its token is void
                    continue
                num_live += 1
                req.num_computed_tokens += 1  # first_token_time: set when the step it continues was collected
                tracked = tracked_of[req.request_id]
                all_ids = req.all_token_ids
                if tracked.deferred is not None and token not in tracked.ends_on and len(all_ids) + 1 < tracked.end_at:
                    all_ids.append(token)
                    tracked.deferred.append(token)
                    quiet.append(req)
                else:
                    # The quiet requests before this one first, in step order: a block they filled is registered
                    # before one this request fills with the same tokens, as _process for each in turn would.
                    done = self._quiet_done(quiet, done)
                    out = self._process_guarded(req, (token,), None, now)
                    if out is not None:
                        outputs.append(out)
                    if req.status.finished:
                        continue
                if drafting is not None and req.sampling_params.max_speculative_tokens != 0:
                    drafting.append(req)
        finally:  # a fault that propagates still counts the tokens appended
            self._quiet_done(quiet, done)
        return num_live

    def _quiet_done(self, quiet: list[Request], done: int) -> int:
        """Count quiet[done:]'s tokens (one each) and register the blocks they filled; returns len(quiet)."""
        if len(quiet) > done:
            self.stats["num_generation_tokens"] += len(quiet) - done
            self.kv.cache_computed_blocks_of(quiet[done:] if done else quiet)
        return len(quiet)

    def _draft(self, requests: list[Request]) -> None:
        """Propose the drafts each request verifies next step, cut to what it could still emit."""
        proposal = self.runner.propose(requests)  # queued on the device; the tokens reach the host when first read
        rooms = []
        for req in requests:
            p = req.sampling_params
            room = self.max_model_len - req.num_tokens - 1  # verified tokens plus the bonus must fit
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            if p.max_speculative_tokens is not None:
                room = min(room, p.max_speculative_tokens)
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
        its room). plan() chooses again if the step differs. NOTE: on the H200 plan() took 2.5 ms of a 37.5 ms
        drafting step at C = 1024 (step_profile.py), the device idle meanwhile; on the 2-vCPU machine the choice and
        its harvest were ~40% of plan() at R = 1024 (benchmarks/planner_host.py --prepare)."""
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

    def _process_guarded(
        self, req: Request, tokens: Sequence[int], rows: list[SampledRow] | None, now: float
    ) -> RequestOutput | None:
        """_process, a fault in it failing this request alone."""
        try:
            return self._process(req, tokens, rows, now)
        except Exception:
            # NOTE: a fault in one request's output (its detokenizer, a stop check) fails that request alone: the
            # batch's others already have their tokens and go on. What faults the whole step (the model runner,
            # drafting) is not caught, and propagates from step().
            if req.status.finished:  # it came while finishing the request: the engine's state is in doubt
                raise
            logger.exception("request %s failed while its output was processed", req.request_id)
            return self._fail(req, now)

    def _process(
        self, req: Request, tokens: Sequence[int], rows: list[SampledRow] | None, now: float
    ) -> RequestOutput | None:
        """Append this step's tokens in order; the first that finishes the request ends it (the rest are dropped).
        rows: the tokens' sampled rows (their logprobs, if any), or None (a continued step's: none)."""
        tracked = self._tracked[req.request_id]
        status = None
        num_appended = 0  # counted once, not token by token (a token appended before a fault is counted)
        try:
            for i, token in enumerate(tokens):
                num_appended += 1
                status = self._append(tracked, token, None if rows is None else rows[i])
                if status is not None:
                    break
        finally:
            self.stats["num_generation_tokens"] += num_appended
        # NOTE: after the accepted drafts are appended (a block's hash needs its tokens), before finishing frees it.
        self.kv.cache_computed_blocks(req)
        if status is None:
            return None if req.sampling_params.output_kind == "final_only" else self._output(tracked, finished=False)
        # Ending a request (its deferred text, freeing it, its final output) costs host time once per request whatever
        # the regime: the planner takes it out of the step's measured time. NOTE: counted in, the steps where a sweep
        # row's requests ended (64 at once at the end of a C = 64 row, ~70 at a time in a C = 256 row's tail) put
        # level 7's plain rate at 6 tokens/ms against a real ~50 on the H200, which implies at least ~0.14 ms a request
        # there, and C = 64 rows then drafted at 0.45-0.68x of no-spec (session 8).
        start = time.perf_counter()
        try:
            if tracked.deferred:
                tracked.text += tracked.detok.add_all(tracked.deferred)
                tracked.deferred = []
            self._finish(req, status, now)
            del self._tracked[req.request_id]
            return self._output(tracked, finished=True)
        finally:
            self._ending_ms += (time.perf_counter() - start) * 1e3

    def _append(self, tracked: _Tracked, token: int, sampled: SampledRow | None) -> RequestStatus | None:
        req = tracked.request
        p = req.sampling_params
        req.all_token_ids.append(token)
        if sampled is not None and sampled.logprob is not None:
            entry = {token: Logprob(sampled.logprob, sampled.rank or 1)}
            for rank, (tid, lp) in enumerate(sampled.top_logprobs or [], start=1):
                entry.setdefault(tid, Logprob(lp, rank))  # the sampled token keeps its own rank (ties: equal)
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            req.logprobs.append(entry)
            req.cumulative_logprob += sampled.logprob

        status = None
        num_tokens = len(req.all_token_ids)  # NOTE: not the properties: a call each, per request and step
        n_out = num_tokens - len(req.prompt_token_ids)
        if n_out >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        # As vLLM: the text of the token that stopped the request is left out unless asked for.
        keep_text = status is None or p.include_stop_str_in_output
        if tracked.deferred is not None:
            if keep_text:
                tracked.deferred.append(token)
            delta = ""
        else:
            delta = tracked.detok.add([token]) if keep_text else ""
            tracked.text += delta
        if status is None and delta and p.stop and n_out >= p.min_tokens:
            status = self._check_stop_strings(tracked, len(delta))
        if status is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        return status

    def _check_stop_strings(self, tracked: _Tracked, delta_len: int) -> RequestStatus | None:
        req, p = tracked.request, tracked.request.sampling_params
        text = tracked.text
        best: tuple[int, str] | None = None
        for stop in p.stop:
            start = max(0, len(text) - delta_len - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        tracked.text = text[: idx + len(stop)] if p.include_stop_str_in_output else text[:idx]
        req.stop_reason = stop
        return RequestStatus.FINISHED_STOPPED

    def _fail(self, req: Request, now: float) -> RequestOutput:
        """Finish the request with finish_reason "error", freeing its blocks; its final output carries what it had."""
        start = time.perf_counter()
        try:
            tracked = self._tracked.pop(req.request_id)
            self._finish(req, RequestStatus.FINISHED_ERROR, now)
            self.stats["num_requests_failed"] += 1
            return self._output(tracked, finished=True)
        finally:
            self._ending_ms += (time.perf_counter() - start) * 1e3

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        self.scheduler.finish(req, status)
        self.runner.release(req.request_id)
        if self.planner is not None:
            self.planner.release(req.request_id)
        req.finished_time = now or time.monotonic()
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.stats["num_requests_finished"] += 1

    def _output(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        req = tracked.request
        # While a stop string could still be completing, hold back its possible beginning from the stream.
        visible = len(tracked.text) if finished else max(0, len(tracked.text) - tracked.margin)
        visible = max(visible, tracked.num_sent_chars)
        new_text = tracked.text[tracked.num_sent_chars : visible]
        num_prompt = len(req.prompt_token_ids)
        num_sent = tracked.num_sent_tokens
        new_ids = req.all_token_ids[num_prompt + num_sent :]
        tracked.num_sent_chars, tracked.num_sent_tokens = visible, num_sent + len(new_ids)
        logprobs = req.logprobs if req.sampling_params.logprobs is not None else None
        if req.sampling_params.output_kind == "delta":
            # NOTE: what this output adds, not all so far (no copy of the request's whole ids and logprobs): a
            # streamed step at C = 1024 took 10.1-12.1 ms of host work so, 16.5-16.9 ms cumulative (host_step.py,
            # 2-vCPU machine).
            text, output_ids = new_text, new_ids
            logprobs = logprobs[num_sent:] if logprobs is not None else None
        else:
            text = tracked.text
            output_ids = req.all_token_ids[num_prompt:]  # a copy per output (the list grows; callers keep it)
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=output_ids,
            cumulative_logprob=req.cumulative_logprob if req.sampling_params.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_generation_tokens=req.num_output_tokens,
            num_preemptions=req.num_preemptions,
            spec_num_drafts=req.spec_num_drafts,
            spec_num_draft_tokens=req.spec_num_draft_tokens,
            spec_num_accepted_tokens=req.spec_num_accepted_tokens,
        )
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, metrics, new_text, new_ids
        )

    # ---- metrics --------------------------------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, Any]:
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
                1 + self.stats["spec_decode_num_accepted_tokens"] / self.stats["spec_decode_num_drafts"]
                if self.stats["spec_decode_num_drafts"]
                else None
            ),
            **(self.planner.metrics() if self.planner is not None else {}),
        }
