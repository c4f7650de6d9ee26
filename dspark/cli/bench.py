"""`dspark bench`: the benchmarks. Offline throughput against transformers and speculation against none are here;
the sweep, the serving benchmark and the load test have modules of their own."""

from __future__ import annotations

import argparse
from typing import Any

from dspark.cli import bench_load, bench_serve, bench_sweep
from dspark.cli.common import Formatter
from dspark.engine.args import add_engine_args, engine_config
from dspark.errors import ConfigError
from dspark.utils.results import output_path, write_json

BENCH_EPILOG = """\
examples:
  dspark bench throughput --num-prompts 16 --output-len 64 --batch-size 16 --output-json out/tp.json
  dspark bench spec --speculative-config '{"method": "ngram"}' --batch-size 1 --batch-size 8
"""


THROUGHPUT_EPILOG = """\
Both arms get the same prompt token ids, decode greedily and produce exactly --output-len tokens per prompt; the
transformers model is built from the same loaded weights. The summary line reads:
  dspark <tok/s> | hf <tok/s> | ratio <dspark/hf>x (<prompts> x <tokens>, batch <B>, <dtype>, <device>)

examples:
  dspark bench throughput --num-prompts 16 --output-len 64 --batch-size 16
  dspark bench throughput --dtype bfloat16 --batch-size 1 --output-json out/tp-bf16-b1.json
  dspark bench throughput --dataset-path prompts.jsonl --num-prompts 100 --no-hf
"""


SPEC_EPILOG = """\
examples:
  dspark bench spec --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --batch-size 1
  dspark bench spec --dataset-path gsm8k.jsonl --num-prompts 32 --batch-size 1 --batch-size 8 --repeats 3 \\
      --speculative-config '{"method": "dspark", "model": "drafter/", "num_speculative_tokens": 7}'
"""


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from dspark.bench.throughput import run_throughput, summary_line

    for b in args.batch_size:
        if b < 1:
            raise ConfigError("batch_size", b, "must be a positive integer")
    for n in args.prefill_len or []:
        if n < 1:
            raise ConfigError("prefill_len", n, "must be a positive integer")
    config = engine_config(args, max_num_seqs=max(args.batch_size))
    output = output_path(args.output_json)
    result = run_throughput(
        config,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        batch_sizes=args.batch_size,
        prefill_lens=args.prefill_len,
        dataset_path=args.dataset_path,
        chat=args.chat,
        hf=args.hf,
        repeats=args.repeats,
        command=args.command_line,
    )
    write_json(output, result)
    print(summary_line(result))
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from dspark.bench.spec import run_spec_bench, summary_table

    batch_sizes = args.batch_size or [1, 8]
    config = engine_config(args, max_num_seqs=max(b for b in batch_sizes if isinstance(b, int)))
    output = output_path(args.output_json)
    result = run_spec_bench(
        config,
        batch_sizes=batch_sizes,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        dataset_path=args.dataset_path,
        chat=args.chat,
        temperature=args.temperature,
        repeats=args.repeats,
        command=args.command_line,
    )
    write_json(output, result)
    print(summary_table(result))
    return 0


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks",
        description="Benchmarks that print a one-line summary and can write their results as JSON.",
        epilog=BENCH_EPILOG,
        formatter_class=Formatter,
    )
    benches = bench.add_subparsers(title="benchmarks", dest="bench", required=True, metavar="<benchmark>")
    tp = benches.add_parser(
        "throughput",
        help="offline output tokens/s of dspark against Hugging Face transformers, in the same run",
        description="Offline throughput: a fixed prompt set in a fixed order through dspark and through\n"
        "transformers `generate` (static left-padded batches), greedy, same weights, same dtype.",
        epilog=THROUGHPUT_EPILOG,
        formatter_class=Formatter,
    )
    g = tp.add_argument_group("benchmark")
    g.add_argument(
        "--num-prompts",
        metavar="N",
        type=int,
        default=32,
        help="prompts to run; the set repeats if shorter (default: %(default)s)",
    )
    g.add_argument(
        "--output-len",
        metavar="L",
        type=int,
        default=128,
        help="tokens generated per prompt, EOS ignored (default: %(default)s)",
    )
    g.add_argument(
        "--batch-size",
        metavar="B",
        type=int,
        nargs="+",
        default=[16],
        help="most sequences in flight: dspark's concurrency, transformers' static batch; one decode row each "
        "(default: 16)",
    )
    g.add_argument(
        "--prefill-len",
        metavar="N",
        type=int,
        nargs="+",
        help="also time the first token of one N-token prompt against transformers' forward over it, one row each "
        "(default: none)",
    )
    g.add_argument(
        "--dataset-path",
        metavar="FILE.jsonl",
        help="JSON lines with 'prompt', 'turns' or 'question' (default: the built-in set of 32 prompts)",
    )
    g.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template (default: on)"
    )
    g.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the transformers baseline (default: on)",
    )
    g.add_argument(
        "--repeats",
        metavar="R",
        type=int,
        default=1,
        help="rounds, the arms alternating within each; medians are reported (default: %(default)s)",
    )
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    add_engine_args(tp, max_num_seqs=False)
    tp.set_defaults(func=cmd_bench_throughput)

    sp = benches.add_parser(
        "spec",
        help="speculative decoding against none: speed-up and acceptance length, in the same run",
        description="A speculative config against no speculation on the same prompts, at each batch size.\n"
        "Requests stop at EOS or --output-len; at temperature 0 the outputs are checked to be identical.",
        epilog=SPEC_EPILOG,
        formatter_class=Formatter,
    )
    g = sp.add_argument_group("benchmark")
    g.add_argument("--num-prompts", metavar="N", type=int, default=16, help="prompts to run (default: %(default)s)")
    g.add_argument(
        "--output-len", metavar="L", type=int, default=128, help="most tokens per prompt (default: %(default)s)"
    )
    g.add_argument(
        "--batch-size",
        metavar="B",
        type=int,
        action="append",
        help="max_num_seqs of one row (repeatable; default: 1 and 8)",
    )
    g.add_argument("--temperature", metavar="T", type=float, default=0.0, help="(default: %(default)s, greedy)")
    g.add_argument(
        "--dataset-path",
        metavar="FILE.jsonl",
        help="JSON lines with 'prompt', 'turns' or 'question' (default: the built-in set of 32 prompts)",
    )
    g.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template (default: on)"
    )
    g.add_argument("--repeats", metavar="R", type=int, default=1, help="rounds, arms alternating (default: 1)")
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    add_engine_args(sp, max_num_seqs=False)
    sp.set_defaults(func=cmd_bench_spec)
    for module in (bench_sweep, bench_serve, bench_load):
        module.add_parser(benches)
