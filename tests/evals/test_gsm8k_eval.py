"""`dspark eval gsm8k`: answer extraction, the few-shot prompt, and accuracy against a fake server that is right on
some questions, wrong on others and gives no number on one."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import MODEL, Behaviour, FakeServer, serve

from dspark.bench.client import BACKENDS, Endpoint
from dspark.cli import main
from dspark.errors import ConfigError
from dspark.evals.gsm8k import build_prompt, evaluate, extract_answer, load_problems, normalize_number

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("The total is $1,234.50.", "1234.5"),
        ("It was 5 degrees, then it fell to -3.", "-3"),
        ("#### -$7", "-7"),
        ("She has 16-3-4 = 9 eggs left", "9"),  # hyphens between numbers are not minus signs
        ("3.5 hours plus 0.25 hours is 3.75", "3.75"),
        ("The answer is 18.00.", "18"),
        ("#### 42\n\nQuestion: a follow-up with 7 apples", "42"),  # #### wins over later numbers
        ("There are 5 boxes of 12, so 60 in all.", "60"),
        ("I do not know.", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_normalize_number() -> None:
    assert normalize_number("100") == "100" and normalize_number("1,000,000") == "1000000"
    assert normalize_number("-0.0") == "0" and normalize_number("abc") is None


PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 12 eggs. How many eggs in 5 boxes?", "12 * 5 = <<12*5=60>>60\n#### 60"),
    ("Sara had $1,000 and spent $250. How much is left?", "1000 - 250 = <<1000-250=750>>750\n#### 750"),
    ("It is 4 degrees and drops by 9. What is the temperature?", "4 - 9 = <<4-9=-5>>-5\n#### -5"),
    ("A rope of 7.5 m is cut in 3 equal parts. How long is each?", "7.5 / 3 = <<7.5/3=2.5>>2.5\n#### 2.5"),
    ("How many legs do 6 spiders have?", "6 * 8 = <<6*8=48>>48\n#### 48"),
]


def write_problems(path: Path, problems: list[tuple[str, str]]) -> str:
    path.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in problems) + "\n")
    return str(path)


def answer_some(body: dict[str, Any]) -> tuple[str, str]:
    """Right on questions 0, 2 and 4 (two of them without ####), wrong on 1 and 3, no number on 5."""
    prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    question = re.findall(r"Question: (.*)", prompt)[-1]
    index = [q for q, _ in PROBLEMS].index(question)
    return {
        0: ("3 plus 4 is 7.\n#### 7", "stop"),
        1: ("12 times 5 is 50.\n#### 50", "stop"),
        2: ("She has $1,000 - $250 = $750 left.", "stop"),
        3: ("4 - 9 = 5, so it is 5 degrees.", "stop"),
        4: ("Each part is 7.5 / 3 = 2.50 m long.", "stop"),
        5: ("Spiders have many legs.", "stop"),
    }[index]


@pytest.fixture(scope="module")
def fake() -> Any:
    with serve() as server:
        yield server


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_accuracy_and_invalid_count(fake: FakeServer, tmp_path: Path, backend: str) -> None:
    fake.reset(Behaviour(answer=answer_some))
    problems = load_problems(write_problems(tmp_path / "test.jsonl", PROBLEMS), "data_path")
    shots = load_problems(write_problems(tmp_path / "train.jsonl", PROBLEMS[:2]), "train_path")
    endpoint = Endpoint(fake.url, backend, BACKENDS[backend], MODEL)
    result = asyncio.run(evaluate(endpoint, problems, shots, max_concurrency=2, progress=False))
    assert result["num_correct"] == 3 and result["accuracy"] == pytest.approx(0.5)
    assert (result["invalid"], result["failed"], result["num_questions"], result["num_shots"]) == (1, 0, 6, 2)
    assert [r["correct"] for r in result["questions"]] == [True, False, True, False, True, False]
    assert [r["prediction"] for r in result["questions"]] == ["7", "50", "750", "5", "2.5", None]
    assert result["output_throughput"] > 0 and result["latency"] > 0
    body = fake.bodies[0]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 256 and body["stop"] == ["Question:"]
    assert fake.peak_in_flight <= 2


def test_few_shot_prompt_shapes(tmp_path: Path) -> None:
    assert build_prompt("Q?", [], chat=False) == "Question: Q?\nAnswer:"
    shots = load_problems(write_problems(tmp_path / "train.jsonl", PROBLEMS[:2]), "train_path")
    assert shots[0].label == "7" and "<<" not in shots[0].solution  # calculator annotations dropped
    text = build_prompt("Q?", shots, chat=False)
    assert text.count("Question:") == 3 and text.endswith("Question: Q?\nAnswer:")
    assert "Answer: 3 + 4 = 7\n#### 7\n\nQuestion:" in text
    messages = build_prompt("Q?", shots, chat=True)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == "3 + 4 = 7\n#### 7" and messages[-1]["content"] == "Question: Q?"


def test_failed_requests_count_as_failed_not_invalid(fake: FakeServer, tmp_path: Path) -> None:
    fake.reset(Behaviour(answer=answer_some, fail_every=2))
    problems = load_problems(write_problems(tmp_path / "test.jsonl", PROBLEMS), "data_path")
    endpoint = Endpoint(fake.url, "openai", BACKENDS["openai"], MODEL)
    result = asyncio.run(evaluate(endpoint, problems, [], max_concurrency=1, progress=False))
    # sequential: requests 2, 4, 6 (questions 1, 3, 5) fail
    assert (result["num_correct"], result["failed"], result["invalid"]) == (3, 3, 0)


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data_path=None is invalid"):
        load_problems(None, "data_path")
    with pytest.raises(ConfigError, match=r"data_path='/nonexistent\.jsonl' is invalid"):
        load_problems("/nonexistent.jsonl", "data_path")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final number"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        load_problems(str(bad), "data_path")


def test_cli(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake.reset(Behaviour(answer=answer_some))
    data = write_problems(tmp_path / "test.jsonl", PROBLEMS)
    train = write_problems(tmp_path / "train.jsonl", PROBLEMS[:1])
    out = tmp_path / "gsm8k.json"
    base = ["eval", "gsm8k", "--base-url", fake.url + "/v1", "--data-path", data, "--disable-tqdm"]
    flags = ["--train-path", train, "--num-shots", "1", "--num-questions", "4", "--output-json", str(out)]
    assert main([*base, *flags, "--save-detailed"]) == 0
    assert "gsm8k: accuracy 0.500 (2/4), invalid 0, failed 0 | 1-shot" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_questions"] == 4 and len(result["questions"]) == 4 and result["model_id"] == MODEL
    fake.reset(Behaviour(answer=answer_some, fail_every=1))
    assert main([*base, "--num-shots", "0"]) == 1
    assert "every request failed, the first with: HTTP 500" in capsys.readouterr().err
    assert main(base) == 2
    assert "train_path=None is invalid" in capsys.readouterr().err
    assert main(["eval", "gsm8k", "--base-url", fake.url, "--num-shots", "0"]) == 2
    assert "data_path=None is invalid" in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "test.jsonl").is_file(), reason="no ../shared/data")
def test_the_real_files_load() -> None:
    problems = load_problems(str(SHARED_DATA / "gsm8k" / "test.jsonl"), "data_path")
    shots = load_problems(str(SHARED_DATA / "gsm8k" / "train.jsonl.gz"), "train_path", 5)
    assert len(problems) == 1319 and problems[0].label == "18" and len(shots) == 5
    assert all(extract_answer(p.solution) == p.label for p in problems)  # the extraction reads every gold answer
