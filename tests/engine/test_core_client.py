"""CoreProcessClient (engine/core_client.py) with stub cores: what a core sent just before it exited is read before
its end is reported, and a core that ignores SIGTERM (as run_core does) is killed, never left behind, when the client
is closed, gives up on it, or fails while starting it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import zmq

from dspark.config import EngineConfig
from dspark.engine.core_client import CoreProcessClient
from dspark.engine.core_proc import StartFailed, StepOutputs, output_encoder
from helpers import fail_to_start as _fail_to_start


def _deaf(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """A core that ignores SIGINT and SIGTERM (as run_core does) and never reads its inputs (so no Shutdown): it says
    when its signals are set, then waits for its parent to go."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_address)
    outputs.send(output_encoder.encode(StepOutputs([])))
    while os.getppid() == parent_pid:
        time.sleep(0.1)


class _SentinelOnly:
    """A poller that reports only the core's end: the race where the process's sentinel is seen before ZeroMQ's I/O
    thread has handed over the last message the core sent."""

    def __init__(self, sentinel: int) -> None:
        self.sentinel = sentinel

    def poll(self, timeout: int | None = None) -> list[tuple[Any, int]]:
        return [(self.sentinel, zmq.POLLIN)]


def _started(target: Any) -> CoreProcessClient:
    client = CoreProcessClient(EngineConfig(), target, blocking=True)
    assert client.process is not None
    return client


def test_what_the_core_sent_before_it_exited_is_read_before_its_end() -> None:
    client = _started(_fail_to_start)
    try:
        assert client.process is not None
        client.process.join(30)
        assert not client.alive
        client._poller = _SentinelOnly(client.sentinel)  # type: ignore[assignment]
        assert client.receive_blocking(5) == [StartFailed("RuntimeError: no device")]
        assert client.receive_blocking(5) is None
    finally:
        client.close()


def test_close_kills_a_core_that_does_not_stop() -> None:
    client = _started(_deaf)
    process = client.process
    assert process is not None
    try:
        assert client.receive_blocking(30) == [StepOutputs([])]  # its signals are set
        client.request_shutdown()
        started = time.monotonic()
        client.close(timeout=0.5)
        assert time.monotonic() - started < 3.0
        assert process.exitcode == -signal.SIGKILL
    finally:
        process.kill()


def test_kill_stops_a_core_that_ignores_sigterm() -> None:
    client = _started(_deaf)
    process = client.process
    assert process is not None
    try:
        assert client.receive_blocking(30) == [StepOutputs([])]
        client.kill()
        process.join(3)
        assert process.exitcode == -signal.SIGKILL
    finally:
        process.kill()
        client.close()


def test_a_client_that_fails_while_starting_the_core_kills_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any error) once the core's process has started, before the client is made: nobody could stop it."""
    processes = []
    start = CoreProcessClient._start

    def start_then_interrupt(self: CoreProcessClient, config: EngineConfig, target: Any) -> None:
        start(self, config, target)
        processes.append(self.process)
        raise KeyboardInterrupt

    monkeypatch.setattr(CoreProcessClient, "_start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        CoreProcessClient(EngineConfig(), _deaf, blocking=True)
    (process,) = processes
    try:
        process.join(3)
        assert process.exitcode == -signal.SIGKILL
    finally:
        process.kill()
