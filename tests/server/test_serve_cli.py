"""`dspark serve` on the command line: help, bad flags as one error line (before any model loads), and a real server
process that answers with its API key and served names, then stops cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from dspark.cli import main
from dspark.server.cli import served_model_names


@contextmanager
def _serve(model: Path, flags: list[str], **popen: Any) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """`dspark serve` in a subprocess: (process, base URL, its first log line naming it) once /health says ok (503
    "starting" until the engine core has loaded the model); the process's `stderr_lines` queue has its later log
    lines. Killed, its whole session, if the test left it running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark", "serve", str(model), *flags], stderr=subprocess.PIPE, text=True, **popen
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    if proc.stdout is not None:  # stdout=subprocess.PIPE: uvicorn's access log, in the same queue
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    proc.stderr_lines = lines  # type: ignore[attr-defined]
    try:
        found = None
        while found is None:
            found = re.search(r"dspark serve: (http://127\.0\.0\.1:\d+)/v1.*", lines.get(timeout=120))
        url = found.group(1)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
                    assert json.load(r) == {"status": "ok"}
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and "starting" in e.read().decode() and time.monotonic() < deadline
                time.sleep(0.2)
        yield proc, url, found.group(0)
    finally:
        if proc.poll() is None:
            if popen.get("start_new_session"):
                os.killpg(proc.pid, signal.SIGKILL)  # the engine core with it
            else:
                proc.kill()
            proc.wait()


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dspark serve") and "examples:" in out and "--speculative-config" in out
    assert main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out


def test_bad_flags_are_one_line_before_loading(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        cases = [
            (["--port", "70000"], "port=70000"),
            (["--port", str(taken.getsockname()[1])], "cannot bind"),
            (["--host", "no-such-host.invalid"], "host="),
            (["--speculative-config", '{"method": "magic"}'], "speculative_config.method"),
            (["--max-request-bytes", "0"], "max_request_bytes"),
            (["--model", "other-model"], "given twice"),
            (["--api-server-count", "0"], "api_server_count=0"),
            (["--api-server-count", "2", "--no-core-process"], "api_server_count=2"),
        ]
        for flags, needle in cases:
            assert main(["serve", str(tiny_llama), *flags]) == 2, flags
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (flags, err)
    finally:
        taken.close()


def test_several_api_servers_do_not_share_a_port_held_elsewhere(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another server holding the port with SO_REUSEPORT would let ours bind and take half its connections.
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    try:
        port = str(held.getsockname()[1])
        assert main(["serve", str(tiny_llama), "--port", port, "--api-server-count", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"port={port}" in err[0] and "cannot bind" in err[0], err
    finally:
        held.close()


def test_default_served_names() -> None:
    assert served_model_names("/models/tiny-llama", None) == ["/models/tiny-llama", "tiny-llama"]
    assert served_model_names("smollm2-135m-instruct", None) == ["smollm2-135m-instruct"]
    assert served_model_names("x/y", ["a", "b", "a"]) == ["a", "b"]


def test_serve_process_answers_and_stops_on_ctrl_c(tiny_llama: Path) -> None:
    flags = ["--port", "0", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
    flags += ["--served-model-name", "tiny", "alias", "--log-level", "warning"]
    env = {**os.environ, "DSPARK_API_KEY": "k3y"}  # the key from the environment, not the command line
    with _serve(tiny_llama, flags, env=env) as (proc, url, line):
        assert line.endswith("serving tiny, alias (API key required)")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        out = client.completions.create(model="alias", prompt="hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_serve_exits_when_the_engine_core_cannot_start(tiny_llama: Path) -> None:
    # One KV block cannot hold a 256-token context: the core refuses at start-up, after the port is bound.
    flags = ["--port", "0", "--dtype", "float32", "--num-kv-blocks", "1", "--max-model-len", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "dspark", "serve", str(tiny_llama), *flags],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "max_model_len=256 is invalid" in proc.stderr and "the engine failed to start" in proc.stderr


def test_ctrl_c_to_the_process_group_lets_running_streams_finish(tiny_llama: Path) -> None:
    # A terminal's Ctrl-C reaches the server and its engine core alike: the core must outlive the graceful drain.
    flags = ["--port", "0", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512"]
    with _serve(tiny_llama, [*flags, "--served-model-name", "tiny"], start_new_session=True) as (proc, url, _):
        body = {"model": "tiny", "prompt": "one", "max_tokens": 150, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            events = [next(r).decode()]
            os.killpg(proc.pid, signal.SIGINT)
            events += [line.decode() for line in r if line.startswith(b"data:")]
        last = json.loads(events[-2].removeprefix("data: "))
        assert events[-1].strip() == "data: [DONE]" and last["choices"][0]["finish_reason"] == "length", events[-2:]
        assert proc.wait(timeout=60) == 0
