"""Scheduler with speculative tokens, driven without a model: drafts ride after the plain token, are cut first when
the budget runs short, the drafter's lookahead is reserved only for requests that sample, preemption drops drafts,
and every block comes back when the requests end. The harness plays the engine and a drafter whose drafts are right
or wrong by a fixed rule, so the output must not depend on speculation."""

from __future__ import annotations

from dspark.config import SamplingParams
from dspark.core.kv_cache import KVCacheManager
from dspark.core.request import Request, RequestStatus
from dspark.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from helpers import SchedulerHarness

BS = 4
K = 3  # drafts per request and step, and the drafter's lookahead slots


def make_req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, None, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0, eos_token_id=None)


def make_sched(
    num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, lookahead: int = 0
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, max_num_batched_tokens, lookahead)


def decoding(sched: Scheduler, rid: str, prompt_len: int, drafts: list[int]) -> Request:
    """A running request as the engine leaves it after its prefill step: the prompt computed (with the lookahead
    reserved), one sampled token not yet computed, and drafts to verify next."""
    base = 100 * int(rid[1:])
    req = make_req(rid, list(range(base, base + prompt_len)), max_tokens=50)
    assert sched.kv.allocate(req, prompt_len, lookahead=sched.num_lookahead_tokens)
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    req.num_computed_tokens = prompt_len
    req.all_token_ids.append(7)
    req.spec_token_ids = list(drafts)
    return req


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


def by_id(out: SchedulerOutput) -> dict[str, ScheduledRequest]:
    return {s.request.request_id: s for s in out.scheduled}


# ---- what one step schedules ---------------------------------------------------------------------------------------


def test_drafts_follow_the_plain_token() -> None:
    sched = make_sched()
    a = decoding(sched, "r0", 6, [41, 42, 43])
    s = by_id(sched.schedule())["r0"]
    assert s.spec_token_ids == [41, 42, 43]
    assert s.num_new_tokens == 1 + 3
    assert s.samples
    assert len(a.block_ids) * BS >= a.num_computed_tokens + 4


def test_samples_is_set_for_a_decode_step_with_drafts() -> None:
    req = make_req("r0", list(range(8)))
    req.num_computed_tokens = 7
    assert ScheduledRequest(req, 1 + 3, [1, 2, 3]).samples  # last prompt token + 3 drafts
    assert ScheduledRequest(req, 1).samples
    req.num_computed_tokens = 4
    assert not ScheduledRequest(req, 3).samples  # a chunk that stops short of the last token
    assert ScheduledRequest(req, 4).samples


def test_drafts_are_cut_first_when_the_budget_is_short() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    a = decoding(sched, "r0", 5, [1, 2, 3])
    b = decoding(sched, "r1", 5, [4, 5, 6])
    c = decoding(sched, "r2", 5, [7, 8, 9])
    sched.max_num_batched_tokens = 4 + 4 + 1  # c: only its plain token
    got = {rid: (s.num_new_tokens, s.spec_token_ids, s.samples) for rid, s in by_id(sched.schedule()).items()}
    assert got == {"r0": (4, [1, 2, 3], True), "r1": (4, [4, 5, 6], True), "r2": (1, [], True)}
    sched.max_num_batched_tokens = 4 + 2  # b: one draft; c: nothing left
    out = sched.schedule()
    got = {rid: (s.num_new_tokens, s.spec_token_ids, s.samples) for rid, s in by_id(out).items()}
    assert got == {"r0": (4, [1, 2, 3], True), "r1": (2, [4], True)}
    assert out.num_tokens == 6
    assert (a.spec_token_ids, b.spec_token_ids, c.spec_token_ids) == ([1, 2, 3], [4, 5, 6], [7, 8, 9])  # untouched


def test_a_partial_prompt_chunk_gets_no_drafts() -> None:
    sched = make_sched(max_num_batched_tokens=64, lookahead=K)
    req = make_req("r0", list(range(12)), max_tokens=5)
    sched.add(req)
    sched.max_num_batched_tokens = 5
    out = sched.schedule()
    req.num_computed_tokens += out.scheduled[0].num_new_tokens
    # Drafts cannot exist mid-prefill in the engine; give it some anyway: a chunk short of its last token takes none.
    req.spec_token_ids = [1, 2, 3]
    s = by_id(sched.schedule())["r0"]
    assert (s.num_new_tokens, s.spec_token_ids, s.samples) == (5, [], False)
    assert len(req.block_ids) == blocks_for(10)  # no lookahead either


def test_a_new_request_admitted_behind_a_drafting_one_gets_no_drafts() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    decoding(sched, "r0", 5, [1, 2, 3])
    b = make_req("r1", list(range(20)), max_tokens=3)
    sched.add(b)
    sched.max_num_batched_tokens = 4 + 6
    got = {rid: (s.num_new_tokens, s.spec_token_ids, s.samples) for rid, s in by_id(sched.schedule()).items()}
    assert got == {"r0": (4, [1, 2, 3], True), "r1": (6, [], False)}


# ---- lookahead -----------------------------------------------------------------------------------------------------


def test_lookahead_is_reserved_for_a_decode_step() -> None:
    sched = make_sched(lookahead=K)
    a = decoding(sched, "r0", 6, [1, 2, 3])
    assert len(a.block_ids) == blocks_for(6 + K)  # admission: the whole prompt, and it samples
    sched.schedule()
    assert len(a.block_ids) == blocks_for(6 + 4 + K)


def test_lookahead_covers_the_budget_cut_decode_step() -> None:
    sched = make_sched(lookahead=K)
    a = decoding(sched, "r0", 9, [1, 2, 3])
    assert len(a.block_ids) == blocks_for(9 + K)
    sched.max_num_batched_tokens = 1
    s = by_id(sched.schedule())["r0"]
    assert (s.num_new_tokens, s.spec_token_ids, s.samples) == (1, [], True)
    assert len(a.block_ids) == blocks_for(9 + 1 + K)


def test_no_lookahead_for_mid_prefill_chunks() -> None:
    sched = make_sched(max_num_batched_tokens=4, lookahead=K)
    req = make_req("r0", list(range(10)), max_tokens=2)
    sched.add(req)
    expected = [(4, False, blocks_for(4)), (4, False, blocks_for(8)), (2, True, blocks_for(10 + K))]
    for num_new, samples, num_blocks in expected:
        s = by_id(sched.schedule())["r0"]
        assert (s.num_new_tokens, s.samples) == (num_new, samples)
        assert len(req.block_ids) == num_blocks, (s.num_new_tokens, req.block_ids)
        req.num_computed_tokens += s.num_new_tokens


def test_no_lookahead_for_a_chunked_admission() -> None:
    sched = make_sched(max_num_batched_tokens=6, lookahead=K)
    short = make_req("r0", list(range(2)), max_tokens=2)
    long = make_req("r1", list(range(100, 109)), max_tokens=2)
    sched.add(short)
    sched.add(long)
    got = {rid: (s.num_new_tokens, s.samples) for rid, s in by_id(sched.schedule()).items()}
    assert got == {"r0": (2, True), "r1": (4, False)}
    assert len(short.block_ids) == blocks_for(2 + K)
    assert len(long.block_ids) == blocks_for(4)


def test_lookahead_that_does_not_fit_sheds_drafts_then_preempts() -> None:
    # a: 4 computed + 1 plain + 3 drafts + K lookahead = 11 slots (3 blocks) do not fit; without its drafts 8 slots
    # (2 blocks) do. b then cannot fit even without drafts (2 + 1 + K = 6 slots, 2 blocks): it is preempted.
    sched = make_sched(num_blocks=3, lookahead=0)
    a = decoding(sched, "r0", BS, [1, 2, 3])
    b = decoding(sched, "r1", 2, [4, 5, 6])
    assert sched.kv.num_free_blocks == 1
    sched.num_lookahead_tokens = K
    out = sched.schedule()
    assert out.preempted == ["r1"]
    assert [(s.request, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(a, 1, [])]
    assert len(a.block_ids) == blocks_for(BS + 1 + K) == 2
    assert b.spec_token_ids == []


# ---- preemption ----------------------------------------------------------------------------------------------------


def test_preemption_drops_drafts_and_confidences() -> None:
    sched = make_sched(num_blocks=4, lookahead=0)
    a = decoding(sched, "r0", BS, [1, 2, 3])  # 2 blocks after this step's 4 tokens
    b = decoding(sched, "r1", BS, [4, 5, 6])
    c = decoding(sched, "r2", BS - 1, [7, 8])  # 1 block now, 2 after this step
    assert sched.kv.num_used_blocks == 3
    out = sched.schedule()
    assert out.preempted == ["r2"]
    assert c.status is RequestStatus.PREEMPTED and c.block_ids == [] and c.num_computed_tokens == 0
    assert c.spec_token_ids == []
    assert (a.spec_token_ids, b.spec_token_ids) == ([1, 2, 3], [4, 5, 6])  # the survivors keep theirs
    # Resumed, it recomputes its prompt and sampled token with no drafts.
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)  # every draft rejected
        s.request.all_token_ids.append(9)
        s.request.spec_token_ids = []
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    s = by_id(sched.schedule())["r2"]
    assert (s.num_new_tokens, s.spec_token_ids, s.samples) == (c.num_tokens, [], True)


# ---- a whole workload ----------------------------------------------------------------------------------------------


def true_token(req: Request, index: int) -> int:
    """The token the 'target' emits at output index `index`: fixed per request and position."""
    return 10_000 + 100 * int(req.request_id[1:]) + index


def draft_is_right(req: Request, index: int) -> bool:
    return (int(req.request_id[1:]) * 7 + index * 5) % 3 != 0


class SpecHarness(SchedulerHarness):
    """Plays the engine: verifies drafts (accept while right, then emit the true token), advances
    num_computed_tokens by what was kept, and drafts K tokens for every request that sampled."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 32) -> None:
        self.kv = KVCacheManager(num_blocks, BS)
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, num_lookahead_tokens=K)
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.num_cut = 0

    def step(self) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        for rid in out.preempted:
            victim = next(r for r in sched.waiting if r.request_id == rid)
            assert victim.spec_token_ids == [] and victim.block_ids == []
        for s in out.scheduled:
            req = s.request
            num_plain = s.num_new_tokens - len(s.spec_token_ids)
            assert s.spec_token_ids == req.spec_token_ids[: len(s.spec_token_ids)]
            self.num_cut += len(req.spec_token_ids) - len(s.spec_token_ids)
            assert num_plain >= 1
            assert not s.spec_token_ids or s.samples, "drafts on a step that does not sample"
            # Slots for every token fed, plus the drafter's lookahead when it samples.
            need = req.num_computed_tokens + s.num_new_tokens + (K if s.samples else 0)
            assert len(req.block_ids) * BS >= need
            if not s.samples:
                assert len(req.block_ids) == blocks_for(req.num_computed_tokens + s.num_new_tokens)
            samples = s.samples
            accepted = 0
            for x in s.spec_token_ids:
                if x != true_token(req, req.num_output_tokens + accepted):
                    break
                accepted += 1
            self.num_draft_tokens += len(s.spec_token_ids)
            self.num_accepted += accepted
            req.num_computed_tokens += s.num_new_tokens - (len(s.spec_token_ids) - accepted)
            req.spec_token_ids = []
            if not samples:
                self.kv.cache_computed_blocks(req)
                continue
            finished = False
            for _ in range(accepted + 1):
                req.all_token_ids.append(true_token(req, req.num_output_tokens))
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    finished = True
                    break
            self.kv.cache_computed_blocks(req)  # as the engine: after the kept tokens are appended
            if finished:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
            assert req.status.finished or req.num_computed_tokens == req.num_tokens - 1
            if not req.status.finished:
                room = req.sampling_params.max_tokens - req.num_output_tokens - 1
                first = req.num_output_tokens  # output index of the first draft
                drafts = [true_token(req, i) + (0 if draft_is_right(req, i) else 1) for i in range(first, first + K)]
                drafts = drafts[: max(0, room)]
                req.spec_token_ids = drafts
        self.check_blocks()
        return out


def test_workload_with_drafts_cuts_and_preemptions_returns_every_block() -> None:
    h = SpecHarness(num_blocks=16, max_num_seqs=5, max_num_batched_tokens=11)
    reqs = [make_req(f"r{i}", list(range(i * 40, i * 40 + 3 + 5 * (i % 3))), max_tokens=16 + i % 4) for i in range(7)]
    for r in reqs:
        h.sched.add(r)
    h.run()
    for r in reqs:
        assert r.output_token_ids == [true_token(r, i) for i in range(r.sampling_params.max_tokens)]
        assert r.status is RequestStatus.FINISHED_LENGTH and r.block_ids == []
    # The workload exercised what it is meant to.
    assert h.num_accepted > 0 and h.num_draft_tokens > h.num_accepted
    assert h.num_cut > 0
    assert h.sched.num_preemptions > 0
    assert h.kv.num_used_blocks == 0 and all(c == 0 for c in h.kv.ref_count)


def test_aborting_drafting_requests_returns_every_block() -> None:
    sched = make_sched(num_blocks=16, lookahead=K)
    reqs = [decoding(sched, f"r{i}", 3 + 2 * i, [1, 2, 3]) for i in range(3)]
    sched.schedule()  # every request grows by its drafts and lookahead
    assert sched.kv.num_used_blocks == sum(blocks_for(3 + 2 * i + 4 + K) for i in range(3))
    for r in reqs:
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_used_blocks == 0 and all(c == 0 for c in sched.kv.ref_count)


def test_drafts_are_shed_before_anyone_is_preempted() -> None:
    """Short of blocks, a request verifies no drafts this step rather than preempting another request."""
    sched = make_sched(num_blocks=8, lookahead=K)
    a = decoding(sched, "r0", 7, [1, 2, 3])  # 7 prompt + K lookahead: 3 blocks
    b = decoding(sched, "r1", 11, [4, 5, 6])  # 11 + K: 4 blocks
    assert sched.kv.num_free_blocks == 1
    out = sched.schedule()
    got = by_id(out)
    assert not out.preempted
    # r0 needs 7 + 4 + K = 14 slots (4 blocks) with its drafts: one more block, which fits.
    assert got["r0"].spec_token_ids == [1, 2, 3]
    # r1 would need 11 + 4 + K = 18 slots (5 blocks) with drafts; without them 11 + 1 + K = 15 (4 blocks): it has those.
    assert got["r1"].spec_token_ids == [] and got["r1"].num_new_tokens == 1
    assert b.status is RequestStatus.RUNNING and a.status is RequestStatus.RUNNING
