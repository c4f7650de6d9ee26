"""Continuous batching with chunked prefill and preemption by recompute; FCFS. Never touches tensors.

There is no prefill or decode phase: every step each running request gets the tokens it still lacks
(num_tokens - num_computed_tokens: a prompt chunk, or the one token sampled last step) plus, with speculative
decoding, the drafts proposed for it last step, within max_num_seqs and the max_num_batched_tokens budget (drafts are
cut first when the budget runs short). A request that will sample also reserves the drafter's lookahead slots.
When the KV cache is full, the most recently admitted running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed from its prompt plus what it has generated so far (its prefix may still
be cached). Sampling is seeded per output position, so its output is unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.core.kv_cache import KVCacheManager
from dspark.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step, drafts included
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step: the last tokens fed
    # Async scheduling: the request continues from a step launched and not yet collected. It feeds the token that step
    # samples for it (on the device, not appended yet), one position after that step's, and samples the next.
    continues: bool = False
    samples: bool = field(init=False)  # this step brings the request level with its tokens, so it emits one

    def __post_init__(self) -> None:
        # NOTE: fixed now, while num_computed_tokens still counts the tokens before this step.
        num_plain = self.num_new_tokens - len(self.spec_token_ids)
        self.samples = self.continues or self.request.num_computed_tokens + num_plain == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What crosses from the scheduler to the model runner in one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Async scheduling: every request continues from the step launched before this one, feeding one token (built by
    # StepPolicy.next_step, whose checks of that step's requests then hold for this one's, a subset of them).
    continued: bool = False
    # A pipelined speculative step (continued): (drafts to verify in all, whether to draft the next block). Its tokens,
    # positions and drafts live on the device (worker/spec_pipeline.py).
    pipelined: tuple[int, bool] | None = None
    pipelined_ok: bool = False  # its requests passed the pipeline's checks (they hold for its continuations)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, num_lookahead_tokens: int = 0
    ) -> None:
        self.kv = kv
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_plain = req.num_tokens - req.num_computed_tokens
            num_new = min(num_plain + len(req.spec_token_ids), budget)
            spec = req.spec_token_ids[: max(0, num_new - num_plain)]
            lookahead = self.num_lookahead_tokens if num_new >= num_plain else 0
            fits = self.kv.allocate(req, num_new, lookahead=lookahead)
            if not fits and spec:  # short of blocks: shed the drafts before preempting anyone
                spec, num_new = [], num_plain
                fits = self.kv.allocate(req, num_new, lookahead=lookahead)
            while not fits:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
                fits = self.kv.allocate(req, num_new, lookahead=lookahead)
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, spec))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it can fit either

        # Admit waiting requests only when nobody was preempted this step (they would just thrash).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            prefix_blocks, num_prefix = self.kv.computed_prefix(req)  # waiting requests have nothing computed
            num_new = min(req.num_tokens - req.num_computed_tokens - num_prefix, budget)
            samples = num_prefix + num_new == req.num_tokens
            if not self.kv.allocate(req, num_new, prefix_blocks, self.num_lookahead_tokens if samples else 0):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []  # drafted for a context it will recompute
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark a request finished (stopped, length or aborted) and free its blocks, wherever it is."""
        if req.status.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free_request(req)
