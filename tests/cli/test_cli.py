"""The command line, in-process through main(argv): help, generate, chat, and errors as one line with status 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import TextIO

import pytest

from dspark import LLM, SamplingParams
from dspark.cli import main
from dspark.cli.generate import ChatSession

SMALL_ENGINE = ["--num-kv-blocks", "128", "--temperature", "0"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs: dict[str, Path]) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["bench", "--help"],
        ["bench", "throughput", "-h"],
        ["bench", "spec", "-h"],
    ],
)
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dspark")
    if argv[0] != "--help":
        assert "examples:" in out


def test_top_level_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "chat", "bench"):
        assert command in out


@pytest.mark.parametrize("argv", [[], ["bench"], ["generate"], ["generate", "--prompt", "x", "--dtype", "int8"]])
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--min-tokens", "5", "--max-tokens", "2"], "min_tokens"),
        (["--logprobs", "99"], "logprobs"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--seed", "-3"], "seed"),
        (["--model", "/no/such/path"], "/no/such/path"),
        (["--speculative-config", "{method: ngram}"], "speculative_config"),
        (["--speculative-config", '{"method": "medusa"}'], "speculative_config.method"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'], "num_speculative_tokens"),
    ],
)
def test_bad_values_name_the_field(flags: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err
    assert "Traceback" not in err


def test_error_exit_status_from_the_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dspark.cli", "generate", "--prompt", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: temperature=") and "Traceback" not in proc.stderr


def test_generate_json(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", tiny, *SMALL_ENGINE, "--prompt", "Hello", "--prompt", "2 + 2 ="]
    assert main([*argv, "--max-tokens", "5", "--ignore-eos", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in records] == ["Hello", "2 + 2 ="]
    for r in records:
        assert len(r["token_ids"]) == 5 and r["finish_reason"] == "length" and isinstance(r["text"], str)
        assert "logprobs" not in r

    # The same run through the Python API gives the same completions.
    expected = LLM(model=tiny, num_kv_blocks=128).generate(
        ["Hello", "2 + 2 ="], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in expected]


def test_generate_text_chat_and_logprobs(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", tiny, *SMALL_ENGINE, "--chat", "--prompt", "Hi there", "--max-tokens", "4"]
    assert main([*argv, "--logprobs", "2", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert len(record["logprobs"]) == len(record["token_ids"])
    for position, token in zip(record["logprobs"], record["token_ids"], strict=True):
        assert token in [e["token_id"] for e in position] and len(position) >= 2

    assert main(argv) == 0
    assert capsys.readouterr().out == record["text"] + "\n"


def test_chat_once_streams_the_answer(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--model", tiny, *SMALL_ENGINE, "--max-tokens", "6", "--once", "Hello!"]) == 0
    out = capsys.readouterr().out
    expected = LLM(model=tiny, num_kv_blocks=128).chat(
        [{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=6)
    )
    assert out == expected[0].outputs[0].text + "\n"


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The messages the REPL hands to ChatSession.answer, which still runs."""
    seen: list[str] = []
    original = ChatSession.answer

    def spy(self: ChatSession, message: str, out: TextIO) -> str:
        seen.append(message)
        return original(self, message, out)

    monkeypatch.setattr(ChatSession, "answer", spy)
    return seen


def test_chat_repl_reads_until_exit(tiny: str, answered: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\n\n  second  \n/exit\nnever read\n"))
    assert main(["chat", "--model", tiny, *SMALL_ENGINE, "--max-tokens", "3"]) == 0
    assert answered == ["first", "second"]


def test_chat_repl_ends_at_eof_and_survives_a_too_long_message(
    tiny: str, answered: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 200 + "\nshort"))
    argv = ["chat", "--model", tiny, *SMALL_ENGINE, "--max-tokens", "2", "--max-model-len", "96"]
    assert main(argv) == 0
    assert answered == ["word " * 199 + "word", "short"]
    assert capsys.readouterr().err.startswith("error: prompt=")


def test_chat_session_keeps_and_trims_history(tiny: str) -> None:
    llm = LLM(model=tiny, num_kv_blocks=128, max_model_len=128)
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), system="Be brief.")
    out = io.StringIO()
    session.answer("one", out)
    session.answer("two", out)
    assert [t["role"] for t in session.turns] == ["user", "assistant", "user", "assistant"]
    assert [t["content"] for t in session.turns[::2]] == ["one", "two"]
    for i in range(6):  # each exchange adds ~30 tokens: the oldest ones must go for the prompt to fit
        session.answer(f"message number {i} " * 3, out)
    assert len(session.prompt_ids()) < llm.engine.max_model_len
    assert session.turns[0]["role"] == "user" and len(session.turns) < 16
    assert not llm.engine.has_unfinished_requests()


def test_generate_with_speculation_matches_without(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", tiny, *SMALL_ENGINE, "--prompt", "a b a b a b a", "--max-tokens", "12", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main([*argv, "--speculative-config", spec]) == 0
    assert json.loads(capsys.readouterr().out) == plain


def test_bench_spec_writes_json(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", tiny, "--num-kv-blocks", "128", "--no-chat", "--num-prompts", "3"]
    argv += ["--output-len", "8", "--batch-size", "1", "--batch-size", "2", "--output-json", str(out)]
    assert main([*argv, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["identical_outputs"] == "3/3"  # greedy: speculation changes no token
        assert row["spec_output_throughput"] > 0 and row["no_spec_output_throughput"] > 0
    assert "| batch |" in capsys.readouterr().out
    # Without a speculative config there is nothing to compare.
    assert main(argv) == 2
    assert "speculative_config" in capsys.readouterr().err
