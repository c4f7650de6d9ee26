"""End to end through LLMEngine / LLM on a tiny model: input errors, stop conditions, logprobs, streaming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dspark import LLM, ConfigError, SamplingParams
from dspark.outputs import RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, Path]) -> LLM:
    return LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, num_kv_blocks=64)


def _greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids


PROMPT = list(range(100, 120))


@pytest.mark.parametrize(
    ("prompt", "field", "needle"),
    [
        (list(range(5, 5 + 128)), "prompt", "max_model_len - 1 = 127"),
        ([], "prompt", "must not be empty"),
        ("", "prompt", "must not be empty"),
        ([1, 2, 49152], "prompt_token_ids", "[0, 49152)"),
        ([1, -1], "prompt_token_ids", "[0, 49152)"),
    ],
)
def test_bad_prompts_name_the_field(llm: LLM, prompt: object, field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        llm.generate([prompt], SamplingParams(max_tokens=1))  # type: ignore[list-item]
    assert e.value.field == field and needle in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_engine_size_errors(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len=4096.*context length, 1024"):
        LLM(model=str(tiny_model_dirs["llama"]), max_model_len=4096)
    with pytest.raises(ConfigError, match="KV cache's 64 tokens"):
        LLM(model=str(tiny_model_dirs["llama"]), max_model_len=512, num_kv_blocks=4)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="one per prompt"):
        llm.generate([PROMPT, PROMPT], [SamplingParams()])


def test_duplicate_request_id(llm: LLM) -> None:
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(ConfigError, match="unique"):
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="x")
    llm.engine.abort_request("x")


def test_max_tokens_and_context_end_with_length(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # Unbounded max_tokens stops at max_model_len.
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == 128 and out.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    ref = _greedy(llm, PROMPT, 12)
    stop_at = ref[5]
    first = ref.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens masks stop tokens until reached, so the greedy path must avoid them.
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_at]))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 12 and stop_at not in out.token_ids


def test_stop_strings_cut_text_and_stream_consistently(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    assert len(full) > 12
    stop = full[8:11]
    idx = full.index(stop)
    engine = llm.engine
    for include in (False, True):
        rid = engine.add_request(
            PROMPT,
            SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
            ),
        )
        streamed, final = "", None
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == rid
                streamed += out.new_text
                final = out
        assert final is not None and final.finished
        expected = full[: idx + len(stop)] if include else full[:idx]
        assert final.outputs[0].text == expected and streamed == expected
        assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop


def test_logprobs_shape(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy: the sampled token is the argmax
        assert len(entry) == 3 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_request_metrics(llm: LLM) -> None:
    m = llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))[0].metrics
    assert m.num_prompt_tokens == len(PROMPT) and m.num_generation_tokens == 3
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft is not None and m.ttft >= 0


def test_chat_rejects_malformed_messages(llm: LLM) -> None:
    with pytest.raises(ConfigError, match=r"messages\[0\]"):
        llm.chat([{"role": "user"}])  # type: ignore[list-item]


def test_stop_token_text_is_left_out(llm: LLM) -> None:
    ref = _greedy(llm, PROMPT, 12)
    stop_at = ref[5]
    first = ref.index(stop_at)
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_at], include_stop_str_in_output=include
        )
        out = llm.generate([PROMPT], params)[0].outputs[0]
        kept = ref[: first + 1] if include else ref[:first]
        assert out.token_ids == ref[: first + 1]  # the stop token is always among the token ids
        assert out.text == llm.tokenizer.decode(kept, skip_special_tokens=True)


def test_bad_request_in_a_batch_adds_nothing(llm: LLM) -> None:
    with pytest.raises(ConfigError) as e:
        llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(stop_token_ids=[10**6])])
    assert e.value.field == "stop_token_ids"
    assert not llm.engine.has_unfinished_requests()


def test_huge_numbers_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=10**400)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2, "stop": ["@@@"]}], ids=["plain", "logprobs-stop"])
def test_output_kinds_carry_the_same_result(tiny_model_dirs: dict[str, Path], extra: dict[str, Any]) -> None:
    """vLLM's output kinds. "final_only": no per-step outputs, and the one final output is exactly what the per-step
    ("cumulative") outputs end with, though its text is detokenised once at the end, not per token (plain requests:
    their steps pipelined, tokens appended without the rest of output processing). "delta": the same outputs as
    "cumulative", each with only what it adds (text, token ids, logprobs), which concatenate to the cumulative result;
    a stop string's possible beginning is held back from both alike."""
    llm = LLM(
        model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, num_kv_blocks=64, async_scheduling=True
    )
    engine = llm.engine
    results = {}
    for kind in ("cumulative", "delta", "final_only"):
        params = SamplingParams(temperature=0.8, seed=5, max_tokens=48, ignore_eos=True, output_kind=kind, **extra)
        rids = [engine.add_request(p, params) for p in (PROMPT, PROMPT[:10])]
        seen: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            seen += engine.step()
        mine = [[o for o in seen if o.request_id == r] for r in rids]
        if kind == "final_only":
            assert len(seen) == 2 and all(o.finished for o in seen)
            assert all(o.new_token_ids == o.outputs[0].token_ids and o.new_text == o.outputs[0].text for o in seen)
        else:
            assert len(seen) > 2 and all(outs[-1].finished for outs in mine)
        if kind == "delta":
            for outs in mine:
                assert all(o.outputs[0].token_ids == o.new_token_ids and o.outputs[0].text == o.new_text for o in outs)
                assert all(len(o.outputs[0].logprobs or o.new_token_ids) == len(o.new_token_ids) for o in outs)
            results[kind] = [
                (
                    "".join(o.outputs[0].text for o in outs),
                    [t for o in outs for t in o.outputs[0].token_ids],
                    [e for o in outs for e in o.outputs[0].logprobs] if "logprobs" in extra else None,
                    outs[-1].outputs[0].cumulative_logprob,
                    [(o.new_text, o.new_token_ids) for o in outs],
                )
                for outs in mine
            ]
            continue
        results[kind] = [
            (
                outs[-1].outputs[0].text,
                outs[-1].outputs[0].token_ids,
                outs[-1].outputs[0].logprobs,
                outs[-1].outputs[0].cumulative_logprob,
                [(o.new_text, o.new_token_ids) for o in outs],
            )
            for outs in mine
        ]
    assert [r[:4] for r in results["final_only"]] == [r[:4] for r in results["cumulative"]]
    assert results["delta"] == results["cumulative"]  # the same outputs, the same steps
    # plain requests pipeline their steps; logprobs are read on the host, so those steps do not
    assert (engine.stats["num_pipelined_steps"] > 0) == (extra == {})
    with pytest.raises(ConfigError, match="output_kind"):
        SamplingParams(output_kind="deltas")


def test_a_dropped_engine_is_collected_when_the_next_is_built(tiny_model_dirs: dict[str, Path]) -> None:
    """Engines freeze the GC heap after start-up; a frozen reference cycle is never collected, so building the next
    engine thaws and collects first: a dropped engine (a cycle through itself here) does not outlive that."""
    import gc
    import weakref

    first = LLM(model=str(tiny_model_dirs["llama"]), max_model_len=128, num_kv_blocks=16)
    first.engine.cycle = first.engine  # type: ignore[attr-defined]
    model = weakref.ref(first.engine.model)
    assert gc.get_freeze_count() > 0
    del first
    gc.collect()  # a frozen cycle survives this
    assert model() is not None
    LLM(model=str(tiny_model_dirs["llama"]), max_model_len=128, num_kv_blocks=16)
    assert model() is None
