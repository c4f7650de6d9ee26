"""ProcessEngine: the server's engine with its core in another process (engine/core_proc.py), as vLLM's AsyncLLM.

The API process keeps the front: tokenization and prompt checks (InputProcessor) when a request arrives, and
detokenization, stop strings and RequestOutput (OutputProcessor) when the core's outputs do. Everything runs on the
event loop: no thread, no lock, no polling. One task reads the core's messages; when it fell behind (a burst of
streams to write), it takes every waiting message at once and merges each request's tokens, so a slow front sends
fewer, larger chunks instead of queueing. A request the front ends (a stop string) runs on in the core until the stop
reaches it: the tokens it makes meanwhile are dropped and taken back from the core's generated-token count, until the
core says it has stopped the request.

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
from typing import Any

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core_client import CoreProcessClient
from dspark.engine.core_proc import (
    AbortRequests,
    AddRequests,
    CoreMessage,
    Ready,
    StartFailed,
    StepFailed,
    StepOutputs,
    StopRequests,
    run_core,
)
from dspark.engine.input_processor import InputProcessor
from dspark.engine.messages import EngineCoreOutput, EngineCoreRequest
from dspark.engine.output_processor import OutputProcessor
from dspark.models.registry import resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.server.async_engine import EngineDeadError, EngineError, EngineStartingError, RequestGroup

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


class ProcessEngine:
    def __init__(
        self, config: EngineConfig, core_target: Callable[..., None] = run_core, slot: FrontSlot | None = None
    ) -> None:
        """Resolve the model (downloading it where needed) and load its tokenizer; start() starts the core (the
        process runs core_target: engine/core_proc.py's run_core, or a benchmark's stub), or attaches to the core of
        `slot` when this is one of several API servers."""
        self.config = config
        self.slot = slot
        self._core_target = core_target
        self.model = config.model
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._input_processor: InputProcessor | None = None
        self.max_model_len = 0  # known once the core is ready
        self.vocab_size = 0
        self.num_step_errors = 0
        self.dead: BaseException | None = None
        self.core_pid: int | None = None
        self._client: CoreProcessClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None
        self._started_at = 0.0
        self._stopping = False
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # request id -> (group, index)
        self._groups: set[RequestGroup] = set()  # added and not yet released
        # Requests this front ended (a stop string, a fault in their output) that the core may still be running: the
        # tokens it sends for them until it has stopped them are taken back (not generated tokens, as vLLM counts).
        self._stopped: dict[str, None] = {}
        self._ids = itertools.count()
        self._core_metrics: dict[str, Any] = {}
        self._num_prompt_tokens = 0

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
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        if self._input_processor is None:
            waited = time.monotonic() - self._started_at
            raise EngineStartingError(f"the engine is starting (loading the model, {waited:.0f} s so far); retry soon")

    def _core_exited(self) -> None:
        assert self._loop is not None and self._client is not None
        self._loop.remove_reader(self._client.sentinel)
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

    def metrics(self) -> dict[str, Any]:
        """The front's counters with the core's latest snapshot (it comes with the core's outputs)."""
        return {**self.front_metrics(), **self._core_metrics}

    def front_metrics(self) -> dict[str, int]:
        """The counters this front keeps (requests it saw end, prompt tokens it added): several fronts' add up."""
        return {**self.output_processor.stats, "num_prompt_tokens": self._num_prompt_tokens}

    async def add(self, prompts: list[list[int]], params: list[SamplingParams], prefix: str) -> RequestGroup:
        """One core request per (prompt, params): all of them, or none if one is refused (its ConfigError is raised)."""
        self._check_running()
        processor = self.input_processor
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        requests: list[tuple[EngineCoreRequest, str | None]] = [
            processor.process(rid, prompt, p) for rid, prompt, p in zip(ids, prompts, params, strict=True)
        ]
        group = RequestGroup(self, ids)
        for i, (request, text) in enumerate(requests):
            self.output_processor.add(
                request.request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time
            )
            self._routes[request.request_id] = (group, i)
            self._num_prompt_tokens += len(request.prompt_token_ids)
        self._groups.add(group)
        assert self._client is not None
        self._client.send(AddRequests([r for r, _ in requests], 0 if self.slot is None else self.slot.index))
        return group

    def abort(self, request_ids: list[str]) -> None:
        aborted = self.output_processor.abort(request_ids)
        for rid in request_ids:
            self._routes.pop(rid, None)
        if aborted and self._client is not None and self.dead is None and not self._stopping:
            self._client.send(AbortRequests(aborted))

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
        except BaseException as e:  # a message the front cannot read: nothing it says can be trusted any more
            logger.critical("reading the engine core's messages failed", exc_info=True)
            self.dead = EngineDeadError(f"the front failed to read the engine core: {type(e).__name__}: {e}")
            self._fail_all(self.dead)
            self._client.terminate()  # nobody will read what it makes
            if self.slot is not None:
                # One of several API servers: the core is shared and keeps sending here. This one stops (the launcher
                # then stops the server), rather than answer 503 while the core's queue to it fills.
                os.kill(os.getpid(), signal.SIGINT)

    def _handle(self, messages: list[CoreMessage]) -> None:
        outputs: list[EngineCoreOutput] = []
        for msg in messages:
            if isinstance(msg, StepOutputs):
                outputs += msg.outputs
                if msg.metrics is not None:
                    self._core_metrics = msg.metrics
            elif isinstance(msg, StepFailed):
                self._deliver_outputs(outputs)  # what earlier steps made, first
                outputs = []
                self._step_failed(msg)
            elif isinstance(msg, Ready):
                self._became_ready(msg)
            elif isinstance(msg, StartFailed):
                self.dead = EngineDeadError(f"the engine failed to start: {msg.error}")
                logger.critical("the engine core failed to start: %s", msg.error)
                assert self._ready is not None
                self._ready.set()
        self._deliver_outputs(outputs)

    def _became_ready(self, msg: Ready) -> None:
        info = msg.info
        self._input_processor = InputProcessor(self.tokenizer, info, self.config.seed)
        self.max_model_len, self.vocab_size, self.core_pid = info.max_model_len, info.vocab_size, msg.pid
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

    def _step_failed(self, msg: StepFailed) -> None:
        self.num_step_errors += 1
        if msg.metrics is not None:
            self._core_metrics = msg.metrics
        error = EngineError(msg.error)
        groups = set()
        self.output_processor.abort(msg.request_ids)  # counted as aborted, as the in-process engine counts them
        for rid in msg.request_ids:
            self._stopped.pop(rid, None)  # aborted by the core: no answer to its stop will come
            route = self._routes.pop(rid, None)
            if route is not None:
                groups.add(route[0])
        for group in groups:
            group._queue.put_nowait(error)

    def _deliver_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if self._stopped:
            outputs = self._take_back(outputs)
        if not outputs:
            return
        merged = coalesce(outputs)
        done = self.output_processor.process(merged)
        if done.stopped and self._client is not None:
            self._client.send(StopRequests(done.stopped))
            # Those the core had not finished go on there until the stop reaches it.
            ended = {o.request_id for o in merged if o.finish_reason is not None}
            self._stopped.update((rid, None) for rid, _ in done.stopped if rid not in ended)
        routes = self._routes
        for out in done.outputs:
            route = routes.pop(out.request_id, None) if out.finished else routes.get(out.request_id)
            if route is not None:
                route[0]._queue.put_nowait((route[1], out))

    def _take_back(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs of requests this front has not stopped. The tokens of the others, made after their stop, are
        taken back from the core's count; an output that finishes one (the core's own end, or its answer to the stop)
        is the last to come for it."""
        stopped = self._stopped
        kept: list[EngineCoreOutput] = []
        late: dict[str, int] = {}
        for out in outputs:
            rid = out.request_id
            if rid not in stopped:
                kept.append(out)
                continue
            if out.new_token_ids:
                late[rid] = late.get(rid, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                del stopped[rid]
        if late and self._client is not None:
            self._client.send(StopRequests(list(late.items())))
        return kept


def coalesce(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One output per request: several steps' news merged in order (tokens and logprobs appended, the latest
    counters and finish kept)."""
    merged: dict[str, EngineCoreOutput] = {}
    for out in outputs:
        seen = merged.get(out.request_id)
        if seen is None:
            merged[out.request_id] = out
            continue
        if out.first_scheduled_time is None and out.new_logprobs is None:  # plain: seen keeps its counters
            seen.new_token_ids = seen.new_token_ids + out.new_token_ids
            continue
        first_token_time = seen.first_token_time or out.first_token_time
        first_scheduled_time = seen.first_scheduled_time or out.first_scheduled_time
        tokens = seen.new_token_ids + out.new_token_ids
        logprobs = None
        if seen.new_logprobs is not None or out.new_logprobs is not None:  # an output without tokens may carry none
            logprobs = (seen.new_logprobs or []) + (out.new_logprobs or [])
        out.new_token_ids, out.new_logprobs = tokens, logprobs
        out.first_token_time, out.first_scheduled_time = first_token_time, first_scheduled_time
        out.prompt_logprobs = seen.prompt_logprobs if seen.prompt_logprobs is not None else out.prompt_logprobs
        merged[out.request_id] = out
    return list(merged.values()) if len(merged) < len(outputs) else outputs
