"""`dspark eval`: the evaluation commands, registered on dspark's command line by cli.py."""

from __future__ import annotations

import argparse
from typing import Any

EVAL_EPILOG = """\
examples:
  dspark eval gsm8k --data-path gsm8k/test.jsonl --train-path gsm8k/train.jsonl.gz --num-questions 200
  dspark eval mtbench --backend openai-chat --data-path mt_bench/question.jsonl --output-json mtbench.json
"""


def add_parser(
    commands: Any, formatter_class: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter
) -> argparse.ArgumentParser:
    from dspark.evals.gsm8k import add_parser as add_gsm8k
    from dspark.evals.mtbench import add_parser as add_mtbench

    p = commands.add_parser(
        "eval",
        help="accuracy and sanity evaluations through a running OpenAI-compatible server",
        description="Evaluations that talk to a running server (`dspark serve`, or any OpenAI-compatible one).\n"
        "The data files are arguments: nothing is downloaded.",
        epilog=EVAL_EPILOG,
        formatter_class=formatter_class,
    )
    evals = p.add_subparsers(title="evaluations", dest="eval", required=True, metavar="<evaluation>")
    add_gsm8k(evals, formatter_class)
    add_mtbench(evals, formatter_class)
    return p
