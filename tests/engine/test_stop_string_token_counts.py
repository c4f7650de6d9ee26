"""Tokens past a stop string are not generated tokens (vLLM: they are not part of the output, nor of completion_tokens):
a stop string completed by the first of several tokens a speculative step appends, or by a token whose next step was
launched before it reached the host (async scheduling), leaves the request's num_generation_tokens, its token ids and
the engine's num_generation_tokens counter all equal to the tokens up to the one that completed it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine

PROMPT = "The quick brown fox"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": False}


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[Any, list[int], list[int]]:
    """The request's final output, its tokens, and how many each of its outputs brought (one output a step)."""
    engine.add_request(prompt, params)
    tokens: list[int] = []
    sizes: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            sizes.append(len(out.new_token_ids))
            final = out
    assert final is not None and final.finished
    return final, tokens, sizes


def stop_inside_a_step(tokenizer: Any, tokens: list[int], sizes: list[int]) -> tuple[str, int]:
    """A stop string that the first token of a step of several tokens completes (its first occurrence), and how many
    tokens the output keeps: the text up to and including that token."""
    start = 0
    for size in sizes:
        if size > 1 and start >= 2:
            text = tokenizer.decode(tokens[: start + 1])
            if text.strip() and text != tokenizer.decode(tokens[:start]) and "\ufffd" not in text:
                return text, start + 1
        start += size
    raise AssertionError(f"no step of several tokens to stop inside: {sizes}")


@pytest.mark.parametrize(
    ("spec", "async_scheduling"), [(NGRAM, False), (None, True)], ids=["ngram-speculation", "async-scheduling"]
)
def test_tokens_past_a_stop_string_are_not_counted(
    tiny_model_dirs: dict[str, Path], spec: dict[str, Any] | None, async_scheduling: bool
) -> None:
    config = EngineConfig(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        num_kv_blocks=64,
        speculative_config=spec,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind="delta")
    _, tokens, sizes = _run(engine, prompt, greedy)
    if spec is None:  # one token a step: stop at any token (the step after it was launched already)
        sizes = [2] * (len(tokens) // 2)
    stop, num_kept = stop_inside_a_step(engine.tokenizer, tokens, sizes)

    for kind in ("delta", "cumulative", "final_only"):
        before = engine.stats["num_generation_tokens"]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], output_kind=kind)
        out, _, _ = _run(engine, prompt, params)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == ""
        if kind != "delta":
            assert c.token_ids == tokens[:num_kept]
        assert out.metrics.num_generation_tokens == num_kept, kind
        assert engine.stats["num_generation_tokens"] - before == num_kept, kind
        assert engine.kv.num_used_blocks == 0 and not engine.core.requests
    if async_scheduling:
        assert engine.stats["num_pipelined_steps"] > 0, "no step was launched ahead"
