"""Scheduler driven without a model: the test plays the engine (advance num_computed_tokens, cache blocks, append
a sampled token) and checks the batching invariants every step."""

from __future__ import annotations

from dspark.config import SamplingParams
from dspark.core.kv_cache import KVCacheManager
from dspark.core.request import Request, RequestStatus
from dspark.core.scheduler import Scheduler, SchedulerOutput
from helpers import SchedulerHarness

BS = 4


def make_req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, None, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0, eos_token_id=None)


def fake_token(req: Request) -> int:
    """Deterministic in (request, output position), so a recomputed request must produce the same output."""
    return 10_000 + 100 * int(req.request_id[1:]) + req.num_output_tokens


class Harness(SchedulerHarness):
    def __init__(self, num_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> None:
        self.kv = KVCacheManager(num_blocks, BS)
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
        self.finished: list[Request] = []

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self) -> SchedulerOutput:
        sched, kv = self.sched, self.kv
        out = sched.schedule()
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert all(s.num_new_tokens > 0 for s in out.scheduled)
        # Running requests advance in order; one is skipped only when the budget is spent.
        running_scheduled = [s.request for s in out.scheduled if s.request in sched.running]
        assert running_scheduled == sched.running[: len(running_scheduled)]
        if len(running_scheduled) < len(sched.running):
            assert out.num_tokens == sched.max_num_batched_tokens
        for rid in out.preempted:
            assert rid not in ids
        for s in out.scheduled:
            req = s.request
            samples = s.samples  # read before num_computed_tokens moves, as the model runner does
            req.num_computed_tokens += s.num_new_tokens
            assert req.num_computed_tokens <= req.num_tokens
            assert len(req.block_ids) * BS >= req.num_computed_tokens
            assert samples == (req.num_computed_tokens == req.num_tokens)
            kv.cache_computed_blocks(req)
            if samples:
                req.all_token_ids.append(fake_token(req))
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(req)
        self.check_blocks()
        return out


def expected_output(req: Request) -> list[int]:
    base = 10_000 + 100 * int(req.request_id[1:])
    return [base + i for i in range(req.sampling_params.max_tokens)]


def test_chunked_prefill_splits_a_long_prompt_under_the_budget() -> None:
    h = Harness(num_blocks=64, max_num_batched_tokens=8)
    a = make_req("r0", list(range(30)), max_tokens=3)
    b = make_req("r1", list(range(100, 105)), max_tokens=2)
    h.add(a, b)
    steps = [[(s.request.request_id, s.num_new_tokens) for s in h.step().scheduled] for _ in range(4)]
    assert steps == [
        [("r0", 8)],
        [("r0", 8)],
        [("r0", 8)],
        [("r0", 6), ("r1", 2)],  # a's last chunk, then b fills the rest of the budget
    ]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 2
    out = h.step()  # a decodes 1 token first (running first), b gets 3 more prompt tokens and samples
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 3)]
    h.run()
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert h.kv.num_used_blocks == 0


def test_budget_and_seq_limits_over_a_mixed_workload() -> None:
    h = Harness(num_blocks=200, max_num_seqs=3, max_num_batched_tokens=10)
    reqs = [make_req(f"r{i}", list(range(i * 50, i * 50 + 3 + 4 * i)), max_tokens=1 + i % 4) for i in range(8)]
    h.add(*reqs)
    outs = h.run()
    assert max(len(o.scheduled) for o in outs) == 3
    assert max(o.num_tokens for o in outs) == 10
    for r in reqs:
        assert r.output_token_ids == expected_output(r)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert h.kv.num_used_blocks == 0
    assert h.sched.num_preemptions == 0


def test_max_num_seqs_and_fcfs_admission_order() -> None:
    h = Harness(num_blocks=64, max_num_seqs=2)
    reqs = [make_req(f"r{i}", list(range(i * 10, i * 10 + 3)), max_tokens=2 + (i == 0)) for i in range(5)]
    h.add(*reqs)
    first_scheduled: list[str] = []
    while h.sched.has_unfinished():
        out = h.step()
        assert len(out.scheduled) <= 2
        for s in out.scheduled:
            if s.request.request_id not in first_scheduled:
                first_scheduled.append(s.request.request_id)
    assert first_scheduled == ["r0", "r1", "r2", "r3", "r4"]


def test_fcfs_head_of_queue_is_not_skipped() -> None:
    h = Harness(num_blocks=4)
    a = make_req("r0", list(range(2 * BS)), max_tokens=2)  # 2 blocks + 1 for its first output token
    big = make_req("r1", list(range(100, 100 + 2 * BS)), max_tokens=1)  # needs 2 blocks
    small = make_req("r2", [7], max_tokens=1)  # needs 1 block: would fit, but must wait behind big
    h.add(a)
    h.step()
    h.add(big, small)
    out = h.step()  # a grows to a third block; one block is left
    assert [s.request.request_id for s in out.scheduled] == ["r0"]
    assert list(h.sched.waiting) == [big, small]
    h.run()
    assert [r.request_id for r in h.finished] == ["r0", "r1", "r2"]


def test_preemption_under_a_tiny_cache_victim_is_last_running() -> None:
    h = Harness(num_blocks=4)
    a, b, c = (make_req(f"r{i}", list(range(i * 10, i * 10 + BS)), max_tokens=6) for i in range(3))
    h.add(a, b, c)
    out = h.step()  # each prompt fills one block exactly; 3 blocks used
    assert [s.request for s in out.scheduled] == [a, b, c] and h.kv.num_free_blocks == 1
    c_block = c.block_ids[0]
    out = h.step()  # a takes the last block; b needs one too: c (last running) is preempted
    assert out.preempted == ["r2"]
    assert [s.request for s in out.scheduled] == [a, b]
    assert h.sched.running == [a, b]
    assert h.sched.waiting[0] is c
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    assert c.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert c.output_token_ids == expected_output(c)[:1]  # what it generated is kept for the recompute
    assert c_block in b.block_ids  # c's freed block went to b, evicting c's cached prompt block
    assert h.kv.computed_prefix(c) == ([], 0)
    h.run()
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert h.kv.num_used_blocks == 0


def test_preempted_request_goes_to_the_front_of_the_queue() -> None:
    h = Harness(num_blocks=4, max_num_seqs=3)
    a, b, c, d = (make_req(f"r{i}", list(range(i * 10, i * 10 + BS)), max_tokens=3) for i in range(4))
    h.add(a, b, c, d)
    h.step()  # a, b, c admitted (max_num_seqs), d waits
    assert list(h.sched.waiting) == [d]
    out = h.step()
    assert out.preempted == ["r2"]
    assert list(h.sched.waiting) == [c, d]  # ahead of d, which arrived later but never ran
    order = []
    while h.sched.has_unfinished():
        order += [s.request.request_id for s in h.step().scheduled if s.request.request_id not in order]
    assert order.index("r2") < order.index("r3")
    assert [r.output_token_ids for r in (a, b, c, d)] == [expected_output(r) for r in (a, b, c, d)]


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    h = Harness(num_blocks=3)
    a = make_req("r0", list(range(BS)), max_tokens=3)
    b = make_req("r1", list(range(100, 100 + BS)), max_tokens=3)
    h.add(a, b)
    h.step()  # one block each, one left
    out = h.step()  # a takes the last block; b, itself the last running, is the victim
    assert out.preempted == ["r1"]
    assert [s.request for s in out.scheduled] == [a]
    assert h.sched.running == [a] and list(h.sched.waiting) == [b]
    assert b.status is RequestStatus.PREEMPTED
    h.run()
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert h.kv.num_used_blocks == 0


def test_many_requests_tiny_cache_all_complete_with_preemptions() -> None:
    h = Harness(num_blocks=10, max_num_seqs=6, max_num_batched_tokens=16)
    reqs = [make_req(f"r{i}", list(range(i * 40, i * 40 + 5 + 3 * (i % 3))), max_tokens=8 + i % 5) for i in range(8)]
    h.add(*reqs)
    outs = h.run()
    assert h.sched.num_preemptions > 0
    assert any(o.preempted for o in outs)
    for r in reqs:
        assert r.output_token_ids == expected_output(r)
    assert sum(r.num_preemptions for r in reqs) == h.sched.num_preemptions
    assert h.kv.num_used_blocks == 0


def test_abort_waiting_preempted_and_running_frees_everything() -> None:
    h = Harness(num_blocks=4)
    a, b, c = (make_req(f"r{i}", list(range(i * 10, i * 10 + BS)), max_tokens=50) for i in range(3))
    h.add(a, b, c)
    h.step()
    h.step()  # c preempted
    assert c.status is RequestStatus.PREEMPTED
    d = make_req("r3", [1, 2, 3], max_tokens=50)
    h.add(d)  # waiting, never scheduled
    assert list(h.sched.waiting) == [c, d]

    h.sched.finish(c, RequestStatus.FINISHED_ABORTED)
    h.sched.finish(d, RequestStatus.FINISHED_ABORTED)
    assert not h.sched.waiting
    assert c.status is RequestStatus.FINISHED_ABORTED and c.finish_reason == "abort"
    assert d.status is RequestStatus.FINISHED_ABORTED and d.block_ids == []
    used = h.kv.num_used_blocks
    assert used == len(a.block_ids) + len(b.block_ids) == 4

    h.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert h.sched.running == [b] and h.kv.num_used_blocks == len(b.block_ids)
    h.sched.finish(a, RequestStatus.FINISHED_ABORTED)  # twice: no double free
    assert h.kv.num_used_blocks == len(b.block_ids)
    h.step()
    h.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not h.sched.has_unfinished()
    assert h.kv.num_used_blocks == 0 and all(x == 0 for x in h.kv.ref_count)
    assert h.sched.schedule().scheduled == []


def test_abort_a_request_sharing_prefix_blocks() -> None:
    h = Harness(num_blocks=16)
    prompt = list(range(3 * BS + 1))
    a = make_req("r0", prompt, max_tokens=10)
    b = make_req("r1", prompt, max_tokens=10)
    h.add(a)
    h.step()
    h.add(b)
    h.step()
    assert b.block_ids[:3] == a.block_ids[:3]
    h.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert all(h.kv.ref_count[x] == 1 for x in b.block_ids)
    h.check_blocks()
    h.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert h.kv.num_used_blocks == 0


def test_prefix_cache_hit_on_admission() -> None:
    h = Harness(num_blocks=32)
    shared = list(range(3 * BS))
    a = make_req("r0", [*shared, 90, 91], max_tokens=20)
    h.add(a)
    h.step()  # a's prompt is computed: its 3 full blocks are cached
    b = make_req("r1", [*shared, 80, 81, 82], max_tokens=2)
    h.add(b)
    out = h.sched.schedule()
    sb = next(s for s in out.scheduled if s.request is b)
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.num_computed_tokens == 3 * BS and b.num_cached_tokens == 3 * BS
    assert sb.num_new_tokens == 3 and sb.samples
    assert h.kv.num_prefix_hits == 3 * BS


def test_prefix_cache_never_serves_the_whole_prompt() -> None:
    h = Harness(num_blocks=32)
    prompt = list(range(3 * BS))
    a = make_req("r0", prompt, max_tokens=1)
    h.add(a)
    h.run()  # a finished; its blocks are free but still cached
    a_blocks = h.kv.computed_prefix(make_req("r9", [*prompt, 0]))[0]
    assert len(a_blocks) == 3
    b = make_req("r1", prompt, max_tokens=1)
    h.add(b)
    out = h.sched.schedule()
    assert b.block_ids[:2] == a_blocks[:2]
    assert b.num_computed_tokens == 2 * BS
    assert [s.num_new_tokens for s in out.scheduled] == [BS]
    assert out.scheduled[0].samples


def test_preempted_request_reuses_its_own_cached_prefix() -> None:
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    a = make_req("r0", list(range(2 * BS)), max_tokens=2 * BS)
    b = make_req("r1", list(range(100, 100 + 2 * BS)), max_tokens=2 * BS)
    h.add(a, b)
    while not b.num_preemptions:
        h.step()
    # b's freed blocks go on the free list tail first, so a's next block evicts b's third block, not its prompt.
    assert h.kv.computed_prefix(b)[1] == 2 * BS
    h.run()
    assert b.num_cached_tokens == 2 * BS
    assert b.output_token_ids == expected_output(b)


def test_cached_blocks_are_evicted_when_reused() -> None:
    h = Harness(num_blocks=4)
    prompt = list(range(3 * BS))
    a = make_req("r0", [*prompt, 1], max_tokens=1)
    h.add(a)
    h.run()
    probe = make_req("r8", [*prompt, 1])
    assert h.kv.computed_prefix(probe)[1] == 3 * BS
    other = make_req("r1", list(range(500, 500 + 4 * BS - 1)), max_tokens=2)  # needs every block
    h.add(other)
    h.step()
    assert not (set(other.block_ids) ^ set(range(4)))
    assert h.kv.computed_prefix(probe) == ([], 0)
    h.run()
    c = make_req("r2", [*prompt, 1], max_tokens=1)
    h.add(c)
    h.sched.schedule()
    assert c.num_computed_tokens == 0 and c.num_cached_tokens == 0


def test_prefix_hit_metrics_count_only_admitted_requests() -> None:
    h = Harness(num_blocks=4)
    prompt = list(range(2 * BS))
    a = make_req("r0", [*prompt, 1], max_tokens=1)
    h.add(a)
    h.run()
    hog = make_req("r1", list(range(500, 500 + 2 * BS)), max_tokens=BS)  # holds 2-3 blocks for a while
    h.add(hog)
    h.step()
    b = make_req("r2", [*prompt, 1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)  # 2 cached + 3 new blocks: cannot fit
    h.add(b)
    for _ in range(3):
        h.step()
    assert b.status is RequestStatus.WAITING
    assert h.kv.num_prefix_hits == 0
