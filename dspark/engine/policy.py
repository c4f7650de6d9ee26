"""What the next step is, decided before this one's tokens reach the host (async scheduling): launched ahead as a
plain continued step, launched ahead as a pipelined speculative step, or launched once this step is collected (and
drafted for on the host, or not).

The engine core asks after launching a step (next_step) and at a step's end (pipeline_takes_over). Whatever is chosen
reads only past steps' results and the load, never a draft's value, so verification stays lossless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.config import SamplingParams
from dspark.core.request import Request
from dspark.core.scheduler import ScheduledRequest, SchedulerOutput
from dspark.worker.model_runner import Launched

if TYPE_CHECKING:
    from dspark.engine.core import EngineCore


def reads_tokens(p: SamplingParams) -> bool:
    """Sampling that reads the request's tokens or returns logprobs: its next step cannot be launched before its last
    token reaches the host."""
    return p.has_penalties or p.logprobs is not None


class StepPolicy:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def next_step(self, launched: Launched) -> SchedulerOutput | bool | None:
        """Async scheduling: the step that continues `launched` (collected next), or None where the next step needs
        the host: a prompt chunk, drafts, preemption, a waiting request with a free seat, penalties or logprobs (they
        read the tokens), running requests left out. False or True: the drafting choice for `launched`'s requests when
        it is what refused (adaptive speculation asked now, before the step is collected; the step keeps that answer).

        Every request of `launched` continues unless that step ends it by length; one that stops otherwise (EOS, a
        stop string, an abort) has its continued token dropped when that step is collected (the KV it wrote lies past
        the request's tokens, in blocks freed with it, and the device runs anything later written there after it)."""
        sched, core = launched.sched, self.core
        # A waiting request that could be admitted now goes first; one that could not (every seat taken) does not
        # stop the overlap: a saturated server always has a queue.
        admissible = core.scheduler.waiting and len(core.scheduler.running) < core.scheduler.max_num_seqs
        pipelined = launched.spec is not None
        if not core.async_scheduling or (launched.tokens is None and not pipelined) or admissible or sched.preempted:
            return None
        active = [s.request for s in sched.scheduled if not s.request.status.finished]
        # A continued step's requests passed these checks when it was built, and nothing in them changes (a request's
        # sampling parameters are fixed): not asked again, request by request, every step.
        if len(active) != len(core.scheduler.running) or (
            not sched.continued
            and not all(s.samples and not reads_tokens(s.request.sampling_params) for s in sched.scheduled)
        ):
            return None
        # A plain continuation feeds one token where launched fed one (a pipeline may start after a prompt's end).
        single = sched.continued or all(s.num_new_tokens == 1 for s in sched.scheduled)
        # launched's token is not appended yet: a request continues if it may emit at least one more after it.
        going_on = [r for r in active if len(r.all_token_ids) + 1 < r.end_at]
        if not going_on:
            return None
        if core.spec is not None:
            drafting = [r.request_id for r in going_on if r.sampling_params.max_speculative_tokens != 0]
            if drafting and (core.planner is None or core.planner.should_draft(drafting)):
                nxt = self._pipelined(sched, going_on)
                return True if nxt is None else nxt
        if pipelined or not single:  # positions the host does not know yet: launched once this step is collected
            return None
        # The KV of launched's token and of this one's, and the drafter's lookahead past them: the regime may choose
        # to draft after this step.
        lookahead = core.scheduler.num_lookahead_tokens
        if not core.kv.allocate_decode(going_on, 2, lookahead=lookahead):
            return False if core.spec is not None else None  # the drafting choice was asked: plain
        if sched.continued and len(going_on) == len(sched.scheduled):
            # The same requests in the same order (going_on keeps sched's order): a continued step's entries are all
            # alike (one token, no drafts, continues, samples) and nothing changes them, so they serve again.
            return SchedulerOutput(sched.scheduled, continued=True)
        return SchedulerOutput([ScheduledRequest(r, 1, continues=True) for r in going_on], continued=True)

    def pipeline_takes_over(self, drafting: list[Request] | None) -> bool:
        """Whether these requests' drafts are better left to a pipelined step: the next step, launched alone, feeds
        their last tokens without drafts, and the step after it starts a pipeline (drafting on the host now would make
        that step a verification, which no step can continue on the device)."""
        core = self.core
        pipeline, planner = core.runner.pipeline, core.planner
        if not drafting or pipeline is None or planner is None or planner.mode == "sync" or not core.async_scheduling:
            return False
        return len(drafting) <= pipeline.max_rows and all(
            r.sampling_path != "general" and not reads_tokens(r.sampling_params) for r in drafting
        )

    def _pipelined(self, sched: SchedulerOutput, going_on: list[Request]) -> SchedulerOutput | None:
        """The pipelined speculative step (worker/spec_pipeline.py) that continues `sched` and drafts, or None where
        the requests need the host's drafting: no device pipeline, synchronous verification (it reads live survivals
        on the host), a request sampling with more than a temperature, one too near max_model_len for two more steps
        and a block, or a KV cache too full for them."""
        core = self.core
        pipeline, planner = core.runner.pipeline, core.planner
        if pipeline is None or planner is None or planner.mode == "sync" or len(going_on) > pipeline.max_rows:
            return None
        k, block = core.num_spec_tokens, core.scheduler.num_lookahead_tokens
        # The tokens the step in flight may add (up to k + 1), this step's (up to k + 1) and the next block's slots.
        span = 2 * (k + 1) + block
        if not sched.pipelined_ok and any(r.sampling_path == "general" for r in going_on):
            return None
        if max(len(r.all_token_ids) for r in going_on) + span > core.max_model_len:
            return None
        if sched.continued:
            if not core.kv.allocate_decode(going_on, 2 * (k + 1), lookahead=block):
                return None
        else:  # the step in flight computes its tokens (a prompt's last chunk, say) before this one's
            fed = {s.request.request_id: s.num_new_tokens for s in sched.scheduled}
            if not all(core.kv.allocate(r, fed[r.request_id] + k + 1, lookahead=block) for r in going_on):
                return None
        caps = [k if (c := r.sampling_params.max_speculative_tokens) is None else min(k, c) for r in going_on]
        budget = planner.pipelined_budget([r.request_id for r in going_on], caps) if sched.pipelined else 0
        budget = min(budget, core.scheduler.max_num_batched_tokens - len(going_on))  # the step's token budget
        if sched.continued and len(going_on) == len(sched.scheduled):
            return SchedulerOutput(sched.scheduled, continued=True, pipelined=(budget, True), pipelined_ok=True)
        entries = [ScheduledRequest(r, 1, continues=True) for r in going_on]
        return SchedulerOutput(entries, continued=True, pipelined=(budget, True), pipelined_ok=True)
