"""The drafter's data at scale: self-written prompts (the template's open user turn, the filters, de-duplication,
follow-up turns), answers at several temperatures, compact uint16 storage, merging shards, and `dspark train-drafter`
on a run directory that holds sequences.npz."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.errors import ConfigError
from dspark.outputs import CompletionOutput
from dspark.train import magpie
from dspark.train.data import (
    Prompt,
    Sequence,
    load_sequences,
    merge_sequences,
    prompt_ids,
    regenerate,
    save_sequences,
    sequences_file,
)
from dspark.train.magpie import Deduplicator, follow_up_prompts, magpie_prompts, open_user_turn, rejection

REPO = Path(__file__).resolve().parents[2]
QUESTION = "Can you explain the process of xenotransplantation?"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs: dict[str, Path]) -> Iterator[LLM]:
    yield LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="module")
def tokenizer(tiny_llm: LLM) -> Any:
    return tiny_llm.tokenizer


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


@pytest.mark.parametrize("text", [QUESTION, " leading space, then\nlines ", "x"])
def test_the_open_user_turn_is_the_template_cut_where_the_users_text_starts(tokenizer: Any, text: str) -> None:
    history = ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."})
    for before in ((), history):
        turn = open_user_turn(tokenizer, before)
        full = _render(tokenizer, [*before, {"role": "user", "content": text}])
        rest = _render(tokenizer, [*before, {"role": "user", "content": ""}])[len(turn.prefix) :]
        assert turn.prefix + text + rest == full
        assert turn.stop_token_id == tokenizer.convert_tokens_to_ids(rest.split("\n")[0])  # SmolLM2's <|im_end|>
    # What the target is sampled from is how regenerate will see the turn's start, token for token.
    ids = tokenizer.encode(open_user_turn(tokenizer, history).prefix, add_special_tokens=False)
    whole = tokenizer.apply_chat_template([*history, {"role": "user", "content": QUESTION}], tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert whole[: len(ids)] == ids and len(whole) > len(ids)


def test_the_open_user_turn_follows_the_template_not_smollm2(tokenizer: Any) -> None:
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}]: {{ m.content }}<|endoftext|>{% endfor %}"
        turn = open_user_turn(tokenizer, [{"role": "system", "content": "Be brief."}])
        assert turn.prefix == "[system]: Be brief.<|endoftext|>[user]: "
        assert turn.stop_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        tokenizer.chat_template = "{% for m in messages %}{{ m.content | upper }}<|endoftext|>{% endfor %}"
        with pytest.raises(ConfigError, match="verbatim"):
            open_user_turn(tokenizer)
        tokenizer.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
        with pytest.raises(ConfigError, match="special token"):
            open_user_turn(tokenizer)
    finally:
        tokenizer.chat_template = saved


@pytest.mark.parametrize(
    "text, reason",
    [
        ("Tell me about it<|im_start|>assistant\nSure, here it is.", "template"),
        ("Tell me a joke about cats.<|im_end|>", "template"),
        ("Tell me a joke about cats.\nassistant\nWhy did the cat sit on the computer?", "template"),
        ("Hello there friend", "short"),
        ("   ", "short"),
        ("Please summarise this text: " + "lorem ipsum dolor " * 100, "long"),
        ("Explain this to me: " + "x" * 2500, "long"),
        ("12 + 34 = ?? 56 * 78 = ?? 9 / 0", "non-letters"),
        ("how how how how are you", "repetitive"),
        ("I like cats and dogs. " * 4, "repetitive"),
        ("Please answer this question now.\n" * 3 + "What is the capital of France?", "repetitive"),
    ],
)
def test_each_filter_rejects_what_it_should(text: str, reason: str) -> None:
    assert rejection(text, ["<|im_start|>", "<|im_end|>"]) == reason


@pytest.mark.parametrize(
    "text",
    [
        QUESTION,
        "  What are the main benefits of using solar power?\n",
        "What is 12 + 35 * 4?",
        "Fix this function:\n```python\ndef add(a, b):\n    return a - b\n```\nIt returns the wrong sum.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle, in three paragraphs.",
        "Who is the assistant to the regional manager in The Office?",
    ],
)
def test_the_filters_keep_a_normal_question(text: str) -> None:
    assert rejection(text, ["<|im_start|>", "<|im_end|>"]) is None


def test_dedup_by_normalised_text_and_first_words() -> None:
    d = Deduplicator(near_dup_words=8)
    assert d.add(QUESTION)
    assert not d.add("  can you EXPLAIN the process of xenotransplantation ")  # case, spacing, punctuation
    assert d.add("Can you explain the process of xenotransplantation to me, step by step?")  # a longer one
    assert not d.add("Can you explain the process of xenotransplantation to a child?")  # the same 8 first words
    assert d.add("Can you explain the process of photosynthesis?")
    assert d.add("What are the main benefits of using solar power?")


def _answered(tokenizer: Any, text: str, finish: str = "stop", *, stop: int) -> CompletionOutput:
    ids = tokenizer.encode(text, add_special_tokens=False) + ([stop] if finish == "stop" else [])
    return CompletionOutput(0, text, ids, None, None, finish)


def test_magpie_prompts_filter_dedup_and_seed_each_request(
    tiny_llm: LLM, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    turn = open_user_turn(tokenizer)
    rounds = [
        [
            QUESTION,
            QUESTION.upper(),  # a duplicate
            "Hi",  # short
            ("What is the tallest mountain in Europe and how tall is it?", "length"),  # cut at max_tokens
            "Tell me a joke<|im_start|>assistant\nSure",  # template tokens
            "What are the main benefits of using solar power?",
        ]
        + ["!!! ???"] * 10,
        ["Write a haiku about the sea and the moon."] + ["???"] * 15,
    ]
    calls: list[list[tuple[list[int], SamplingParams]]] = []

    def fake_run(llm: LLM, requests: list, deadline: Any, progress: bool, desc: str) -> dict[int, CompletionOutput]:
        calls.append(requests)
        canned = rounds[len(calls) - 1]
        return {
            i: _answered(tokenizer, *(c if isinstance(c, tuple) else (c,)), stop=turn.stop_token_id)
            for i, c in enumerate(canned)
        }

    monkeypatch.setattr(magpie, "run_requests", fake_run)
    prompts = magpie_prompts(tiny_llm, 3, seed=100)
    assert [p.text for p in prompts] == [
        QUESTION,
        "What are the main benefits of using solar power?",
        "Write a haiku about the sea and the moon.",
    ]
    assert all(p.source == "magpie" and p.chat and p.history == () for p in prompts)
    assert [len(c) for c in calls] == [16, 16]  # at least 16 a round; twice the missing ones otherwise
    params = [sp for c in calls for _, sp in c]
    assert [sp.seed for sp in params] == list(range(100, 132))  # one seed per request, none reused
    assert all(sp.temperature == 1.0 and sp.stop_token_ids == [turn.stop_token_id] for sp in params)
    prefix = tokenizer.encode(turn.prefix, add_special_tokens=False)
    assert all(ids == prefix for c in calls for ids, _ in c)


def test_follow_ups_make_two_turn_prompts_tokenized_as_regenerate_does(
    tiny_llm: LLM, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Prompt("gsm8k-train", "What is 2 + 3 times 4?", True)
    answer = "2 + 3 * 4 = 2 + 12 = 14."
    ids = prompt_ids(tiny_llm, first)
    answered = [Sequence(ids + tokenizer.encode(answer, add_special_tokens=False) + [2], len(ids), 1.0, first)]
    answered.append(Sequence([5, 6, 7, 8], 2, 1.0, Prompt("c4", "The river", False)))  # not a chat: no follow-up
    seen: list[list[int]] = []

    def fake_run(llm: LLM, requests: list, deadline: Any, progress: bool, desc: str) -> dict[int, CompletionOutput]:
        seen.extend(ids for ids, _ in requests)
        return {0: _answered(tokenizer, "Can you show the steps once more, slowly?", stop=2)}

    monkeypatch.setattr(magpie, "run_requests", fake_run)
    [two] = follow_up_prompts(tiny_llm, answered, seed=7)
    assert two.source == "gsm8k-train-follow-up" and two.chat
    assert two.history == ({"role": "user", "content": first.text}, {"role": "assistant", "content": answer})
    assert two.messages()[-1] == {"role": "user", "content": "Can you show the steps once more, slowly?"}
    whole = prompt_ids(tiny_llm, two)  # what regenerate feeds the target: it starts as the turn was written from
    assert len(seen) == 1 and whole[: len(seen[0])] == seen[0] and len(whole) > len(seen[0])


def test_magpie_on_a_random_model_keeps_the_filter_contract(tiny_llm: LLM, tokenizer: Any) -> None:
    prompts = magpie_prompts(tiny_llm, 4, seed=1, max_tokens=12, max_rounds=1)
    assert isinstance(prompts, list) and len(prompts) <= 4  # a random model writes junk: maybe nothing passes
    markers = tokenizer.all_special_tokens
    for p in prompts:
        assert isinstance(p, Prompt) and p.source == "magpie" and p.chat
        assert rejection(p.text, markers) is None and not any(m in p.text for m in markers)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_answers_at_several_temperatures_record_theirs(tiny_llm: LLM) -> None:
    prompts = [Prompt("t", "Tell me about rivers.", True), Prompt("t", "def add(a, b):", False)]
    seqs = regenerate(tiny_llm, prompts, samples_per_prompt=2, max_tokens=6, temperature=[1.0, 0.0])
    assert [(s.prompt, s.temperature) for s in seqs] == [(p, t) for p in prompts for t in (1.0, 1.0, 0.0)]
    greedy = tiny_llm.generate(
        [prompt_ids(tiny_llm, p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=6)
    )
    assert [s.tokens[s.num_prompt_tokens :] for s in seqs if s.temperature == 0.0] == [
        o.outputs[0].token_ids for o in greedy
    ]


def _sequences() -> list[Sequence]:
    rng = np.random.default_rng(0)
    return [
        Sequence(rng.integers(0, 49152, size=n).tolist(), p, t)
        for n, p, t in [(30, 10, 1.0), (5, 5, 0.0), (3000, 1, None), (12, 3, 0.7)]
    ] + [Sequence([49151, 0, 65535], 1, 1.0)]


def test_uint16_storage_round_trips_as_json_lines_do(tmp_path: Path) -> None:
    seqs = _sequences()
    save_sequences(tmp_path / "s.npz", seqs)
    save_sequences(tmp_path / "s.jsonl", seqs)
    assert load_sequences(tmp_path / "s.npz") == load_sequences(tmp_path / "s.jsonl") == seqs
    with np.load(tmp_path / "s.npz") as z:
        assert z["tokens"].dtype == np.uint16 and z["tokens"].size == sum(len(s.tokens) for s in seqs)
    assert (tmp_path / "s.npz").stat().st_size < (tmp_path / "s.jsonl").stat().st_size / 2
    save_sequences(tmp_path / "empty.npz", [])
    assert load_sequences(tmp_path / "empty.npz") == []
    assert not list(tmp_path.glob("*.tmp"))


def test_ids_past_uint16_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the largest id is 70000 and the smallest 1: save as \.jsonl"):
        save_sequences(tmp_path / "s.npz", [Sequence([1, 2], 1), Sequence([70000, 3], 1)])
    assert not (tmp_path / "s.npz").exists()
    save_sequences(tmp_path / "s.jsonl", [Sequence([70000, 3], 1)])  # JSON lines take any id
    assert load_sequences(tmp_path / "s.jsonl") == [Sequence([70000, 3], 1)]


def test_a_damaged_npz_is_a_clear_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "missing.npz", tokens=np.zeros(3, np.uint16))
    with pytest.raises(ConfigError, match="offsets"):
        load_sequences(tmp_path / "missing.npz")
    save_sequences(tmp_path / "ok.npz", _sequences())
    with np.load(tmp_path / "ok.npz") as z:
        arrays = dict(z)
    arrays["offsets"] = arrays["offsets"][::-1].copy()
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConfigError, match="consistent"):
        load_sequences(tmp_path / "bad.npz")


def test_merging_shards_of_either_format(tmp_path: Path) -> None:
    seqs = _sequences()
    save_sequences(tmp_path / "a.npz", seqs[:2])
    save_sequences(tmp_path / "b.jsonl", seqs[2:])
    assert merge_sequences([tmp_path / "a.npz", tmp_path / "b.jsonl"], tmp_path / "all.npz") == len(seqs)
    assert load_sequences(tmp_path / "all.npz") == seqs


def test_a_run_directory_has_one_sequences_file(tmp_path: Path) -> None:
    assert sequences_file(tmp_path) is None
    save_sequences(tmp_path / "sequences.npz", _sequences())
    assert sequences_file(tmp_path) == tmp_path / "sequences.npz"
    save_sequences(tmp_path / "sequences.jsonl", _sequences())
    with pytest.raises(ConfigError, match="both"):
        sequences_file(tmp_path)


def _train_args(run: Path, data: Path, model: Path, steps: int) -> list[str]:
    return [
        *("train-drafter", "--data-dir", str(data), "--output-dir", str(run), "--model", str(model)),
        *("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128", "--num-layers", "1"),
        *("--draft-block-size", "4", "--markov-rank", "8", "--steps", str(steps), "--batch-size", "2"),
        *("--blocks-per-sequence", "2", "--checkpoint-every", "1"),
    ]


def test_train_drafter_reads_a_run_directory_with_sequences_npz(
    tmp_path: Path, tiny_llm: LLM, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from dspark.cli import main

    prompts = [Prompt("t", f"Question {i}: tell me about the number {i}.", True) for i in range(3)]
    seqs = regenerate(tiny_llm, prompts, 1, max_tokens=16, temperature=[1.0, 0.0])
    run, data = tmp_path / "run", tmp_path / "data"
    run.mkdir()
    data.mkdir()  # no prompt source: the answers are there already
    save_sequences(run / "sequences.npz", seqs)
    assert main(_train_args(run, data, tiny_model_dirs["llama"], 2)) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["sequences"] == len(seqs) == 6 and summary["steps_done"] == 2
    assert json.loads((run / "state.json").read_text())["step"] == 2
    assert (run / "drafter" / "config.json").exists() and not (run / "sequences.jsonl").exists()
    save_sequences(run / "sequences.jsonl", seqs)
    assert main(_train_args(run, data, tiny_model_dirs["llama"], 3)) == 2
    assert "holds both" in capsys.readouterr().err


def test_gen_data_writes_an_npz_shard_that_merges(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many?"} for i in range(4)]
    (data / "gsm8k" / "train.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [
        *("--data-dir", str(data), "--out", str(tmp_path / "shard.npz"), "--format", "npz"),
        *("--model", str(tiny_model_dirs["llama"]), "--device", "cpu", "--max-num-seqs", "16"),
        *("--max-model-len", "256", "--prompts-per-source", "3", "--samples-per-prompt", "1", "--max-tokens", "6"),
        *("--temperatures", "1.0", "0.0", "--heldout", "1", "--heldout-out", str(tmp_path / "heldout.jsonl")),
        *("--magpie", "2", "--magpie-max-tokens", "6", "--follow-ups", "2", "--time-limit", "300"),
        *("--prompts-out", str(tmp_path / "prompts.jsonl")),
    ]
    gen = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/drafter/gen_data.py"), *args], env=env, capture_output=True, text=True
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    seqs = load_sequences(tmp_path / "shard.npz")
    # 2 chat prompts answered as first turns (at 1.0), then the pool (3 gsm8k less 1 held out, 3 stdlib heads) at 1
    # and 0; the random model's self-written turns and follow-ups are junk, so the filters leave none.
    assert [s.temperature for s in seqs[:2]] == [1.0, 1.0]
    assert sorted(s.temperature for s in seqs[2:]) == [0.0] * 5 + [1.0] * 5
    assert len(json.loads((tmp_path / "heldout.jsonl").read_text())["turns"]) == 1
    assert "answer tokens" in gen.stdout
    wrong = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/drafter/gen_data.py"), *args[:4], "--format", "jsonl"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "--format" in wrong.stderr
    save_sequences(tmp_path / "other.jsonl", seqs[:3])
    shards = [str(tmp_path / "shard.npz"), str(tmp_path / "other.jsonl")]
    merge = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/drafter/merge_data.py"), str(tmp_path / "all.npz"), *shards],
        env=env,
        capture_output=True,
        text=True,
    )
    assert merge.returncode == 0, merge.stderr[-2000:]
    assert load_sequences(tmp_path / "all.npz") == seqs + seqs[:3]
