"""CoreFront: what a front does for an engine core in another process (engine/core_proc.py), without the I/O.

A front checks and tokenizes the requests it adds (InputProcessor), and turns the core's messages into RequestOutputs
(OutputProcessor: detokenization, stop strings): Ready makes it ready, StartFailed dead, StepOutputs outputs (several
steps' news of a request merged into one, so a front that fell behind catches up in one go) and StepFailed failed
requests. A request it ends (a stop string) runs on in the core until the stop reaches it: the tokens the core makes
meanwhile are dropped and taken back from the core's generated-token count, until the core says it has stopped it.

Reading the core and handing outputs over is each front's own, through hooks: the server's ProcessEngine (asyncio,
server/process_engine.py) routes them to the handlers' request groups; the LLM's SyncCoreFront (engine/sync_front.py)
blocks on the core until a generate() call's requests have finished.
"""

from __future__ import annotations

import logging
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
)
from dspark.engine.input_processor import InputProcessor
from dspark.engine.messages import EngineCoreOutput, EngineCoreRequest
from dspark.engine.output_processor import OutputProcessor
from dspark.errors import EngineDeadError, EngineError
from dspark.models.registry import resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.outputs import RequestOutput


class CoreFront:
    _log = logging.getLogger("dspark")  # a subclass logs where its module does

    _shut_down = "the engine has been shut down"  # what a request added after shutdown is told

    def __init__(self, config: EngineConfig) -> None:
        """Resolve the model (downloading it where needed) and load its tokenizer: the core comes later."""
        self.config = config
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._input_processor: InputProcessor | None = None  # once the core is ready
        self.max_model_len = 0  # known once the core is ready
        self.vocab_size = 0
        self.core_pid: int | None = None
        self.num_step_errors = 0
        self.dead: BaseException | None = None
        self._stopping = False
        self._client: CoreProcessClient | None = None  # sends to the core; the subclass makes it
        # Requests this front ended (a stop string, a fault in their output) that the core may still be running: the
        # tokens it sends for them until it has stopped them are taken back (not generated tokens, as vLLM counts).
        self._stopped: dict[str, None] = {}
        self._core_metrics: dict[str, Any] = {}
        self._num_prompt_tokens = 0

    # ---- hooks ----------------------------------------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand over the RequestOutputs made of the core's latest messages (in the order the core made them)."""
        raise NotImplementedError

    def _fail_requests(self, request_ids: list[str], error: EngineError) -> None:
        """A step failed in the core, which aborted these requests (called before the front forgets them)."""
        raise NotImplementedError

    def _became_ready(self, msg: Ready) -> None:
        """The core is ready: requests can be added. Extended by subclasses (logs, waiters)."""
        info = msg.info
        self._input_processor = InputProcessor(self.tokenizer, info, self.config.seed)
        self.max_model_len, self.vocab_size, self.core_pid = info.max_model_len, info.vocab_size, msg.pid

    def _start_failed(self, msg: StartFailed) -> None:
        """The core could not start (its process exits). Extended by subclasses (logs, waiters)."""
        self.dead = EngineDeadError(f"the engine failed to start: {msg.error}")

    # ---- requests -------------------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """The front's counters with the core's latest snapshot (it comes with the core's outputs)."""
        return {**self.front_metrics(), **self._core_metrics}

    def front_metrics(self) -> dict[str, int]:
        """The counters this front keeps (requests it saw end, prompt tokens it added): several fronts' add up."""
        return {**self.output_processor.stats, "num_prompt_tokens": self._num_prompt_tokens}

    def _check_running(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if self._stopping:
            raise EngineDeadError(self._shut_down)

    def _process_inputs(
        self, request_ids: list[str], prompts: list[str | list[int]] | list[list[int]], params: list[SamplingParams]
    ) -> list[tuple[EngineCoreRequest, str | None]]:
        """The core's requests (and the prompts' text): all of them, or the first refusal's ConfigError is raised with
        nothing added."""
        processor = self._input_processor
        assert processor is not None, "the core is not ready"
        return [processor.process(rid, prompt, p) for rid, prompt, p in zip(request_ids, prompts, params, strict=True)]

    def _submit(self, requests: list[tuple[EngineCoreRequest, str | None]], front: int = 0) -> None:
        """Track the processed requests' outputs and send them to the core, in one message."""
        for request, text in requests:
            self.output_processor.add(
                request.request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time
            )
            self._num_prompt_tokens += len(request.prompt_token_ids)
        assert self._client is not None
        self._client.send(AddRequests([r for r, _ in requests], front))

    def _abort(self, request_ids: list[str]) -> None:
        """Forget these requests, and have the core abort those that had not finished."""
        aborted = self.output_processor.abort(request_ids)
        if aborted and self._client is not None and self.dead is None and not self._stopping:
            self._client.send(AbortRequests(aborted))

    # ---- the core's messages --------------------------------------------------------------------------------------

    def _read_failed(self, error: BaseException) -> EngineDeadError:
        """A message the front could not read (or handle): nothing the core says can be trusted any more. The front is
        dead, and the core stopped (nobody will read what it makes); returns the error."""
        self._log.critical("reading the engine core's messages failed", exc_info=error)
        self.dead = EngineDeadError(f"the front failed to read the engine core: {type(error).__name__}: {error}")
        if self._client is not None:
            self._client.kill()
        return self.dead

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
                self._start_failed(msg)
        self._deliver_outputs(outputs)

    def _step_failed(self, msg: StepFailed) -> None:
        self.num_step_errors += 1
        if msg.metrics is not None:
            self._core_metrics = msg.metrics
        self._fail_requests(msg.request_ids, EngineError(msg.error))
        self.output_processor.abort(msg.request_ids)  # counted as aborted, as the in-process engine counts them
        for rid in msg.request_ids:
            self._stopped.pop(rid, None)  # aborted by the core: no answer to its stop will come

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
        self._deliver(done.outputs)

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
        if out.first_scheduled_time is None and out.new_logprobs is None:  # plain (a token alone): seen's counters stay
            seen.new_token_ids = seen.new_token_ids + out.new_token_ids
            # The core's plain outputs never finish a request, but one that did (benchmarks/serve_front.py's stub
            # core's) must not lose its finish, or its stream stays open for ever
            if out.finish_reason is not None:
                seen.finish_reason, seen.stop_reason = out.finish_reason, out.stop_reason
                seen.finished_time = out.finished_time
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
