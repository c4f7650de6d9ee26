"""`dspark serve`: the OpenAI-compatible server on the command line, with the engine flags of the other commands.

The port is bound before the model loads, so a port in use or a host that does not resolve is one error line at once,
not after a minute of loading. FastAPI and uvicorn are imported only when the command runs (`dspark --help` stays
fast).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from dspark.engine.args import add_engine_args, engine_config
from dspark.errors import ConfigError
from dspark.models.registry import DEFAULT_MODEL

logger = logging.getLogger("dspark")

API_KEY_ENV = "DSPARK_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

SERVE_EPILOG = """\
examples:
  dspark serve                                    # the default model on http://127.0.0.1:8000/v1
  dspark serve path/to/hf-model --port 8001 --api-key "$KEY"
  dspark serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 16}'
"""


def add_parser(subparsers: Any, formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register `serve` on dspark's commands (cli.py passes its own formatter)."""
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /metrics",
        description="Serve one model over HTTP with OpenAI's API (streaming included), speculative decoding and\n"
        "adaptive verification as configured, and Prometheus metrics under vLLM's names with the dspark: prefix.",
        epilog=SERVE_EPILOG,
        formatter_class=formatter_class,
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (the same as --model)")
    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to bind; 0.0.0.0 for every interface (default: %(default)s)"
    )
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    g.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, else no key)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names requests may give as `model` (default: the model as given, and its last path component)",
    )
    g.add_argument(
        "--max-request-bytes",
        metavar="N",
        type=int,
        default=16 << 20,
        help="largest request body accepted; larger ones get 413 (default: %(default)s, 16 MiB)",
    )
    g.add_argument(
        "--core-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler, model, speculative decoding) in its own process, as vLLM does, so the "
        "step loop never waits on HTTP; --no-core-process keeps it in the server's process, on a thread "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--api-server-count",
        metavar="N",
        type=int,
        default=1,
        help="API server processes on the one engine core (HTTP, tokenization, detokenization, streaming), as vLLM's "
        "flag: one API server's Python tops out below a GPU's output at high concurrency (on an H200 at 256 streams, "
        "4 made 0.68x of the offline engine, 1 made 0.36x) (Linux; default: %(default)s)",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def served_model_names(model: str, names: list[str] | None) -> list[str]:
    if names:
        return list(dict.fromkeys(names))
    return list(dict.fromkeys([model, Path(model).name]))


def cmd_serve(args: argparse.Namespace) -> int:
    from dspark.engine.llm_engine import LLMEngine
    from dspark.server.api_servers import bind, check_count, serve_many, serve_on
    from dspark.server.process_engine import ProcessEngine

    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise ConfigError("model", args.model_tag, f"given twice (and --model {args.model}); give it once")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ConfigError("port", args.port, "must be in [0, 65535]")
    if args.max_request_bytes < 1:
        raise ConfigError("max_request_bytes", args.max_request_bytes, "must be a positive integer")
    check_count(args.api_server_count, args.core_process)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = engine_config(args)  # validated before the port is taken or the model loads
    socks = bind(args.host, args.port, args.api_server_count)
    names = served_model_names(args.model, args.served_model_name)
    host, port = socks[0].getsockname()[:2]
    logger.info(
        "dspark serve: http://%s:%d/v1 serving %s%s%s",
        f"[{host}]" if ":" in host else host,
        port,
        ", ".join(names),
        " (API key required)" if api_key else "",
        f" through {args.api_server_count} API servers" if args.api_server_count > 1 else "",
    )
    if args.api_server_count > 1:
        code = serve_many(config, args.api_server_count, names, api_key, args.max_request_bytes, args.log_level, socks)
    else:
        # With a core process the HTTP server is up at once (/health answers 503 while the core loads the model);
        # in-process, the engine is built first.
        engine = ProcessEngine(config) if args.core_process else LLMEngine(config)
        code = serve_on(engine, names, api_key, args.max_request_bytes, args.log_level, socks[0])
    if code:
        if args.api_server_count == 1:  # the launcher of several says itself what ended it
            logger.error("dspark serve: the engine failed to start; the log above says why")
        return code
    logger.info("dspark serve: stopped")
    return 0
