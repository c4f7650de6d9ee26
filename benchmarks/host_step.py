"""The host's share of a decode step, with the model replaced by a stub: scheduler, inputs, output processing.

    python benchmarks/host_step.py --concurrency 256 --output-kind cumulative final_only --thaw

Every request emits one token per step from a stub runner, so what is timed is the engine's own Python: the
scheduler, the runner's input lists and sampling rows, and output processing (detokenising, stop checks, outputs).
--thaw also times each output kind with the GC heap unfrozen (as if the engine did not freeze it after start-up).
--real-runner keeps the model runner's own launch and collect (inputs, sampling-path choice, the argmax, the tokens'
way back) and stubs only the target's forward and logits (8 vocabulary columns), with --spec the drafter's context
write, and with a temperature the sampler's draw (the CPU draws row by row, where a CUDA step makes one batched pass;
the draw's uniforms are still computed on the host); the tokens sampled are then made ordinary text tokens (so that
streamed output detokenises text). The graph runner's staging (CUDA only) is not in it.

Against another commit, run both from their own checkouts with PYTHONPATH set to each (`PYTHONPATH=$PWD python
benchmarks/host_step.py ...` in a `git worktree`): `python benchmarks/host_step.py` puts benchmarks/, not the checkout,
first on sys.path, and the editable install then imports the main checkout's dspark in both.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from dspark import LLM, SamplingParams
from dspark.sample import sampler as sampler_module
from dspark.sample.random import uniforms
from dspark.speculative import planner as planner_module
from dspark.speculative.budget import drafting_verdict
from dspark.speculative.regime import Verdict
from dspark.worker import model_runner as mr


def host_ms(
    concurrency: int,
    output_kind: str,
    thaw: bool,
    steps: int,
    spec: bool = False,
    async_scheduling: bool = False,
    temperature: float = 1.0,
    model_verdict: bool = False,
    real_runner: bool = False,
) -> float:
    # spec: an adaptive DSpark engine whose planner always answers "drafting does not pay", i.e. the plain steps of
    # adaptive verification at high load, which should cost what a no-spec step costs.
    config = {"method": "dspark", "num_speculative_tokens": 7} if spec else None
    llm = LLM(
        max_num_seqs=concurrency,
        max_model_len=1024,
        device="cpu",
        dtype="bfloat16",  # every request's whole run in half fp32's memory, which C = 1024 would nearly fill
        speculative_config=config,
        async_scheduling=async_scheduling,
        # Every request's whole run fits (64 prompt tokens, 100 + steps generated, a drafter's lookahead): sized
        # from memory, the cache could hold only part of the requests, and a queue that a free seat could admit stops
        # the overlap of async scheduling (engine/policy.py), so most steps would be launched alone.
        num_kv_blocks=concurrency * ((64 + 100 + steps + 16) // 16 + 2),
    )
    engine = llm.engine
    if engine.planner is not None and not model_verdict:
        planner, regime_choose = engine.planner, engine.planner.regime.choose
        planner.regime.choose = lambda n, model_says: regime_choose(n, False) and False  # type: ignore[method-assign]
    elif engine.planner is not None:
        # The regime asks the cost model as at a level that never measured drafting: the verdict computed
        # (reused for PREDICTED_PLAIN_REUSE steps at the same request count; the stub's count moves during its ramp,
        # so more often there), turned into "plain, drafting 10x slower" so that the stub never drafts.
        assert engine.planner.cost is not None
        engine.planner.cost._spec_loads.append(1)  # "drafting measured at a lower load": predictions are passed on

        def verdict(*args: object) -> Verdict:
            v = drafting_verdict(*args)  # type: ignore[arg-type]
            assert v.rate is not None and v.ms is not None
            return Verdict(False, {True: v.rate[False] / 10, False: v.rate[False]}, v.ms)

        planner_module.drafting_verdict = verdict  # type: ignore[assignment]

    def stub(sched: mr.SchedulerOutput, previous: mr.Launched | None = None) -> mr.Launched:
        # a naive runner's host work (input lists and sampling lists request by request, every step); one token per
        # sampling request. --real-runner times the runner's own work.
        ids: list[int] = []
        for s in sched.scheduled:
            req = s.request
            ids += req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + s.num_new_tokens]
            mr.slots_for(req.block_ids, req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens, 16)
        sampling = [s for s in sched.scheduled if s.samples]
        if all(s.request.sampling_path == "greedy" for s in sampling):  # as ModelRunner.launch
            pass
        elif all(s.request.sampling_path == "temperature" for s in sampling):
            # the lists ModelRunner.launch hands Sampler.temperature, and its uniforms
            _ = [s.request.sampling_params.temperature for s in sampling]
            uniforms([s.request.seed for s in sampling], [s.request.num_output_tokens + s.continues for s in sampling])
        else:
            [mr.sampling_row(s.request, [0] if s.continues else None) for s in sampling]
        # tokens left "on the device" as the real runner leaves them, so that async scheduling can continue the step
        sampling = [s.request.request_id for s in sched.scheduled if s.samples]
        tokens = torch.full((len(sampling),), 100, dtype=torch.int64)
        return mr.Launched(sched, tokens=tokens, download=mr.Download(tokens), request_ids=sampling)

    if real_runner:
        runner = engine.runner
        # device work, one batched pass on a GPU: its inputs (the uniforms) are made on the host before it is called
        sampler_module.draw = lambda probs, u: torch.zeros(probs.shape[0], dtype=torch.int64)  # type: ignore[assignment]
        hidden = torch.zeros(8192, 4)
        slots = torch.zeros(8192, dtype=torch.int64)

        def forward(input_ids: list[int], *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
            n = len(input_ids)
            return hidden[:n], hidden[:n] if spec else None, slots[:n], slots[:n]

        runner._forward_eager = forward  # type: ignore[method-assign, assignment]
        runner.model.compute_logits = lambda h, invariant=None: torch.zeros(h.shape[0], 8)  # type: ignore[method-assign]
        if runner.drafter is not None:  # --spec: the drafter's context write is device work (a matmul), stubbed too
            runner.drafter.extend_context = lambda taps, positions, slots: None  # type: ignore[method-assign]
        # The stubs sample token 0, a special token that decodes to nothing: a streamed request's detokenizer
        # would never emit text, and its window would grow every step. Every request samples an ordinary text token
        # instead (ids 1000-1499 in turn, one a step): an in-place add on the step's [n] tokens.
        launch, num_launched = runner.launch, [0]

        def text_launch(sched: mr.SchedulerOutput, previous: mr.Launched | None = None) -> mr.Launched:
            launched = launch(sched, previous)
            if launched.tokens is not None:
                with torch.inference_mode():  # the runner's tensors are inference tensors
                    launched.tokens.add_(1000 + num_launched[0] % 500)
            num_launched[0] += 1
            return launched

        runner.launch = text_launch  # type: ignore[method-assign]
    else:
        engine.runner.launch = stub  # type: ignore[method-assign]
    params = SamplingParams(temperature=temperature, max_tokens=steps + 200, ignore_eos=True, output_kind=output_kind)
    for i in range(concurrency):
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8 + i % 50] * 8, params)
    for _ in range(100):
        engine.step()
    if thaw:
        gc.unfreeze()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    # The median step, not the mean: on a shared host stolen time comes in bursts that move the mean between runs of
    # the same tree.
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--output-kind", nargs="+", default=["cumulative", "final_only"])
    parser.add_argument("--thaw", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--spec", action="store_true", help="also time an adaptive DSpark engine's plain steps")
    parser.add_argument(
        "--async-scheduling", action="store_true", help="with async scheduling (each step continued from the last)"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy rows (the runner's argmax path)")
    parser.add_argument(
        "--model-verdict",
        action="store_true",
        help="--spec: the regime asks the cost model (computed, then said plain) instead of being told plain",
    )
    parser.add_argument(
        "--real-runner",
        action="store_true",
        help="the model runner's own launch and collect, the target's forward, logits and draws stubbed",
    )
    args = parser.parse_args()
    for kind in args.output_kind:
        for thaw in (True, False) if args.thaw else (False,):
            for spec in (False, True) if args.spec else (False,):
                ms = host_ms(
                    args.concurrency,
                    kind,
                    thaw,
                    args.steps,
                    spec,
                    args.async_scheduling,
                    args.temperature,
                    args.model_verdict,
                    args.real_runner,
                )
                heap = "unfrozen" if thaw else "frozen"
                arm = "adaptive (plain steps)" if spec else "no-spec"
                print(
                    f"{arm} C={args.concurrency} output_kind={kind} GC heap {heap}: {ms:.2f} ms/step (median)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
