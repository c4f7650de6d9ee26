"""KVCacheManager: block accounting, prefix caching by chained block hash, LRU reuse and eviction."""

from __future__ import annotations

import pytest

from dspark.config import SamplingParams
from dspark.core.kv_cache import KVCacheManager, block_hash
from dspark.core.request import Request

BS = 4


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, list(tokens), SamplingParams(), seed=0, eos_token_id=None)


def compute_all(kv: KVCacheManager, req: Request) -> None:
    """Allocate and 'compute' the whole prompt of a request, as a prefill step would, then register its blocks."""
    prefix, _ = kv.computed_prefix(req)
    num_new = req.num_tokens - req.num_computed_tokens - len(prefix) * kv.block_size
    assert kv.allocate(req, num_new, prefix)
    req.num_computed_tokens += num_new
    kv.cache_computed_blocks(req)


def check_consistent(kv: KVCacheManager, live: list[Request]) -> None:
    """Reference counts equal the number of live block tables holding each block; free list = blocks with ref 0."""
    expected = [0] * kv.num_blocks
    for r in live:
        for b in r.block_ids:
            expected[b] += 1
    assert kv.ref_count == expected
    assert set(kv.free) == {b for b in range(kv.num_blocks) if expected[b] == 0}
    for h, b in kv.cached.items():
        assert kv.hash_of[b] == h


def test_allocate_counts_blocks_and_free_returns_them() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert kv.blocks_needed(9) == 3 and kv.blocks_needed(8) == 2 and kv.blocks_needed(0) == 0
    assert kv.allocate(a, 9)
    assert len(a.block_ids) == 3 and len(set(a.block_ids)) == 3
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    a.num_computed_tokens = 9
    # Growing within the last block needs nothing new; crossing a boundary needs one more.
    assert kv.allocate(a, 3) and len(a.block_ids) == 3
    assert kv.allocate(a, 4) and len(a.block_ids) == 4
    check_consistent(kv, [a])
    kv.free_request(a)
    assert kv.num_used_blocks == 0 and a.block_ids == [] and a.block_hashes == []
    check_consistent(kv, [])


def test_allocate_fails_atomically_when_full() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(12)))
    b = make_req("b", list(range(100, 108)))
    assert kv.allocate(a, 12)  # 3 blocks
    assert not kv.allocate(b, 8)  # needs 2, 1 free
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert kv.num_free_blocks == 1
    assert kv.allocate(b, 4)  # exactly the last block
    assert kv.num_free_blocks == 0
    check_consistent(kv, [a, b])


def test_allocate_decode_is_allocate_request_by_request() -> None:
    # Running requests at every offset within a block: allocate_decode's inline check must call allocate exactly where
    # the step crosses into a block the request does not hold, and give what allocate one by one gives.
    def running(kv: KVCacheManager) -> list[Request]:
        reqs = []
        for i in range(2 * BS):
            r = make_req(f"r{i}", list(range(BS + i)))
            assert kv.allocate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
            reqs.append(r)
        return reqs

    for num_new, lookahead in ((1, 0), (2, 0), (2, BS), (2, 2 * BS + 1)):
        kv_a, kv_b = KVCacheManager(num_blocks=200, block_size=BS), KVCacheManager(num_blocks=200, block_size=BS)
        a, b = running(kv_a), running(kv_b)
        before = [len(r.block_ids) for r in a]
        assert kv_a.allocate_decode(a, num_new, lookahead=lookahead)
        assert all(kv_b.allocate(r, num_new, lookahead=lookahead) for r in b)
        assert [r.block_ids for r in a] == [r.block_ids for r in b]
        grew = [len(r.block_ids) > n for r, n in zip(a, before, strict=True)]
        assert any(grew) and (lookahead > 0 or not all(grew))  # without lookahead, both sides of the check taken
        check_consistent(kv_a, a)


def test_allocate_decode_stops_at_the_first_request_that_does_not_fit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b, c = (make_req(x, list(range(BS))) for x in "abc")
    for r in (a, b, c):
        assert kv.allocate(r, BS)
        r.num_computed_tokens = BS
    # One free block: a gets it, b does not fit, c is not asked.
    assert not kv.allocate_decode([a, b, c], 1)
    assert [len(r.block_ids) for r in (a, b, c)] == [2, 1, 1]
    check_consistent(kv, [a, b, c])


def test_prefix_hit_reuses_block_ids_and_leaves_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(3 * BS + 2))
    a = make_req("a", prompt)
    compute_all(kv, a)
    assert len(a.block_hashes) == 3  # only full, computed blocks are registered

    b = make_req("b", [*prompt[: 3 * BS], 777, 778, 779])
    blocks, num = kv.computed_prefix(b)
    assert blocks == a.block_ids[:3] and num == 3 * BS
    assert kv.allocate(b, b.num_tokens - num, blocks)
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.block_ids[3] not in a.block_ids
    assert b.num_computed_tokens == 3 * BS and b.num_cached_tokens == 3 * BS
    assert all(kv.ref_count[x] == 2 for x in a.block_ids[:3])
    check_consistent(kv, [a, b])

    # The same prompt exactly 3 blocks long: at most 2 blocks may come from the cache, 1 token (here a block) is left.
    c = make_req("c", prompt[: 3 * BS])
    blocks, num = kv.computed_prefix(c)
    assert blocks == a.block_ids[:2] and num == 2 * BS
    # One token more than 3 blocks: all 3 blocks hit.
    d = make_req("d", prompt[: 3 * BS + 1])
    assert kv.computed_prefix(d) == (a.block_ids[:3], 3 * BS)


def test_prefix_hash_is_chained_over_the_whole_prefix() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute_all(kv, a)
    # Same second block, different first block: no hit at all (the second block's hash depends on the first).
    b = make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.computed_prefix(b) == ([], 0)
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [0, 2, 3, 4])
    assert block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    # A diverging second block: only the first hits.
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert kv.computed_prefix(c) == (a.block_ids[:1], BS)


def test_partial_and_uncomputed_blocks_are_not_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", list(range(3 * BS)))
    assert kv.allocate(a, 3 * BS)
    a.num_computed_tokens = BS + 3  # one full block computed, the second not yet
    kv.cache_computed_blocks(a)
    assert len(a.block_hashes) == 1 and len(kv.cached) == 1
    b = make_req("b", [*range(3 * BS), 99])
    assert kv.computed_prefix(b) == (a.block_ids[:1], BS)


def test_cache_computed_blocks_registers_each_block_once_it_fills() -> None:
    # Decoding token by token: a block is registered the call after its last token is computed, not before.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", list(range(BS - 1)))
    assert kv.allocate(a, 3 * BS)
    for n in range(BS - 1, 3 * BS + 1):
        a.num_computed_tokens = n
        kv.cache_computed_blocks(a)
        assert len(a.block_hashes) == n // BS
        if n < 3 * BS:
            a.all_token_ids.append(n)
    assert len(kv.cached) == 3


def test_cache_computed_blocks_of_is_cache_computed_blocks_request_by_request() -> None:
    # Requests decoding at every offset within a block, a step at a time: the batch call (which calls only for requests
    # that filled a block) registers what a call per request registers, on the same step.
    kvs = [KVCacheManager(num_blocks=64, block_size=BS) for _ in range(2)]
    reqs = [[make_req(f"r{i}", list(range(10 * i, 10 * i + BS + i))) for i in range(BS + 1)] for _ in kvs]
    for kv, rs in zip(kvs, reqs, strict=True):
        for r in rs:
            compute_all(kv, r)
            assert kv.allocate(r, 3 * BS)
    for step in range(3 * BS):
        kvs[0].cache_computed_blocks_of(reqs[0])
        for r in reqs[1]:
            kvs[1].cache_computed_blocks(r)
        assert [r.block_hashes for r in reqs[0]] == [r.block_hashes for r in reqs[1]], step
        assert kvs[0].cached == kvs[1].cached and kvs[0].hash_of == kvs[1].hash_of, step
        for r in (*reqs[0], *reqs[1]):
            r.all_token_ids.append(step)
            r.num_computed_tokens += 1
    assert all(len(r.block_hashes) >= 3 for r in reqs[0])  # the decode steps filled blocks (prompts fill 1 or 2)


def test_free_cached_blocks_still_hit_and_are_taken_back_from_the_free_list() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(3 * BS))
    a = make_req("a", prompt)
    compute_all(kv, a)
    ids = list(a.block_ids)
    kv.free_request(a)
    assert kv.num_used_blocks == 0 and len(kv.cached) == 3

    # 3 cached blocks + 2 new ones: 4 free blocks, but 3 of them are the prefix itself, so only 1 is spare.
    b = make_req("b", [*prompt, 50, 51, 52, 53, 54])
    blocks, num = kv.computed_prefix(b)
    assert blocks == ids and num == 3 * BS
    assert not kv.allocate(b, b.num_tokens - num, blocks)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.num_free_blocks == 4
    # One new block fits.
    c = make_req("c", [*prompt, 50, 51])
    blocks, num = kv.computed_prefix(c)
    assert kv.allocate(c, c.num_tokens - num, blocks)
    assert c.block_ids[:3] == ids and kv.num_free_blocks == 0
    check_consistent(kv, [c])


def test_shared_block_stays_in_use_until_last_owner_frees_it() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(2 * BS + 1))
    a = make_req("a", prompt)
    compute_all(kv, a)
    b = make_req("b", prompt)
    compute_all(kv, b)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared
    kv.free_request(a)
    assert all(kv.ref_count[x] == 1 for x in shared)
    assert not any(x in kv.free for x in shared)
    check_consistent(kv, [b])
    kv.free_request(b)
    assert kv.num_used_blocks == 0
    check_consistent(kv, [])


def test_lru_reuse_tail_blocks_first_and_oldest_freed_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_req("a", list(range(3 * BS)))
    assert kv.allocate(a, 3 * BS)
    b = make_req("b", list(range(100, 100 + 3 * BS)))
    assert kv.allocate(b, 3 * BS)
    a_ids, b_ids = list(a.block_ids), list(b.block_ids)
    kv.free_request(a)
    kv.free_request(b)
    # a was freed first, and within a request the tail goes first.
    assert list(kv.free) == [*reversed(a_ids), *reversed(b_ids)]
    c = make_req("c", list(range(200, 200 + 4 * BS)))
    assert kv.allocate(c, 4 * BS)
    assert c.block_ids == [*reversed(a_ids), b_ids[2]]


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(2 * BS + 1))
    a = make_req("a", prompt)
    compute_all(kv, a)  # 3 blocks, the first 2 cached
    kv.free_request(a)
    assert kv.computed_prefix(make_req("q", prompt))[1] == 2 * BS

    # Free list now: the never-used block, then a's blocks tail first. Two new blocks take the unused one and a's
    # uncached tail: no hash is lost.
    other = make_req("o", list(range(500, 500 + 2 * BS)))
    assert kv.allocate(other, 2 * BS)
    assert kv.computed_prefix(make_req("q", prompt))[1] == 2 * BS  # no cached block taken yet
    # The next block handed out is a's second block (freed before its first), and with it goes a's second hash.
    more = make_req("m", list(range(600, 600 + 2 * BS)))
    assert kv.allocate(more, BS)
    assert kv.computed_prefix(make_req("q", prompt))[1] == BS  # the first block still hits
    assert len(kv.cached) == 1
    assert kv.allocate(more, 2 * BS)
    assert kv.computed_prefix(make_req("q", prompt)) == ([], 0)
    assert kv.cached == {} and all(h is None for h in kv.hash_of)
    check_consistent(kv, [other, more])


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(2 * BS + 1))
    a = make_req("a", prompt)
    compute_all(kv, a)
    assert a.block_hashes == [] and kv.cached == {}
    assert kv.computed_prefix(make_req("b", prompt)) == ([], 0)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(2 * BS + 1))
    compute_all(kv, make_req("a", prompt))
    assert kv.computed_prefix(make_req("b", prompt))[1] == 2 * BS
    kv.reset_prefix_cache()
    assert kv.computed_prefix(make_req("c", prompt)) == ([], 0)
