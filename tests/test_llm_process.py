"""LLM(engine_process=True): the engine core in its own process (the server's client and messages), answering as the
in-process LLM does: the same outputs in the same order (greedy, stop strings, seeded and unseeded sampling, chat),
the same ConfigError for a refused prompt with nothing left running, Ctrl-C that aborts, the usual counters. The core
stops with shutdown() and `with`, garbage collection and the interpreter's exit; one that fails to start, fails a
step or is killed raises, never hangs."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dspark.llm
from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core import EngineCore
from dspark.engine.core_proc import run_core
from dspark.engine.messages import EngineCoreOutput
from dspark.engine.sync_front import SyncCoreFront
from dspark.errors import ConfigError, EngineDeadError, EngineError
from dspark.llm import LLM
from dspark.outputs import RequestOutput

ENGINE: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256}
PROMPTS = ["The quick brown fox", "Hello, my name is", "One two three four five"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def llms(model: Path) -> Iterator[tuple[LLM, LLM]]:
    """(in-process, core process), used alike by every test (unseeded requests draw their seeds in the same order)."""
    process = LLM(str(model), engine_process=True, **ENGINE)
    try:
        yield LLM(str(model), **ENGINE), process
    finally:
        process.shutdown()


def _answers(outs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    return [
        (o.prompt_token_ids, o.finished, [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs])
        for o in outs
    ]


def _both(llms: tuple[LLM, LLM], call: str, *args: Any) -> list[list[tuple[Any, ...]]]:
    return [_answers(getattr(llm, call)(*args)) for llm in llms]


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def _core_pid(llm: LLM) -> int:
    assert llm._front is not None and llm._front.core_pid is not None
    return llm._front.core_pid


def test_outputs_equal_the_in_process_llms(llms: tuple[LLM, LLM]) -> None:
    local, _ = llms
    greedy = _both(llms, "generate", PROMPTS, GREEDY)
    assert greedy[0] == greedy[1] and [len(o[2][0][0]) for o in greedy[0]] == [12] * 3
    # A prompt of token ids, a stop string that ends a request halfway (in the front; the core learns of it later),
    # logprobs, seeded and unseeded sampling, one SamplingParams each.
    text = greedy[0][0][2][0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    prompts: list[Any] = [PROMPTS[0], local.tokenizer.encode(PROMPTS[1]), PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7),
        SamplingParams(temperature=1.0, max_tokens=10),
    ]
    mixed = _both(llms, "generate", prompts, params)
    assert mixed[0] == mixed[1]
    assert mixed[1][0][2][0][2] == "stop" and len(mixed[1][0][2][0][0]) < 12


def test_chat_equals_the_in_process_llms(llms: tuple[LLM, LLM]) -> None:
    conversation = [{"role": "user", "content": "Say something short."}]
    one = _both(llms, "chat", conversation, GREEDY)
    assert one[0] == one[1] and len(one[1]) == 1
    two = _both(llms, "chat", [conversation, [{"role": "user", "content": "And now?"}]], GREEDY)
    assert two[0] == two[1] and len(two[1]) == 2


def test_a_refused_prompt_raises_the_same_config_error_and_nothing_runs(llms: tuple[LLM, LLM]) -> None:
    process = llms[1]
    before = [llm.get_metrics() for llm in llms]
    too_long = [5] * ENGINE["max_model_len"]
    for prompts, params in [
        ([PROMPTS[0], too_long], GREEDY),  # the second is refused: the first must not run either
        ([PROMPTS[0], PROMPTS[1]], [GREEDY, SamplingParams(stop_token_ids=[10**6])]),
        ([PROMPTS[0], ""], GREEDY),
    ]:
        errors = []
        for llm in llms:
            with pytest.raises(ConfigError) as e:
                llm.generate(prompts, params)
            errors.append(e.value)
        assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert not process._front.has_unfinished_requests()  # type: ignore[union-attr]
    after = _both(llms, "generate", PROMPTS[:2], GREEDY)
    assert after[0] == after[1]
    # Nor did the core get any of a refused call's prompts: it made only the tokens of the two answers since.
    metrics = [llm.get_metrics() for llm in llms]
    generated = [m["num_generation_tokens"] - b["num_generation_tokens"] for m, b in zip(metrics, before, strict=True)]
    assert generated == [2 * GREEDY.max_tokens] * 2
    assert metrics[1]["kv_num_used_blocks"] == 0 and metrics[1]["num_requests_running"] == 0


def test_ctrl_c_aborts_the_requests(llms: tuple[LLM, LLM]) -> None:
    process = llms[1]
    aborted = process.get_metrics()["num_requests_aborted"]
    running = threading.Event()

    def interrupt() -> None:
        if running.is_set():  # never once generate() has returned: pytest would stop
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    timer = threading.Timer(0.5, interrupt)
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True, seed=1)  # seeded: no seed drawn
    running.set()
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            process.generate(PROMPTS * 2, long)
    finally:
        running.clear()
        timer.join()
    assert time.monotonic() - started < 5.0
    assert not process._front.has_unfinished_requests()  # type: ignore[union-attr]
    assert process.get_metrics()["num_requests_aborted"] - aborted == 6
    deadline = time.monotonic() + 10
    while process.get_metrics()["kv_num_used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the abort reaches the core within a step
    metrics = process.get_metrics()
    assert metrics["kv_num_used_blocks"] == 0 and metrics["num_requests_running"] == 0
    after = _both(llms, "generate", PROMPTS[0], GREEDY)
    assert after[0] == after[1]


def test_get_metrics_has_the_usual_counters(llms: tuple[LLM, LLM]) -> None:
    local, process = llms
    before = [llm.get_metrics() for llm in llms]
    text = local.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[text[len(text) // 2 :][:3]])
    process.generate(PROMPTS[1], GREEDY)
    _both(llms, "generate", [*PROMPTS, PROMPTS[1]], [GREEDY] * 3 + [stop])
    after = [llm.get_metrics() for llm in llms]
    assert set(after[1]) == set(after[0])
    for key in ["num_requests_finished", "num_requests_aborted", "num_requests_failed", "num_prompt_tokens"]:
        assert after[1][key] - before[1][key] == after[0][key] - before[0][key], key
    # The tokens a stop string raced (made before the stop reached the core) are taken back a moment later.
    key = "num_generation_tokens"
    deadline = time.monotonic() + 5
    while after[1][key] - before[1][key] != after[0][key] - before[0][key] and time.monotonic() < deadline:
        time.sleep(0.05)
        after[1] = process.get_metrics()
    assert after[1][key] - before[1][key] == after[0][key] - before[0][key]
    assert after[1]["kv_num_used_blocks"] == 0 and after[1]["num_requests_running"] == 0


def test_get_metrics_does_not_wait_for_ever_for_a_lost_stop_answer(
    llms: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop whose answer was lost (a Ctrl-C between receiving and handling it) leaves the core idle: get_metrics()
    gives up after METRICS_WAIT_S and forgets the stop, so the next call does not wait again."""
    import time

    from dspark.engine import sync_front

    _, process = llms
    front = process._front
    assert front is not None
    monkeypatch.setattr(sync_front, "METRICS_WAIT_S", 0.5)
    front._stopped["req-lost"] = None
    began = time.monotonic()
    assert "num_generation_tokens" in process.get_metrics()
    assert 0.4 < time.monotonic() - began < 5.0
    assert not front._stopped


def test_the_in_process_engine_is_not_there(llms: tuple[LLM, LLM]) -> None:
    local, process = llms
    assert local.engine.model is not None and not local.engine_process and process.engine_process
    with pytest.raises(AttributeError, match="engine_process=True"):
        process.engine.model  # noqa: B018


def test_shutdown_and_with_stop_the_core(model: Path) -> None:
    hooks = atexit._ncallbacks()
    with LLM(str(model), engine_process=True, **ENGINE) as llm:
        pid = _core_pid(llm)
        assert llm.generate(PROMPTS[0], GREEDY)[0].finished
    assert _gone(pid)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS[0], GREEDY)
    llm.shutdown()  # again: nothing to do
    assert atexit._ncallbacks() == hooks


def test_garbage_collection_and_exit_stop_the_core(model: Path) -> None:
    hooks = atexit._ncallbacks()
    llm = LLM(str(model), engine_process=True, **ENGINE)
    pid = _core_pid(llm)
    del llm
    gc.collect()
    assert _gone(pid)
    assert atexit._ncallbacks() == hooks, "an exit hook per LLM: many LLMs would pile them up"
    # The interpreter's exit, without shutdown(): before multiprocessing's exit hook, which would wait for ever for a
    # core that ignores SIGTERM.
    script = (
        "import sys; from dspark.llm import LLM; "
        f"llm = LLM(sys.argv[1], engine_process=True, **{ENGINE!r}); "
        "llm.generate('Hello'); print(llm._front.core_pid, flush=True)"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(model)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert select.select([child.stdout], [], [], 120)[0], "the child's LLM did not answer"
        pid = int(child.stdout.readline())
        started = time.monotonic()
        assert child.wait(timeout=60) == 0
        assert time.monotonic() - started < 10 and _gone(pid)
    finally:
        if child.poll() is None:  # it hangs: killed, its core then exits with it
            child.kill()
            child.wait()


def test_a_core_that_fails_to_start_raises_its_reason(model: Path) -> None:
    before = {p.pid for p in _children()}
    hooks = atexit._ncallbacks()
    with pytest.raises(EngineDeadError, match="failed to start: ConfigError: max_model_len=4096"):
        LLM(str(model), engine_process=True, **{**ENGINE, "max_model_len": 4096})
    assert {p.pid for p in _children()} <= before and atexit._ncallbacks() == hooks


def _loading_for_ever(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """A core that never gets ready, deaf to Ctrl-C and SIGTERM as run_core is; it goes with its parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent_pid:
        time.sleep(0.1)


def test_ctrl_c_while_the_core_loads_stops_it(model: Path) -> None:
    before = {p.pid for p in _children()}
    hooks = atexit._ncallbacks()
    timer = threading.Timer(2.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            SyncCoreFront(EngineConfig(model=str(model), **ENGINE), core_target=_loading_for_ever)
    finally:
        timer.join()
    assert {p.pid for p in _children()} <= before and atexit._ncallbacks() == hooks


class _FaultyCore(EngineCore):
    """Fails any step that runs a request with max_tokens=13."""

    def step(self) -> list[EngineCoreOutput]:
        if any(r.sampling_params.max_tokens == 13 for r in self.requests.values()):
            raise RuntimeError("injected fault")
        return super().step()


def _faulty_core(config: EngineConfig) -> EngineCore:
    return _FaultyCore(config)


class _FaultyFront(SyncCoreFront):
    def __init__(self, config: EngineConfig, cost_model: Any = None) -> None:
        super().__init__(config, cost_model, core_target=functools.partial(run_core, make_core=_faulty_core))


def test_a_failed_step_and_a_killed_core_raise(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dspark.llm, "SyncCoreFront", _FaultyFront)
    llm = LLM(str(model), engine_process=True, **ENGINE)
    try:
        with pytest.raises(EngineError, match="injected fault"):
            llm.generate(PROMPTS, [GREEDY, SamplingParams(max_tokens=13), GREEDY])
        assert llm.get_metrics()["num_requests_aborted"] == 3
        assert llm.generate(PROMPTS[0], GREEDY)[0].finished  # the core goes on serving

        pid = _core_pid(llm)
        timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        timer.start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            llm.generate(PROMPTS * 3, SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
        assert time.monotonic() - started < 3.0
        timer.join()
        with pytest.raises(EngineDeadError, match="not running: the engine core process was killed by signal 9"):
            llm.generate(PROMPTS[0], GREEDY)
    finally:
        llm.shutdown()


def _children() -> list[Any]:
    import multiprocessing

    return multiprocessing.active_children()
