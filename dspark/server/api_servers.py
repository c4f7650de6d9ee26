"""`dspark serve --api-server-count N`: N API server processes on one engine core, as vLLM scales its front end.

One API server's Python (HTTP parsing, JSON, detokenization, a chunk per token per stream) tops out below what a GPU
core makes at high concurrency; N of them share that work. The `dspark serve` process becomes the launcher:

- it binds N listening sockets to the one port with SO_REUSEPORT, so the kernel spreads new connections over the API
  servers evenly, and a port in use is one error line at once;
- it starts the engine core (engine/core_proc.py), connected to every API server's pair of ZeroMQ sockets, then the
  N API servers, each a ProcessEngine attached to that core (FrontSlot) under uvicorn;
- it holds the core: on Ctrl-C or SIGTERM it asks each API server to stop (uvicorn's graceful drain: a stream still
  running gets 10 s), then stops the core. The API servers run in their own process group, so a terminal's Ctrl-C
  reaches them once, through the launcher; a second Ctrl-C makes them stop at once.

If an API server dies, the launcher stops the rest and exits 1 (a supervisor restarts the whole server). If the core
dies, the API servers answer 503 and end their streams with an error event, as one server does, and the launcher logs
how the core ended. /metrics from any API server counts every API server's requests (server/metrics.py).
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from dspark.config import EngineConfig
from dspark.engine.core_proc import Shutdown, input_encoder, run_core
from dspark.errors import ConfigError
from dspark.models.registry import resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.server.process_engine import FrontSlot, ProcessEngine

logger = logging.getLogger("dspark")

GRACEFUL_S = 10  # a stream still running at shutdown gets this long to finish before it is cancelled (and aborted)


def serve_on(
    engine: Any,
    names: list[str],
    api_key: str | None,
    max_body_bytes: int,
    log_level: str,
    sock: socket.socket,
    log_prefix: str = "",
    stop_asked: threading.Event | None = None,
) -> int:
    """Serve the app of `engine` on a bound socket until stopped: 0, or 1 if the engine core failed to start.
    log_prefix: before each of uvicorn's log lines (which of several API servers wrote it). stop_asked: set by a
    SIGTERM that came before serving (then this serves nothing and returns)."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from dspark.server.app import build_app

    server: Any = None
    failed = False

    def start_failed() -> None:  # the engine core could not start: stop serving, exit 1 (as vLLM does)
        nonlocal failed
        failed = True
        server.should_exit = True

    app = build_app(engine, names, api_key=api_key, max_body_bytes=max_body_bytes, on_start_failure=start_failed)
    log_config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in log_config["formatters"].values():
        formatter["fmt"] = log_prefix + formatter["fmt"]
    config = uvicorn.Config(app, log_level=log_level, log_config=log_config, timeout_graceful_shutdown=GRACEFUL_S)
    server = uvicorn.Server(config)
    if stop_asked is not None:
        # From here a SIGTERM stops the server even before uvicorn takes the signal over (as it starts), and one that
        # came earlier does now: the launcher sends it once, so a stop lost while starting would leave it waiting.
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
        if stop_asked.is_set():
            server.should_exit = True
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again: a normal stop here
        pass
    return 1 if failed else 0


def bind(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """`count` listening sockets on host:port (SO_REUSEPORT when more than one; port 0: the one the first got)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError("host", host, f"cannot be resolved ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    socks: list[socket.socket] = []
    try:
        if count > 1:  # SO_REUSEPORT would share a port another server of this user holds: make sure it is free
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
                address = probe.getsockname()  # port 0: the one chosen, for all of them
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = sock.getsockname()  # port 0 chose one: the others join it
            sock.listen(2048)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise ConfigError("port", port, f"cannot bind {host}:{port} ({e.strerror})") from None
    return socks


def check_count(count: int, core_process: bool) -> None:
    if count < 1:
        raise ConfigError("api_server_count", count, "a positive integer")
    if count > 1 and not core_process:
        raise ConfigError("api_server_count", count, "1 with --no-core-process (several need the core's process)")
    if count > 1 and not (hasattr(socket, "SO_REUSEPORT") and hasattr(os, "pidfd_open")):
        raise ConfigError("api_server_count", count, "1 on this platform (several need Linux)")


def serve_many(
    config: EngineConfig,
    count: int,
    names: list[str],
    api_key: str | None,
    max_body_bytes: int,
    log_level: str,
    socks: list[socket.socket],
    core_target: Callable[..., None] = run_core,
) -> int:
    """The launcher: the core and `count` API servers on `socks` (bind(..., count)); returns the exit code.
    core_target: the core process's entry point (run_core; a benchmark's stub core)."""
    # Download (or convert) the model here, once: the API servers load its tokenizer and the core its weights at the
    # same time, and must not race to write the same cache.
    resolve_model(config.model)
    load_tokenizer(resolve_model(config.tokenizer or config.model))
    directory = tempfile.mkdtemp(prefix="dspark-serve-")
    ctx = zmq.Context()
    control = ctx.socket(zmq.PUSH)  # the launcher's own line to the core: Shutdown
    control.setsockopt(zmq.LINGER, 1000)
    core: Any = None
    try:
        control.bind(f"ipc://{directory}/control")
        core, fronts = _start(config, count, names, api_key, max_body_bytes, log_level, socks, core_target, directory)
        return _supervise(core, fronts, control)
    finally:
        if core is not None and core.is_alive():  # a failure before the core was stopped: it ignores SIGTERM
            core.kill()
            core.join(5)
        for sock in socks:
            sock.close()
        control.close()
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)


def _start(
    config: EngineConfig,
    count: int,
    names: list[str],
    api_key: str | None,
    max_body_bytes: int,
    log_level: str,
    socks: list[socket.socket],
    core_target: Callable[..., None],
    directory: str,
) -> tuple[Any, list[Any]]:
    spawn = multiprocessing.get_context("spawn")
    inputs = [f"ipc://{directory}/in-{i}" for i in range(count)]
    outputs = [f"ipc://{directory}/out-{i}" for i in range(count)]
    core = spawn.Process(
        target=core_target,
        args=(config, [*inputs, f"ipc://{directory}/control"], outputs, os.getpid()),
        name="dspark-core",
        daemon=True,
    )
    core.start()
    assert core.pid is not None
    logger.info("engine core process started (pid %d), %d API servers", core.pid, count)
    fronts = []
    for i, sock in enumerate(socks):
        slot = FrontSlot(i, count, inputs[i], outputs[i], core.pid, directory)
        front = spawn.Process(
            target=run_front,
            args=(slot, config, names, api_key, max_body_bytes, log_level, sock),
            name=f"dspark-api-server-{i}",
            daemon=True,
        )
        front.start()
        fronts.append(front)
        sock.close()  # the API server has its own copy: a dead one's connections must not queue here unanswered
    return core, fronts


def _supervise(core: Any, fronts: list[Any], control: zmq.Socket) -> int:
    stopping = False
    failed = False

    def stop(signum: int = signal.SIGTERM, frame: object = None) -> None:
        nonlocal stopping
        # The first signal: SIGTERM, uvicorn's graceful drain; one more from a service manager straight to the API
        # servers changes nothing. Another signal here: SIGINT, which after the first makes uvicorn stop at once.
        for front in fronts:
            if front.is_alive():
                os.kill(front.pid, signal.SIGINT if stopping else signal.SIGTERM)
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    core_seen = False
    while alive := [f for f in fronts if f.is_alive()]:
        # A front that ends between is_alive() and wait() is no race: its sentinel stays readable.
        ended = multiprocessing.connection.wait([f.sentinel for f in alive] + ([] if core_seen else [core.sentinel]))
        # A sentinel closes as its process exits, a moment before waitpid can reap it: join what ended, or its exit
        # code may read None here and the next is_alive() reap it unseen (a dead front left the launcher waiting).
        for process in [*alive, core]:
            if process.sentinel in ended:
                process.join()
        if not core_seen and not core.is_alive():
            core_seen = True
            if not stopping:
                code = core.exitcode
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                logger.critical("the engine core process %s; the API servers can run no more requests", how)
        for i, front in enumerate(fronts):
            if front.exitcode is not None and not stopping:
                failed = True
                if core.is_alive():
                    logger.error("API server %d exited with code %s; stopping the others", i, front.exitcode)
                # else the core failed to start (an API server exits then, as one server does): the log says why
                stop()
    if core.is_alive():
        control.send(input_encoder.encode(Shutdown()))
        core.join(30)
    if core.is_alive():  # it ignores SIGTERM (a group's signal must not kill it under the draining streams)
        logger.error("the engine core did not stop within 30 s; killing it")
        core.kill()
        core.join(5)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 1 if failed or any(f.exitcode != 0 for f in fronts) else 0


def run_front(
    slot: FrontSlot,
    config: EngineConfig,
    names: list[str],
    api_key: str | None,
    max_body_bytes: int,
    log_level: str,
    sock: socket.socket,
) -> None:
    """An API server's process (spawned by the launcher)."""
    os.setpgid(0, 0)  # out of the terminal's process group: Ctrl-C reaches the launcher, which stops us once
    # uvicorn handles SIGTERM while it serves, then raises it again once stopped: not fatal then, so that a graceful
    # stop ends this process with 0 rather than -15. Before serving it is remembered (serve_on stops at once).
    stop_asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.set())
    log = logging.getLogger("dspark")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[api server {slot.index}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    launcher = os.getppid()
    threading.Thread(target=_exit_with_launcher, args=(launcher,), name="launcher-watch", daemon=True).start()
    engine = ProcessEngine(config, slot=slot)
    code = serve_on(engine, names, api_key, max_body_bytes, log_level, sock, f"[api server {slot.index}] ", stop_asked)
    raise SystemExit(code)


def _exit_with_launcher(launcher: int) -> None:
    """The launcher was killed: nobody would stop this API server."""
    while True:
        time.sleep(1.0)
        if os.getppid() != launcher:
            os._exit(1)
