"""`dspark eval mtbench`: the 80 MT-bench questions answered by a served model, saved, and checked for degeneration.

There is no judge here: the point is a sanity check that sampling (speculative or not) still writes sensible text at
temperature 1. Each question's first turn is asked; with --num-turns 2 (chat API only, as the second turn refers to
the first answer) the first answer goes back as the assistant's turn before the second question. Every answer is run
through degeneration.check, and the summary names the flagged ones and why. Request i is sent with seed = --seed + i,
so a server that honours `seed` gives the same answers on a rerun.

--data-path is FastChat's question.jsonl (question_id, category, turns) or DeepSpec's mt-bench.jsonl (turns only).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dspark.bench.client import (
    Endpoint,
    RequestInput,
    RequestResult,
    open_session,
    run_requests,
)
from dspark.errors import ConfigError
from dspark.evals.degeneration import DegenerationConfig, check
from dspark.utils.jsonl import read_jsonl_records

MAX_TOKENS = 1024  # FastChat's default answer length for MT-bench


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str | None
    turns: list[str]


def load_questions(path: str | None, limit: int | None = None) -> list[Question]:
    records = read_jsonl_records(path, "data_path", "MT-bench questions (a 'turns' list of strings per line)")
    questions = []
    for i, record in enumerate(records[:limit] if limit is not None else records):
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError("data_path", f"{path}:{i + 1}", "each record needs 'turns', a list of strings")
        questions.append(Question(record.get("question_id", i + 1), record.get("category"), turns))
    return questions


def check_turns(num_turns: int, backend: str) -> None:
    if num_turns not in (1, 2):
        raise ConfigError("num_turns", num_turns, "1 or 2")
    if num_turns == 2 and backend != "openai-chat":
        raise ConfigError("num_turns", num_turns, "1 with --backend openai; the second turn needs openai-chat")


async def evaluate(
    endpoint: Endpoint,
    questions: list[Question],
    *,
    num_turns: int = 1,
    temperature: float = 1.0,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
    max_concurrency: int | None = None,
    degeneration: DegenerationConfig | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Answer every question (turn by turn) and check each answer; the result JSON."""
    check_turns(num_turns, endpoint.backend)
    conversations: list[list[dict[str, str]]] = [[] for _ in questions]
    answers: list[list[RequestResult]] = [[] for _ in questions]
    duration = 0.0
    async with open_session(max_concurrency) as session:
        for turn in range(num_turns):
            # A question whose earlier turn failed, or that has no such turn, is not asked again.
            asked = [i for i, q in enumerate(questions) if turn < len(q.turns) and len(answers[i]) == turn]
            asked = [i for i in asked if turn == 0 or answers[i][-1].success]
            inputs = []
            for i in asked:
                conversations[i].append({"role": "user", "content": questions[i].turns[turn]})
                prompt = list(conversations[i]) if endpoint.chat else questions[i].turns[turn]
                extra = {"seed": seed + i + turn * len(questions)}
                inputs.append(RequestInput(prompt, max_tokens, temperature, extra=extra))
            run = await run_requests(
                session,
                endpoint,
                inputs,
                max_concurrency=max_concurrency,
                desc=f"mtbench turn {turn + 1}",
                progress=progress,
            )
            duration += run.duration
            for i, result in zip(asked, run.results, strict=True):
                answers[i].append(result)
                conversations[i].append({"role": "assistant", "content": result.text})
    records = [_record(q, a, degeneration) for q, a in zip(questions, answers, strict=True)]
    output_tokens = sum(r.output_tokens for a in answers for r in a if r.success)
    flags = Counter(code for r in records for turn in r["flags"] for code in turn)
    return {
        "eval": "mtbench",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": endpoint.base_url,
        "backend": endpoint.backend,
        "model_id": endpoint.model,
        "num_questions": len(questions),
        "num_turns": num_turns,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "seed": seed,
        "num_answers": sum(len(a) for a in answers),
        "failed": sum(not r.success for a in answers for r in a),
        "num_flagged": sum(any(turn for turn in r["flags"]) for r in records),
        "flag_counts": dict(sorted(flags.items())),
        "latency": duration,
        "total_output_tokens": output_tokens,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "questions": records,
    }


def _record(question: Question, answers: list[RequestResult], config: DegenerationConfig | None) -> dict[str, Any]:
    checks = [check(a.text, a.finish_reason, config) if a.success else None for a in answers]
    return {
        "question_id": question.question_id,
        "category": question.category,
        "turns": question.turns[: len(answers)],
        "answers": [a.text for a in answers],
        "finish_reasons": [a.finish_reason for a in answers],
        "output_tokens": [a.output_tokens for a in answers],
        "errors": [a.error for a in answers],
        "flags": [c.reasons if c is not None else {} for c in checks],
        "repeated_ngram_ratio": [c.ngram_ratio if c is not None else None for c in checks],
        "longest_repeated_run": [c.run_words if c is not None else None for c in checks],
    }


def summary(result: dict[str, Any]) -> str:
    lines = []
    for r in result["questions"]:
        for turn, flags in enumerate(r["flags"]):
            for code, why in flags.items():
                lines.append(f"  question {r['question_id']} turn {turn + 1}: {code}: {why}")
    counts = ", ".join(f"{n} {code}" for code, n in result["flag_counts"].items()) or "none"
    lines.append(
        f"mtbench: {result['num_answers']} answers to {result['num_questions']} questions "
        f"({result['num_turns']} turn(s), temperature {result['temperature']:g}), {result['failed']} failed, "
        f"{result['num_flagged']} question(s) flagged ({counts}) | {result['latency']:.1f} s, "
        f"{result['output_throughput']:.1f} output tok/s | {result['model_id']}"
    )
    return "\n".join(lines)
