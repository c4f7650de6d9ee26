"""ProcessEngine: the server's engine with its core in another process (engine/core_proc.py), as vLLM's AsyncLLM.

The API process keeps the front (engine/front.py's CoreFront, shared with LLM(engine_process=True)): tokenization and
prompt checks (InputProcessor) when a request arrives, and detokenization, stop strings and RequestOutput
(OutputProcessor) when the core's outputs do. Everything runs on the event loop: no thread, no lock, no polling. One
task reads the core's messages; when it fell behind (a burst of streams to write), it takes every waiting message at
once and merges each request's tokens, so a slow front sends fewer, larger chunks instead of queueing. A request the
front ends (a stop string) runs on in the core until the stop reaches it: the tokens it makes meanwhile are dropped and
taken back from the core's generated-token count, until the core says it has stopped the request.

Handlers use it as they use AsyncEngine (add, abort, release, metrics, alive): RequestGroup is shared. The server
answers 503 until the core is ready and after it is gone; if the core process dies, every waiting handler gets an
EngineDeadError at once (streams end with an error event) and the log says how it ended.

One of several API servers (`--api-server-count`, server/api_servers.py) is given a FrontSlot: it attaches to the core
the launcher started instead of starting one, and its requests carry its index so that their outputs come back to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core_client import DRAIN_S, CoreProcessClient
from dspark.engine.core_proc import Ready, StartFailed, run_core
from dspark.engine.front import CoreFront
from dspark.engine.input_processor import InputProcessor
from dspark.errors import EngineError
from dspark.outputs import RequestOutput
from dspark.server.async_engine import EngineDeadError, EngineStartingError, RequestGroup

logger = logging.getLogger("dspark.server")


@dataclass(frozen=True)
class FrontSlot:
    """An API server's place among several on one engine core."""

    index: int
    count: int
    input_address: str  # the sockets this front binds (the core connects to them)
    output_address: str
    core_pid: int
    stats_dir: str  # where the fronts share their counters (server/metrics.py)


class ProcessEngine(CoreFront):
    _log = logger
    _shut_down = "the server is shutting down"

    def __init__(
        self, config: EngineConfig, core_target: Callable[..., None] = run_core, slot: FrontSlot | None = None
    ) -> None:
        """Resolve the model (downloading it where needed) and load its tokenizer; start() starts the core (the
        process runs core_target: engine/core_proc.py's run_core, or a benchmark's stub), or attaches to the core of
        `slot` when this is one of several API servers."""
        super().__init__(config)
        self.slot = slot
        self._core_target = core_target
        self.model = config.model
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None
        self._started_at = 0.0
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # request id -> (group, index)
        self._groups: set[RequestGroup] = set()  # added and not yet released
        self._ids = itertools.count()

    # ---- life -----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the core process; call from the event loop. The server answers 503 until the core says it is ready."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._started_at = time.monotonic()
        slot = self.slot
        attach = None if slot is None else (slot.input_address, slot.output_address, slot.core_pid)
        self._client = CoreProcessClient(self.config, self._core_target, attach)
        self._loop.add_reader(self._client.sentinel, self._core_exited)
        self._reader = self._loop.create_task(self._read(), name="dspark-core-reader")

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until the core is ready; raises EngineDeadError if it failed to start or died."""
        assert self._ready is not None, "start() first"
        await asyncio.wait_for(self._ready.wait(), timeout)
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    @property
    def alive(self) -> bool:
        return self._input_processor is not None and self.dead is None and not self._stopping

    @property
    def starting(self) -> bool:
        return self._input_processor is None and self.dead is None and not self._stopping

    @property
    def input_processor(self) -> InputProcessor:
        self._check_running()
        assert self._input_processor is not None
        return self._input_processor

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (requests in flight are aborted and fail); idempotent."""
        if self._client is None or self._stopping:
            return
        self._stopping = True
        assert self._loop is not None
        self._loop.remove_reader(self._client.sentinel)
        if self._reader is not None:
            self._reader.cancel()
        self._client.request_shutdown()  # on the loop: the socket is the loop's
        await asyncio.to_thread(self._client.close, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _check_running(self) -> None:
        super()._check_running()
        if self._input_processor is None:
            waited = time.monotonic() - self._started_at
            raise EngineStartingError(f"the engine is starting (loading the model, {waited:.0f} s so far); retry soon")

    def _core_exited(self) -> None:
        assert self._loop is not None and self._client is not None
        self._loop.remove_reader(self._client.sentinel)
        # What the core sent just before it exited (a StartFailed and its reason, final outputs) may still be on its
        # way through ZeroMQ: the reader gets DRAIN_S to deliver it before the core is declared dead.
        self._loop.call_later(DRAIN_S, self._declare_dead)

    def _declare_dead(self) -> None:
        assert self._client is not None
        if self._stopping:
            return
        how = self._client.how_it_ended()
        if self.dead is not None:  # it said why before it exited (StartFailed): keep that reason
            return
        self.dead = EngineDeadError(f"the engine core process {how}")
        logger.critical("the engine core process %s; the server can run no more requests", how)
        self._fail_all(self.dead)
        if self._ready is not None:
            self._ready.set()

    def _fail_all(self, error: BaseException) -> None:
        for group in list(self._groups):
            group._queue.put_nowait(error)
        self._groups.clear()
        self._routes.clear()
        self._stopped.clear()

    # ---- requests -------------------------------------------------------------------------------------------------

    async def add(self, prompts: list[list[int]], params: list[SamplingParams], prefix: str) -> RequestGroup:
        """One core request per (prompt, params): all of them, or none if one is refused (its ConfigError is raised)."""
        self._check_running()
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        requests = self._process_inputs(ids, prompts, params)
        group = RequestGroup(self, ids)
        for i, rid in enumerate(ids):
            self._routes[rid] = (group, i)
        self._groups.add(group)
        self._submit(requests, 0 if self.slot is None else self.slot.index)
        return group

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._routes.pop(rid, None)
        self._abort(request_ids)

    def release(self, group: RequestGroup) -> int:
        """The handler is done with the group: abort what is left of it (returns how many) and stop tracking it."""
        self._groups.discard(group)
        return group.close()

    # ---- the core's messages --------------------------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._client is not None
        try:
            while True:
                self._handle(await self._client.receive())
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fail_all(self._read_failed(e))
            if self.slot is not None:
                # One of several API servers: the core is shared and keeps sending here. This one stops (the launcher
                # then stops the server), rather than answer 503 while the core's queue to it fills.
                os.kill(os.getpid(), signal.SIGINT)

    # The hooks of CoreFront, which turns the core's messages into outputs.

    def _start_failed(self, msg: StartFailed) -> None:
        super()._start_failed(msg)
        logger.critical("the engine core failed to start: %s", msg.error)
        assert self._ready is not None
        self._ready.set()

    def _became_ready(self, msg: Ready) -> None:
        super()._became_ready(msg)
        info = msg.info
        logger.info(
            "engine ready in %.1f s: %s on %s (%s), max_model_len %d",
            time.monotonic() - self._started_at,
            self.model,
            info.device,
            info.dtype,
            info.max_model_len,
        )
        assert self._ready is not None
        self._ready.set()

    def _fail_requests(self, request_ids: list[str], error: EngineError) -> None:
        groups = set()
        for rid in request_ids:
            route = self._routes.pop(rid, None)
            if route is not None:
                groups.add(route[0])
        for group in groups:
            group._queue.put_nowait(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        routes = self._routes
        for out in outputs:
            route = routes.pop(out.request_id, None) if out.finished else routes.get(out.request_id)
            if route is not None:
                route[0]._queue.put_nowait((route[1], out))
