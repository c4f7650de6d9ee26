"""Pipelined speculative steps (worker/spec_pipeline.py): drafting and verification on the device, launched a step
ahead of the host. They change speed, never output (CPU fp32, the same code path as CUDA's, eagerly):

- greedy output equals the output without speculation, in fixed-k and adaptive modes, with drafts accepted;
- strict verification keeps seeded sampled output identical to plain sampling;
- rejection-sampled output of a request does not depend on its batch: requests that end, or are aborted, mid-run
  leave the others' rows (gathered from one step to the next) exactly as they were;
- a pipeline ends and starts again around an admission, and around a stop token or string ending a request mid-run.

The drafter is a random DSpark drafter whose Markov head says "repeat the previous token", and the tiny tied targets
repeat a token for many steps at temperature 0: drafts are accepted, so every verification path runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.speculative.cost_model import CostModel
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

CHEAP_DRAFTS = CostModel.from_points({1: 1.0, 64: 1.5}, {1: 0.05, 64: 0.1})  # drafting always pays


@pytest.fixture(scope="module")
def echo_drafters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> dict[str, Path]:
    """family -> a drafter that proposes its anchor again and again (a Markov head peaked on the previous token)."""
    from dspark.models.loader import load_config

    out = {}
    for family in ("llama", "qwen3"):
        cfg = DSparkConfig.for_target(
            load_config(tiny_model_dirs[family]), num_layers=2, block_size=7, num_taps=2, markov_rank=8
        )
        drafter = random_drafter(cfg, seed=1)
        with torch.no_grad():
            unit = torch.randn(drafter.markov_head.markov_w1.weight.shape, generator=torch.Generator().manual_seed(3))
            unit = torch.nn.functional.normalize(unit, dim=1)  # W2 W1[x] peaks at x: unit vectors, x's own is 1
            drafter.markov_head.markov_w1.weight.copy_(unit)
            drafter.markov_head.markov_w2.weight.copy_(unit * 200.0)
        out[family] = save_drafter(drafter, tmp_path_factory.mktemp(f"echo-{family}"))
    return out


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def _llm(
    model: Path, spec: dict[str, Any] | None, async_scheduling: bool = True, padded: bool = False, **kw: Any
) -> LLM:
    """padded: pipelined steps run at the shapes CUDA graphs are captured for (padding rows and tokens), eagerly."""
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=256,
        speculative_config=spec,
        async_scheduling=async_scheduling,
        **kw,
    )
    if padded:
        pipeline = llm.engine.runner.pipeline
        assert pipeline is not None
        pipeline.pad_like_graphs(llm.engine.config.max_num_batched_tokens)
    return llm


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("family", "adaptive", "padded"),
    [("llama", False, False), ("llama", True, True), ("qwen3", False, True), ("qwen3", True, False)],
    ids=["llama-fixed", "llama-adaptive-padded", "qwen3-fixed-padded", "qwen3-adaptive"],
)
def test_greedy_output_is_unchanged(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path], family: str, adaptive: bool, padded: bool
) -> None:
    model = tiny_model_dirs[family]
    prompts = _prompts(0, [5, 9, 17, 30, 44])
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    want = _tokens(_llm(model, None, async_scheduling=False), prompts, params)
    spec = {"method": "dspark", "model": str(echo_drafters[family]), "enable_adaptive_verification": adaptive}
    llm = _llm(model, spec, padded=padded, cost_model=CHEAP_DRAFTS if adaptive else None)
    assert _tokens(llm, prompts, params) == want
    pipeline = llm.engine.runner.pipeline
    metrics = llm.get_metrics()
    assert pipeline is not None and pipeline.num_launched >= 5, "no pipelined step ran"
    assert metrics["spec_decode_num_accepted_tokens"] > 20, "nothing exercised acceptance"
    assert metrics["num_generation_tokens"] == sum(len(t) for t in want)


def test_strict_verification_keeps_seeded_sampling(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path]
) -> None:
    """Drafting greedily verifies strictly: every emitted token is the one plain sampling draws at that position."""
    model = tiny_model_dirs["llama"]
    prompts = _prompts(1, [6, 12, 25])
    params = [
        SamplingParams(temperature=0.0 if i == 0 else 0.3 + 0.4 * i, seed=11 + i, max_tokens=40, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = _tokens(_llm(model, None, async_scheduling=False), prompts, params)
    spec = {
        "method": "dspark",
        "model": str(echo_drafters["llama"]),
        "enable_adaptive_verification": False,
        "draft_sample_method": "greedy",
    }
    llm = _llm(model, spec)
    assert _tokens(llm, prompts, params) == want
    assert llm.engine.runner.pipeline is not None and llm.engine.runner.pipeline.num_launched >= 5


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_rejection_sampled_output_does_not_depend_on_the_batch(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path], padded: bool
) -> None:
    """Requests of different lengths end at different steps (the rows that go on are gathered from the step before,
    the draft distributions read at their old rows) and one is aborted mid-run: each of the others samples exactly
    what it samples alone."""
    model = tiny_model_dirs["llama"]
    prompts = _prompts(2, [5, 11, 19, 33])
    params = [
        SamplingParams(temperature=0.0 if i == 2 else 0.9, seed=7 + i, max_tokens=20 + 9 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    spec = {"method": "dspark", "model": str(echo_drafters["llama"]), "enable_adaptive_verification": False}
    llm = _llm(model, spec, padded=padded)
    alone = [_tokens(llm, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(p, sp, f"r{i}")
    engine.add_request(_prompts(9, [8])[0], SamplingParams(temperature=0.9, seed=3, max_tokens=60), "aborted")
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 6:
            engine.abort_request("aborted")
    assert [got[f"r{i}"] for i in range(len(prompts))] == alone
    assert engine.kv.num_used_blocks == 0
    assert engine.runner.pipeline is not None and engine.runner.pipeline.num_launched >= 10


def test_a_one_row_pipeline_samples_what_a_wider_one_does(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path]
) -> None:
    """An engine of one sequence (the pipeline's tables one row wide, its draft distributions one row a position)
    samples each request exactly as an engine of four does with the request alone."""
    model = tiny_model_dirs["llama"]
    prompts = _prompts(4, [6, 13])
    params = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=30, ignore_eos=True) for i in range(2)]
    spec = {"method": "dspark", "model": str(echo_drafters["llama"]), "enable_adaptive_verification": False}
    wide, narrow = _llm(model, spec, max_num_seqs=4), _llm(model, spec, max_num_seqs=1)
    for p, sp in zip(prompts, params, strict=True):
        assert _tokens(narrow, [p], [sp]) == _tokens(wide, [p], [sp])
    assert narrow.engine.runner.pipeline is not None and narrow.engine.runner.pipeline.num_launched >= 10


def test_a_pipeline_ends_and_starts_again_around_an_admission_and_stops(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path]
) -> None:
    """A request admitted mid-run ends the pipeline (its prompt needs the host); the pipeline starts again after it.
    A stop token id and a stop string end requests mid-run while others go on. Output is the output without
    speculation throughout."""
    model = tiny_model_dirs["llama"]
    prompts = _prompts(3, [7, 13, 21])
    late = _prompts(4, [10])[0]
    base = _llm(model, None, async_scheduling=False)
    free = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ref = _tokens(base, prompts, [free] * 3)
    stop_token = ref[1][20]  # the second request stops there (its first appearance may come earlier)
    params = [free, SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[stop_token]), free]
    text = base.tokenizer.decode(ref[2][12:14])
    params[2] = SamplingParams(temperature=0.0, max_tokens=50, stop=[text], ignore_eos=True)

    def run(llm: LLM) -> tuple[dict[str, list[int]], dict[str, str | None]]:
        engine = llm.engine
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(p, sp, f"r{i}")
        got, reasons, steps = {}, {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
                    reasons[out.request_id] = out.outputs[0].finish_reason
            steps += 1
            if steps == 4:
                engine.add_request(late, free, "late")
        return got, reasons

    want, want_reasons = run(base)
    spec = {"method": "dspark", "model": str(echo_drafters["llama"]), "enable_adaptive_verification": False}
    llm = _llm(model, spec)
    got, reasons = run(llm)
    assert got == want and reasons == want_reasons
    assert want_reasons["r1"] == "stop" and want_reasons["r2"] == "stop"
    pipeline = llm.engine.runner.pipeline
    assert pipeline is not None and pipeline.num_launched >= 4
    assert llm.engine.kv.num_used_blocks == 0


def test_the_graphs_static_drafting_inputs_are_the_eager_ones(
    tiny_model_dirs: dict[str, Path], echo_drafters: dict[str, Path]
) -> None:
    """CUDA graphs read a drafting pass's metadata from static buffers (SpecPipeline.capture): filled from the rows,
    they hold what the eager pass computes (slots, query starts, context lengths, block tables)."""
    from dspark.attention.base import AttentionMetadata
    from dspark.utils.numerics import padded_rows

    spec = {"method": "dspark", "model": str(echo_drafters["llama"]), "enable_adaptive_verification": False}
    llm = _llm(tiny_model_dirs["llama"], spec)
    engine = llm.engine
    for i, p in enumerate(_prompts(5, [6, 14, 9])):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), f"r{i}")
    for _ in range(4):
        engine.step()
    pipeline = engine.runner.pipeline
    assert pipeline is not None and pipeline.num_launched > 0
    r, K = 4, pipeline.block  # one padding row slot past the three requests
    eager = pipeline.prologue_b(r, sample=True)
    meta = AttentionMetadata(
        num_actual_tokens=r * K,
        slot_mapping=torch.full((padded_rows(r * K),), 7, dtype=torch.int64),
        query_start_loc=torch.zeros(r + 1, dtype=torch.int32),
        seq_lens=torch.zeros(r, dtype=torch.int32),
        block_tables=torch.zeros(r, pipeline.max_blocks, dtype=torch.int32),
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
        max_query_len=K,
        max_seq_len=pipeline.max_blocks * pipeline.block_size,
        causal=False,
    )
    static = pipeline.prologue_b(r, sample=True, meta_out=meta)
    for a, b in zip(eager[:2] + eager[3:5], static[:2] + static[3:5], strict=True):
        assert torch.equal(a, b)
    assert eager[5] is not None and static[5] is not None and torch.equal(eager[5], static[5])
    m = eager[2]  # the real requests' (three)
    assert torch.equal(meta.slot_mapping, m.slot_mapping)
    assert torch.equal(meta.query_start_loc[:4], m.query_start_loc) and torch.equal(meta.seq_lens[:3], m.seq_lens)
    assert torch.equal(meta.block_tables[:3], m.block_tables)
    # the padding row is empty: no query rows, no context, no slot written
    assert meta.query_start_loc[4] == meta.query_start_loc[3] and meta.seq_lens[3] == 0
    assert (meta.slot_mapping[3 * K :] == -1).all()
    engine.abort_request(["r0", "r1", "r2"])
