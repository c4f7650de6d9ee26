"""Faults inside the engine, at temperature 0 against a run without them, with and without DSpark speculation:

- an exception while one request's output is processed (its detokenizer raising) fails that request alone: it
  finishes with finish_reason "error" and what it had produced, its KV blocks are freed, and every other request of
  the batch ends with exactly the output it has without the fault;
- an exception of the whole step (the model runner's forward, the wait for its tokens with the next step already
  launched (async scheduling), or drafting) propagates from step(), is not swallowed, and once the requests in flight
  are aborted the engine serves new requests with unchanged outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

PROMPTS = {"a": [5, 6, 7, 8, 5, 6, 7], "b": list(range(100, 130)), "c": list(range(300, 340))}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SPECS = ["none", "async", "dspark"]


@pytest.fixture(scope="module")
def target(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Path:
    from dspark.models.loader import load_config

    cfg = DSparkConfig.for_target(load_config(target), num_layers=1, block_size=4, num_taps=2, markov_rank=8)
    return save_drafter(random_drafter(cfg, seed=1), tmp_path_factory.mktemp("faults-drafter"))


def make_engine(target: Path, drafter: Path, spec: str) -> LLMEngine:
    # Fixed k: every draft is verified, so drafting runs every step (and no start-up profiling).
    speculative = {"method": "dspark", "model": str(drafter), "enable_adaptive_verification": False}
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        num_kv_blocks=64,
        speculative_config=speculative if spec == "dspark" else None,
        # "async": the next decode step is launched before this one is collected; a fault then strands a step
        async_scheduling=spec == "async",
    )
    return LLMEngine(config)


def run(engine: LLMEngine, prompts: dict[str, list[int]] = PROMPTS) -> dict[str, RequestOutput]:
    """Add the prompts and step to the end; every request's final output by id."""
    for rid, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, rid)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


@pytest.fixture(scope="module")
def engines(target: Path, drafter: Path) -> Callable[[str], LLMEngine]:
    """spec -> one engine, built once and shared by the tests (each test leaves it idle; that it stays usable after
    a fault is part of what they show)."""
    built: dict[str, LLMEngine] = {}

    def get(spec: str) -> LLMEngine:
        if spec not in built:
            built[spec] = make_engine(target, drafter, spec)
        engine = built[spec]
        engine.abort_request(list(engine.output_processor.states))  # what a failed test may have left
        return engine

    return get


@pytest.fixture(scope="module")
def want(engines: Callable[[str], LLMEngine]) -> dict[str, list[int]]:
    """The fault-free tokens of every request, without speculation (which at temperature 0 changes none)."""
    return {rid: o.outputs[0].token_ids for rid, o in run(engines("none")).items()}


@pytest.mark.parametrize("spec", SPECS)
def test_a_fault_in_one_requests_output_fails_it_alone(
    engines: Callable[[str], LLMEngine],
    want: dict[str, list[int]],
    spec: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engines(spec)
    before = engine.get_metrics()
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, PARAMS, rid)
    detok = engine.output_processor.states["b"].detok
    real_add = detok.add
    calls = {"n": 0}

    def add_that_fails_on_the_third_step(ids: list[int]) -> str:
        calls["n"] += 1
        if calls["n"] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_add(ids)

    monkeypatch.setattr(detok, "add", add_that_fails_on_the_third_step)
    finals: dict[str, RequestOutput] = {}
    streamed_b: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "b":
                streamed_b += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
                if out.request_id == "b":
                    # Freed at once, while the others still run.
                    assert engine.scheduler.running and all(r.request_id != "b" for r in engine.scheduler.running)
                    assert engine.kv.num_used_blocks == sum(len(r.block_ids) for r in engine.scheduler.running)

    failed = finals["b"].outputs[0]
    assert failed.finish_reason == "error" and finals["b"].finished
    # What it had produced: its first tokens, the one whose detokenisation failed included.
    assert 0 < len(failed.token_ids) < len(want["b"]) and failed.token_ids == want["b"][: len(failed.token_ids)]
    assert streamed_b == failed.token_ids
    assert "request b failed while its output was processed" in caplog.text and "UnicodeDecodeError" in caplog.text
    for rid in ("a", "c"):
        assert finals[rid].outputs[0].finish_reason == "length" and finals[rid].outputs[0].token_ids == want[rid]
    metrics = engine.get_metrics()
    assert metrics["num_requests_failed"] - before["num_requests_failed"] == 1
    assert metrics["num_requests_finished"] - before["num_requests_finished"] == 2
    assert metrics["kv_num_used_blocks"] == 0 and metrics["num_requests_running"] == 0


def test_a_fault_while_finishing_a_final_only_request(
    engines: Callable[[str], LLMEngine], want: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A final_only request is detokenised once, as it finishes: a fault there fails it the same way."""
    engine = engines("none")
    final_only = dataclasses.replace(PARAMS, output_kind="final_only")
    engine.add_request(PROMPTS["a"], PARAMS, "a")
    engine.add_request(PROMPTS["b"], final_only, "b")

    def add_all(ids: list[int]) -> str:
        raise ValueError("no such token")

    monkeypatch.setattr(engine.output_processor.states["b"].detok, "add_all", add_all)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["b"].outputs[0].finish_reason == "error" and finals["b"].outputs[0].token_ids == want["b"]
    assert finals["a"].outputs[0].token_ids == want["a"]
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    ("spec", "where"),
    [("none", "launch"), ("async", "launch"), ("async", "collect"), ("dspark", "launch"), ("dspark", "propose")],
    ids=lambda v: v,
)
def test_a_failed_step_propagates_and_the_engine_goes_on(
    engines: Callable[[str], LLMEngine],
    want: dict[str, list[int]],
    spec: str,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engines(spec)
    before = engine.get_metrics()
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, PARAMS, rid)
    real = getattr(engine.runner, where)
    calls = {"n": 0}

    def fails_on_the_third_call(*args: Any, **kwargs: Any) -> Any:  # mid-generation: prompts done, tokens out
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, where, fails_on_the_third_call)
    with pytest.raises(RuntimeError, match="boom"):
        for _ in range(10):
            engine.step()
    assert engine.has_unfinished_requests()  # not dropped: the caller decides (the server aborts them)
    engine.abort_request(list(PROMPTS))
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    assert engine.get_metrics()["num_requests_aborted"] - before["num_requests_aborted"] == len(PROMPTS)
    # The same prompts as new requests: the outputs of a fresh engine.
    again = run(engine, {f"{rid}-again": prompt for rid, prompt in PROMPTS.items()})
    assert {rid.removesuffix("-again"): o.outputs[0].token_ids for rid, o in again.items()} == want
    assert engine.kv.num_used_blocks == 0
