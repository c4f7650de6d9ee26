"""`dspark serve --api-server-count N`: several API server processes on one engine core. The core routes each
request's outputs to the API server that added it; /metrics from any of them counts them all; a killed core ends
every API server's streams; Ctrl-C drains them all; an API server that dies stops the whole server."""

from __future__ import annotations

import asyncio
import json
import multiprocessing.connection
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from server_harness import live_server, wait_for
from test_process_engine import _complete, _status
from test_serve_cli import _serve

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core_proc import (
    AbortRequests,
    AddRequests,
    CoreLoop,
    StepFailed,
    StepOutputs,
    output_decoder,
)
from dspark.engine.messages import EngineCoreOutput, EngineCoreRequest
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dspark.server import api_servers
from dspark.server.metrics import FrontPeers, ServerMetrics
from dspark.server.process_engine import FrontSlot, ProcessEngine

# ---- the core's routing -------------------------------------------------------------------------------------------


class _Socket:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, data: bytes) -> None:
        self.sent.append(output_decoder.decode(data))


class _Core:
    """EngineCore's interface: each step, one token for every request, finished at its max_tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.fail = False

    def add_request(self, r: EngineCoreRequest) -> None:
        self.requests[r.request_id] = [r.sampling_params.max_tokens, 0]

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)

    def stop_requests(self, stops: list[tuple[str, int]]) -> None:
        self.abort_requests([rid for rid, _ in stops])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        if self.fail:
            raise RuntimeError("boom")
        outs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outs.append(EngineCoreOutput(rid, [state[1]], finish_reason="length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def end_step(self) -> None:
        pass

    def get_metrics(self) -> dict[str, Any]:
        return {"num_requests_running": len(self.requests)}


def _request(rid: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=max_tokens), 0, None, 0.0)


def test_the_core_sends_each_request_to_its_api_server() -> None:
    core, sockets = _Core(), [_Socket(), _Socket(), _Socket()]
    loop = CoreLoop(core, SimpleNamespace(), sockets)  # type: ignore[arg-type]
    loop._handle([AddRequests([_request("a", 2), _request("b", 3)], 0), AddRequests([_request("c", 2)], 2)])
    loop._metrics_at = time.monotonic()  # no counters due this step
    loop._step()
    assert [[o.request_id for o in m.outputs] for m in sockets[0].sent] == [["a", "b"]]
    assert [[o.request_id for o in m.outputs] for m in sockets[2].sent] == [["c"]]
    assert sockets[1].sent == []  # nothing of its own and no counters due: no message
    loop._step()  # a and c finish: the counters go with them, to every API server
    assert all(isinstance(s.sent[-1], StepOutputs) and s.sent[-1].metrics is not None for s in sockets)
    assert [o.request_id for o in sockets[0].sent[-1].outputs] == ["a", "b"]
    assert [o.request_id for o in sockets[2].sent[-1].outputs] == ["c"]
    assert sockets[1].sent[-1].outputs == []
    assert loop._front_of == {"b": 0}  # finished requests are forgotten
    loop._handle([AbortRequests(["b"])])
    assert loop._front_of == {} and not core.has_unfinished_requests()
    loop._handle([AddRequests([_request("d", 5)], 1)])
    core.fail = True
    loop._step()  # a failed step: every API server hears of it (each fails its own, all count the failed step)
    assert all(isinstance(s.sent[-1], StepFailed) and s.sent[-1].request_ids == ["d"] for s in sockets)
    assert loop._front_of == {}


# ---- /metrics across API servers ----------------------------------------------------------------------------------


class _Engine:
    def __init__(self, finished: int, prompt_tokens: int) -> None:
        self.counts = {"num_requests_finished": finished, "num_prompt_tokens": prompt_tokens}
        self.num_step_errors = 0
        self.alive = True

    def front_metrics(self) -> dict[str, int]:
        return dict(self.counts)

    def metrics(self) -> dict[str, Any]:
        return {**self.counts, "num_requests_running": 7}  # the core's gauge: the same in every API server


def _finished(ttft: float) -> RequestOutput:
    metrics = RequestMetrics(0.0, 0.0, ttft, 1.0, 3, 0, 4, 0)
    return RequestOutput(
        "r", None, [1, 2, 3], [CompletionOutput(0, "x", [1, 2, 3, 4], None, None, "length")], True, metrics
    )


def _sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def test_metrics_add_up_across_api_servers(tmp_path: Path) -> None:
    servers = [ServerMetrics(_Engine(2 + i, 10 * (i + 1)), FrontPeers(str(tmp_path), i, 3)) for i in range(3)]
    for i, server in enumerate(servers):
        for _ in range(i + 1):
            server.finished(_finished(0.03 * (i + 1)))
    for server in servers[1:]:
        server.peers.publish(server.front_state())  # type: ignore[union-attr]
    text = servers[0].render().decode()
    assert _sample(text, "dspark:num_requests_finished_total") == 2 + 3 + 4
    assert _sample(text, "dspark:prompt_tokens_total") == 10 + 20 + 30
    assert _sample(text, "dspark:num_requests_running") == 7  # a gauge of the core's: not added up
    assert _sample(text, "dspark:time_to_first_token_seconds_count") == 1 + 2 + 3
    assert _sample(text, 'dspark:time_to_first_token_seconds_bucket{le="0.04"}') == 1  # 0.03 only
    assert _sample(text, 'dspark:time_to_first_token_seconds_bucket{le="0.06"}') == 3  # and 0.06 (le: <=)
    assert _sample(text, "dspark:time_to_first_token_seconds_sum") == pytest.approx(0.03 + 2 * 0.06 + 3 * 0.09)
    assert _sample(text, 'dspark:request_success_total{finished_reason="length"}') == 6
    # The API server that rendered published its own counts: another one now sees everything too.
    assert _sample(servers[2].render().decode(), "dspark:num_requests_finished_total") == 9


class _ReadyFront(ProcessEngine):
    """One of two API servers whose core is ready at once (no process): /health must still wait for the other."""

    def start(self) -> None:
        self._ready = asyncio.Event()
        self._input_processor = SimpleNamespace()  # type: ignore[assignment]
        self._ready.set()

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True


def test_health_is_200_only_once_every_api_server_is_ready(tiny_llama: Path, tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu")
    front = _ReadyFront(config, slot=FrontSlot(0, 2, "", "", 0, str(tmp_path)))
    with live_server(front) as url:  # type: ignore[arg-type]
        wait_for(lambda: (tmp_path / "ready-0").exists(), 10, "this API server to mark itself ready")
        status, body = _status(url)
        assert status == 503 and "1 of 2 API servers ready" in body, body
        (tmp_path / "ready-1").touch()  # the other API server took its Ready
        assert _status(url)[0] == 200


def test_an_api_server_that_cannot_mark_itself_ready_stops(tiny_llama: Path, tmp_path: Path) -> None:
    """Without its mark every API server's /health would answer 503 for ever: it stops instead (the launcher then
    stops the server, exit 1), as when the core fails to start."""
    config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu")
    front = _ReadyFront(config, slot=FrontSlot(0, 2, "", "", 0, str(tmp_path / "gone")))
    stopped = threading.Event()
    with live_server(front, on_start_failure=stopped.set):  # type: ignore[arg-type]
        assert stopped.wait(10)


# ---- the launcher, its API servers and its core, as processes ------------------------------------------------------

FLAGS = ["--port", "0", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512"]
FLAGS += ["--served-model-name", "tiny", "--api-server-count", "2"]


def _processes(launcher: int) -> tuple[int, list[int]]:
    """The launcher's engine core and API servers (these lead their own process groups)."""
    children = [int(p) for p in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]
    children = [p for p in children if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    fronts = [p for p in children if os.getpgid(p) == p]
    cores = [p for p in children if p not in fronts]
    assert len(fronts) == 2 and len(cores) == 1, children
    return cores[0], fronts


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() for p in pids):
        assert time.monotonic() < deadline, "the core or an API server outlived the launcher"
        time.sleep(0.1)


def _all_ready(url: str) -> None:
    """_serve waited for one /health 200, which an API server answers only once every API server is ready: from then
    on each connection, whichever API server the kernel hands it to (SO_REUSEPORT), is served (20 in a row: one
    still starting among 2 would be missed with probability 2^-20)."""
    answers = [_status(url)[0] for _ in range(20)]
    assert answers == [200] * 20, answers


def _open_stream(url: str, **body: object) -> Any:
    data = json.dumps({"model": "tiny", "stream": True, **body}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=30)


def _events(response: Any) -> list[str]:
    return [line.decode().strip() for line in response if line.startswith(b"data:")]


def _lines(proc: Any) -> list[str]:
    lines = []
    while not proc.stderr_lines.empty():
        lines.append(proc.stderr_lines.get())
    return lines


def test_api_servers_share_the_requests_and_their_metrics_and_drain_on_sigterm(tiny_llama: Path) -> None:
    flags = [*FLAGS, "--log-level", "info"]
    with _serve(tiny_llama, flags, start_new_session=True, stdout=subprocess.PIPE) as (proc, url, line):
        _all_ready(url)
        assert line.endswith("serving tiny through 2 API servers")
        core, fronts = _processes(proc.pid)
        answers = [_complete(url, prompt="one two three", max_tokens=4, temperature=0) for _ in range(12)]
        failed = [(status, body) for status, body in answers if status != 200]
        assert not failed, (failed, _lines(proc))  # the answers and the server's log, should it ever fail
        assert len({a["choices"][0]["text"] for _, a in answers}) == 1  # greedy: the same answer from either
        time.sleep(0.5)
        logged = _lines(proc)
        for i in range(2):  # each connection is a new one: the kernel spreads them over both API servers
            assert any(f"[api server {i}]" in x and "POST /v1/completions" in x for x in logged), logged

        def finished_everywhere() -> bool:  # each scrape a new connection, whichever API server takes it
            counts = [_sample(_status(url, "/metrics")[1], "dspark:num_requests_finished_total") for _ in range(6)]
            return counts == [12] * 6

        deadline = time.monotonic() + 5
        while not finished_everywhere():
            assert time.monotonic() < deadline, "the API servers' metrics did not add up to 12 finished requests"
            time.sleep(0.1)
        text = _status(url, "/metrics")[1]
        assert _sample(text, 'dspark:request_success_total{finished_reason="length"}') == 12
        assert _sample(text, "dspark:e2e_request_latency_seconds_count") == 12

        # SIGTERM to every process, as a service manager sends it: the API servers drain (a running stream finishes),
        # then the core stops. (A terminal's Ctrl-C reaches the launcher alone: the killed-core test ends that way.)
        with _open_stream(url, prompt="one", max_tokens=150, ignore_eos=True) as stream:
            first = next(stream)
            for pid in (proc.pid, core, *fronts):
                os.kill(pid, signal.SIGTERM)
            events = [first.decode().strip(), *_events(stream)]
        last = json.loads(events[-2].removeprefix("data: "))
        assert events[-1] == "data: [DONE]" and last["choices"][0]["finish_reason"] == "length", events[-2:]
        code = proc.wait(timeout=60)
        time.sleep(0.2)
        assert code == 0, "".join(_lines(proc)[-12:])
        _wait_gone([core, *fronts])


def test_a_killed_core_ends_every_api_servers_streams(tiny_llama: Path) -> None:
    with _serve(tiny_llama, FLAGS, start_new_session=True) as (proc, url, _):
        _all_ready(url)
        core, fronts = _processes(proc.pid)
        streams = [_open_stream(url, prompt="one", max_tokens=400, ignore_eos=True) for _ in range(6)]
        for stream in streams:
            next(stream)  # each is running
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            with stream:
                events = _events(stream)
            error = json.loads(events[-2].removeprefix("data: "))
            assert events[-1] == "data: [DONE]" and error["error"]["type"] == "service_unavailable", events[-2:]
            assert "engine core process" in error["error"]["message"]
        ended = time.monotonic() - killed
        assert ended < 2.0, f"the streams ended {ended:.1f} s after the core was killed"
        for _ in range(6):  # whichever API server answers
            status, text = _status(url)
            assert status == 503 and "not running" in text
            assert _complete(url, prompt="one two", max_tokens=2)[0] == 503
        time.sleep(0.3)
        assert any("the engine core process was killed by signal 9" in x for x in _lines(proc))
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        _wait_gone(fronts)


def test_an_api_server_that_dies_stops_the_server(tiny_llama: Path) -> None:
    with _serve(tiny_llama, FLAGS, start_new_session=True) as (proc, _url, _):
        core, fronts = _processes(proc.pid)
        os.kill(fronts[1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert any("API server" in x and "exited with code -9; stopping the others" in x for x in _lines(proc))
        _wait_gone([core, fronts[0]])


# ---- the launcher's supervision -----------------------------------------------------------------------------------


class _Process:
    """multiprocessing.Process as the launcher sees it. A process's sentinel closes as it exits, a moment (reap_after)
    before waitpid reports its exit code; is_alive() and exitcode poll waitpid, join() waits for it."""

    def __init__(self, pid: int, reap_after: float) -> None:
        self.pid, self.reap_after = pid, reap_after
        self.sentinel, self._end = os.pipe()
        self._exited_at: float | None = None
        self.exitcode: int | None = None

    def exit(self, code: int) -> None:
        os.close(self._end)
        self._exited_at, self._code = time.monotonic(), code

    def _poll(self) -> None:
        if self._exited_at is not None and time.monotonic() >= self._exited_at + self.reap_after:
            self.exitcode = self._code

    def is_alive(self) -> bool:
        self._poll()
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        while self._exited_at is not None and self.exitcode is None:
            time.sleep(0.01)
            self._poll()

    def kill(self) -> None:
        raise AssertionError("the core stops when asked")


def test_the_launcher_sees_an_api_server_that_dies_before_it_can_be_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    core = _Process(100, 0.0)
    fronts = [_Process(101, 0.0), _Process(102, 0.3)]  # the one that dies is reaped only after a while
    signals: list[tuple[int, int]] = []

    def kill(pid: int, sig: int) -> None:  # a front asked to stop exits with 0
        signals.append((pid, sig))
        fronts[pid - 101].exit(0)

    class _Control:
        def send(self, _data: bytes) -> None:  # Shutdown: the core exits
            core.exit(0)

    wait = multiprocessing.connection.wait

    def bounded_wait(objects: list[Any], timeout: float | None = None) -> list[Any]:
        ready = wait(objects, 5.0)
        assert ready, "the launcher waits for processes that will not end"
        return ready

    monkeypatch.setattr(api_servers.os, "kill", kill)
    monkeypatch.setattr(api_servers.multiprocessing.connection, "wait", bounded_wait)
    threading.Timer(0.2, fronts[1].exit, args=(-9,)).start()
    assert api_servers._supervise(core, fronts, _Control()) == 1  # type: ignore[arg-type]
    assert signals == [(101, signal.SIGTERM)] and core.exitcode == 0


def test_a_sigterm_before_serving_stops_the_api_server(tiny_llama: Path) -> None:
    """An API server told to stop while it starts (the launcher stops the others when one dies, once): the signal is
    remembered as run_front remembers it, and serve_on then starts, serves nothing and returns, rather than losing the
    signal and leaving the launcher waiting for ever."""
    from server_harness import make_engine

    stop_asked = threading.Event()
    sock = api_servers.bind("127.0.0.1", 0)[0]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.set())
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # while the API server loads its engine
        started = time.monotonic()
        code = api_servers.serve_on(make_engine(tiny_llama), ["tiny"], None, 1 << 20, "warning", sock, "", stop_asked)
        assert code == 0 and time.monotonic() - started < 30
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
