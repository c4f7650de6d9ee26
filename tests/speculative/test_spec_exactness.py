"""Speculative decoding changes speed, never output (CPU fp32):

- greedy output with n-gram or DSpark drafting (k = 1..7) is token-for-token the output without speculation, for
  mixed batches with chunked prefill, stop conditions and the tiny models of every family;
- strict verification (n-gram, or DSpark drafting greedily) keeps seeded sampled output identical too, penalties,
  top-k/p, min_tokens and logprobs included;
- with rejection sampling, a request's output does not depend on its batch (chunked prefill, preemption);
- metrics count as vLLM counts.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.outputs import RequestOutput
from dspark.speculative.cost_model import CostModel
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
from helpers import FAMILIES, hold_drafting


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> dict[str, Path]:
    """family -> a random DSpark drafter directory for that tiny target."""
    from dspark.models.loader import load_config

    out = {}
    for family, path in tiny_model_dirs.items():
        cfg = DSparkConfig.for_target(load_config(path), num_layers=2, block_size=7, num_taps=2, markov_rank=8)
        out[family] = save_drafter(random_drafter(cfg, seed=1), tmp_path_factory.mktemp(f"drafter-{family}"))
    return out


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
    prompts.append((prompts[0][:6] * 12)[:70])  # repetitive: n-gram drafts get accepted
    return prompts


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _llm(model: str, spec: dict[str, Any] | None, **kw: Any) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256, **kw}
    return LLM(model=model, speculative_config=spec, **kw)


def _greedy_params(n: int) -> list[SamplingParams]:
    # Varied lengths, and a stop token on one request: drafts past a stop must be dropped.
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 5 * (i % 4), ignore_eos=True) for i in range(n)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11, 13, 101])
    return params


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_greedy_output_is_unchanged_by_speculation(
    family: str, method: str, tiny_model_dirs: dict[str, Path], drafters: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs[family])
    prompts = _prompts(3, [5, 23, 70, 140, 9])
    params = _greedy_params(len(prompts))
    reference = _tokens(_llm(model, None, max_num_batched_tokens=48).generate(prompts, params))
    total_drafts, partial = 0, 0
    for k in range(1, 8):
        # Fixed k, adaptive async and sync in turn; adaptive with the profiled cost or with a steep one under which
        # only some drafts are worth verifying.
        mode = ("fixed", "async", "sync")[k % 3]
        spec: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
        if mode == "fixed":
            spec["enable_adaptive_verification"] = False
        else:
            spec["adaptive_verification_mode"] = mode
        if method == "dspark":
            spec["model"] = str(drafters[family])
        cost = _STEEP if k % 2 else None
        llm = _llm(model, spec, max_num_batched_tokens=48, cost_model=cost)  # chunked prefill mixed with verification
        if mode != "fixed":  # drafting, whatever the regime would measure (noise at this size): the budgets are tested
            hold_drafting(llm.engine)
        assert _tokens(llm.generate(prompts, params)) == reference, f"k={k} mode={mode}"
        m = llm.get_metrics()
        total_drafts += m["spec_decode_num_draft_tokens"]
        assert m["kv_num_used_blocks"] == 0
        if mode != "fixed":
            hist = m["spec_decode_verify_len_hist"]
            partial += sum(hist[1:k])  # steps that verified some but not all of K slots
    assert total_drafts > 0, "nothing was ever drafted: the test would prove nothing"
    assert partial > 0, "adaptive verification never verified a partial block: the test would prove little"


def test_dspark_on_the_fast_cpu_path_defers_its_context_and_keeps_greedy_output(
    tiny_model_dirs: dict[str, Path], drafters: dict[str, Path]
) -> None:
    """The default CPU path (not batch-invariant) defers the drafter's context write (DSparkDrafter.extend_context):
    greedy output still equals the same path's without speculation, and once the requests ended (released), no row
    is left unwritten."""
    model = str(tiny_model_dirs["llama"])
    prompts = _prompts(5, [5, 23, 70, 9])
    params = _greedy_params(len(prompts))
    reference = _tokens(_llm(model, None, batch_invariant=False).generate(prompts, params))
    for adaptive in (False, True):
        spec = {"method": "dspark", "model": str(drafters["llama"]), "enable_adaptive_verification": adaptive}
        llm = _llm(model, spec, batch_invariant=False, max_num_batched_tokens=48)
        drafter = llm.engine.core.runner.drafter
        assert isinstance(drafter, DSparkDrafter) and drafter.defer_context
        if adaptive:
            hold_drafting(llm.engine)
        assert _tokens(llm.generate(prompts, params)) == reference
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
        assert drafter._pending_rows == 0 and not drafter._pending


# Each verified token costs a quarter of a one-token step: only drafts with survival above 1/4 pay.
_STEEP = CostModel.from_points({1: 4.0, 16: 7.75, 64: 19.75}, {1: 0.0, 64: 0.0})


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("spec", [{"method": "ngram"}, {"method": "dspark", "draft_sample_method": "greedy"}])
def test_strict_verification_keeps_seeded_sampling_identical(
    spec: dict[str, Any], adaptive: bool, tiny_model_dirs: dict[str, Path], drafters: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs["qwen3"])
    prompts = _prompts(5, [4, 30, 90, 12])
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=12, max_tokens=25, repetition_penalty=1.2),
        SamplingParams(
            temperature=1.0, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3, seed=13, max_tokens=20
        ),
        SamplingParams(temperature=0.5, seed=14, max_tokens=24, min_tokens=20, stop_token_ids=[5, 6, 7]),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
    ]
    base = _llm(model, None).generate(prompts, params)
    spec = {**spec, "num_speculative_tokens": 5, "enable_adaptive_verification": adaptive}
    if spec["method"] == "dspark":
        spec["model"] = str(drafters["qwen3"])
    llm = _llm(model, spec, max_num_batched_tokens=40)
    out = llm.generate(prompts, params)
    assert _tokens(out) == _tokens(base)
    for a, b in zip(base, out, strict=True):
        if a.outputs[0].logprobs is not None:
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
            assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    if not adaptive:  # adaptive verification may rightly verify nothing here: it follows measured step times
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


def test_rejection_sampling_output_does_not_depend_on_the_batch(
    tiny_model_dirs: dict[str, Path], drafters: dict[str, Path]
) -> None:
    from helpers import BATCH_LENGTHS as LENGTHS
    from helpers import batch_workload as _workload

    model = str(tiny_model_dirs["llama"])
    # Fixed k: adaptive verification sizes each request's verification by what else is in the batch (by design), so a
    # sampled request's output is equal in distribution there, not token for token (greedy stays exact).
    spec = {
        "method": "dspark",
        "model": str(drafters["llama"]),
        "num_speculative_tokens": 4,
        "enable_adaptive_verification": False,
    }
    prompts, params = _workload(9, LENGTHS[:10], max_tokens=12)
    alone_llm = _llm(model, spec)
    alone = [_tokens(alone_llm.generate([p], sp))[0] for p, sp in zip(prompts, params, strict=True)]
    # A small token budget (chunked prefill, drafts cut) and a small cache (preemption by recompute).
    llm = _llm(model, spec, max_num_batched_tokens=48, num_kv_blocks=22, max_model_len=300)
    batched = _tokens(llm.generate(prompts, params))
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0, "the cache was meant to force preemption"
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert a == b, f"request {i} changed inside the batch"
    assert m["kv_num_used_blocks"] == 0


def test_spec_metrics_count_as_vllm(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    prompts = _prompts(8, [6, 40, 12])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = _llm(model, None)
    base_out = base.generate(prompts, params)
    llm = _llm(model, {"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": False})
    out = llm.generate(prompts, params)
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert (
        m["num_generation_tokens"]
        == base.get_metrics()["num_generation_tokens"]
        == sum(len(t) for t in _tokens(base_out))
    )
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), "acceptance at position j needs acceptance before it"
    assert m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"] <= 3 * m["spec_decode_num_drafts"]
    assert m["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"]
    )
    # Per-request counts add up to the engine's.
    assert sum(o.metrics.spec_num_drafts for o in out) == m["spec_decode_num_drafts"]
    assert sum(o.metrics.spec_num_draft_tokens for o in out) == m["spec_decode_num_draft_tokens"]
    assert sum(o.metrics.spec_num_accepted_tokens for o in out) == m["spec_decode_num_accepted_tokens"]
    # Fewer steps than tokens: accepted drafts save target forwards.
    assert m["num_steps"] < base.get_metrics()["num_steps"]


def test_no_speculation_reports_empty_spec_metrics(tiny_model_dirs: dict[str, Path]) -> None:
    llm = _llm(str(tiny_model_dirs["llama"]), None)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts"] == 0 and m["spec_decode_num_accepted_tokens_per_pos"] == []
    assert m["spec_decode_mean_acceptance_length"] is None
    assert out[0].metrics.spec_acceptance_length is None


MIN_ACCEPTED = {1: 0.22, 4: 0.33, 7: 0.33}  # accepted drafts per verification step, for the shipped drafter


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "dspark", "dspark-shipped"])
def test_smollm2_greedy_output_is_unchanged_by_speculation(method: str, tmp_path: Path) -> None:
    """dspark-shipped: "method": "dspark" without "model" picks the drafter that ships for the default target."""
    base = LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=64)
    chats = [
        "List the first ten prime numbers, separated by commas.",
        "Write a Python function that checks whether a number is even.",
        "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
        "What is the capital of France?",
    ]
    prompts = [base.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    reference = _tokens(base.generate(prompts, params))
    spec: dict[str, Any] = {"method": method.removesuffix("-shipped")}
    if method == "dspark":
        cfg = DSparkConfig.for_target(base.engine.model_config, num_layers=1, block_size=7, markov_rank=16)
        spec["model"] = str(save_drafter(random_drafter(cfg, seed=0), tmp_path / "drafter"))
    for k in (1, 4, 7):
        llm = LLM(
            dtype="float32",
            max_model_len=512,
            max_num_batched_tokens=64,
            # The shipped drafter at fixed k, so that every draft is verified and its acceptance can be checked.
            speculative_config={
                **spec,
                "num_speculative_tokens": k,
                "enable_adaptive_verification": method != "dspark-shipped",
            },
        )
        assert _tokens(llm.generate(prompts, params)) == reference, f"k={k}"
        if method == "dspark-shipped":
            m = llm.get_metrics()
            # Trained: the random drafter accepts 1 draft in hundreds; this one, measured on these prompts, accepted
            # 0.44 and 0.67 drafts per verification step at k = 1 and 4 (half of that is the bar).
            assert m["spec_decode_num_accepted_tokens"] > MIN_ACCEPTED[k] * m["spec_decode_num_drafts"], (k, m)


def test_prefix_cache_covers_generated_text_under_speculation(tiny_model_dirs: dict[str, Path]) -> None:
    """Blocks filled by accepted drafts are hashed from their real tokens: a follow-up prompt that repeats the first
    request's prompt and output hits the cache for all of its full blocks."""
    # Fixed k, so that every step drafts: adaptive's regime chooses from measured step rates, and on a loaded host
    # it may keep nearly every token plain, leaving no accepted drafts to fill blocks.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": False}
    llm = _llm(str(tiny_model_dirs["llama"]), spec, block_size=4)
    prompt = ([5, 6, 7, 8, 9, 10] * 8)[:45]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    assert first.metrics.spec_num_accepted_tokens > 4, "accepted drafts were meant to fill blocks"
    history = prompt + first.outputs[0].token_ids
    follow = llm.generate([[*history, 11, 12]], SamplingParams(temperature=0.0, max_tokens=1))[0]
    # Every block of the first request's computed tokens (all but its last token) is found again.
    assert follow.metrics.num_cached_tokens == (len(history) - 1) // 4 * 4


@pytest.mark.parametrize("adaptive", [False, True])
def test_per_request_cap_on_drafts(tiny_model_dirs: dict[str, Path], drafters: dict[str, Path], adaptive: bool) -> None:
    """SamplingParams.max_speculative_tokens caps one request's drafts per step; 0 opts it out of speculation. Adaptive
    verification runs with a flat cost (verifying is free, so it verifies every draft it may): the caps still hold."""
    spec = {
        "method": "dspark",
        "model": str(drafters["llama"]),
        "num_speculative_tokens": 4,
        "enable_adaptive_verification": adaptive,
    }
    flat = CostModel.from_points({1: 1.0, 4096: 1.0}, {1: 0.0, 4096: 0.0})
    llm = _llm(str(tiny_model_dirs["llama"]), spec, cost_model=flat)
    if adaptive:
        hold_drafting(llm.engine)
    prompt = ([5, 6, 7, 8, 9, 10] * 8)[:45]
    caps = [None, 2, 0]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, max_speculative_tokens=c) for c in caps]
    outs = llm.generate([prompt] * 3, params)
    assert _tokens(outs)[0] == _tokens(outs)[1] == _tokens(outs)[2]
    full, capped, opted_out = (o.metrics for o in outs)
    assert full.spec_num_draft_tokens > 2 * full.spec_num_drafts  # uncapped: more than 2 drafts a step on average
    assert 0 < capped.spec_num_draft_tokens <= 2 * capped.spec_num_drafts
    assert opted_out.spec_num_drafts == opted_out.spec_num_draft_tokens == 0


def test_a_sampled_request_joins_greedy_ones_drafted_without_distributions(
    tiny_model_dirs: dict[str, Path], drafters: dict[str, Path]
) -> None:
    """A pass whose rows are all greedy drafts argmaxes and keeps no distributions; a sampled request that then joins
    is verified beside greedy rows drafted that way (their rows need none), and from its first drafting pass on the
    pass samples again. Greedy outputs stay those without speculation, and nothing is left pending."""
    model = str(tiny_model_dirs["llama"])
    prompts = _prompts(5, [9, 30, 17])
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = _tokens(_llm(model, None).generate(prompts, greedy))
    spec = {"method": "dspark", "model": str(drafters["llama"]), "enable_adaptive_verification": False}
    llm = _llm(model, spec)
    engine, runner = llm.engine, llm.engine.runner
    for p in prompts:
        engine.add_request(p, greedy)
    for _ in range(3):  # prefill, then greedy passes: no distributions kept
        engine.step()
    assert runner._draft_probs == {}
    assert engine.stats["spec_decode_num_draft_tokens"] > 0
    engine.add_request(prompts[0][:5], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    engine.step()  # its prefill beside greedy rows verified without distributions
    engine.step()  # its drafts were sampled: it has a distribution, the greedy rows a one-hot each
    assert len(runner._draft_probs) == len(prompts) + 1
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert [outs[f"req-{i}"] for i in range(len(prompts))] == reference
    assert len(outs[f"req-{len(prompts)}"]) == 20
    assert runner._draft_probs == {} and engine.kv.num_used_blocks == 0
