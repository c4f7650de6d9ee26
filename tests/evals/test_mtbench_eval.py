"""`dspark eval mtbench` against a fake server whose answers loop on one question and run away on another."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import MODEL, Behaviour, FakeServer, serve

from dspark.bench.client import BACKENDS, Endpoint
from dspark.cli import main
from dspark.errors import ConfigError
from dspark.evals.mtbench import evaluate, load_questions

PARAGRAPH = (
    "Plants turn sunlight, water and carbon dioxide into sugar and oxygen. The green pigment in their leaves catches "
    "the light, and the energy it holds is used to build the sugars that feed the plant, and through it, most of "
    "the animals that eat plants or eat the animals that do. Without that quiet chemistry there would be little "
    "food to eat and far less oxygen in the air we breathe."
)
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write about plants.", "Now shorter, please."]},
    {"question_id": 82, "category": "writing", "turns": ["Write about loops.", "Again?"]},
    {"question_id": 83, "category": "roleplay", "turns": ["Write forever.", "Stop now."]},
]


def answer(body: dict[str, Any]) -> tuple[str, str]:
    last = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    if "loops" in last:
        return "I will explain. " + "Loops repeat the same words. " * 25, "stop"
    if "forever" in last:
        return PARAGRAPH, "length"
    return PARAGRAPH, "stop"


def write_questions(path: Path) -> str:
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def fake() -> Any:
    with serve(Behaviour(answer=answer)) as server:
        yield server


def test_flags_and_saved_answers(fake: FakeServer, tmp_path: Path) -> None:
    fake.reset(Behaviour(answer=answer))
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    endpoint = Endpoint(fake.url, "openai", BACKENDS["openai"], MODEL)
    result = asyncio.run(evaluate(endpoint, questions, max_tokens=64, seed=5, progress=False))
    assert (result["num_questions"], result["num_answers"], result["failed"]) == (3, 3, 0)
    flags = [r["flags"][0] for r in result["questions"]]
    assert flags[0] == {} and set(flags[1]) == {"repeated-ngrams", "repeated-run"}
    assert set(flags[2]) == {"runaway-length"}
    assert result["num_flagged"] == 2 and result["flag_counts"] == {
        "repeated-ngrams": 1,
        "repeated-run": 1,
        "runaway-length": 1,
    }
    assert result["questions"][0]["answers"][0].strip() == PARAGRAPH
    assert result["questions"][2]["finish_reasons"] == ["length"]
    assert [b["seed"] for b in fake.bodies] == [5, 6, 7]
    assert {b["temperature"] for b in fake.bodies} == {1.0} and {b["max_tokens"] for b in fake.bodies} == {64}


def test_second_turn_sees_the_first_answer(fake: FakeServer, tmp_path: Path) -> None:
    fake.reset(Behaviour(answer=answer))
    questions = load_questions(write_questions(tmp_path / "q.jsonl"), limit=2)
    endpoint = Endpoint(fake.url, "openai-chat", BACKENDS["openai-chat"], MODEL)
    result = asyncio.run(evaluate(endpoint, questions, num_turns=2, max_concurrency=1, progress=False))
    assert result["num_answers"] == 4 and len(fake.bodies) == 4
    second = fake.bodies[2]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"].strip() == PARAGRAPH and second[2]["content"] == "Now shorter, please."
    assert len(result["questions"][1]["flags"]) == 2


def test_two_turns_need_the_chat_api(fake: FakeServer, tmp_path: Path) -> None:
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    endpoint = Endpoint(fake.url, "openai", BACKENDS["openai"], MODEL)
    with pytest.raises(ConfigError, match="num_turns=2"):
        asyncio.run(evaluate(endpoint, questions, num_turns=2, progress=False))


def test_cli(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake.reset(Behaviour(answer=answer))
    out = tmp_path / "mt.json"
    args = ["eval", "mtbench", "--base-url", fake.url, "--backend", "openai-chat", "--disable-tqdm"]
    args += ["--data-path", write_questions(tmp_path / "q.jsonl"), "--output-json", str(out), "--max-tokens", "32"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "question 82 turn 1: repeated-ngrams" in printed and "question 83 turn 1: runaway-length" in printed
    assert "2 question(s) flagged" in printed
    saved = json.loads(out.read_text())
    assert len(saved["questions"]) == 3 and saved["questions"][0]["category"] == "writing"
    assert main(["eval", "mtbench", "--base-url", fake.url]) == 2
    assert "data_path=None is invalid" in capsys.readouterr().err


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[3] / "shared/data/mt_bench/question.jsonl").is_file(),
    reason="no ../shared/data",
)
def test_the_real_file_loads() -> None:
    questions = load_questions(str(Path(__file__).resolve().parents[3] / "shared/data/mt_bench/question.jsonl"))
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    assert questions[0].question_id == 81 and questions[0].category == "writing"
