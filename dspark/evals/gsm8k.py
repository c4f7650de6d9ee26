"""`dspark eval gsm8k`: grade-school maths accuracy of a served model, few-shot, greedy, through the HTTP API.

Questions are the first --num-questions of --data-path (GSM8K's test.jsonl: "question" and "answer", the answer
ending in "#### <number>"); the few-shot examples are the first --num-shots of --train-path (the train split), their
calculator annotations (`<<3*4=12>>`) removed: they were tool calls for training, and a model that copies them
writes text no one reads. The completions API gets the shots as "Question: ...\\nAnswer: ...\\n\\n" blocks ending in
"Question: <q>\\nAnswer:"; the chat API gets them as user/assistant turns. Both stop at the next "Question:".

Answer extraction: the number after the last "####", else the last number in the completion; commas and "$" are
dropped, and numbers compare by value (18.00 equals 18). A completion with no number is invalid (and wrong); a request
that failed is counted as failed (and wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from dspark.bench.client import (
    Endpoint,
    Prompt,
    RequestInput,
    RequestResult,
    open_session,
    run_requests,
)
from dspark.errors import ConfigError
from dspark.utils.jsonl import read_jsonl_records

MAX_TOKENS = 256
STOP = ["Question:"]
# A number: an optional minus sign that is not a hyphen inside a word or between digits ("16-3" is 16 and 3), an
# optional "$", digits with thousands commas, an optional decimal part.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\$?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"####\s*(?:-\s*)?\$?\s*-?\d[\d,]*(?:\.\d+)?")
_ANNOTATION = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # the worked answer, annotations removed, ending in "#### <number>"
    label: str  # the final number, normalised


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$18' -> '18', '-3.0' -> '-3'; None for anything that is not a number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "")
    try:
        value = Decimal(cleaned)
        if not value.is_finite():
            return None
        return "0" if value == 0 else format(value.normalize(), "f")  # "f": 100 stays 100, not normalize()'s 1E+2
    except InvalidOperation:  # not a number, or too many digits for the default context
        return None


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the number after the last '####', else the last number in the text."""
    finals = _FINAL.findall(completion)
    if finals:
        return normalize_number(finals[-1].removeprefix("####"))
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def load_problems(path: str | None, field: str, limit: int | None = None) -> list[Problem]:
    records = read_jsonl_records(path, field, "GSM8K problems ('question' and 'answer' ending in '#### <number>')")
    problems = []
    for i, record in enumerate(records[:limit] if limit is not None else records):
        question, answer = record.get("question"), record.get("answer")
        label = extract_answer(answer[answer.rfind("####") :]) if isinstance(answer, str) and "####" in answer else None
        if not isinstance(question, str) or label is None:
            raise ConfigError(field, f"{path}:{i + 1}", "each record needs 'question' and 'answer' ending in '#### N'")
        problems.append(Problem(question, _ANNOTATION.sub("", answer), label))
    return problems


def build_prompt(question: str, shots: list[Problem], chat: bool) -> Prompt:
    if chat:
        messages = []
        for shot in shots:
            messages.append({"role": "user", "content": f"Question: {shot.question}"})
            messages.append({"role": "assistant", "content": shot.solution})
        return [*messages, {"role": "user", "content": f"Question: {question}"}]
    prefix = "".join(f"Question: {s.question}\nAnswer: {s.solution}\n\n" for s in shots)
    return f"{prefix}Question: {question}\nAnswer:"


def grade(problems: list[Problem], results: list[RequestResult]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the scores, one record per question)."""
    records = []
    for i, (problem, result) in enumerate(zip(problems, results, strict=True)):
        prediction = extract_answer(result.text) if result.success else None
        records.append(
            {
                "index": i,
                "question": problem.question,
                "label": problem.label,
                "prediction": prediction,
                "correct": prediction == problem.label,
                "completion": result.text,
                "finish_reason": result.finish_reason,
                "output_tokens": result.output_tokens,
                "error": result.error,
            }
        )
    correct = sum(r["correct"] for r in records)
    failed = sum(not r.success for r in results)
    scores = {
        "accuracy": correct / len(problems),
        "num_correct": correct,
        "invalid": sum(r["prediction"] is None for r in records) - failed,
        "failed": failed,
    }
    return scores, records


async def evaluate(
    endpoint: Endpoint,
    problems: list[Problem],
    shots: list[Problem],
    *,
    max_concurrency: int | None = None,
    max_tokens: int = MAX_TOKENS,
    progress: bool = True,
) -> dict[str, Any]:
    """Ask every question greedily; the result JSON, with the per-question records under "questions"."""
    inputs = [
        RequestInput(build_prompt(p.question, shots, endpoint.chat), max_tokens, 0.0, extra={"stop": STOP})
        for p in problems
    ]
    async with open_session(max_concurrency) as session:
        run = await run_requests(
            session, endpoint, inputs, max_concurrency=max_concurrency, desc="gsm8k", progress=progress
        )
    scores, records = grade(problems, run.results)
    output_tokens = sum(r.output_tokens for r in run.results if r.success)
    return {
        "eval": "gsm8k",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": endpoint.base_url,
        "backend": endpoint.backend,
        "model_id": endpoint.model,
        "num_questions": len(problems),
        "num_shots": len(shots),
        "max_concurrency": max_concurrency,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        **scores,
        "latency": run.duration,
        "total_output_tokens": output_tokens,
        "output_throughput": output_tokens / run.duration,
        "questions": records,
    }


def summary_line(result: dict[str, Any]) -> str:
    return (
        f"gsm8k: accuracy {result['accuracy']:.3f} ({result['num_correct']}/{result['num_questions']}), "
        f"invalid {result['invalid']}, failed {result['failed']} | {result['num_shots']}-shot, "
        f"{result['latency']:.1f} s, {result['output_throughput']:.1f} output tok/s | {result['model_id']}"
    )
