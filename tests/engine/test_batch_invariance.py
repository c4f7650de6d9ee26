"""A request's output does not depend on its batch: alone vs. 16 mixed requests with chunked prefill, preemption and
prefix caching (fp32, CPU). Also: KV blocks all return to the pool, finished or aborted."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark import LLM, SamplingParams
from helpers import BATCH_LENGTHS, batch_workload


def _check_batch_invariance(
    model: str, max_model_len: int, num_kv_blocks: int, lengths: list[int] = BATCH_LENGTHS, max_tokens: int = 20
) -> None:
    prompts, params = batch_workload(7, lengths, max_tokens)
    alone_llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, num_kv_blocks=512)
    alone = [alone_llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]

    # Small token budget (chunked prefill) and a small cache (preemption by recompute).
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_batched_tokens=64,
        num_kv_blocks=num_kv_blocks,
    )
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0, "the cache was meant to force preemption"
    assert metrics["prefix_cache_hits"] > 0, "the shared prefix was meant to hit the prefix cache"
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert len(a) == params[i].max_tokens
        assert a == b, f"request {i} ({len(prompts[i])} prompt tokens) changed inside the batch"
    assert metrics["kv_num_used_blocks"] == 0
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_batch_invariance(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    _check_batch_invariance(str(tiny_model_dirs[family]), max_model_len=448, num_kv_blocks=60)


@pytest.mark.slow
def test_smollm2_batch_invariance() -> None:
    # 16 requests as for the tiny models, shorter, so the real model stays within the CI budget.
    lengths = [n // 4 + 2 for n in BATCH_LENGTHS]
    _check_batch_invariance("smollm2-135m-instruct", max_model_len=160, num_kv_blocks=20, lengths=lengths, max_tokens=8)


def test_blocks_return_after_abort(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    ids = [
        engine.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=50, ignore_eos=True))
        for n in (5, 40, 120)
    ]
    engine.step()
    engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort_request(ids[1])
    engine.step()
    engine.abort_request([ids[0], ids[2], "no-such-request"])
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    assert engine.get_metrics()["num_requests_aborted"] == 3
