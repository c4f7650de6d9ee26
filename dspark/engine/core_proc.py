"""The engine core in its own process, as vLLM's EngineCoreProc: the step loop never waits on HTTP, tokenization or
detokenization, and the front's Python does not share its interpreter lock.

The front binds two ZeroMQ sockets and starts this process, which connects to them: inputs arrive on a PULL socket
(requests, aborts, stops, shutdown) and outputs leave on a PUSH socket, one message per step with every request's
news from it. Messages are msgspec msgpack structs (engine/messages.py): token ids only, no pickles.

With several API servers (`dspark serve --api-server-count N`, server/api_servers.py) the core's PULL socket connects
to every front's input socket (and the launcher's), and it has one PUSH socket per front: a request's outputs go to
the front that added it (AddRequests.front), the core's counters and Ready to all of them.

The loop blocks on its input socket when it has nothing to run (an idle core uses no CPU), and otherwise takes
whatever has arrived between steps, so an abort reaches the scheduler within one step. A step that raises fails the
requests it ran (their blocks are freed) and the core goes on serving. The core exits when the front says so, or
when the front's process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from dspark.config import EngineConfig
from dspark.engine.messages import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger("dspark")

METRICS_EVERY_S = 0.1  # the core's counters ride with a step's outputs at most this often (and whenever one finishes)


# ---- front -> core ------------------------------------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineCoreRequest]
    front: int = 0  # which API server's output socket their outputs go to


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopRequests(msgspec.Struct, tag=True, array_like=True):
    """The front ended these (a stop string, a fault in its output): (request id, how many of the last tokens it
    was sent it dropped). Sent again for tokens of such a request that reach the front later (those the core made
    before the stop reached it): none of them is counted as generated.

    The core answers a stop that finds the request still running with an output that finishes it (no tokens,
    finish_reason "stop"): nothing more comes for it, and the front forgets it."""

    stops: list[tuple[str, int]]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | StopRequests | Shutdown


# ---- core -> front ------------------------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineCoreInfo
    pid: int


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    error: str  # the exception, one line; the core's log has the traceback


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[EngineCoreOutput]
    metrics: dict[str, Any] | None = None  # EngineCore.get_metrics(), when due


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A step raised: these requests were aborted in the core (blocks freed) and must fail at the front."""

    request_ids: list[str]
    error: str
    metrics: dict[str, Any] | None = None


CoreMessage = Ready | StartFailed | StepOutputs | StepFailed

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)


def run_core(
    config: EngineConfig,
    input_addresses: str | list[str],
    output_addresses: str | list[str],
    parent_pid: int,
    make_core: Callable[[EngineConfig], Any] | None = None,
) -> None:
    """The process's entry point (multiprocessing, spawn): inputs from every input address, outputs to front i at
    output address i. The core exits with its parent (the front, or the launcher of several). make_core: builds
    the core (EngineCore; a benchmark's stub, with EngineCore's interface)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (core): %(message)s")
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the front stops the core (a Shutdown
    # message, after its graceful drain), so the core must not die under the streams still finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    for address in [input_addresses] if isinstance(input_addresses, str) else input_addresses:
        inputs.connect(address)
    outputs = []
    for address in [output_addresses] if isinstance(output_addresses, str) else output_addresses:
        outputs.append(ctx.socket(zmq.PUSH))
        outputs[-1].setsockopt(zmq.LINGER, 2000)
        outputs[-1].connect(address)  # connected (not bound): a message waits for a front not yet up
    try:
        if make_core is None:
            from dspark.engine.core import EngineCore

            make_core = EngineCore
        core = make_core(config)
    except BaseException as e:
        logger.critical("the engine core failed to start", exc_info=True)
        failed = output_encoder.encode(StartFailed(f"{type(e).__name__}: {e}"))
        for socket in outputs:
            socket.send(failed)
        _close(ctx, inputs, outputs)
        raise SystemExit(1) from None
    ready = output_encoder.encode(Ready(core.info, os.getpid()))
    for socket in outputs:
        socket.send(ready)
    try:
        CoreLoop(core, inputs, outputs).run()
    finally:
        _close(ctx, inputs, outputs)


def _close(ctx: zmq.Context, inputs: zmq.Socket, outputs: list[zmq.Socket]) -> None:
    inputs.close(linger=0)  # every socket closed, or term() waits for ever
    for socket in outputs:
        socket.close()
    ctx.term()


class CoreLoop:
    def __init__(self, core: Any, inputs: zmq.Socket, outputs: zmq.Socket | list[zmq.Socket]) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs if isinstance(outputs, list) else [outputs]
        self._metrics_at = 0.0
        self._front_of: dict[str, int] = {}  # request id -> the front it came from (kept with several fronts)
        self._stopped: list[EngineCoreOutput] = []  # the answers to stops of running requests, sent with the next step

    def run(self) -> None:
        while self._handle(self._receive(block=not self.core.has_unfinished_requests())):
            self._turn()

    def _turn(self) -> None:
        """A step, or (nothing to run) the news of aborts and stops taken while idle."""
        if self.core.has_unfinished_requests():
            self._step()
        else:
            self._send(self._take_stopped(), self._metrics(force=True))

    def _receive(self, block: bool) -> list[CoreInput]:
        """Block for a message while there is no work; then take whatever has arrived, without waiting."""
        messages = [input_decoder.decode(self.inputs.recv())] if block else []
        while True:
            try:
                messages.append(input_decoder.decode(self.inputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def _handle(self, messages: list[CoreInput]) -> bool:
        core = self.core
        for msg in messages:
            if isinstance(msg, AddRequests):
                for request in msg.requests:
                    core.add_request(request)
                if len(self.outputs) > 1:
                    self._front_of.update((r.request_id, msg.front) for r in msg.requests)
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
                self._forget(msg.request_ids)
            elif isinstance(msg, StopRequests):
                # The front forgets a request it stopped once told that no more of its tokens are coming: an output
                # that finishes it, the core's own (it ended before the stop came) or this answer. Its front is
                # forgotten when the answer is sent; a request that ended before has been forgotten already.
                running = [rid for rid, _ in msg.stops if rid in core.requests]
                core.stop_requests(msg.stops)
                self._stopped += [EngineCoreOutput(rid, [], finish_reason="stop") for rid in running]
            else:
                core.abort_requests(list(core.requests))
                return False
        return True

    def _step(self) -> None:
        core = self.core
        stopped = self._take_stopped()
        try:
            outs = core.step()
            # The front processes the outputs in its own process, concurrently: the step is over for the timer.
            core.end_step()
        except Exception as e:
            if stopped:
                self._send(stopped, None)
            logger.exception("an engine step failed; failing the %d requests in flight", len(core.requests))
            failed = list(core.requests)
            core.abort_requests(failed)  # frees their blocks; if this raises too, the process dies (loudly)
            error = f"the engine step failed: {type(e).__name__}: {e}"
            self._forget(failed)
            failure = output_encoder.encode(StepFailed(failed, error, self._metrics(force=True)))
            for socket in self.outputs:  # every front: each fails those it has, and counts the failed step
                socket.send(failure)
            return
        if stopped:
            outs = stopped + outs
        finished = any(o.finish_reason is not None for o in outs)
        self._send(outs, self._metrics(force=finished))

    def _take_stopped(self) -> list[EngineCoreOutput]:
        stopped, self._stopped = self._stopped, []
        return stopped

    def _forget(self, request_ids: list[str]) -> None:
        if self._front_of:
            for rid in request_ids:
                self._front_of.pop(rid, None)

    def _metrics(self, force: bool) -> dict[str, Any] | None:
        now = time.monotonic()
        if not force and now - self._metrics_at < METRICS_EVERY_S:
            return None
        self._metrics_at = now
        return self.core.get_metrics()

    def _send(self, outs: list[EngineCoreOutput], metrics: dict[str, Any] | None) -> None:
        """Each front its requests' outputs; the counters, when due, to every front. No empty message every step."""
        if len(self.outputs) == 1:
            if outs or metrics is not None:
                self.outputs[0].send(output_encoder.encode(StepOutputs(outs, metrics)))
            return
        shares: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        front_of = self._front_of
        for out in outs:
            front = (
                front_of.pop(out.request_id, 0) if out.finish_reason is not None else front_of.get(out.request_id, 0)
            )
            shares[front].append(out)
        for socket, share in zip(self.outputs, shares, strict=True):
            if share or metrics is not None:
                socket.send(output_encoder.encode(StepOutputs(share, metrics)))


def _exit_with_parent(parent_pid: int) -> None:
    """The front (or the launcher of several) was killed, so no shutdown message can come: a core left behind would
    hold the device and its memory."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            logger.error("the process that started the engine core is gone; the core exits")
            os._exit(1)
