"""The front's handle on an engine core running in its own process (engine/core_proc.py): start it, send it inputs,
read its messages, know when it is gone, stop it.

asyncio-first (zmq.asyncio), for the server's event loop: reading blocks nothing and polls nothing, and the process's
sentinel tells the loop the moment the core dies. A blocking client (blocking=True, for LLM(engine_process=True)) has
plain ZeroMQ sockets instead and no event loop: receive_blocking() waits for the core's messages or its end.

One of several API servers does not start the core: it attaches to the one the launcher started
(server/api_servers.py), binding its own pair of sockets, and learns of the core's end from a pidfd (Linux).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import shutil
import tempfile
import uuid
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from dspark.config import EngineConfig
from dspark.engine.core_proc import (
    CoreInput,
    CoreMessage,
    Shutdown,
    input_encoder,
    output_decoder,
    run_core,
)

logger = logging.getLogger("dspark")
DRAIN_S = 0.2  # once the core has ended, how long a front waits for the messages it sent just before


class CoreProcessClient:
    def __init__(
        self,
        config: EngineConfig | None,
        target: Callable[..., None] = run_core,
        attach: tuple[str, str, int] | None = None,
        blocking: bool = False,
    ) -> None:
        """Bind the sockets and start the core process; its Ready (or StartFailed) is the first message read.
        target: the process's entry point, run_core's signature (benchmarks put a stub core there).
        attach: (input address, output address, core pid) of a core another process started: bind those, start
        nothing; the core's owner stops it.
        blocking: plain sockets, read with receive_blocking() (no event loop); else asyncio's, read with receive()."""
        self.ctx: zmq.Context = zmq.Context() if blocking else zmq.asyncio.Context()
        self._blocking = blocking
        self._poller: zmq.Poller | None = None
        self.process: BaseProcess | None = None
        self._pidfd: int | None = None
        self._dir: str | None = None
        try:
            if attach is None:
                assert config is not None
                self._dir = tempfile.mkdtemp(prefix="dspark-core-")
                name = uuid.uuid4().hex[:8]
                self._bind(f"ipc://{self._dir}/in-{name}", f"ipc://{self._dir}/out-{name}")
                self._start(config, target)
            else:
                input_address, output_address, self.pid = attach
                self._pidfd = os.pidfd_open(self.pid)  # readable once the process ends; ours is not its parent
                self._bind(input_address, output_address)
        except BaseException:  # nothing left behind: the core (it ignores SIGTERM), sockets, context, their directory
            if self.process is not None and self.process.pid is not None:
                self.process.kill()
                self.process.join(5)
            self.ctx.destroy(linger=0)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            if self._pidfd is not None:
                os.close(self._pidfd)
            raise

    def _bind(self, input_address: str, output_address: str) -> None:
        self.input_address, self.output_address = input_address, output_address
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.bind(input_address)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(output_address)

    def _start(self, config: EngineConfig, target: Callable[..., None]) -> None:
        # spawn: the front may hold threads (uvicorn, tokenizers) and, on a GPU machine, must not fork a CUDA context.
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=target,
            args=(config, self.input_address, self.output_address, os.getpid()),
            name="dspark-core",
            daemon=True,
        )
        self.process.start()
        assert self.process.pid is not None
        self.pid = self.process.pid
        logger.info("engine core process started (pid %d)", self.pid)

    @property
    def owns_core(self) -> bool:
        return self.process is not None

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        assert self._pidfd is not None
        return not select.select([self._pidfd], [], [], 0)[0]

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        if self.process is not None:
            return self.process.sentinel
        assert self._pidfd is not None
        return self._pidfd

    def how_it_ended(self) -> str:
        """Once the core has ended: how, for the log and the clients' errors."""
        if self.process is None:  # not our child: its exit code is its launcher's to know (and log)
            return f"(pid {self.pid}) has exited"
        self.process.join(1.0)  # it has ended (its sentinel says so): reap it for its exit code
        code = self.process.exitcode
        return f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"

    def kill(self) -> None:
        """Stop a core nobody can read any more (ours only: an attached front leaves that to the launcher). SIGKILL:
        the core ignores SIGTERM."""
        if self.process is not None:
            self.process.kill()

    def send(self, msg: CoreInput) -> None:
        """Queue an input for the core (ZeroMQ sends it in the background; never blocks the loop). A blocking client
        waits only while the core's end of the socket is not connected yet; once the core has ended, the input is
        dropped (a PUSH socket without a peer would block for ever): the reader learns of the end from the sentinel."""
        data = input_encoder.encode(msg)
        if not self._blocking:
            self.inputs.send(data, copy=False)
            return
        while True:
            try:
                self.inputs.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not self.alive:
                    return
                self.inputs.poll(100, zmq.POLLOUT)

    async def receive(self) -> list[CoreMessage]:
        """Wait for the core's next message, then take every one already waiting: a front that fell behind catches
        up in one go, and its streams coalesce what it missed."""
        messages = [output_decoder.decode(await self.outputs.recv(copy=False))]
        while True:
            pending = self.outputs.recv(zmq.NOBLOCK, copy=False)  # a future already resolved, or failed with Again
            try:
                messages.append(output_decoder.decode(pending.result()))
            except zmq.Again:
                return messages

    def receive_blocking(self, timeout: float | None = None) -> list[CoreMessage] | None:
        """receive() for a blocking client: wait at most timeout seconds (None: for ever) for the core's next message,
        then take every one already waiting. [] if none came in time; None once the core process has ended and every
        message it sent has been read. Ctrl-C interrupts the wait."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.outputs, zmq.POLLIN)
            self._poller.register(self.sentinel, zmq.POLLIN)
        ready = dict(self._poller.poll(None if timeout is None else max(0, round(timeout * 1000))))
        if not ready:
            return []
        # Only the core's end (its sentinel): what it sent just before it exited (a StartFailed, final outputs) may
        # still be with ZeroMQ's I/O thread, on its way to the socket. Read first; the end is reported once none comes.
        if self.outputs not in ready and not self.outputs.poll(round(DRAIN_S * 1000)):
            return None
        messages = []
        while True:
            try:
                messages.append(output_decoder.decode(self.outputs.recv(zmq.NOBLOCK, copy=False)))
            except zmq.Again:
                return messages

    def request_shutdown(self) -> None:
        """Ask the core to stop (its requests are aborted); from the event loop (an asyncio client). Only the core's
        owner does."""
        if self.process is not None and self.process.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the core to stop (after request_shutdown), killing it past the timeout (it ignores SIGTERM); then
        close the sockets. Blocks: run it in a thread from an event loop."""
        process = self.process
        if process is not None and process.is_alive():
            process.join(timeout)
        if process is not None and process.is_alive():
            logger.error("the engine core did not stop within %.1f s; killing it", timeout)
            process.kill()
            process.join(5)
        self.inputs.close(0)
        self.outputs.close(0)
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._pidfd is not None:
            os.close(self._pidfd)
