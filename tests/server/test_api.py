"""The OpenAI API of a live `dspark serve` (uvicorn on a loopback port, tiny random llama, fp32 CPU) through the
official openai client: completions and chat, whole and streamed, without speculation, with n-gram and with a DSpark
drafter (adaptive verification on). Greedy text is the same streamed or not and with or without speculation; usage
counts the tokenized prompt and the generated tokens; stop strings split across tokens never leak into a stream;
n fans out with seed + i; logprobs come in OpenAI's two shapes."""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import MODEL_NAME, live_server, make_engine, metric, scrape

from dspark.engine.llm_engine import LLMEngine
from helpers import hold_drafting

PROMPT = "one two three four five one two three four five one two three"
CHAT = [{"role": "user", "content": "Count: one two three four one two three four"}]
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
KINDS = ["plain", "ngram", "dspark"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tiny_drafter: Path) -> Iterator[dict[str, tuple[str, LLMEngine]]]:
    specs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": True},
        "dspark": {"method": "dspark", "model": str(tiny_drafter), "enable_adaptive_verification": True},
    }
    engines = {kind: make_engine(tiny_llama, spec) for kind, spec in specs.items()}
    # Held to drafting: left to its measured rates (noise for a tiny model), the regime may keep every step plain.
    for kind in ("ngram", "dspark"):
        hold_drafting(engines[kind])
    with live_server(engines["plain"]) as a, live_server(engines["ngram"]) as b, live_server(engines["dspark"]) as c:
        yield {"plain": (a, engines["plain"]), "ngram": (b, engines["ngram"]), "dspark": (c, engines["dspark"])}


@pytest.fixture(scope="module")
def plain(servers: dict[str, tuple[str, LLMEngine]]) -> openai.OpenAI:
    return _client(servers["plain"][0])


def _stream_text(stream: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """Per choice index: the concatenated text (or chat content) and the finish reason; and the usage chunk's usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models_health_version(servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI) -> None:
    url = servers["plain"][0]
    assert [m.id for m in plain.models.list().data] == [MODEL_NAME, "other-name"]
    with urllib.request.urlopen(f"{url}/health") as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{url}/version") as r:
        assert json.load(r)["version"]
    out = plain.completions.create(model="other-name", prompt="hi", max_tokens=2)  # any served name answers
    assert out.model == "other-name" and out.usage.completion_tokens == 2


@pytest.mark.parametrize("kind", KINDS)
def test_completion_streamed_equals_whole_and_no_speculation(
    kind: str, servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI
) -> None:
    url, engine = servers[kind]
    client = _client(url)
    reference = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY).choices[0].text
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, reasons, usage = _stream_text(stream)
    assert whole.choices[0].text == texts[0] == reference
    assert whole.choices[0].finish_reason == reasons[0] == "length"
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    for u in (whole.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompt_ids), 24, len(prompt_ids) + 24)
    if kind != "plain":  # speculation really ran
        assert metric(scrape(url), "dspark:spec_decode_num_drafts_total") > 0


@pytest.mark.parametrize("kind", KINDS)
def test_chat_streamed_equals_whole_and_no_speculation(
    kind: str, servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI
) -> None:
    url, engine = servers[kind]
    client = _client(url)
    reference = plain.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY).choices[0].message.content
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, reasons, usage = _stream_text(stream)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == texts[0] == reference
    assert whole.choices[0].finish_reason == reasons[0] == "length"
    prompt_ids = engine.tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    num_prompt = len(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    for u in (whole.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens) == (num_prompt, 24)
    # max_completion_tokens (OpenAI's newer name) wins over max_tokens
    short = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=20, max_completion_tokens=5
    )
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


# Seeded sampling: varied text (this random model's greedy text soon repeats one token), the same in every run, and
# the same with n-gram speculation (strict verification keeps seeded output).
SAMPLED = {"temperature": 0.8, "seed": 5, "max_tokens": 40}


def _stop_across_tokens(client: openai.OpenAI) -> tuple[str, str]:
    """(full text, a stop string made of the end of one token and the start of the next, after the 8th)."""
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=0, **SAMPLED)
    text, tokens = out.choices[0].text, out.choices[0].logprobs.tokens
    offset = 0
    for k, (a, b) in enumerate(itertools.pairwise(tokens)):
        offset += len(a)
        if text[:offset] != "".join(tokens[: k + 1]):  # a token that is part of a multi-byte character
            break
        if k >= 8 and len(a) >= 2 and len(b) >= 2 and (a + b).isascii() and text[offset:].startswith(b):
            return text, a[-2:] + b[:2]
    raise AssertionError(f"no two adjacent ASCII tokens of 2+ characters in {tokens}")


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_stop_string_split_across_tokens_never_reaches_the_stream(
    kind: str, servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI
) -> None:
    client = _client(servers[kind][0])
    full, stop = _stop_across_tokens(plain)
    expected = full[: full.index(stop)]
    args: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "stop": [stop, "never-there"], **SAMPLED}
    whole = client.completions.create(**args)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop
    texts, reasons, _ = _stream_text(client.completions.create(stream=True, **args))
    assert texts[0] == expected and reasons[0] == "stop"
    # Chat too, with the stop as a plain string: the answer is cut before its first occurrence.
    chat_args: dict[str, Any] = {"model": MODEL_NAME, "messages": CHAT, **SAMPLED}
    chat_full = client.chat.completions.create(**chat_args).choices[0].message.content
    chat_stop = chat_full[len(chat_full) // 2 : len(chat_full) // 2 + 4]
    texts, reasons, _ = _stream_text(client.chat.completions.create(stream=True, stop=chat_stop, **chat_args))
    assert texts[0] == chat_full[: chat_full.index(chat_stop)] and reasons[0] == "stop"


def test_n_fans_out_with_seed_plus_i(plain: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 1.0, "max_tokens": 12}
    many = plain.completions.create(n=3, seed=11, **args)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [plain.completions.create(seed=11 + i, **args).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1, "three seeds drew the same 12 tokens"
    assert many.usage.completion_tokens == 36
    assert many.usage.prompt_tokens == singles_prompt_tokens(plain)  # the prompt is counted once, not n times
    texts, reasons, usage = _stream_text(
        plain.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True}, **args)
    )
    assert [texts[i] for i in range(3)] == singles and set(reasons) == {0, 1, 2}
    assert usage.completion_tokens == 36
    # several prompts x n: choice k is prompt k // n, sample k % n
    multi = plain.completions.create(**{**args, "prompt": ["alpha beta", PROMPT]}, n=2, seed=11)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert [c.text for c in multi.choices[2:]] == singles[:2]
    # chat, streamed, no seed: every choice opens with the role and finishes once
    chat = plain.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=6, stream=True)
    texts, reasons, _ = _stream_text(chat)
    assert set(texts) == set(reasons) == {0, 1}


def singles_prompt_tokens(client: openai.OpenAI) -> int:
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1).usage.prompt_tokens


def test_token_id_prompts_and_sampling_fields(servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI) -> None:
    engine = servers["plain"][1]
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_text = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY).choices[0].text
    by_ids = plain.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text and by_ids.usage.prompt_tokens == len(ids)
    # Every sampling field is taken (vLLM's extras through extra_body), and a seed makes the result reproducible.
    sampled: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.2, "min_tokens": 4, "unknown_field": 1},
    }
    a, b = (plain.completions.create(**sampled).choices[0].text for _ in range(2))
    assert a == b
    # A penalty changes a greedy answer of this repetitive random model.
    penalised = plain.completions.create(
        model=MODEL_NAME, prompt=PROMPT, **{**GREEDY, "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}}
    )
    assert penalised.choices[0].text != by_text


def test_completion_logprobs_shape(plain: openai.OpenAI) -> None:
    out = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely
    stream = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=3, stream=True, **GREEDY)
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_echo_and_prompt_logprobs(plain: openai.OpenAI) -> None:
    """echo repeats the prompt before the completion and, with logprobs, scores it (the first token's logprob null):
    lm-evaluation-harness's loglikelihood requests. vLLM's prompt_logprobs gives the same numbers in its own field."""
    plain_out = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    echoed = plain.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain_out.choices[0].text
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    scored = plain.completions.create(**body, extra_body={"prompt_logprobs": 2})
    choice = scored.choices[0]
    lp = choice.logprobs
    num_prompt = scored.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:num_prompt]) == PROMPT
    vllm_field = choice.model_extra["prompt_logprobs"]
    assert len(vllm_field) == num_prompt and vllm_field[0] is None
    for i, entry in enumerate(vllm_field[1:], start=1):  # the prompt token's own entry carries the echoed logprob
        (mine,) = [
            e for e in entry.values() if e["decoded_token"] == lp.tokens[i] and e["logprob"] == lp.token_logprobs[i]
        ]
        assert mine["rank"] >= 1 and len(entry) <= 3
    streamed = plain.completions.create(**body, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks if c.logprobs is not None for t in c.logprobs.token_logprobs] == lp.token_logprobs


def test_chat_logprobs_shape(plain: openai.OpenAI) -> None:
    out = plain.chat.completions.create(model=MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == entry.top_logprobs[0].logprob
        assert entry.bytes == list(entry.token.encode())
    plain_only = plain.chat.completions.create(model=MODEL_NAME, messages=CHAT, logprobs=True, max_tokens=3)
    assert all(e.top_logprobs == [] for e in plain_only.choices[0].logprobs.content)
    stream = plain.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=2, stream=True, **GREEDY
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_concurrent_requests_are_batched_and_match_sequential(
    servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI
) -> None:
    url = servers["plain"][0]
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    sequential = [plain.completions.create(model=MODEL_NAME, prompt=p, **GREEDY).choices[0].text for p in prompts]

    def one(i: int) -> str:
        if i % 2:  # half of them streamed
            stream = plain.completions.create(model=MODEL_NAME, prompt=prompts[i], stream=True, **GREEDY)
            return _stream_text(stream)[0][0]
        return plain.completions.create(model=MODEL_NAME, prompt=prompts[i], **GREEDY).choices[0].text

    steps = metric(scrape(url), "dspark:engine_steps_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, range(len(prompts)))) == sequential
    # 24 tokens each: run one by one they would take 6 x 24 steps
    assert metric(scrape(url), "dspark:engine_steps_total") - steps < len(prompts) * 24


@pytest.mark.parametrize("kind", ["ngram", "dspark"])
def test_every_field_with_speculation(
    kind: str, servers: dict[str, tuple[str, LLMEngine]], plain: openai.OpenAI
) -> None:
    """n, seed, penalties, top-k/p, min-p and logprobs with speculation on. N-gram drafts are verified strictly, so
    seeded samples are those without speculation, streamed or not. The DSpark drafter samples its drafts and is
    verified by rejection sampling, which keeps the distribution but not the draws: which drafts adaptive verification
    verifies depends on measured step times, so there only the shapes are checked."""
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "n": 2,
        "seed": 21,
        "temperature": 0.9,
        "top_p": 0.95,
        "max_tokens": 20,
        "logprobs": 2,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "extra_body": {"top_k": 100, "min_p": 0.001, "repetition_penalty": 1.1, "ignore_eos": True},
    }
    client = _client(servers[kind][0])
    out = client.completions.create(**args)
    assert [len(c.logprobs.tokens) for c in out.choices] == [20, 20] and out.usage.completion_tokens == 40
    texts, reasons, usage = _stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
    )
    assert reasons == {0: "length", 1: "length"} and usage.completion_tokens == 40
    if kind == "ngram":
        reference = plain.completions.create(**args)
        assert [c.text for c in out.choices] == [c.text for c in reference.choices] == [texts[0], texts[1]]
        for ours, theirs in zip(out.choices, reference.choices, strict=True):
            assert ours.logprobs.token_logprobs == pytest.approx(theirs.logprobs.token_logprobs, abs=1e-5)
