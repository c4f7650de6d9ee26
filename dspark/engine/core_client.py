"""The front's handle on an engine core running in its own process (engine/core_proc.py): start it, send it inputs,
read its messages, know when it is gone, stop it.

asyncio-first (zmq.asyncio), for the server's event loop: reading blocks nothing and polls nothing, and the process's
sentinel tells the loop the moment the core dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
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


class CoreProcessClient:
    def __init__(self, config: EngineConfig, target: Callable[..., None] = run_core) -> None:
        """Bind the sockets and start the core process; its Ready (or StartFailed) is the first message read.
        target: the process's entry point, run_core's signature (benchmarks put a stub core there)."""
        self.ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="dspark-core-")
        try:
            self._start(config, target)
        except BaseException:  # nothing left behind: sockets, context, the sockets' directory
            self.ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def _start(self, config: EngineConfig, target: Callable[..., None]) -> None:
        name = uuid.uuid4().hex[:8]
        input_address = f"ipc://{self._dir}/in-{name}"
        output_address = f"ipc://{self._dir}/out-{name}"
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.bind(input_address)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(output_address)
        # spawn: the front may hold threads (uvicorn, tokenizers) and, on a GPU machine, must not fork a CUDA context.
        spawn = multiprocessing.get_context("spawn")
        self.process: BaseProcess = spawn.Process(
            target=target,
            args=(config, input_address, output_address, os.getpid()),
            name="dspark-core",
            daemon=True,
        )
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        return self.process.sentinel

    def send(self, msg: CoreInput) -> None:
        """Queue an input for the core (ZeroMQ sends it in the background; never blocks the loop)."""
        self.inputs.send(input_encoder.encode(msg), copy=False)

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

    def request_shutdown(self) -> None:
        """Ask the core to stop (its requests are aborted); from the event loop."""
        if self.process.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the core to stop (after request_shutdown), terminating it past the timeout; then close the
        sockets. Blocks: run it in a thread from the event loop."""
        if self.process.is_alive():
            self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine core did not stop within %.0f s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.inputs.close(0)
        self.outputs.close(0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
