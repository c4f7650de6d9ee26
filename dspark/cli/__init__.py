"""`dspark` on the command line: generate, chat, serve, bench, profile, the drafter commands, simulate and eval.

Engine flags follow vLLM's names, so a command line moves between the two with few edits. A user error (a bad flag
value, a missing model or file) ends as one line, `error: <message>`, on stderr with exit status 2; never a traceback.
Each command family is a module here whose `add_parser(subparsers)` registers its parser and sets `func`, the
function that runs it.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from dspark import __version__
from dspark.cli import bench, generate, profile, serve, simulate, train
from dspark.cli import eval as evaluate
from dspark.cli.common import Formatter
from dspark.errors import DSparkError

EXIT_USAGE = 2
COMMANDS = (generate, serve, bench, profile, train, simulate, evaluate)  # in the order `dspark --help` lists them


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (a StreamHandler keeps the stream it was made with, which a test
    harness may have closed since)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark",
        description="dspark: an LLM inference engine with DSpark speculative decoding.",
        epilog="run `dspark <command> --help` for a command's flags; "
        "the default model is downloaded to $DSPARK_CACHE (~/.cache/dspark) on first use",
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="<command>")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0), or a usage error argparse has already printed (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.command_line = shlex.join(["dspark", *argv])
    log = logging.getLogger("dspark")  # one-off notices, e.g. start-up profiling, on stderr
    if not log.handlers:
        log.addHandler(_StderrHandler())
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
