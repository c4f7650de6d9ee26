"""`dspark bench serve`: stream requests to a running OpenAI-compatible server and report latency and throughput as
vllm bench serve does (bench/serve.py measures, bench/client.py talks to the server)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from dspark.bench.client import add_server_args, check_load, endpoint_from_args, open_session, run_async
from dspark.bench.serve import DETAILED_FIELDS, default_result_filename, run_benchmark, summary_table
from dspark.bench.serve_data import DATASETS, load_client_tokenizer, sample_prompts
from dspark.cli.common import Formatter
from dspark.errors import ConfigError
from dspark.utils.results import write_json

SERVE_EPILOG = """\
Start a server first (`dspark serve`, or any OpenAI-compatible one). Every request streams; the summary table and the
--save-result JSON use vllm bench serve's names. Random prompts are token ids from the tokenizer of --tokenizer (else
--model when it is a local path or a dspark alias) decoded, else words from a fixed list (about one token each).

examples:
  dspark bench serve --num-prompts 200 --random-input-len 256 --random-output-len 128 --ignore-eos \\
      --max-concurrency 16 --save-result
  dspark bench serve --backend openai-chat --dataset-name mt-bench --dataset-path question.jsonl \\
      --num-prompts 80 --request-rate 4 --seed 1 --save-result --result-dir out --save-detailed
  dspark bench serve --base-url http://10.0.0.2:8000 --model smollm2-135m-instruct --dataset-name gsm8k \\
      --dataset-path test.jsonl --output-len 256 --max-concurrency 32
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="load a running OpenAI-compatible server: TTFT, TPOT, ITL, throughput, spec-decode acceptance",
        description="Online serving benchmark, as vllm bench serve: stream --num-prompts requests to a running server\n"
        "at --request-rate with at most --max-concurrency in flight, then print the result table.",
        epilog=SERVE_EPILOG,
        formatter_class=Formatter,
    )
    add_server_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", metavar="N", type=int, default=1000, help="requests to send (default: %(default)s)")
    g.add_argument(
        "--request-rate",
        metavar="RPS",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals from --seed; inf sends all at once (default: inf)",
    )
    g.add_argument(
        "--num-workers",
        metavar="W",
        type=int,
        default=1,
        help="client processes: one Python process spends ~25 us of CPU a chunk, so a GPU server streaming 10^5 "
        "chunks/s needs several, or the client is what gets measured (default: %(default)s)",
    )
    g.add_argument("--num-warmups", metavar="N", type=int, default=0, help="untimed requests first (default: 0)")
    g.add_argument("--seed", metavar="N", type=int, default=0, help="arrivals, shuffling, random prompts (default: 0)")
    g = p.add_argument_group("requests")
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="(default: %(default)s)")
    g.add_argument("--dataset-path", metavar="FILE.jsonl", help="prompts: 'prompt', 'turns' or 'question' per line")
    g.add_argument("--disable-shuffle", action="store_true", help="take file prompts in file order")
    g.add_argument("--random-input-len", metavar="N", type=int, default=1024, help="(default: %(default)s)")
    g.add_argument("--random-output-len", metavar="N", type=int, default=128, help="(default: %(default)s)")
    g.add_argument("--output-len", metavar="N", type=int, default=256, help="max_tokens of file prompts (default: 256)")
    g.add_argument("--tokenizer", metavar="T", help="for random prompts: a tokenizer directory, .gguf or dspark alias")
    g.add_argument("--temperature", metavar="T", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every request writes max_tokens")
    g = p.add_argument_group("results")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", metavar="DIR", default=".", help="where (default: the current directory)")
    g.add_argument("--result-filename", metavar="NAME", help="(default: <backend>-<rate>qps[-concurrency<C>]-...)")
    g.add_argument("--save-detailed", action="store_true", help="keep per-request lens, ttfts, itls, texts, errors")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.save_result and not Path(args.result_dir).is_dir():
        raise ConfigError("result_dir", args.result_dir, "an existing directory")
    result = run_async(_bench(args))
    if not args.save_detailed:
        for key in DETAILED_FIELDS:
            del result[key]
    print(summary_table(result))
    if args.save_result:
        path = Path(args.result_dir) / (args.result_filename or default_result_filename(result))
        write_json(path, result)
        print(f"result: {path}", file=sys.stderr)
    if result["completed"] == 0:  # a script should not read a run of failures as a measurement
        print("error: every request failed", file=sys.stderr)
        return 1
    return 0


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    # Flags are checked before anything is sent or loaded, so a typo costs no tokenizer load or server round trip.
    check_load(args.max_concurrency, args.request_rate)
    if args.num_prompts < 1:
        raise ConfigError("num_prompts", args.num_prompts, "a positive integer")
    if args.num_workers < 1:
        raise ConfigError("num_workers", args.num_workers, "a positive integer")
    if args.num_warmups < 0:
        raise ConfigError("num_warmups", args.num_warmups, "0 or more")
    async with open_session(1) as session:
        endpoint = await endpoint_from_args(session, args)
    tokenizer, tokenizer_id = None, None
    if args.dataset_name == "random" or args.tokenizer:
        tokenizer, tokenizer_id = load_client_tokenizer(args.tokenizer, endpoint.model)
    prompts = sample_prompts(
        args.dataset_name,
        args.num_prompts,
        dataset_path=args.dataset_path,
        tokenizer=tokenizer,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        output_len=args.output_len,
        shuffle=not args.disable_shuffle,
        seed=args.seed,
    )
    result = await run_benchmark(
        endpoint,
        prompts,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        num_warmups=args.num_warmups,
        progress=not args.disable_tqdm,
        num_workers=args.num_workers,
    )
    return {
        **result,
        "dataset_name": args.dataset_name,
        "tokenizer_id": tokenizer_id,
        "command": getattr(args, "command_line", ""),
    }
