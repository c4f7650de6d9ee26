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

import argparse
import asyncio
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from dspark.bench.client import (
    Endpoint,
    Prompt,
    RequestInput,
    RequestResult,
    add_server_args,
    endpoint_from_args,
    open_session,
    run_requests,
)
from dspark.errors import ConfigError
from dspark.evals.data import read_jsonl_records

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


# ---- command line -------------------------------------------------------------------------------------------------

GSM8K_EPILOG = """\
examples:
  dspark eval gsm8k --data-path gsm8k/test.jsonl --train-path gsm8k/train.jsonl.gz --num-questions 200 \\
      --max-concurrency 16 --output-json gsm8k.json
  dspark eval gsm8k --backend openai-chat --base-url http://127.0.0.1:8000 --data-path test.jsonl --num-shots 0
"""


def add_parser(
    subparsers: Any, formatter_class: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gsm8k",
        help="GSM8K accuracy, few-shot and greedy, through a running server",
        description="GSM8K through an OpenAI-compatible server: temperature 0, few-shot from the train split, the\n"
        "answer taken after '####' (else the last number); prints the accuracy and the invalid count.",
        epilog=GSM8K_EPILOG,
        formatter_class=formatter_class,
    )
    add_server_args(p, max_concurrency=32)
    g = p.add_argument_group("gsm8k")
    g.add_argument("--data-path", metavar="FILE.jsonl", help="the questions: GSM8K's test.jsonl (required)")
    g.add_argument("--train-path", metavar="FILE.jsonl", help="the few-shot examples: GSM8K's train.jsonl[.gz]")
    g.add_argument("--num-shots", metavar="K", type=int, default=5, help="examples before each question (default: 5)")
    g.add_argument("--num-questions", metavar="N", type=int, help="the first N questions (default: all)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=MAX_TOKENS, help="(default: %(default)s)")
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    g.add_argument("--save-detailed", action="store_true", help="add every question's completion and grade")
    p.set_defaults(func=cmd_eval_gsm8k)
    return p


def cmd_eval_gsm8k(args: argparse.Namespace) -> int:
    from dspark.cli import output_path, write_json

    output = output_path(args.output_json)
    if args.num_shots < 0:
        raise ConfigError("num_shots", args.num_shots, "0 or more")
    if args.num_questions is not None and args.num_questions < 1:
        raise ConfigError("num_questions", args.num_questions, "a positive integer (or leave it out: all)")
    if args.max_tokens < 1:
        raise ConfigError("max_tokens", args.max_tokens, "a positive integer")
    problems = load_problems(args.data_path, "data_path", args.num_questions)
    shots: list[Problem] = []
    if args.num_shots:
        if args.train_path is None:
            raise ConfigError("train_path", None, "GSM8K's train.jsonl[.gz] for the shots, or --num-shots 0")
        shots = load_problems(args.train_path, "train_path", args.num_shots)

    async def main() -> dict[str, Any]:
        async with open_session(1) as session:
            endpoint = await endpoint_from_args(session, args)
        return await evaluate(
            endpoint,
            problems,
            shots,
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            progress=not args.disable_tqdm,
        )

    result = asyncio.run(main())
    result.update(data_path=args.data_path, train_path=args.train_path, command=getattr(args, "command_line", ""))
    first_error = result["questions"][0]["error"]
    if not args.save_detailed:
        del result["questions"]
    write_json(output, result)
    print(summary_line(result))
    if output is not None:
        print(f"results: {output}", file=sys.stderr)
    if result["failed"] == result["num_questions"]:  # an accuracy of 0 that measured nothing
        print(f"error: every request failed, the first with: {first_error}", file=sys.stderr)
        return 1
    return 0
