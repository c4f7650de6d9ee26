"""Async scheduling (vLLM's --async-scheduling) changes when the host schedules, never what is generated (CPU fp32):

with async_scheduling=True the engine launches decode step t+1 before it has processed step t's outputs, and every
request's tokens, text and finish reason are those of the synchronous engine: greedy and seeded sampling, stops by
length, stop token, stop string and min_tokens, aborts, requests arriving mid-run, preemption, and adaptive n-gram
speculation. A request that finishes at step t has its step t+1 token dropped: it is neither output nor counted, and its
blocks return to the pool.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark import LLM, ConfigError, SamplingParams
from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.speculative.cost_model import CostModel
from helpers import make_hf_model

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> str:
    """A tiny llama with untied embeddings: the tied tiny models' greedy output repeats one token for tens of
    steps, so a step fed the previous step's input token instead of its sample would go unseen; this one's does not."""
    out = tmp_path_factory.mktemp("tiny-untied")
    make_hf_model("llama", tie_word_embeddings=False).save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return str(out)


@pytest.fixture(scope="module")
def _engines(untied_model: str) -> dict[bool, LLM]:
    return {
        mode: LLM(
            model=untied_model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, async_scheduling=mode
        )
        for mode in (False, True)
    }


@pytest.fixture
def engines(_engines: dict[bool, LLM]) -> Iterator[dict[bool, LLM]]:
    """async_scheduling -> an engine. Every test drives both through the same requests (in the same order), so that
    seeds drawn for requests without one stay the same in the two. A test that fails midway leaves its requests to be
    aborted here, so that the next test starts from idle engines."""
    yield _engines
    for llm in _engines.values():
        sched = llm.engine.scheduler
        llm.engine.abort_request([r.request_id for r in (*sched.running, *sched.waiting)])


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def _summary(out: RequestOutput) -> tuple[Any, ...]:
    c = out.outputs[0]
    return c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs, c.cumulative_logprob


def _check_idle(engine: LLMEngine) -> None:
    """Nothing left in flight: no request, and every KV block back in the pool."""
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.num_used_blocks == 0


def _both(
    llms: dict[bool, LLM], prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[dict[bool, list[RequestOutput]], int]:
    """Generate with the synchronous and the async engine and check that they agree; return async_scheduling -> the
    outputs, and how many steps the async engine pipelined."""
    results = {}
    for mode in (False, True):
        engine = llms[mode].engine
        before = dict(engine.stats)
        outs = llms[mode].generate(prompts, params)
        _check_idle(engine)
        # A dropped step t+1 token is not a generated token.
        num_generated = engine.stats["num_generation_tokens"] - before["num_generation_tokens"]
        assert num_generated == sum(len(o.outputs[0].token_ids) for o in outs), f"async_scheduling={mode}"
        results[mode] = outs, engine.stats["num_pipelined_steps"] - before["num_pipelined_steps"]
    (sync, num_sync), (out, num_async) = results[False], results[True]
    assert num_sync == 0, "the synchronous engine pipelined"
    for i, (a, b) in enumerate(zip(sync, out, strict=True)):
        assert _summary(b) == _summary(a), f"request {i} changed under async scheduling"
    return {False: sync, True: out}, num_async


def test_greedy_batch_with_mixed_lengths(engines: dict[bool, LLM]) -> None:
    prompts = _prompts(1, [5, 9, 14, 20, 7, 30, 11])
    max_tokens = [1, 2, 3, 8, 17, 33, None]  # None: until max_model_len
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs, num_pipelined = _both(engines, prompts, params)
    sync = outs[False]
    expected = [n if n is not None else MAX_MODEL_LEN - len(p) for n, p in zip(max_tokens, prompts, strict=True)]
    assert [len(o.outputs[0].token_ids) for o in sync] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in sync)
    assert num_pipelined > 0, "async scheduling never pipelined a step"
    # Follow-ups that repeat a prompt and its output: the prefix cache serves the blocks each engine wrote, every
    # full block of the computed tokens (all but the last) at least.
    history = [[*p, *o.outputs[0].token_ids] for p, o in zip(prompts[:6], sync[:6], strict=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(history)
    follow, _ = _both(engines, [[*h, 7] for h in history], params)
    block_size = engines[True].engine.config.block_size
    for mode, outs in follow.items():
        cached = [o.metrics.num_cached_tokens for o in outs]
        assert all(c >= (len(h) - 1) // block_size * block_size for c, h in zip(cached, history, strict=True)), mode
    assert sum(o.metrics.num_cached_tokens for o in follow[True]) > 0


def test_seeded_sampling_and_stop_tokens(engines: dict[bool, LLM]) -> None:
    prompts = _prompts(2, [6, 13, 25, 9, 17, 4])
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    ref = _both(engines, [prompts[4]], [free])[0][False][0].outputs[0].token_ids
    stop_at = ref[6]
    first = ref.index(stop_at)
    many_stops = list(range(1000, 5000))  # about 8% of the vocabulary: a sampled request soon draws one
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=24),
        SamplingParams(temperature=1.0, top_k=40, seed=2, max_tokens=31),
        SamplingParams(temperature=1.0, max_tokens=20),  # its seed is drawn from the engine's
        SamplingParams(temperature=1.0, seed=4, max_tokens=60, min_tokens=8, stop_token_ids=many_stops),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=100, seed=6, max_tokens=2),
    ]
    outs, num_pipelined = _both(engines, prompts, params)
    sync = outs[False]
    assert num_pipelined > 0, "async scheduling never pipelined a step"
    # The stops happened where the test means them to, so that it checks what it claims.
    min_toks = sync[3].outputs[0]
    assert min_toks.finish_reason == "stop" and 8 <= len(min_toks.token_ids) < 60
    assert not set(min_toks.token_ids[:7]) & set(many_stops)  # masked until min_tokens
    stopped = sync[4].outputs[0]
    assert stopped.token_ids == ref[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_at


def test_eos_ends_a_request_mid_run(engines: dict[bool, LLM]) -> None:
    """A continued step appends a token that cannot end its request without the rest of output processing
    (EngineCore._update_continued); the request's EOS still ends it there, as in the synchronous engine, and with
    ignore_eos the same token does not. The engines' EOS is set to a token the greedy output reaches mid-run (the
    tiny model's own EOS is drawn too rarely to test)."""
    prompts = _prompts(3, [7, 12])
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = _both(engines, prompts[1:], [free])[0][False][0].outputs[0].token_ids
    eos = next(t for i, t in enumerate(ids) if i >= 5 and t not in ids[:i])  # its first appearance, well into the run
    saved = {mode: llm.engine.input_processor.eos_token_id for mode, llm in engines.items()}
    try:
        for llm in engines.values():
            llm.engine.input_processor.eos_token_id = eos
        params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=0.0, max_tokens=30), free]
        outs, num_pipelined = _both(engines, [prompts[0], prompts[1], prompts[1]], params)
    finally:
        for mode, llm in engines.items():
            llm.engine.input_processor.eos_token_id = saved[mode]
    assert num_pipelined > 0, "async scheduling never pipelined a step"
    stopped, ignored = outs[False][1].outputs[0], outs[False][2].outputs[0]
    assert stopped.token_ids == ids[: ids.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == ids and ignored.finish_reason == "length"


def test_stop_string_ends_one_request_while_others_go_on(engines: dict[bool, LLM]) -> None:
    prompts = _prompts(3, [12, 8, 21, 15])
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _both(engines, prompts[:2], [greedy] * 2)[0][False]
    text = ref[0].outputs[0].text
    stop = text[10:14]
    stop_token = ref[1].outputs[0].token_ids[4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=9, max_tokens=25, ignore_eos=True),
    ]
    outs, num_pipelined = _both(engines, prompts, params)
    sync = outs[False]
    assert num_pipelined > 0, "async scheduling never pipelined a step"
    by_string, by_token = sync[0].outputs[0], sync[1].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    assert by_string.text == text[: text.index(stop)] and len(by_string.token_ids) < 30
    first = ref[1].outputs[0].token_ids.index(stop_token)
    assert by_token.token_ids == ref[1].outputs[0].token_ids[: first + 1] and by_token.stop_reason == stop_token
    assert [len(o.outputs[0].token_ids) for o in sync[2:]] == [30, 25]  # the others went on


def _drive(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], late: list[int]
) -> dict[str, Any]:
    """Step the engine by hand: abort request 0 after five steps, add `late` two steps later, run to the end."""
    before = dict(engine.stats)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    streamed: dict[str, list[int]] = {rid: [] for rid in rids}
    finals: dict[str, RequestOutput] = {}
    aborted = False

    def step() -> None:
        for out in engine.step():
            assert not (aborted and out.request_id == rids[0]), "an output for a request after its abort"
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out

    for _ in range(5):
        step()
    num_pipelined_before_abort = engine.stats["num_pipelined_steps"] - before["num_pipelined_steps"]
    engine.abort_request(rids[0])
    aborted = True
    step()
    step()
    late_rid = engine.add_request(late, SamplingParams(temperature=0.8, seed=77, max_tokens=20, ignore_eos=True))
    streamed[late_rid] = []
    for _ in range(3):  # a waiting request stops the pipelining: it is admitted with the next step scheduled
        step()
    assert streamed[late_rid], "the request added mid-run waited for more than three steps"
    while engine.has_unfinished_requests():
        step()
    _check_idle(engine)
    assert engine.stats["num_requests_aborted"] - before["num_requests_aborted"] == 1
    assert rids[0] not in finals
    for rid, out in finals.items():  # the stream holds each token once, in order
        assert streamed[rid] == out.outputs[0].token_ids, rid
    return {
        "others": [_summary(finals[rid]) for rid in rids[1:]],
        "late": _summary(finals[late_rid]),
        "num_pipelined_before_abort": num_pipelined_before_abort,
    }


def test_abort_and_a_late_request_driving_the_engine(engines: dict[bool, LLM]) -> None:
    prompts = _prompts(4, [10, 7, 16, 5])
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=21, max_tokens=26, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True),
    ]
    late = _prompts(5, [10])[0]
    runs = {mode: _drive(engines[mode].engine, prompts, params, late) for mode in (False, True)}
    assert runs[False]["num_pipelined_before_abort"] == 0
    assert runs[True]["num_pipelined_before_abort"] > 0, "the abort was meant to come while steps were pipelined"
    assert runs[True]["others"] == runs[False]["others"]
    # The request that arrived mid-run samples what it samples alone.
    alone = _both(engines, [late], [SamplingParams(temperature=0.8, seed=77, max_tokens=20, ignore_eos=True)])[0]
    assert runs[False]["late"] == runs[True]["late"] == _summary(alone[False][0])


def test_requests_with_logprobs_or_penalties_are_not_pipelined(engines: dict[bool, LLM]) -> None:
    """Their sampling reads the step's output on the host (penalties: the history; logprobs: the rows), so no step
    that holds one is pipelined; once they finish, the others' steps are."""
    prompts = _prompts(6, [8, 11, 6, 14])
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    finals = {}
    for mode in (False, True):
        engine = engines[mode].engine
        before = engine.stats["num_pipelined_steps"]
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outs = {}
        while engine.has_unfinished_requests():
            num_pipelined = engine.stats["num_pipelined_steps"]
            step = engine.step()
            if engine.stats["num_pipelined_steps"] > num_pipelined:  # this call collected a pipelined step
                assert not {o.request_id for o in step} & set(rids[:2]), "a pipelined step held logprobs or penalties"
            outs.update((o.request_id, _summary(o)) for o in step if o.finished)
        _check_idle(engine)
        finals[mode] = [outs[rid] for rid in rids]
        if mode:
            assert engine.stats["num_pipelined_steps"] > before, "once they finished, no step was pipelined"
    assert finals[True] == finals[False]


def test_preemption_while_pipelining(untied_model: str) -> None:
    # Every prompt fits at first; the requests then outgrow the cache during decoding, while steps are pipelined.
    llms = {
        mode: LLM(
            model=untied_model,
            dtype="float32",
            max_model_len=64,
            block_size=4,
            num_kv_blocks=20,
            async_scheduling=mode,
        )
        for mode in (False, True)
    }
    prompts = _prompts(7, [8, 7, 9, 8])
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=31, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=50, seed=32, max_tokens=40, ignore_eos=True),
    ]
    outs, num_pipelined = _both(llms, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs[False]] == [10, 40, 25, 40]
    assert llms[False].get_metrics()["num_preemptions"] > 0, "the cache was meant to force preemption"
    assert num_pipelined > 0, "async scheduling never pipelined a step"
    # Stepped by hand: a preemption comes in the step right after a pipelined one (the cache ran short while the
    # engine was pipelining), and the outputs are generate()'s.
    engine = llms[True].engine
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals, preempted_after_pipelined, was_pipelined = {}, 0, False
    while engine.has_unfinished_requests():
        stats = (engine.stats["num_pipelined_steps"], engine.scheduler.num_preemptions)
        finals.update((o.request_id, _summary(o)) for o in engine.step() if o.finished)
        preempted_after_pipelined += was_pipelined and engine.scheduler.num_preemptions > stats[1]
        was_pipelined = engine.stats["num_pipelined_steps"] > stats[0]
    _check_idle(engine)
    assert preempted_after_pipelined > 0, "no preemption came while steps were pipelined"
    assert [finals[rid][:4] for rid in rids] == [_summary(o)[:4] for o in outs[False]]


# Each verified token costs a quarter of a one-token step (as in test_spec_exactness): some drafts pay, some do not.
_STEEP = CostModel.from_points({1: 4.0, 16: 7.75, 64: 19.75}, {1: 0.0, 64: 0.0})


def test_adaptive_ngram_speculation(tiny_model_dirs: dict[str, Path]) -> None:
    """Adaptive speculation pipelines only its plain steps, fixed k never; greedy output stays that without
    speculation. The tied model's repetitive output gets n-gram drafts accepted."""
    model = str(tiny_model_dirs["llama"])
    prompts = _prompts(8, [5, 23, 40, 9])
    prompts.append((prompts[0][:6] * 12)[:70])  # repetitive: n-gram drafts get accepted
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11, 13, 101])
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "cost_model": _STEEP}
    reference = LLM(model=model, async_scheduling=False, **kw).generate(prompts, params)
    adaptive = {"method": "ngram", "num_speculative_tokens": 4}
    fixed = {**adaptive, "enable_adaptive_verification": False}
    for name, spec, mode in [("adaptive", adaptive, False), ("adaptive", adaptive, True), ("fixed", fixed, True)]:
        llm = LLM(model=model, async_scheduling=mode, speculative_config=spec, **kw)
        out = llm.generate(prompts, params)
        for i, (a, b) in enumerate(zip(reference, out, strict=True)):
            assert _summary(b) == _summary(a), f"{name} speculation, async_scheduling={mode}: request {i}"
        m = llm.get_metrics()
        _check_idle(llm.engine)
        assert m["spec_decode_num_draft_tokens"] > 0, f"{name}, {mode=}: nothing was drafted"
        if name == "fixed" or not mode:
            assert m["num_pipelined_steps"] == 0, f"{name}, {mode=}: pipelined"
        else:  # the regime explores plain steps early on, whichever it then settles on
            assert m["num_pipelined_steps"] > 0, "adaptive speculation never pipelined a plain step"


def test_a_request_keeps_the_sampling_params_it_was_added_with(engines: dict[bool, LLM]) -> None:
    # A continued step does not check again what its requests passed when the chain began (logprobs, penalties,
    # lengths): a caller's change to the SamplingParams it passed, mid-run, must not reach the request.
    engine = engines[True].engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rid = engine.add_request(_prompts(11, [7])[0], params)
    finals = {}
    for i in range(40):
        if i == 3:
            params.max_tokens, params.logprobs, params.output_kind = 2, 3, "delta"
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    _check_idle(engine)
    out = finals[rid].outputs[0]
    assert len(out.token_ids) == 12 and out.logprobs is None and out.finish_reason == "length"


def test_async_scheduling_must_be_a_bool(untied_model: str) -> None:
    for value in ("yes", 1, "true"):
        with pytest.raises(ConfigError) as e:
            LLM(model=untied_model, async_scheduling=value)
        assert e.value.field == "async_scheduling" and "async_scheduling" in str(e.value)
    assert EngineConfig(async_scheduling=None).async_scheduling is None
    # None: off on a CPU.
    llm = LLM(model=untied_model, dtype="float32", max_model_len=64, num_kv_blocks=8)
    llm.generate(_prompts(9, [6, 9]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert llm.engine.stats["num_pipelined_steps"] == 0


def _alternating_dspark(model: str, tmp_path: Path, **kw: Any) -> LLM:
    """An async engine with a random DSpark drafter whose drafting choice alternates, four plain steps then two
    drafting ones: pipelined runs that the regime ends by drafting."""
    from dspark.models.loader import load_config
    from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
    from dspark.speculative.drafters.dspark.config import DSparkConfig

    cfg = DSparkConfig.for_target(load_config(Path(model)), num_layers=1, block_size=4, num_taps=2, markov_rank=8)
    drafter = str(save_drafter(random_drafter(cfg, seed=1), tmp_path / "drafter"))
    llm = LLM(
        model=model,
        async_scheduling=True,
        speculative_config={"method": "dspark", "model": drafter},
        cost_model=_STEEP,
        **kw,
    )
    planner = llm.engine.planner
    assert planner is not None
    calls = {"n": 0}

    def alternating(request_ids: list[str]) -> bool:
        calls["n"] += 1
        return calls["n"] % 6 >= 4

    planner.should_draft = alternating  # type: ignore[method-assign]
    return llm


def test_dspark_drafting_after_a_pipelined_run(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A run of pipelined plain steps, then the regime chooses to draft: the DSpark drafter writes K lookahead slots
    past the last token, which the pipelined steps must have reserved, else drafting runs past a request's block
    table. The choice alternates here, four plain steps then two drafting ones; greedy output is
    that without speculation."""
    model = str(tiny_model_dirs["llama"])
    # block_size 4: the lookahead (4 slots) crosses block boundaries often
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, "block_size": 4}
    prompts = _prompts(10, [5, 13, 30, 7])
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    reference = LLM(model=model, async_scheduling=False, **kw).generate(prompts, params)
    llm = _alternating_dspark(model, tmp_path, **kw)
    out = llm.generate(prompts, params)
    for i, (a, b) in enumerate(zip(reference, out, strict=True)):
        assert _summary(b) == _summary(a), f"request {i}"
    m = llm.get_metrics()
    _check_idle(llm.engine)
    assert m["num_pipelined_steps"] > 0 and m["spec_decode_num_draft_tokens"] > 0


def test_a_continued_step_that_drafts_is_not_measured_as_plain(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Continued steps report what they ran. The regime ends a run of plain continued steps by choosing to draft: the
    step after it starts a pipeline (a continued step that drafts on the device and verifies nothing: a switching step,
    which the regime does not count), and the pipelined steps after it verify and draft. Plain continued steps count
    as plain. The cost model prices every step that drafted as speculative, the plain ones as plain."""
    model = str(tiny_model_dirs["llama"])
    llm = _alternating_dspark(model, tmp_path, dtype="float32", max_model_len=256, num_kv_blocks=256)
    engine, planner, timer = llm.engine, llm.engine.planner, llm.engine.core.timer
    assert planner is not None and planner.cost is not None and timer is not None
    seen: list[tuple[str, bool, bool]] = []  # (what the step ran, verified, drafted) of what continued steps reported
    priced: list[tuple[str, bool]] = []  # (what the step ran, speculative) of what they told the cost model
    observe, finished, cost_observe = planner.regime.observe, timer.continued_step_finished, planner.cost.observe
    inside = {"on": False}

    def spy_observe(
        n: int, verified: bool, drafted: bool, tokens: int, ms: float, expected: tuple[float, int] | None = None
    ) -> None:
        if inside["on"]:
            seen.append((engine.last_step_kind, verified, drafted))
        observe(n, verified, drafted, tokens, ms, expected)

    def spy_cost(n: int, base_ms: float, ms: float, speculative: bool) -> None:
        if inside["on"]:
            priced.append((engine.last_step_kind, speculative))
        cost_observe(n, base_ms, ms, speculative)

    def spy_finished(*args: Any, **kwargs: Any) -> None:
        inside["on"] = True
        try:
            finished(*args, **kwargs)
        finally:
            inside["on"] = False

    planner.regime.observe = spy_observe  # type: ignore[method-assign]
    planner.cost.observe = spy_cost  # type: ignore[method-assign]
    timer.continued_step_finished = spy_finished  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm.generate(_prompts(11, [5, 9, 14]), params)
    kinds = {kind for kind, _, _ in seen}
    assert {"draft", "plain", "verify+draft"} <= kinds, seen  # all happened and were reported
    for kind, verified, drafted in seen:
        assert drafted == (kind in ("draft", "verify+draft")) and verified == (kind == "verify+draft"), seen
    assert {kind for kind, _ in priced} >= {"draft", "plain"}
    assert all(speculative == (kind != "plain") for kind, speculative in priced), priced


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_regime_hears_each_verified_steps_expected_and_accepted_drafts(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, async_scheduling: bool
) -> None:
    """Every step the regime chooser measures that verified drafts comes with their expected accepted count (the sum of
    the verified slots' survivals) and the accepted count, from that step's own verification: its tokens are its
    requests' one each plus those accepted drafts (fewer only where a request ended inside its block). Steps that
    verified nothing carry none. Both timing paths: steps launched alone (events or the host clock) and pipelined
    continued steps."""
    model = str(tiny_model_dirs["llama"])
    llm = _alternating_dspark(model, tmp_path, dtype="float32", max_model_len=256, num_kv_blocks=256)
    if not async_scheduling:
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=256,
            speculative_config={"method": "dspark", "model": str(tmp_path / "drafter")},
            cost_model=_STEEP,
        )
    planner = llm.engine.planner
    assert planner is not None
    heard: list[tuple[int, bool, int, tuple[float, int] | None]] = []
    observe = planner.regime.observe

    def spy_observe(
        n: int, verified: bool, drafted: bool, tokens: int, ms: float, expected: tuple[float, int] | None = None
    ) -> None:
        heard.append((n, verified, tokens, expected))
        observe(n, verified, drafted, tokens, ms, expected)

    planner.regime.observe = spy_observe  # type: ignore[method-assign]
    if not async_scheduling:
        planner.should_draft = lambda request_ids: True  # type: ignore[method-assign]
    llm.generate(_prompts(17, [6, 11, 8]), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    verified = [h for h in heard if h[1]]
    assert verified and all(h[3] is None for h in heard if not h[1])
    for n, _, tokens, expected in verified:
        assert expected is not None
        assert 0.0 < expected[0] and 0 <= expected[1]
        assert tokens <= n + expected[1]
    # a step's tokens fall short of its requests plus accepted drafts only where a request ended inside its block
    assert sum(tokens != n + e[1] for n, _, tokens, e in verified if e is not None) <= 3
    assert sum(e[1] for *_, e in verified if e is not None) <= planner.calibration.realised


def test_every_plain_step_of_a_pipelined_run_is_measured(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A pipelined run starts with a step launched alone, whose successor is launched before it is collected: that
    successor is timed from the first step's end, like every later continued step from its predecessor's. Were it
    left unmeasured, a regime burst of plain steps (a switching step, then two plain ones) would reach the regime with
    no plain measurement at all, and a level whose model says draft would keep drafting, its plain rate unknown."""
    model = str(tiny_model_dirs["llama"])
    llm = _alternating_dspark(model, tmp_path, dtype="float32", max_model_len=256, num_kv_blocks=256)
    engine, planner, timer = llm.engine, llm.engine.planner, llm.engine.core.timer
    assert planner is not None and timer is not None
    continued_plain, measured_plain = [0], [0]
    observe, finished = planner.regime.observe, timer.continued_step_finished
    inside = {"on": False}

    def spy_observe(
        n: int, verified: bool, drafted: bool, tokens: int, ms: float, expected: tuple[float, int] | None = None
    ) -> None:
        if inside["on"] and engine.last_step_kind == "plain" and not verified and not drafted and ms > 0:
            measured_plain[0] += 1
        observe(n, verified, drafted, tokens, ms, expected)

    def spy_finished(num_requests: int, num_emitted: int, chain_goes_on: bool, drafted: bool, **kw: Any) -> None:
        continued_plain[0] += not drafted
        inside["on"] = True
        try:
            finished(num_requests, num_emitted, chain_goes_on, drafted, **kw)
        finally:
            inside["on"] = False

    planner.regime.observe = spy_observe  # type: ignore[method-assign]
    timer.continued_step_finished = spy_finished  # type: ignore[method-assign]
    llm.generate(_prompts(13, [6, 11]), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    # every pipelined run here is one step launched alone and continued steps: each continued plain step is measured
    assert continued_plain[0] >= 10 and measured_plain[0] == continued_plain[0]


def _adaptive_ngram(model: str, async_scheduling: bool = True, **kw: Any) -> LLM:
    """Adaptive n-gram speculation (k = 4) under the steep cost model; kw overrides the engine's other settings."""
    settings: dict[str, Any] = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64} | kw
    return LLM(
        model=model,
        async_scheduling=async_scheduling,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        cost_model=_STEEP,
        **settings,
    )


def _plain_adaptive_ngram(model: str, async_scheduling: bool = True, **kw: Any) -> LLM:
    """Adaptive n-gram speculation held in its plain regime: every decode step that can be pipelined is."""
    llm = _adaptive_ngram(model, async_scheduling, **kw)
    assert llm.engine.planner is not None
    llm.engine.planner.should_draft = lambda request_ids: False  # type: ignore[method-assign]
    return llm


def test_a_step_launched_for_requests_that_all_ended_is_dropped(untied_model: str) -> None:
    """The last request stops on a stop token while the step after it is already launched; the engine goes idle. The
    next request must not wait a step behind that leftover, and the idle time must not reach the regime as one plain
    step (level 1's plain rate would read the whole pause)."""
    import time

    prompt = _prompts(3, [9])[0]
    ref = LLM(model=untied_model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    stop = ref.outputs[0].token_ids[25]
    llm = _plain_adaptive_ngram(untied_model)
    engine, planner = llm.engine, llm.engine.planner
    assert planner is not None
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop" and engine.stats["num_pipelined_steps"] > 0
    observed: list[float] = []
    observe = planner.regime.observe
    planner.regime.observe = lambda *a, **kw: (observed.append(a[4]), observe(*a, **kw))  # type: ignore[method-assign]
    steps = engine.stats["num_steps"]
    time.sleep(0.5)  # idle, as a server between requests
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    first = engine.step()
    assert first and first[0].outputs[0].token_ids == ref.outputs[0].token_ids[:1]  # its prefill, not the leftover
    assert engine.stats["num_steps"] == steps + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert all(ms < 250 for ms in observed), observed


def test_the_regime_hears_only_the_tokens_a_continued_step_kept(untied_model: str) -> None:
    """A request stops on a stop token mid-run while the others go on: the continued step that carried its voided
    token reports the requests it served and the tokens they kept, so that every token reported to the planner is one
    the engine generated."""
    prompts = _prompts(4, [7, 12, 5])
    ref = LLM(model=untied_model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64).generate(
        prompts[:1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    stop = ref.outputs[0].token_ids[12]
    llm = _plain_adaptive_ngram(untied_model)
    timer = llm.engine.core.timer
    assert timer is not None
    reported = []
    for name in ("step_finished", "continued_step_finished"):
        real = getattr(timer, name)

        def spy(*args: Any, _real: Any = real, **kwargs: Any) -> None:
            reported.append(args[1])  # num_emitted, the second argument of both
            _real(*args, **kwargs)

        setattr(timer, name, spy)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])
    before = llm.engine.stats["num_generation_tokens"]
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert sum(reported) == llm.engine.stats["num_generation_tokens"] - before


def test_a_queue_that_cannot_be_admitted_does_not_stop_the_overlap(untied_model: str) -> None:
    """Every seat taken (max_num_seqs) and requests waiting: the waiting ones could not run anyway, so steps still
    overlap; a freed seat is filled within a step of the synchronous engine. Outputs are the synchronous ones."""
    prompts = _prompts(6, [6, 9, 4, 11])
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) for _ in prompts]
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "max_num_seqs": 2}
    sync = LLM(model=untied_model, async_scheduling=False, **kw)
    want = [_summary(o) for o in sync.generate(prompts, params)]
    llm = LLM(model=untied_model, async_scheduling=True, **kw)
    got = [_summary(o) for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.engine.stats
    # two waves of 30 tokens: all but the prefill and the last steps of each wave overlap
    assert stats["num_pipelined_steps"] >= 0.8 * stats["num_steps"], stats
    assert stats["num_steps"] <= sync.engine.stats["num_steps"] + 4
    _check_idle(llm.engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_host_work_of_ending_requests_is_not_a_step_cost(untied_model: str, async_scheduling: bool) -> None:
    """A request that ends has its final output built in that step (its deferred text, freeing it, the output): host
    work every regime pays once per request. Neither the regime's rates nor the cost model may read it as the step's
    cost, whether the step is timed host to host (continued) or as one step (synchronous): counted in, the steps where
    a sweep's requests end read as slow plain steps, a level's plain rate falls far below its real one, and the level
    drafts at a loss. Here ending a request takes 0.3 s, nearly all of such a step: it is no measurement, and no step
    may read it."""
    import time

    llm = _plain_adaptive_ngram(untied_model, async_scheduling=async_scheduling)
    core, planner, timer = llm.engine.core, llm.engine.planner, llm.engine.core.timer
    assert planner is not None and planner.cost is not None and timer is not None
    finish = core._finish

    def slow_finish(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.3)
        finish(*args, **kwargs)

    core._finish = slow_finish  # type: ignore[method-assign]
    observed: list[float] = []
    priced: list[float] = []
    observe, cost_observe = planner.regime.observe, planner.cost.observe
    planner.regime.observe = lambda *a, **kw: (observed.append(a[4]), observe(*a, **kw))  # type: ignore[method-assign]
    planner.cost.observe = lambda n, base, ms, speculative: (priced.append(ms), cost_observe(n, base, ms, speculative))  # type: ignore[method-assign]
    ending_steps = [0]  # steps that ended a request and were timed
    dropped = [0]  # those that reached neither the regime nor the cost model
    name = "continued_step_finished" if async_scheduling else "step_finished"
    finished = getattr(timer, name)

    def spy(*args: Any, ending_ms: float = 0.0, **kwargs: Any) -> None:
        timed = timer._last_continued is not None if async_scheduling else timer._step_start is not None
        before = (len(observed), len(priced))
        finished(*args, ending_ms=ending_ms, **kwargs)
        planner.timing.harvest(planner.cost, planner.regime)  # type: ignore[arg-type]
        if timed and ending_ms >= 300:
            ending_steps[0] += 1
            # Dropped, unless the rest of the step was a fifth of it or more (ENDING_MIN_SHARE: 75 ms here, which a
            # stalled CI host can reach); kept, it is without its ending work.
            dropped[0] += (len(observed), len(priced)) == before
            new = observed[before[0] :] + priced[before[1] :]
            assert all(ms < 150 for ms in new), f"a step's ending work reached the regime or the cost model: {new}"

    setattr(timer, name, spy)
    prompts = _prompts(5, [6, 9, 4])
    # they end at different steps, each while the others decode on (in a pipelined run when async)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params)
    assert ending_steps[0] >= 2 and dropped[0] >= 1 and len(observed) >= 20
    assert max(observed) < 150 and max(priced) < 150, (max(observed), max(priced))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_regime_hears_how_many_requests_have_started(untied_model: str, async_scheduling: bool) -> None:
    """Each request counts once, when it is first scheduled (not when it is added; preemptions: the test below):
    the regime chooser's new-text signal. The planner passes the count with every choice."""
    llm = _adaptive_ngram(untied_model, async_scheduling, max_num_seqs=2)
    planner = llm.engine.planner
    assert planner is not None
    heard: list[int | None] = []
    choose = planner.regime.choose

    def spy(n: int, model_says: Any, arrivals: int | None = None) -> bool:
        heard.append(arrivals)
        return choose(n, model_says, arrivals=arrivals)

    planner.regime.choose = spy  # type: ignore[method-assign]
    llm.generate(_prompts(5, [6, 9, 7, 8, 5]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert planner.num_admitted == 5
    assert heard and heard[-1] == 5 and all(a is not None for a in heard)
    assert heard == sorted(heard) and heard[0] <= 2  # two at a time: the count grows as requests start


def test_a_preempted_request_starts_once_for_the_regime(untied_model: str) -> None:
    """The cache forces preemptions (as in test_preemption_while_pipelining): a request recomputed after one is not new
    text, so it is not counted again."""
    llm = _adaptive_ngram(untied_model, max_model_len=64, block_size=4, num_kv_blocks=20)
    llm.generate(_prompts(7, [8, 7, 9, 8]), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert llm.get_metrics()["num_preemptions"] > 0, "the cache was meant to force preemption"
    assert llm.engine.planner is not None and llm.engine.planner.num_admitted == 4
