"""`dspark eval`: the evaluations through a running OpenAI-compatible server, GSM8K accuracy (evals/gsm8k.py) and
MT-bench answers checked for degeneration (evals/mtbench.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dspark.bench.client import add_server_args, endpoint_from_args, open_session, run_async
from dspark.cli.common import Formatter
from dspark.errors import ConfigError
from dspark.evals import gsm8k, mtbench
from dspark.utils.results import output_path, write_json

EVAL_EPILOG = """\
examples:
  dspark eval gsm8k --data-path gsm8k/test.jsonl --train-path gsm8k/train.jsonl.gz --num-questions 200
  dspark eval mtbench --backend openai-chat --data-path mt_bench/question.jsonl --output-json mtbench.json
"""
GSM8K_EPILOG = """\
examples:
  dspark eval gsm8k --data-path gsm8k/test.jsonl --train-path gsm8k/train.jsonl.gz --num-questions 200 \\
      --max-concurrency 16 --output-json gsm8k.json
  dspark eval gsm8k --backend openai-chat --base-url http://127.0.0.1:8000 --data-path test.jsonl --num-shots 0
"""
MTBENCH_EPILOG = """\
examples:
  dspark eval mtbench --backend openai-chat --data-path mt_bench/question.jsonl --output-json mtbench.json
  dspark eval mtbench --backend openai-chat --data-path question.jsonl --num-turns 2 --max-tokens 512 \\
      --max-concurrency 16 --seed 1
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval",
        help="accuracy and sanity evaluations through a running OpenAI-compatible server",
        description="Evaluations that talk to a running server (`dspark serve`, or any OpenAI-compatible one).\n"
        "The data files are arguments: nothing is downloaded.",
        epilog=EVAL_EPILOG,
        formatter_class=Formatter,
    )
    evals = p.add_subparsers(title="evaluations", dest="eval", required=True, metavar="<evaluation>")
    _add_gsm8k(evals)
    _add_mtbench(evals)


def _add_gsm8k(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gsm8k",
        help="GSM8K accuracy, few-shot and greedy, through a running server",
        description="GSM8K through an OpenAI-compatible server: temperature 0, few-shot from the train split, the\n"
        "answer taken after '####' (else the last number); prints the accuracy and the invalid count.",
        epilog=GSM8K_EPILOG,
        formatter_class=Formatter,
    )
    add_server_args(p, max_concurrency=32)
    g = p.add_argument_group("gsm8k")
    g.add_argument("--data-path", metavar="FILE.jsonl", help="the questions: GSM8K's test.jsonl (required)")
    g.add_argument("--train-path", metavar="FILE.jsonl", help="the few-shot examples: GSM8K's train.jsonl[.gz]")
    g.add_argument("--num-shots", metavar="K", type=int, default=5, help="examples before each question (default: 5)")
    g.add_argument("--num-questions", metavar="N", type=int, help="the first N questions (default: all)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=gsm8k.MAX_TOKENS, help="(default: %(default)s)")
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    g.add_argument("--save-detailed", action="store_true", help="add every question's completion and grade")
    p.set_defaults(func=cmd_eval_gsm8k)


def cmd_eval_gsm8k(args: argparse.Namespace) -> int:
    output = output_path(args.output_json)
    if args.num_shots < 0:
        raise ConfigError("num_shots", args.num_shots, "0 or more")
    if args.num_questions is not None and args.num_questions < 1:
        raise ConfigError("num_questions", args.num_questions, "a positive integer (or leave it out: all)")
    if args.max_tokens < 1:
        raise ConfigError("max_tokens", args.max_tokens, "a positive integer")
    problems = gsm8k.load_problems(args.data_path, "data_path", args.num_questions)
    shots: list[gsm8k.Problem] = []
    if args.num_shots:
        if args.train_path is None:
            raise ConfigError("train_path", None, "GSM8K's train.jsonl[.gz] for the shots, or --num-shots 0")
        shots = gsm8k.load_problems(args.train_path, "train_path", args.num_shots)

    async def main() -> dict[str, Any]:
        async with open_session(1) as session:
            endpoint = await endpoint_from_args(session, args)
        return await gsm8k.evaluate(
            endpoint,
            problems,
            shots,
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            progress=not args.disable_tqdm,
        )

    result = run_async(main())
    result.update(data_path=args.data_path, train_path=args.train_path, command=getattr(args, "command_line", ""))
    first_error = result["questions"][0]["error"]
    if not args.save_detailed:
        del result["questions"]
    write_json(output, result)
    print(gsm8k.summary_line(result))
    if output is not None:
        print(f"results: {output}", file=sys.stderr)
    if result["failed"] == result["num_questions"]:  # an accuracy of 0 that measured nothing
        print(f"error: every request failed, the first with: {first_error}", file=sys.stderr)
        return 1
    return 0


def _add_mtbench(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "mtbench",
        help="answer the MT-bench questions, save the answers, flag degenerate ones",
        description="MT-bench through an OpenAI-compatible server at temperature 1: the answers go to a JSON file\n"
        "and each is checked for loops, repeated n-grams and runaway length; no judge is run.",
        epilog=MTBENCH_EPILOG,
        formatter_class=Formatter,
    )
    add_server_args(p, max_concurrency=32)
    g = p.add_argument_group("mtbench")
    g.add_argument("--data-path", metavar="FILE.jsonl", help="the questions: MT-bench question.jsonl (required)")
    g.add_argument("--num-questions", metavar="N", type=int, help="the first N questions (default: all)")
    g.add_argument("--num-turns", type=int, choices=(1, 2), default=1, help="(default: 1; 2 needs openai-chat)")
    g.add_argument("--temperature", metavar="T", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=mtbench.MAX_TOKENS, help="(default: %(default)s)")
    g.add_argument("--seed", metavar="N", type=int, default=0, help="request i gets seed N + i (default: 0)")
    g.add_argument("--output-json", metavar="PATH", help="(default: mtbench-<model>-<date>.json here)")
    p.set_defaults(func=cmd_eval_mtbench)


def cmd_eval_mtbench(args: argparse.Namespace) -> int:
    output = output_path(args.output_json)
    if args.num_questions is not None and args.num_questions < 1:
        raise ConfigError("num_questions", args.num_questions, "a positive integer (or leave it out: all)")
    if args.max_tokens < 1:
        raise ConfigError("max_tokens", args.max_tokens, "a positive integer")
    mtbench.check_turns(args.num_turns, args.backend)
    questions = mtbench.load_questions(args.data_path, args.num_questions)

    async def main() -> dict[str, Any]:
        async with open_session(1) as session:
            endpoint = await endpoint_from_args(session, args)
        return await mtbench.evaluate(
            endpoint,
            questions,
            num_turns=args.num_turns,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
            max_concurrency=args.max_concurrency,
            progress=not args.disable_tqdm,
        )

    result = run_async(main())
    result.update(data_path=args.data_path, command=getattr(args, "command_line", ""))
    if output is None:
        output = Path(f"mtbench-{Path(result['model_id']).name or 'model'}-{result['date']}.json")
    write_json(output, result)
    print(mtbench.summary(result))
    print(f"answers: {output}", file=sys.stderr)
    if result["failed"] == result["num_answers"]:
        first_error = result["questions"][0]["errors"][0]
        print(f"error: every request failed, the first with: {first_error}", file=sys.stderr)
        return 1
    return 0
