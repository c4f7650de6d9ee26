"""AsyncEngine: the LLMEngine driven by one background thread, for an asyncio server.

The LLMEngine is not thread-safe, so one thread owns it. Handlers reach it only through a thread-safe command queue
(add a group of requests, abort some, stop), which the thread drains between steps; it loops step() while there is
work and blocks on the queue when there is none. Everything it tells the event loop (a request's outputs, whether an
add was accepted, a failure) goes through loop.call_soon_threadsafe, in order, so handlers only await asyncio queues
and futures, and every piece of per-request bookkeeping on the loop side runs on the loop thread.

Failures are loud: a step that raises is logged with its traceback and fails every request in flight with an
EngineError (the engine aborts them, freeing their blocks), and the thread goes on serving new requests. Should the
thread itself die (an abort that raises after a failed step: the engine is beyond repair), that is logged too, every
waiting handler gets an EngineDeadError and /health turns 503.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dspark.config import SamplingParams
from dspark.engine.input_processor import InputProcessor
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import DSparkError, EngineDeadError, EngineError
from dspark.outputs import RequestOutput

logger = logging.getLogger("dspark.server")


class EngineStartingError(EngineDeadError):
    """The engine is still loading: no request can run yet (a 503 too, with its own words)."""


class RequestGroup:
    """The engine requests of one API call (its prompts x n samples). Iterating yields (index, RequestOutput) in the
    order the engine makes them, until every request has finished; an engine failure is raised from the iteration, as
    is one of these requests that the engine failed alone (finish_reason "error").
    close() aborts whatever has not finished, so a handler calls it in `finally`: a client that went away frees its
    requests' KV blocks at the engine's next step."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._closed = False
        self.unread_finals: list[RequestOutput] = []  # filled by close()
        self._pending: collections.deque[tuple[int, RequestOutput] | BaseException] = collections.deque()

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = self._pending.popleft() if self._pending else await self._queue.get()
        # A reader that fell behind (a slow client) gets one request's queued stream outputs as one: fewer, larger
        # chunks rather than a growing backlog. Only deltas are queued unfinished (streams), so they merge.
        while not isinstance(item, BaseException) and not item[1].finished and not self._queue.empty():
            following = self._queue.get_nowait()
            if isinstance(following, BaseException) or following[0] != item[0]:
                self._pending.append(following)
                break
            item = (item[0], merge_deltas(item[1], following[1]))
        if isinstance(item, BaseException):
            self._unfinished.clear()  # the engine has dropped them all
            raise item
        index, out = item
        if out.finished:
            self._unfinished.discard(index)
            if out.outputs[0].finish_reason == "error":  # the engine failed this request alone; close() aborts the rest
                raise EngineError(f"request {out.request_id} failed in the engine; the server log has the traceback")
        return index, out

    def close(self) -> int:
        """Abort the requests that have not finished; returns how many (0 once closed)."""
        if self._closed:
            return 0
        self._closed = True
        # Outputs the engine delivered that the handler never read: those requests finished, they are not aborted.
        while self._pending or not self._queue.empty():
            item = self._pending.popleft() if self._pending else self._queue.get_nowait()
            if isinstance(item, BaseException):
                break
            index, out = item
            if out.finished and index in self._unfinished:
                self._unfinished.discard(index)
                self.unread_finals.append(out)
        num_aborted = len(self._unfinished)
        if num_aborted:
            self._engine.abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()
        return num_aborted


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one: text, tokens and logprobs joined; the later state kept."""
    a, b = first.outputs[0], then.outputs[0]
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    merged = dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
    return dataclasses.replace(
        then,
        outputs=[merged],
        new_text=first.new_text + then.new_text,
        new_token_ids=first.new_token_ids + then.new_token_ids,
    )


@dataclass
class _Add:
    group: RequestGroup
    prompts: list[list[int]]
    params: list[SamplingParams]
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # encoding happens on the loop thread; the engine thread only decodes
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.num_step_errors = 0
        self._commands: queue.SimpleQueue[_Add | _Abort | object] = queue.SimpleQueue()
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # engine thread only: request id -> (group, index)
        self._groups: set[RequestGroup] = set()  # loop thread only: groups added and not yet released
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self._ids = itertools.count()
        self._metrics: dict[str, Any] = engine.get_metrics()
        self._snapshot_failed = False

    # ---- loop side ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def starting(self) -> bool:
        return False  # the engine was built before the app

    @property
    def model(self) -> str:
        return self.engine.config.model

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    def metrics(self) -> dict[str, Any]:
        """get_metrics() as of the last step (a snapshot the engine thread takes, so reading it never races a step)."""
        return self._metrics

    async def add(self, prompts: list[list[int]], params: list[SamplingParams], prefix: str) -> RequestGroup:
        """Add one engine request per (prompt, params): all of them or, if the engine refuses one (its ConfigError is
        raised here), none. Returns once the engine has them, so a refusal is known before a response starts."""
        if self.dead is not None or self._stopping or self._loop is None:
            raise EngineDeadError("the engine is not running" + (f" (it died: {self.dead!r})" if self.dead else ""))
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        group = RequestGroup(self, ids)
        accepted = self._loop.create_future()
        self._groups.add(group)
        self._commands.put(_Add(group, prompts, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            group.close()  # the client left while the engine was busy: abort what it may have added since
            self._groups.discard(group)
            raise
        except BaseException:
            self._groups.discard(group)
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        if not self._stopping and self.dead is None:
            self._commands.put(_Abort(request_ids))

    def release(self, group: RequestGroup) -> int:
        """The handler is done with the group: abort what is left of it (returns how many) and stop tracking it."""
        self._groups.discard(group)
        return group.close()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (requests in flight are aborted and fail); idempotent."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _fail_all(self, error: BaseException) -> None:
        """On the loop: fail every group still waiting, and every add the thread never got to."""
        for group in list(self._groups):
            group._queue.put_nowait(error)
        self._groups.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add) and not cmd.accepted.done():
                cmd.accepted.set_exception(error)

    def _deliver(self, items: list[tuple[RequestGroup, tuple[int, RequestOutput] | BaseException]]) -> None:
        for group, item in items:
            group._queue.put_nowait(item)

    # ---- engine thread --------------------------------------------------------------------------------------------

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        try:
            while self._handle(self._next_commands()):
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._snapshot()  # adds refused or aborts taken while idle
            self.engine.abort_request(list(self._routes))
            self._routes.clear()
        except BaseException as e:
            logger.critical("the engine thread died; the server can run no more requests", exc_info=True)
            self.dead = e
            self._call_soon(self._fail_all, EngineDeadError(f"the engine thread died: {type(e).__name__}: {e}"))

    def _snapshot(self) -> None:
        try:
            self._metrics = self.engine.get_metrics()
        except Exception:  # /metrics goes stale rather than the server going down; said once, not every step
            if not self._snapshot_failed:
                logger.exception("engine.get_metrics() failed; /metrics keeps the last snapshot")
            self._snapshot_failed = True

    def _next_commands(self) -> list[object]:
        """Block for a command while there is no work; else take whatever has arrived, without waiting."""
        commands = [] if self.engine.has_unfinished_requests() else [self._commands.get()]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, commands: list[object]) -> bool:
        for cmd in commands:
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                for rid in cmd.request_ids:
                    self._routes.pop(rid, None)
                self.engine.abort_request(cmd.request_ids)
        return True

    def _add(self, cmd: _Add) -> None:
        added: list[str] = []
        error: BaseException | None = None
        try:
            for i, (rid, prompt, params) in enumerate(zip(cmd.group.request_ids, cmd.prompts, cmd.params, strict=True)):
                self.engine.add_request(prompt, params, rid)
                added.append(rid)
                self._routes[rid] = (cmd.group, i)
        except Exception as e:  # a ConfigError the handler turns into a 400; anything else is a 500 there
            if not isinstance(e, DSparkError):
                logger.exception("adding a request failed")
            self.engine.abort_request(added)
            for rid in added:
                self._routes.pop(rid, None)
            error = e
        self._call_soon(_resolve, cmd.accepted, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_step_errors += 1
            logger.exception("an engine step failed; failing the %d requests in flight", len(self._routes))
            error = EngineError(f"the engine step failed: {type(e).__name__}: {e}")
            failed = list(self._routes)
            groups = {group for group, _ in self._routes.values()}
            self._routes.clear()
            self.engine.abort_request(failed)  # frees their blocks; if this raises too, the thread dies (loudly)
            self._snapshot()
            self._call_soon(self._deliver, [(g, error) for g in groups])
            return
        items: list[tuple[RequestGroup, tuple[int, RequestOutput] | BaseException]] = []
        for out in outputs:
            route = self._routes.pop(out.request_id, None) if out.finished else self._routes.get(out.request_id)
            if route is not None:  # None: aborted while this step ran
                items.append((route[0], (route[1], out)))
        # NOTE: the snapshot first, so that a client that has its final output reads /metrics with it counted.
        self._snapshot()
        if items:
            self._call_soon(self._deliver, items)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # cancelled: the handler has already given up on it
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
