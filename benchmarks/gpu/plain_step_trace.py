"""Why a plain step (no drafts verified, none drafted) of an adaptive engine costs more than a no-spec step: both
engines decode C requests in steady state, the adaptive one held in its plain regime, under torch.profiler. The
fixed-7 configuration traces drafting steps (verify 7, draft again) the same way.

    python benchmarks/gpu/plain_step_trace.py --concurrency 1 512 --config no-spec adaptive fixed-7 --steps 20

Prints per configuration the wall time per step, the device time per step, and the operators with the most device
and host time.
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dspark import LLM, SamplingParams

CONFIGS = {
    "no-spec": None,
    "adaptive": {"method": "dspark", "num_speculative_tokens": 7},
    # every step verifies 7 drafts and drafts again: what a drafting step costs, against a plain one
    "fixed-7": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False},
}


def trace(
    name: str, concurrency: int, steps: int, top: int, temperature: float = 0.0, context: int = 0
) -> dict[str, float]:
    """Prints the step's wall and device time and the top operators; returns each kernel's device us a step."""
    llm = LLM(
        device="cuda",
        max_num_seqs=concurrency,
        max_model_len=2048,
        num_kv_blocks=max(8192, concurrency * (48 + context // 16)),
        speculative_config=CONFIGS[name],
    )
    engine = llm.engine
    if engine.planner is not None:  # the plain regime: never draft
        engine.planner.regime.choose = lambda n, model_says: False  # type: ignore[method-assign]
    params = SamplingParams(
        temperature=temperature, max_tokens=steps * 4 + 64, ignore_eos=True, output_kind="final_only"
    )
    # context: about that many prompt tokens a request (a sweep row's prompts and outputs are ~100-500 tokens; the
    # attention's share of a step grows with them)
    filler = " Explain how a bicycle stays upright." * (context // 8)
    for i in range(concurrency):
        engine.add_request(f"Question {i}: explain how a bicycle stays upright.{filler}", params)
    for _ in range(16):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # NOTE: kernels only: a CPU op's self device time is the time of the kernels it launched, which appear as events
    # of their own, so summed over every event eager kernels would count twice.
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / steps
    print(
        f"== {name} C={concurrency} T={temperature:g}: {wall:.2f} ms/step wall (unprofiled), "
        f"{device_us / 1e3:.2f} ms/step on device"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    kernels = collections.Counter[str]()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            kernels[e.key] += e.self_device_time_total / steps
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return dict(kernels)


def print_diff(label: str, per_config: dict[str, dict[str, float]], top: int) -> None:
    """Each configuration's kernels against the first's: the device time a step that differs most, and the total."""
    (base, ref), *others = per_config.items()
    for name, kernels in others:
        diff = {k: kernels.get(k, 0.0) - ref.get(k, 0.0) for k in set(ref) | set(kernels)}
        print(f"== {label}: {name} - {base}: {sum(diff.values()):+.1f} us a step on device")
        for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"  {d:+9.1f} us  ({ref.get(k, 0.0):8.1f} -> {kernels.get(k, 0.0):8.1f})  {k[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[512])
    parser.add_argument("--config", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    parser.add_argument("--context", type=int, default=0, help="about this many more prompt tokens a request")
    args = parser.parse_args()
    for t in args.temperature:
        for c in args.concurrency:
            per_config = {name: trace(name, c, args.steps, args.top, t, args.context) for name in args.config}
            print_diff(f"C={c} T={t:g}", per_config, args.top)


if __name__ == "__main__":
    main()
