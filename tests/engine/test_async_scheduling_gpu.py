"""Async scheduling on CUDA (skipped without a GPU; run with `pytest -m gpu`): the pipelined steps give
the synchronous steps' tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.loader import load_config
from dspark.models.registry import resolve_model
from dspark.speculative.cost_model import CostModel
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("spec", ["none", "adaptive-dspark"])
def test_cuda_async_scheduling_gives_the_synchronous_tokens(spec: str, tmp_path: Path) -> None:
    """fp32: launching decode step t+1 before step t's tokens reach the host changes no token, greedy or seeded
    T = 1, with requests ending at different lengths and one aborted mid-run; the pipelined steps were taken (with
    adaptive speculation: in its plain regime)."""
    # Its own engines: each (spec, async_scheduling) pair is built once, for this test alone, and the pipelined-step
    # count it asserts is the engine's from its start.
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 4096, "max_num_seqs": 16}
    speculative = None
    if spec == "adaptive-dspark":
        target = load_config(resolve_model("smollm2-135m-instruct"))
        cfg = DSparkConfig.for_target(target, num_layers=1, block_size=7, markov_rank=16)
        speculative = {"method": "dspark", "model": str(save_drafter(random_drafter(cfg, seed=0), tmp_path / "d"))}
    prompts = [f"Write a short story about the number {i}." for i in range(10)]
    params = [
        SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=20 + 9 * i, ignore_eos=True)
        for i in range(10)
    ]
    outs = {}
    for on in (False, True):
        # a dear drafting pass (5 ms), so the regime mostly runs plain (and start-up profiling is skipped)
        cost = CostModel.from_points({1: 1.0, 4096: 1.0}, {1: 5.0, 4096: 5.0}) if speculative else None
        engine = LLM(**kw, async_scheduling=on, speculative_config=speculative, cost_model=cost).engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finals = {}
        for n in range(10_000):
            if n == 12:
                engine.abort_request(ids[3])
            finals.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            if not engine.has_unfinished_requests():
                break
        assert engine.kv.num_used_blocks == 0
        assert (engine.stats["num_pipelined_steps"] > 0) == on
        outs[on] = [finals.get(rid) for rid in ids]
    if spec == "none":
        assert outs[True] == outs[False]
    else:  # sampled rows verified in other steps draw other (equally distributed) tokens: greedy rows must agree
        assert outs[True][::2] == outs[False][::2]
    assert outs[True][3] is None
