"""Rollback after rejected drafts: once some drafts were rejected, the target's KV cache (and the DSpark drafter's own
paged cache) hold exactly the accepted history, bit for bit what a fresh engine computes by prefilling those tokens.

Rejected drafts' KV is left past num_computed_tokens and overwritten later (the first rejected position always
receives the corrected or bonus token next step), so equality below num_computed_tokens checks that nothing from a
rejected draft survives there and that the drafter's context was written only for accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.attention.base import KVCache, slots_for
from dspark.core.request import Request
from dspark.engine.llm_engine import LLMEngine
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 96
MAX_MODEL_LEN = 256


@dataclass
class Snapshot:
    """A request's computed history and the K/V stored at its positions 0..num_computed-1."""

    tokens: list[int]
    target: list[tuple[torch.Tensor, torch.Tensor]]  # per target layer: key, value [num_computed, kv_heads, head_dim]
    drafter: list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer, same shapes ([] without a DSpark drafter)


def _gather(caches: list[KVCache], slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    idx = torch.tensor(slots, dtype=torch.int64)
    out = []
    for c in caches:
        kv_heads, head_dim = c.key.shape[2:]
        out.append(
            (
                c.key.view(-1, kv_heads, head_dim)[idx].clone(),
                c.value.view(-1, kv_heads, head_dim)[idx].clone(),
            )
        )
    return out


def _snapshot(engine: LLMEngine, req: Request) -> Snapshot:
    n = req.num_computed_tokens
    slots = slots_for(req.block_ids, 0, n, engine.config.block_size)
    drafter = engine.runner.drafter
    draft_caches: list[KVCache] = getattr(drafter, "caches", [])
    return Snapshot(req.all_token_ids[:n], _gather(engine.runner.kv_caches, slots), _gather(draft_caches, slots))


def _make_llm(model: Path | str, spec: dict[str, Any]) -> LLM:
    # Fixed k: every draft verified, so rejections (what rollback is about) come for sure.
    spec = {"enable_adaptive_verification": False, **spec}
    return LLM(
        model=str(model),
        dtype="float32",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        speculative_config=spec,
    )


def _run_until_rejections(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, steps: int
) -> tuple[list[Request], int]:
    """Run `steps` steps; return the requests still running and how many rejected draft positions are now below
    their request's num_computed_tokens (positions whose rejected KV was overwritten by accepted history)."""
    reqs = []
    for prompt in prompts:
        rid = engine.add_request(prompt, params)
        reqs.append(engine.core.requests[rid])
    rejected_positions: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(steps):
        before = {r.request_id: (r.num_tokens, len(r.spec_token_ids)) for r in engine.scheduler.running}
        engine.step()
        for r in reqs:
            if r.request_id in before and not r.status.finished:
                num_tokens, num_drafts = before[r.request_id]
                # Drafts sat at positions num_tokens..num_tokens+num_drafts-1; those at or past num_computed were
                # rejected (the budget is large, so the scheduler never cuts drafts here).
                rejected_positions[r.request_id] += [
                    p for p in range(num_tokens, num_tokens + num_drafts) if p >= r.num_computed_tokens
                ]
    running = [r for r in reqs if not r.status.finished]
    overwritten = sum(p < r.num_computed_tokens for r in running for p in rejected_positions[r.request_id])
    return running, overwritten


def _fresh_snapshot(fresh: LLMEngine, tokens: list[int]) -> Snapshot:
    """Prefill exactly `tokens` in one step of a fresh engine and read its caches at the request's slots."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # 2: still running after the step
    rid = fresh.add_request(tokens, params)
    req = fresh.core.requests[rid]
    fresh.step()
    assert req.num_computed_tokens == len(tokens) and not req.status.finished
    snap = _snapshot(fresh, req)
    fresh.abort_request(rid)
    assert fresh.kv.num_used_blocks == 0
    return snap


def _assert_same_history(snaps: list[tuple[Request, Snapshot]], fresh: LLMEngine, with_drafter: bool) -> None:
    assert snaps, "no request is still running: raise max_tokens"
    for req, got in snaps:
        want = _fresh_snapshot(fresh, got.tokens)
        assert got.tokens == want.tokens
        assert len(got.target) == len(fresh.runner.kv_caches)
        caches = [("target", got.target, want.target)]
        if with_drafter:
            assert got.drafter, "the DSpark drafter has no caches"
            caches.append(("drafter", got.drafter, want.drafter))
        for name, ours, theirs in caches:
            for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(ours, theirs, strict=True)):
                for what, a, b in (("key", k, k_ref), ("value", v, v_ref)):
                    if not torch.equal(a, b):
                        bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
                        close = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                        raise AssertionError(
                            f"{req.request_id}: {name} {what} cache of layer {layer} differs from a fresh prefill "
                            f"at positions {bad} of {len(got.tokens)} (allclose: {close}, "
                            f"max abs diff {(a - b).abs().max().item():.3e})"
                        )


def _check_rollback(
    model: Path | str,
    spec: dict[str, Any],
    prompts: list[list[int]],
    params: SamplingParams,
    steps: int,
    fresh_engine: bool = True,
) -> None:
    """fresh_engine=False (for big models: one load instead of two) reuses the engine for the reference prefills,
    after snapshotting, aborting everything and zeroing every cache, so no stale entry can match by chance."""
    llm = _make_llm(model, spec)
    engine = llm.engine
    running, overwritten = _run_until_rejections(engine, prompts, params, steps)
    m = engine.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > m["spec_decode_num_accepted_tokens"], "no draft was rejected"
    assert m["spec_decode_num_accepted_tokens"] > 0, "no draft was accepted: the test would miss accepted history"
    assert overwritten > 0, "no rejected draft's position became part of the computed history"
    with_drafter = spec["method"] == "dspark"
    if fresh_engine:
        _assert_same_history([(r, _snapshot(engine, r)) for r in running], _make_llm(model, spec).engine, with_drafter)
        return
    snaps = [(r, _snapshot(engine, r)) for r in running]
    engine.abort_request([r.request_id for r in running])
    assert engine.kv.num_used_blocks == 0
    for c in [*engine.runner.kv_caches, *getattr(engine.runner.drafter, "caches", [])]:
        c.key.zero_()
        c.value.zero_()
    _assert_same_history(snaps, engine, with_drafter)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> Path:
    from dspark.models.loader import load_model

    target = load_model(tiny_model_dirs["llama"], torch.float32, torch.device("cpu")).config
    cfg = DSparkConfig.for_target(target, num_layers=2, block_size=7, markov_rank=8)
    return save_drafter(random_drafter(cfg, 0), tmp_path_factory.mktemp("tiny-drafter"))


def test_dspark_context_kv_does_not_depend_on_how_many_tokens_were_written_together(
    tiny_model_dirs: dict[str, Path], tiny_drafter_dir: Path
) -> None:
    """The drafter's context K/V of a token is the same whether it was written in a prefill of many tokens or in a
    step that kept 1..11 tokens (one accepted run): what makes the rollback test above hold bit for bit."""
    spec = {"method": "dspark", "model": str(tiny_drafter_dir), "num_speculative_tokens": 4}
    drafter = _make_llm(tiny_model_dirs["llama"], spec).engine.runner.drafter
    assert drafter is not None
    g = torch.Generator().manual_seed(0)
    n = 66  # 1 + 2 + ... + 11
    taps = torch.randn(n, len(drafter.tap_layers) * 64, generator=g)
    positions = torch.arange(n)
    slots = torch.arange(n) + 7  # any valid slots
    drafter.extend_context(taps, positions, slots)
    together = _gather(drafter.caches, slots.tolist())
    for c in drafter.caches:
        c.key.zero_()
        c.value.zero_()
    start = 0
    for size in range(1, 12):
        drafter.extend_context(taps[start : start + size], positions[start : start + size], slots[start : start + size])
        start += size
    apart = _gather(drafter.caches, slots.tolist())
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(apart, together, strict=True)):
        for what, a, b in (("key", k, k_ref), ("value", v, v_ref)):
            bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
            assert not bad, (
                f"layer {layer} {what}: tokens {bad} differ when written in small groups (max abs diff "
                f"{(a - b).abs().max().item():.3e})"
            )


REPETITIVE = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [14]]


def test_ngram_rollback_target_cache_holds_accepted_history(tiny_model_dirs: dict[str, Path]) -> None:
    """Greedy n-gram on repetitive prompts: the first drafts (continuing the prompt's pattern) are rejected, the
    model's own loops later get accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    _check_rollback(tiny_model_dirs["llama"], spec, REPETITIVE, params, steps=12)


def test_dspark_rollback_target_and_drafter_caches_hold_accepted_history(
    tiny_model_dirs: dict[str, Path], tiny_drafter_dir: Path
) -> None:
    """Seeded sampling with a random DSpark drafter: rejection sampling accepts some drafts and rejects most."""
    spec = {"method": "dspark", "model": str(tiny_drafter_dir), "num_speculative_tokens": 4}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 4, list(range(100, 117))]
    _check_rollback(tiny_model_dirs["llama"], spec, prompts, params, steps=12)


@pytest.mark.slow
def test_ngram_rollback_on_smollm2(smollm2_path: Path) -> None:
    """The real model continues a counted pattern, so n-gram drafts are accepted in runs and rejected where it
    deviates."""
    from dspark.models.tokenizer import load_tokenizer

    text = "one two three four five, one two three four five, one two three four five, one two"
    prompts = [load_tokenizer(smollm2_path).encode(text, add_special_tokens=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 5}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _check_rollback(smollm2_path, spec, prompts, params, steps=4, fresh_engine=False)
