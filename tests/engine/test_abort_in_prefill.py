"""A long prompt aborted part-way through its chunked prefill frees its KV blocks at once (before the next step), long
before its prefill would have ended, with or without async scheduling, and leaves nothing behind: the request is gone
from the scheduler, the core and the front, every block is back in the pool, and a request running beside it goes on
unchanged (the same tokens as alone)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from helpers import make_hf_model

PROMPT_LEN = 6000
CHUNK = 64  # max_num_batched_tokens: the prompt takes ~94 steps
BLOCK = 16
NUM_BLOCKS = 600  # 9600 tokens: the long prompt and a short request beside it


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> str:
    """A tiny llama with an 8192-token context (the shared tiny models have 1024)."""
    out = tmp_path_factory.mktemp("tiny-long-context")
    make_hf_model("llama", max_position_embeddings=8192).save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return str(out)


def _engine(model: str, async_scheduling: bool) -> LLMEngine:
    config = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        max_model_len=8192,
        max_num_batched_tokens=CHUNK,
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        async_scheduling=async_scheduling,
    )
    return LLMEngine(config)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.core.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_blocks == NUM_BLOCKS
    assert all(count == 0 for count in engine.kv.ref_count)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_aborted_prefill_frees_its_blocks_within_a_step(long_model: str, async_scheduling: bool) -> None:
    engine = _engine(long_model, async_scheduling)
    short_prompt = _prompt(12, 1)
    short_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request(short_prompt, short_params, "alone")
    want = []
    while engine.has_unfinished_requests():
        want += [o for o in engine.step() if o.finished]
    _check_idle(engine)

    engine.add_request(short_prompt, short_params, "short")
    long_id = engine.add_request(_prompt(PROMPT_LEN, 2), SamplingParams(max_tokens=8, ignore_eos=True), "long")
    long_req = engine.core.requests[long_id]
    got = []
    num_steps = 6
    for _ in range(num_steps):
        got += [o for o in engine.step() if o.finished]
        assert all(o.request_id != long_id for o in got)
    # Part-way through its prefill: a few chunks computed (the short request took a little of the first step's budget).
    assert 0 < long_req.num_computed_tokens <= num_steps * CHUNK < PROMPT_LEN
    held = len(long_req.block_ids)
    assert held >= long_req.num_computed_tokens // BLOCK
    used = engine.kv.num_used_blocks
    steps_before = engine.stats["num_steps"]

    engine.abort_request(long_id)
    # Freed by the abort itself: no further step is needed.
    assert engine.kv.num_used_blocks == used - held and long_req.block_ids == []
    assert long_req not in engine.scheduler.running and long_req not in engine.scheduler.waiting
    assert long_id not in engine.core.requests and long_id not in engine.output_processor.states
    assert long_req.status.finished

    while engine.has_unfinished_requests():  # the short request goes on, alone
        got += [o for o in engine.step() if o.finished]
        assert all(o.request_id != long_id for o in got)
    assert engine.stats["num_steps"] - steps_before <= short_params.max_tokens, "the aborted prefill went on"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.step() == []
    _check_idle(engine)
    assert engine.get_metrics()["num_requests_aborted"] == 1
    assert engine.get_metrics()["kv_num_used_blocks"] == 0
