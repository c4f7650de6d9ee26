"""The command line of `dspark bench load` (the load logic is in bench/load.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dspark.bench.client import add_server_args, endpoint_from_args, open_session, run_async
from dspark.bench.load import LoadSettings, run_load, summary_line
from dspark.cli.common import Formatter
from dspark.utils.results import write_json

LOAD_EPILOG = """\
Start a server first; with its pid, the server's memory is read from /proc before and after each round. The exit
status is 1 when any completed output differs from its reference, a request failed, or resources leaked.

examples:
  dspark serve --speculative-config '{"method": "dspark"}' & \\
  dspark bench load --concurrency 64 --duration 60 --rounds 2 --disconnect-fraction 0.2 --max-tokens 64 \\
      --server-pid $! --output-json load.json
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "load",
        help="hold a running server under streaming load with disconnects; check outputs, leaks and memory",
        description="Keep --concurrency greedy streaming requests in flight for --duration seconds, --rounds times,\n"
        "a --disconnect-fraction of them hanging up mid-stream; then check every completed output against the\n"
        "prompt's output alone, that the server holds no request or KV block, and its memory across rounds.",
        epilog=LOAD_EPILOG,
        formatter_class=Formatter,
    )
    add_server_args(p, concurrency_flag=False)
    d = LoadSettings()
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", metavar="N", type=int, default=d.concurrency, help="(default: %(default)s)")
    g.add_argument("--duration", metavar="S", type=float, default=d.duration, help="per round (default: %(default)s)")
    g.add_argument("--rounds", metavar="R", type=int, default=d.rounds, help="(default: %(default)s)")
    g.add_argument(
        "--disconnect-fraction",
        metavar="F",
        type=float,
        default=d.disconnect_fraction,
        help="share of requests that hang up at a random point of their stream (default: %(default)s)",
    )
    g.add_argument("--max-tokens", metavar="N", type=int, default=d.max_tokens, help="(default: %(default)s)")
    g.add_argument("--seed", metavar="N", type=int, default=d.seed, help="prompt and cut choices (default: 0)")
    g.add_argument(
        "--logprobs", action="store_true", help="ask for logprobs=0 and check each stream lists usage's token count"
    )
    g = p.add_argument_group("checks")
    g.add_argument("--server-pid", metavar="PID", type=int, help="read the server's RSS from /proc/PID")
    g.add_argument(
        "--settle", metavar="S", type=float, default=d.settle, help="wait for /metrics to go idle (default: 10)"
    )
    g.add_argument(
        "--rss-tolerance-mb",
        metavar="MB",
        type=float,
        default=d.rss_tolerance_mb,
        help="RSS growth allowed from the first round's end to the last's (default: 64)",
    )
    g.add_argument("--output-json", metavar="PATH", help="write the summary here")
    p.set_defaults(func=cmd_bench_load)


def cmd_bench_load(args: argparse.Namespace) -> int:
    settings = LoadSettings(
        concurrency=args.concurrency,
        duration=args.duration,
        disconnect_fraction=args.disconnect_fraction,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        seed=args.seed,
        settle=args.settle,
        rss_tolerance_mb=args.rss_tolerance_mb,
        logprobs=args.logprobs,
        server_pid=args.server_pid,
    )
    result = run_async(_load(args, settings))
    result["command"] = getattr(args, "command_line", "")
    write_json(Path(args.output_json) if args.output_json else None, result)
    print(summary_line(result))
    return 0 if result["ok"] else 1


async def _load(args: argparse.Namespace, settings: LoadSettings) -> dict[str, Any]:
    async with open_session(1) as session:
        endpoint = await endpoint_from_args(session, args)
    return await run_load(endpoint, settings, progress=not args.disable_tqdm)
