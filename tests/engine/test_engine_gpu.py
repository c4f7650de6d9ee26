"""The engine on CUDA (skipped without a GPU; run with `pytest -m gpu`): transformers' greedy tokens,
a bf16 batch, speculation keeping greedy output, and decode steps without a host sync.

Engines are built once per module and shared: a test takes one cold (no requests, an empty prefix cache) and leaves
it so (what it left unfinished is aborted)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.bench.throughput import build_hf_model
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CHATS = ["What is the capital of France?", "Write a Python function that reverses a string."]
FP32 = {"device": "cuda", "dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 4096}
BF16 = {"device": "cuda", "max_model_len": 1024, "num_kv_blocks": 4096}  # auto: bf16 on CUDA


def _engine(**kw: Any) -> Iterator[LLM]:
    """One engine for the module; never built without CUDA (the skipif above skips first, this is the backstop)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(**kw)
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _cold(llm: LLM) -> Iterator[LLM]:
    """Hand a shared engine to one test as a fresh one would be (no requests, an empty prefix cache), and take it
    back the same way."""
    llm.engine.kv.reset_prefix_cache()
    yield llm
    llm.engine.abort_request(list(llm.engine.output_processor.states))
    llm.engine.kv.reset_prefix_cache()


@pytest.fixture(scope="module")
def fp32_engine() -> Iterator[LLM]:
    yield from _engine(**FP32)


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[LLM]:
    yield from _engine(**BF16)


@pytest.fixture
def fp32_llm(fp32_engine: LLM) -> Iterator[LLM]:
    """The plain fp32 engine: transformers' comparison and the speculation test's reference."""
    yield from _cold(fp32_engine)


@pytest.fixture
def bf16_llm(bf16_engine: LLM) -> Iterator[LLM]:
    yield from _cold(bf16_engine)


def test_cuda_fp32_greedy_matches_transformers(fp32_llm: LLM) -> None:
    """Teacher-forced: transformers (same weights, same GPU) agrees with every greedy token; logits close."""
    llm = fp32_llm
    hf = build_hf_model(llm.engine.model, torch.device("cuda"), torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for chat in CHATS:
        prompt = llm.apply_chat_template([{"role": "user", "content": chat}])
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out[:-1]], device="cuda")).logits[0, len(prompt) - 1 :].float()
        assert out == logits.argmax(-1).tolist()


def test_cuda_bf16_batch_runs_and_frees_blocks(bf16_llm: LLM) -> None:
    llm = bf16_llm
    assert llm.engine.dtype == torch.bfloat16
    assert llm.engine.eos_token_id == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Count to {i}."}]) for i in range(3, 35)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=32))
    assert all(o.outputs[0].finish_reason in ("stop", "length") and o.outputs[0].token_ids for o in outs)
    assert llm.engine.kv.num_used_blocks == 0
    # NOTE: bf16 on the GPU is deterministic for the same step sequence, not batch-invariant (cuBLAS picks kernels
    # by size); with its prefix cache emptied the engine repeats the same steps, as a fresh one would (a second run
    # that hit the prefix cache would prefill less).
    llm.engine.kv.reset_prefix_cache()
    again = llm.generate(prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=32))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_cuda_speculation_keeps_greedy_output(fp32_llm: LLM, tmp_path: Path) -> None:
    """n-gram and a random DSpark drafter on CUDA (fp32): greedy tokens as without speculation; sampling runs."""
    base = fp32_llm
    prompts = [base.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    prompts.append(base.tokenizer.encode("one two three one two three one two three one two"))
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
    cfg = DSparkConfig.for_target(base.engine.model_config, num_layers=1, block_size=7, markov_rank=16)
    drafter = str(save_drafter(random_drafter(cfg, seed=0), tmp_path / "drafter"))
    # Fixed k for the draft count below; the engine's default (adaptive) runs in the bench sweep and the tests on CPU.
    fixed = {"enable_adaptive_verification": False}
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, **fixed},
        {"method": "dspark", "model": drafter, **fixed},
    ):
        llm = LLM(**FP32, speculative_config=spec)  # one test uses each: built here, freed after its loop turn
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference, spec
        sampled = llm.generate(prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=24))
        assert all(o.outputs[0].token_ids for o in sampled)
        m = llm.get_metrics()
        assert m["spec_decode_num_draft_tokens"] > 0 and m["kv_num_used_blocks"] == 0
        del llm


def test_cuda_decode_steps_make_no_host_sync() -> None:
    """Steady-state decode steps (captured graph, sampling at T = 1 and T = 0) under sync debug mode "error": every
    host-device copy is asynchronous; the step waits only on the event of its own output copy."""
    # Its own engine (max_num_seqs=16, no other test's configuration), left with its requests running.
    llm = LLM(**BF16, max_num_seqs=16)
    engine = llm.engine
    for i in range(16):
        params = SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=64, ignore_eos=True)
        engine.add_request(f"Tell me about the number {i}.", params)
    for _ in range(3):  # prefill, then the first decode steps
        engine.step()
    torch.cuda.synchronize()
    replays = engine.runner.graphs.num_replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = [engine.step() for _ in range(20)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.runner.graphs.num_replays == replays + 20
    assert all(len(out) == 16 for out in outputs)
    assert engine.async_scheduling and engine.stats["num_pipelined_steps"] >= 19  # CUDA's default: steps overlap
