"""`dspark serve` with the engine core in its own process (the default): the same answers as the in-process server,
503 while the core loads and once it is gone, streams that end with an error event within 2 s when the core is
killed, aborts that free their blocks, an idle core and front that use no CPU, and several steps' tokens merged for a
front that fell behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from server_harness import MODEL_NAME, drained, live_server, make_engine, metric, scrape, wait_for
from test_async_serving import _requests

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.front import coalesce
from dspark.engine.messages import EngineCoreOutput
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dspark.server.async_engine import RequestGroup
from dspark.server.process_engine import ProcessEngine
from helpers import fail_to_start


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=256)


def _status(url: str, path: str = "/health") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _complete(url: str, **body: object) -> tuple[int, dict[str, Any]]:
    data = json.dumps({"model": MODEL_NAME, **body}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextmanager
def _stream(url: str, **body: object) -> Iterator[Iterator[str]]:
    """A streamed completion's `data:` lines as they arrive."""
    data = json.dumps({"model": MODEL_NAME, "stream": True, **body}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        yield (line.decode().strip() for line in r if line.startswith(b"data:"))


@pytest.fixture(scope="module")
def servers(tiny_llama: Path) -> Iterator[tuple[str, str, ProcessEngine]]:
    engine = ProcessEngine(_config(tiny_llama))
    with live_server(make_engine(tiny_llama)) as thread_url, live_server(engine) as process_url:
        wait_for(lambda: _status(process_url)[0] == 200, 120, "the engine core to be ready")
        yield thread_url, process_url, engine


def test_answers_equal_the_in_process_server(servers: tuple[str, str, ProcessEngine]) -> None:
    thread_url, process_url, _ = servers
    full = _requests(thread_url)[4][0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # request 4 stops halfway, by a stop string seen in the front
    for stop_string in (None, stop):
        assert _requests(process_url, stop_string) == _requests(thread_url, stop_string)
    wait_for(lambda: drained(process_url), what="every block back in the core")


def test_echoed_prompt_logprobs_cross_the_process_boundary(servers: tuple[str, str, ProcessEngine]) -> None:
    body = {"prompt": "one two three four", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    answers = [_complete(url, **body, prompt_logprobs=1)[1]["choices"][0] for url in servers[:2]]
    assert answers[0] == answers[1]
    assert answers[0]["logprobs"]["token_logprobs"][0] is None and answers[0]["prompt_logprobs"][0] is None
    assert len(answers[0]["prompt_logprobs"]) == len(answers[0]["logprobs"]["tokens"]) - 2


def test_a_client_that_leaves_frees_its_blocks_in_the_core(servers: tuple[str, str, ProcessEngine]) -> None:
    _, url, _ = servers
    with _stream(url, prompt="one two three", max_tokens=900, ignore_eos=True) as lines:
        assert next(lines)  # it is running
    wait_for(lambda: drained(url), timeout=10, what="the abort to reach the core")
    text = scrape(url)
    aborted = metric(text, "dspark:request_success_total", 'finished_reason="abort"')
    assert aborted >= 1 and aborted == metric(text, "dspark:num_requests_aborted_total")


def test_max_tokens_past_the_context_is_a_400_with_the_numbers(servers: tuple[str, str, ProcessEngine]) -> None:
    for url in servers[:2]:
        status, answer = _complete(url, prompt="one two three", max_tokens=1023)
        assert status == 400, answer
        message = answer["error"]["message"]
        assert "maximum context length is 1024 tokens" in message and "1023 in the completion" in message
        assert answer["error"]["param"] == "max_tokens"
        assert _complete(url, prompt="one two three", max_tokens=8)[0] == 200


def test_an_idle_server_uses_no_cpu(servers: tuple[str, str, ProcessEngine]) -> None:
    _, url, engine = servers
    wait_for(lambda: drained(url), what="an idle server")
    assert engine.core_pid is not None
    core_before, front_before = _cpu_seconds(engine.core_pid), time.process_time()
    time.sleep(3.0)
    core, front = _cpu_seconds(engine.core_pid) - core_before, time.process_time() - front_before
    assert core < 0.06 and front < 0.06, f"idle for 3 s: core {core:.3f} s of CPU, front {front:.3f} s"


def test_starting_and_a_killed_core_answer_503_and_end_streams_with_an_error(tiny_llama: Path) -> None:
    engine = ProcessEngine(_config(tiny_llama))
    with live_server(engine) as url:
        status, text = _status(url)
        assert status == 503 and "starting" in text  # the core is still importing torch and loading the model
        status, answer = _complete(url, prompt="one two three", max_tokens=4)
        assert status == 503 and "starting" in answer["error"]["message"]
        wait_for(lambda: _status(url)[0] == 200, 120, "the engine core to be ready")
        with _stream(url, prompt="one", max_tokens=1000, ignore_eos=True) as lines:
            events = [next(lines)]
            assert engine.core_pid is not None
            os.kill(engine.core_pid, signal.SIGKILL)
            killed = time.monotonic()
            events += list(lines)
            ended = time.monotonic() - killed
        assert ended < 2.0, f"the stream ended {ended:.1f} s after the core was killed"
        error = json.loads(events[-2].removeprefix("data: "))
        assert events[-1] == "data: [DONE]" and error["error"]["type"] == "service_unavailable"
        assert "killed by signal 9" in error["error"]["message"]
        status, text = _status(url)
        assert status == 503 and "not running" in text
        status, answer = _complete(url, prompt="one two three", max_tokens=4)
        assert status == 503 and "killed by signal 9" in answer["error"]["message"]


def test_coalesce_merges_a_requests_steps_in_order() -> None:
    a1 = EngineCoreOutput("a", [1, 2], [(-0.1, 1, []), (-0.2, 1, [])], first_token_time=5.0)
    b1 = EngineCoreOutput("b", [7])
    a2 = EngineCoreOutput("a", [3], [(-0.3, 2, [])], finish_reason="length", spec_num_drafts=4)
    merged = coalesce([a1, b1, a2])
    assert [o.request_id for o in merged] == ["a", "b"]
    a = merged[0]
    assert a.new_token_ids == [1, 2, 3] and [lp[0] for lp in a.new_logprobs or []] == [-0.1, -0.2, -0.3]
    assert a.finish_reason == "length" and a.spec_num_drafts == 4 and a.first_token_time == 5.0
    unchanged = [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2])]
    assert coalesce(unchanged) == unchanged
    # Plain outputs (a continued step's token alone) after a full one: the full one's counters stay.
    full = EngineCoreOutput("c", [4], first_scheduled_time=1.0, first_token_time=2.0, num_cached_tokens=16)
    (c,) = coalesce([full, EngineCoreOutput("c", [5]), EngineCoreOutput("c", [6])])
    assert c.new_token_ids == [4, 5, 6] and c.num_cached_tokens == 16 and c.first_token_time == 2.0
    # A last output with the token alone and its finish (benchmarks/serve_front.py's stub core sends these): the finish
    # is kept, or a front that fell behind never ends the stream (seen: 11-29 of 128 streams hung at C = 64).
    (d,) = coalesce(
        [EngineCoreOutput("d", [1], first_token_time=2.0), EngineCoreOutput("d", [2], finish_reason="length")]
    )
    assert d.new_token_ids == [1, 2] and d.finish_reason == "length" and d.first_token_time == 2.0
    full = EngineCoreOutput("e", [4], first_scheduled_time=1.0, num_cached_tokens=16, spec_num_drafts=3)
    (e,) = coalesce([full, EngineCoreOutput("e", [5], finish_reason="stop", stop_reason=2, finished_time=9.0)])
    assert e.new_token_ids == [4, 5] and (e.finish_reason, e.stop_reason, e.finished_time) == ("stop", 2, 9.0)
    assert e.num_cached_tokens == 16 and e.spec_num_drafts == 3  # the full output's counters stay


def test_plain_outputs_keep_the_requests_counters(tokenizer_dir: Path) -> None:
    """The front keeps a request's counters from its last full output: plain ones carry tokens alone."""
    from dspark.engine.output_processor import OutputProcessor
    from dspark.models.tokenizer import load_tokenizer

    processor = OutputProcessor(load_tokenizer(tokenizer_dir))
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=4, output_kind="delta"), 0.5)
    first = EngineCoreOutput("r", [300], first_scheduled_time=1.0, first_token_time=2.0, num_cached_tokens=16)
    processor.process([first])
    (out,) = processor.process([EngineCoreOutput("r", [301])]).outputs
    assert out.metrics.num_cached_tokens == 16 and out.metrics.first_token_time == 2.0 and out.new_token_ids == [301]
    processor.process([EngineCoreOutput("r", [302])])
    last = EngineCoreOutput("r", [303], finish_reason="length", first_scheduled_time=1.0, first_token_time=2.0)
    last.num_cached_tokens, last.finished_time = 16, 3.0
    (out,) = processor.process([last]).outputs
    assert out.finished and out.metrics.num_cached_tokens == 16 and out.metrics.first_token_time == 2.0
    assert out.metrics.num_generation_tokens == 4


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _delta(rid: str, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    metrics = RequestMetrics(0.0, None, None, None, 3, 0, ids[-1], 0)
    reason = "length" if finished else None
    completion = CompletionOutput(0, text, ids, None, None, finish_reason=reason)
    return RequestOutput(rid, None, [1, 2, 3], [completion], finished, metrics, text, ids)


def test_a_reader_that_fell_behind_gets_a_requests_queued_deltas_as_one() -> None:
    class Engine:
        def abort(self, ids: list[str]) -> None:
            pass

    async def read() -> list[tuple[int, RequestOutput]]:
        group = RequestGroup(Engine(), ["a", "b"])  # type: ignore[arg-type]
        for item in [(0, _delta("a", "x", [1])), (0, _delta("a", "y", [2])), (1, _delta("b", "p", [7]))]:
            group._queue.put_nowait(item)
        group._queue.put_nowait((1, _delta("b", "q", [8], finished=True)))
        group._queue.put_nowait((0, _delta("a", "z", [3], finished=True)))
        return [item async for item in group]

    got = asyncio.run(read())
    assert [(i, o.new_text, o.new_token_ids, o.finished) for i, o in got] == [
        (0, "xy", [1, 2], False),
        (1, "pq", [7, 8], True),
        (0, "z", [3], True),
    ]
    assert got[1][1].outputs[0].token_ids == [7, 8] and got[1][1].metrics.num_generation_tokens == 8


def test_a_core_that_fails_to_start_is_reported_with_its_reason_even_when_its_exit_is_seen_first(
    tiny_llama: Path,
) -> None:
    """The core sends StartFailed and exits; here the front reads its messages late (its reader restarted once the
    exit was seen), so the exit comes before the message: the front still reports the core's reason, not only its
    exit code."""

    async def run() -> str:
        engine = ProcessEngine(_config(tiny_llama), core_target=fail_to_start)
        engine.start()
        assert engine._reader is not None
        engine._reader.cancel()
        waiting = asyncio.get_running_loop().create_task(engine.wait_ready(30))  # as the server's start-up does
        assert engine._client is not None and engine._client.process is not None
        while engine._client.process.exitcode is None:  # the core has sent StartFailed and exited
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the loop has seen the exit (the sentinel's callback ran)
        engine._reader = asyncio.get_running_loop().create_task(engine._read())
        with pytest.raises(Exception) as failed:
            await waiting
        await engine.shutdown()
        return str(failed.value)

    reason = asyncio.run(run())
    assert "no device" in reason, reason
