"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-request block tables, prefix caching by block hash.

Only ids and counts live here; the tensors belong to the model runner. A block is either in use (ref_count > 0) or
free; a free block may still hold a cached prefix (its hash stays findable until the block is reused), and free
blocks are reused least-recently-freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from dspark.core.request import Request


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """sha256 over the parent's hash and this block's token ids: a block's hash covers the whole prefix before it.

    NOTE: a cryptographic hash, because a hit reuses another request's KV without comparing tokens: a 64-bit hash
    could be made to collide by a crafted prompt, and Python's hash() is not stable across runs.
    """
    h = hashlib.sha256(parent or b"dspark-kv-root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_prefix_hits = 0  # tokens served from the prefix cache, for metrics
        self.num_prefix_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_prefix(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of the request's tokens, and how many tokens they cover.

        At least one token is always left to compute: the step that computes it produces the next token's logits.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        bs = self.block_size
        tokens = req.all_token_ids
        hits: list[int] = []
        parent: bytes | None = None
        for i in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate(
        self, req: Request, num_new_tokens: int, prefix_blocks: Sequence[int] = (), lookahead: int = 0
    ) -> bool:
        """Give `req` blocks for num_computed_tokens + num_new_tokens (+ lookahead) tokens; False if full (nothing
        changed). Lookahead slots are written by a drafter past the request's tokens and never become computed."""
        total = req.num_computed_tokens + len(prefix_blocks) * self.block_size + num_new_tokens + lookahead
        num_new_blocks = self.blocks_needed(total) - len(req.block_ids) - len(prefix_blocks)
        if num_new_blocks <= 0 and not prefix_blocks and req.num_computed_tokens:
            # A running request whose blocks already hold the step: most calls (every request, every decode
            # step; a new block every block_size tokens). The general path below then changes nothing.
            return True
        reusable = sum(1 for b in prefix_blocks if self.ref_count[b] == 0)
        if num_new_blocks > len(self.free) - reusable:
            return False
        for b in prefix_blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            req.block_ids.append(b)
        if req.num_computed_tokens == 0:  # admission (new or resumed): count the prefix-cache lookup once
            self.num_prefix_queries += req.num_tokens
            self.num_prefix_hits += len(prefix_blocks) * self.block_size
        req.num_computed_tokens += len(prefix_blocks) * self.block_size
        req.num_cached_tokens = max(
            req.num_cached_tokens, min(len(prefix_blocks) * self.block_size, req.num_prompt_tokens)
        )
        for _ in range(max(0, num_new_blocks)):
            b, _ = self.free.popitem(last=False)
            old = self.hash_of[b]
            if old is not None:  # evict the cached prefix this block held
                if self.cached.get(old) == b:
                    del self.cached[old]
                self.hash_of[b] = None
            self.ref_count[b] = 1
            req.block_ids.append(b)
        return True

    def allocate_decode(self, reqs: list[Request], num_new_tokens: int, lookahead: int = 0) -> bool:
        """allocate(r, num_new_tokens, lookahead=lookahead) for running requests in turn, stopping at the first that
        does not fit (False; those before it keep their blocks, as with allocate called one by one).

        A continued decode step's allocation, every request, every step: most hold their next tokens already (a new
        block every block_size tokens), and that is checked here inline, not by a call per request, whose overhead
        would dominate the engine's continuation at high load."""
        bs = self.block_size
        for r in reqs:
            if r.num_computed_tokens + num_new_tokens + lookahead > len(r.block_ids) * bs and not self.allocate(
                r, num_new_tokens, lookahead=lookahead
            ):
                return False
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks so later requests with the same prefix can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        if req.num_computed_tokens < (len(req.block_hashes) + 1) * bs:
            return  # no block filled since the last call: most calls (a decode step fills one every block_size steps)
        # A stop inside accepted drafts leaves num_computed_tokens past the tokens the request kept.
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // bs, len(req.block_ids))
        tokens = req.all_token_ids
        while len(req.block_hashes) < num_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            h = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            req.block_hashes.append(h)
            b = req.block_ids[i]
            if self.hash_of[b] is None and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b

    def cache_computed_blocks_of(self, reqs: list[Request]) -> None:
        """cache_computed_blocks for each request, called only for those that filled a block since their last call
        (every block_size decode steps): a call per request and step would be a visible share of a continued step's
        host work."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for r in reqs:
            if r.num_computed_tokens >= (len(r.block_hashes) + 1) * bs:
                self.cache_computed_blocks(r)

    def free_request(self, req: Request) -> None:
        # Freed in reverse so that a request's tail blocks are reused first and its shared prefix survives longest.
        for b in reversed(req.block_ids):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        req.block_ids = []
        req.block_hashes = []

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
