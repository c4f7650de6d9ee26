"""SyncCoreFront: LLM(engine_process=True)'s engine, with its core in another process (engine/core_proc.py), as vLLM
V1's LLMEngine over its multiprocessing core client.

It offers what LLM uses of LLMEngine (add requests, step, abort, get_metrics), blocking, with no thread and no event
loop: step() waits on the core's output socket and its process's sentinel together, so it returns the moment outputs
come, and raises (it never hangs) the moment the core is gone. The front's work on the core's messages (outputs,
stop strings, failures) is CoreFront's (engine/front.py), the server's ProcessEngine's too.

The core stops with shutdown(), when the front is garbage collected, when the interpreter exits, and (the core
watches its parent) when this process is killed.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import multiprocessing.util  # noqa: F401 (its exit hook must be registered before _stop_all)
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core_client import CoreProcessClient
from dspark.engine.core_proc import AbortRequests, StartFailed, run_core
from dspark.engine.front import CoreFront
from dspark.errors import EngineDeadError, EngineError
from dspark.outputs import RequestOutput
from dspark.speculative.cost_model import CostModel

logger = logging.getLogger("dspark")
METRICS_WAIT_S = 5.0  # get_metrics() waits at most this long for the core's counters


class SyncCoreFront(CoreFront):
    _shut_down = "the engine has been shut down (LLM.shutdown())"

    def __init__(
        self,
        config: EngineConfig,
        cost_model: CostModel | None = None,
        core_target: Callable[..., None] = run_core,
        shutdown_timeout: float = 10.0,
    ) -> None:
        """Load the tokenizer, start the core process and wait until it is ready. Raises EngineDeadError, with the
        core's reason, if it fails to start. cost_model: as LLMEngine's (it is sent to the core process)."""
        super().__init__(config)
        self._outputs: list[RequestOutput] = []  # delivered by the latest messages, for step()
        self._error: EngineError | None = None  # a step that failed requests of ours, for step() to raise
        self._ids = itertools.count()
        if cost_model is not None:
            from dspark.engine.core import EngineCore

            core_target = functools.partial(core_target, make_core=functools.partial(EngineCore, cost_model=cost_model))
        client = CoreProcessClient(config, core_target, blocking=True)  # kills the core if it raises once it started
        self._client = client
        # Garbage collection stops the core too (a function, not a method of self: that would keep self alive), and so
        # does the interpreter's exit (_stop_all).
        self._finalizer = weakref.finalize(self, _stop_core, client, shutdown_timeout)
        self._finalizer.atexit = False
        _FRONTS.add(self)
        try:
            while self._input_processor is None:
                self._receive(None)
        except BaseException:  # it failed to start, or Ctrl-C while it loads: nothing of it to keep
            client.kill()  # at once: a loading core reads no Shutdown, and it ignores SIGINT and SIGTERM
            self.shutdown()
            raise

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._stopping

    def shutdown(self) -> None:
        """Stop the core process (its requests are aborted) and wait for it; idempotent."""
        self._stopping = True
        self.output_processor.abort(list(self.output_processor.states))
        self._stopped.clear()
        self._finalizer()
        _FRONTS.discard(self)

    # ---- requests -------------------------------------------------------------------------------------------------

    def add_requests(self, prompts: Sequence[str | list[int]], params: Sequence[SamplingParams]) -> list[str]:
        """One core request per (prompt, params), sent together: all of them, or none if one is refused (its
        ConfigError is raised, as LLMEngine.add_request raises it). Returns their ids."""
        self._check_running()
        self._outputs, self._error = [], None  # what an interrupted call left
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        requests = self._process_inputs(ids, list(prompts), list(params))
        try:
            self._submit(requests)
        except BaseException:
            self._abort(ids)
            raise
        return ids

    def abort_request(self, request_id: str | list[str]) -> None:
        self._abort([request_id] if isinstance(request_id, str) else request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def step(self) -> list[RequestOutput]:
        """Wait for the core's next outputs (every message already waiting is taken too) and return the
        RequestOutputs made of them, as LLMEngine.step() returns a step's. Raises EngineError if a step failed in the
        core (the core aborted the requests in flight), EngineDeadError if the core process is gone."""
        self._check_running()
        self._receive(None)
        outputs, self._outputs = self._outputs, []
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return outputs

    def get_metrics(self) -> dict[str, Any]:
        """LLMEngine.get_metrics()'s counters: the front's, with the core's as of its latest message (they come with
        its outputs; the tokens of a request that a stop string ended, made before the stop reached the core, are
        taken back a moment after). Those of a core that has died are its last ones."""
        try:
            if self.alive and not self._core_metrics:  # none yet: an idle core answers any input with its counters
                assert self._client is not None
                self._client.send(AbortRequests([]))
            if self.alive:
                self._receive(0)  # whatever has come since the last call
            # The counters, and the core's word that it stopped what stop strings ended: waited for, but not for
            # ever (a Ctrl-C between receiving and handling a message can lose that word; the core then sits idle).
            deadline = time.monotonic() + METRICS_WAIT_S
            while self.alive and (not self._core_metrics or self._stopped):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stopped.clear()
                    break
                self._receive(left)
        except EngineDeadError:
            pass
        return self.metrics()

    # ---- the core's messages --------------------------------------------------------------------------------------

    def _receive(self, timeout: float | None) -> None:
        """Handle the core's messages that come within timeout seconds (None: wait for one). Raises EngineDeadError
        if the core failed to start or has ended."""
        assert self._client is not None
        messages = self._client.receive_blocking(timeout)
        if messages is None:  # the core's process ended
            if self.dead is None:  # (a core that failed to start said why before it exited: that reason is kept)
                self.dead = EngineDeadError(f"the engine core process {self._client.how_it_ended()}")
                logger.error("%s", self.dead)
            self.output_processor.abort(list(self.output_processor.states))
            self._stopped.clear()
            raise self.dead
        try:
            self._handle(messages)
        except Exception as e:
            raise self._read_failed(e) from e
        if self.dead is not None:
            raise self.dead

    # The hooks of CoreFront, which turns the core's messages into outputs.

    def _start_failed(self, msg: StartFailed) -> None:
        super()._start_failed(msg)
        logger.error("the engine core failed to start: %s", msg.error)

    def _fail_requests(self, request_ids: list[str], error: EngineError) -> None:
        if any(rid in self.output_processor.states for rid in request_ids):
            self._error = error

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._outputs += outputs


def _stop_core(client: CoreProcessClient, timeout: float) -> None:
    client.request_shutdown()
    client.close(timeout)


# The fronts whose core the interpreter's exit stops: weakly held, so that a front garbage collected (its core stopped
# by its finalizer) or shut down leaves nothing behind, however many LLMs a process makes.
_FRONTS: weakref.WeakSet[SyncCoreFront] = weakref.WeakSet()


def _stop_all() -> None:
    for front in list(_FRONTS):
        front._finalizer()


# Registered once, after multiprocessing's exit hook (imported above), so run before it: that hook joins the core,
# which ignores SIGTERM, and would wait for ever.
atexit.register(_stop_all)
