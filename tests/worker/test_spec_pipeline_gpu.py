"""Pipelined speculative steps on CUDA (skipped without a GPU; run with `pytest -m gpu`): the captured steps give the
eager steps' tokens, and a steady-state pipelined step makes no host sync."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [f"Count from {i} to {i + 30}, one number per line." for i in range(10)] + [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
]
FIXED_7 = {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False}
KW = {"device": "cuda", "max_model_len": 1024, "num_kv_blocks": 4096, "max_num_seqs": 32}


def test_pipelined_graphs_give_the_eager_pipelines_tokens() -> None:
    """fp32, the shipped drafter, fixed k = 7: greedy requests and seeded T = 1 ones verified by rejection sampling.
    The captured pipelined steps (allocation, layout, target, verification, drafting in two graphs) emit what the same
    steps emit eagerly, and accept drafts."""
    params = [
        SamplingParams(temperature=1.0 if i % 3 == 2 else 0.0, seed=i, max_tokens=64, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    runs = []
    for eager in (True, False):
        llm = LLM(**KW, dtype="float32", enforce_eager=eager, speculative_config=FIXED_7)
        pipeline = llm.engine.runner.pipeline
        assert pipeline is not None and bool(pipeline.graphs_a) == (not eager)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert pipeline.num_launched > 10 and (eager or pipeline.num_graph_replays > 10)
        stats = llm.engine.stats
        runs.append((tokens, stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]))
        del llm, pipeline
    (want, _, _), (got, accepted, drafts) = runs
    assert got == want
    assert accepted > 0.1 * drafts


def test_a_pipelined_step_makes_no_host_sync() -> None:
    """bf16, fixed k = 7, greedy and T = 1 requests: steady-state pipelined steps under sync debug mode "error" (every
    host-device copy asynchronous; a step waits only on the event of its own output copy)."""
    llm = LLM(**KW, speculative_config=FIXED_7)
    engine = llm.engine
    pipeline = engine.runner.pipeline
    assert pipeline is not None
    for i in range(16):
        params = SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=400, ignore_eos=True)
        engine.add_request(f"Tell me about the number {i}.", params)
    for _ in range(4):  # prefill, a plain step, then the pipeline
        engine.step()
    torch.cuda.synchronize()
    launched, replays = pipeline.num_launched, pipeline.num_graph_replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = [engine.step() for _ in range(20)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pipeline.num_launched == launched + 20 and pipeline.num_graph_replays == replays + 20
    assert all(len(out) == 16 for out in outputs)
    engine.abort_request([f"req-{i}" for i in range(16)])
