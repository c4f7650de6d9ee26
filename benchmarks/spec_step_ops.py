"""The device work of a pipelined speculative step, counted on CPU: operations that launch a kernel, by part.

    python benchmarks/spec_step_ops.py --concurrency 1 64 --temperature 0 1 [--output-json F.json] [--by-op PART] \
        [--twin-draw]

At small batches a pipelined step (worker/spec_pipeline.py) is one CUDA graph of many tiny kernels, and its device
time grows with their count: on the H200 at C = 1 a fixed-7 step took 1.72 ms of device time at T = 0 and 3.17 ms at
T = 1 (`benchmarks/results/h200/spec-goal.json`), the same model and block, only more sampling kernels. This script
runs the same step eagerly on CPU (fp32, the default model and its shipped drafter, fixed k = 7, graphs' padded shapes)
and counts the operations that reach the device, with a dispatch mode, by part:

- gather, allocate and lay out (SpecPipeline.prologue_a; the allocation is its torch twin here, one Triton kernel on
  CUDA, so it is counted as 1, and 2 where its survivals are a strided view the kernel copies first);
- the target forward (not counted: the same graph as a plain step's);
- verify and append (epilogue_a);
- the block's inputs (prologue_b), the drafter's backbone, draft logits, Markov loop with sampling (the loop CUDA
  runs, not the CPU's one C call), and the new survivals (epilogue_b);
- the step's own copies (ctrl, block tables, outputs).

Draws take CUDA's branches: batched, and a one-row draw padded to two rows (random.inverse_cdf_rows), so that C = 1
counts what CUDA launches. A sampled draft position is CUDA's one fused kernel (draw_kernel.py), counted as one op with
its reads and writes; --twin-draw counts the torch loop it replaced instead. Views (slices, reshapes, transposes),
`empty` and a `to` that returns its input launch nothing and are not counted. A read of a device value on the host
(`item`, `tolist`) is counted apart, as syncs: the eager path reads a few (the attention's host lists), graphs none.
Beside the count, the bytes each op reads and writes (its tensor arguments and its output, each once; a gather its
output twice; an `out=` tensor counts as read too): at large batches the vocabulary-wide rows of sampling (softmax, the
draws' fp64 scans) dominate them. Both figures are counts, not times: what an op costs on a GPU is measured there.

The script is not part of the package: nothing imports it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dspark
from dspark import LLM, SamplingParams
from dspark.bench.throughput import machine_info
from dspark.models import llama
from dspark.sample import random as random_module
from dspark.sample import rejection
from dspark.sample.ops import temperature_probs
from dspark.speculative import budget as budget_module
from dspark.speculative.drafters.dspark import drafter as drafter_module
from dspark.speculative.drafters.dspark import draw_kernel
from dspark.speculative.drafters.dspark import markov as markov_module
from dspark.speculative.drafters.dspark import model as model_module
from dspark.worker import spec_pipeline

FREE = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach", "_to_copy_noop"}
SYNCS = {"_local_scalar_dense", "item"}
GATHERS = {"embedding", "index", "gather", "index_select", "take"}


class Counter(TorchDispatchMode):
    """Ops dispatched while active, filed under the innermost part running."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "step"
        self.counts: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.syncs = 0
        self.bytes: collections.Counter[str] = collections.Counter()
        self.allocate_copies = 0
        self.paused = False  # a Triton kernel's torch twin running: the kernel is counted instead

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused:
            pass
        elif name in SYNCS:
            self.syncs += 1
        # NOTE: `to` says it may alias its input (is_view), and does only when it returns it unchanged.
        elif (out is not args[0]) if name == "to" else not (func.is_view or name in FREE):
            self.counts[self.part] += 1
            self.ops[self.part, name] += 1
            # A gather reads only what it gathers (and its index), not the whole table.
            read = 2 * _bytes(out) if name in GATHERS else _bytes(args) + _bytes(kwargs)
            self.bytes[self.part] += read + _bytes(out)
        return out


def _bytes(x: Any) -> int:
    """Bytes of the tensors in x: what an op reads (its inputs) or writes (its output), read once each."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_bytes(v) for v in x.values())
    return 0


MODE = Counter()


def _in_part(part: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        outer, MODE.part = MODE.part, part
        try:
            return fn(*a, **k)
        finally:
            MODE.part = outer

    return wrapped


def _count_fused_draw() -> None:
    """Sampled drafts through the fused draw (draw_kernel.py), as CUDA runs them: one op a position, reading the base
    logits and the correction four times (max, sum, the distribution and its total, the scan) and writing the
    distribution once. Here its torch twin computes the values, uncounted."""

    def counted(
        base: torch.Tensor,
        correction: torch.Tensor | None,
        temps: torch.Tensor,
        greedy: torch.Tensor,
        u: torch.Tensor,
        out: torch.Tensor | None = None,
        one_hot_greedy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        MODE.paused = True
        try:
            logits = base if correction is None else base + correction
            top = logits.argmax(-1)
            q = temperature_probs(logits, temps, greedy if one_hot_greedy else None, top, out=out)
            x = torch.where(greedy, top, random_module.inverse_cdf_rows(q, u))
        finally:
            MODE.paused = False
        MODE.counts[MODE.part] += 1
        MODE.ops[MODE.part, "draw_kernel (Triton)"] += 1
        MODE.bytes[MODE.part] += 4 * (_bytes(base) + _bytes(correction)) + _bytes([q, temps, greedy, u, x])
        return x, q

    draw_kernel.enabled = lambda device: True
    draw_kernel.draw_position = counted


def _instrument() -> None:
    sp = spec_pipeline.SpecPipeline
    for name, part in [
        ("prologue_a", "gather+layout"),
        ("epilogue_a", "verify+append"),
        ("prologue_b", "block inputs"),
        ("epilogue_b", "survivals"),
    ]:
        setattr(sp, name, _in_part(part, getattr(sp, name)))
    budget_module.allocate_torch = _in_part("allocate", budget_module.allocate_torch)
    allocate = budget_module.allocate

    def allocate_noting_copies(survival: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        # The Triton kernel reads contiguous survivals: a strided view costs it a copy first.
        MODE.allocate_copies += 0 if survival.is_contiguous() else 1
        return allocate(survival, *a, **k)

    spec_pipeline.allocate = allocate_noting_copies
    model_module.DSparkModel.backbone = _in_part("drafter backbone", model_module.DSparkModel.backbone)
    llama.CausalLM.draft_logits = _in_part("draft logits", llama.CausalLM.draft_logits)
    drafter_module.sample_block_with = _in_part("markov+sample", markov_module.sample_block_with)
    drafter_module.DSparkDrafter.flush_context = _in_part("cpu flush", drafter_module.DSparkDrafter.flush_context)
    # What CUDA runs: the Markov loop, not the CPU's one C call for greedy blocks; every draw batched, not row by row.
    rejection.draw = random_module.inverse_cdf_rows
    # ... including the one-row case, which CUDA pads to two rows (random.inverse_cdf_rows) and a CPU does not
    one_row = random_module.inverse_cdf_rows

    def cuda_rows(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if p.shape[0] == 1:
            return one_row(torch.cat([p, torch.zeros_like(p)]), torch.cat([u, u]))[:1]
        return one_row(p, u)

    random_module.inverse_cdf_rows = rejection.draw = markov_module.inverse_cdf_rows = cuda_rows
    markov_module.cpu_kernels = type("NoCpuKernels", (), {"supports": staticmethod(lambda x: False)})


NOT_COUNTED = ("target forward", "cpu flush", "allocate")


def count(concurrency: int, temperature: float, steps: int) -> dict[str, Any]:
    llm = LLM(
        dtype="float32",
        speculative_config={"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False},
        max_num_seqs=max(concurrency, 4),
        async_scheduling=True,
    )
    pipe = llm.engine.runner.pipeline
    assert pipe is not None, "the default drafter has a confidence head: the engine pipelines its steps"
    pipe.forward = _in_part("target forward", pipe.forward)
    pipe.pad_like_graphs(llm.engine.config.max_num_batched_tokens)
    launch = pipe.launch
    per_step: list[tuple[dict[str, int], dict[tuple[str, str], int], int, dict[str, int]]] = []

    def counted(*a: Any, **k: Any) -> Any:
        MODE.counts.clear()
        MODE.ops.clear()
        MODE.syncs = 0
        MODE.bytes.clear()
        MODE.allocate_copies = 0
        with MODE:
            out = launch(*a, **k)
        counts = dict(MODE.counts) | {"allocate (Triton)": 1 + MODE.allocate_copies}
        per_step.append((counts, dict(MODE.ops), MODE.syncs, dict(MODE.bytes)))
        return out

    pipe.launch = counted
    params = SamplingParams(max_tokens=steps, temperature=temperature, ignore_eos=True, seed=1)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * concurrency, params)
    drafting = [s for s in per_step if s[0].get("markov+sample")]
    totals = [sum(v for p, v in c.items() if p not in NOT_COUNTED) for c, *_ in drafting]
    mid = totals.index(sorted(totals)[len(totals) // 2])
    parts, ops, syncs, moved = drafting[mid]
    parts = {p: v for p, v in parts.items() if p not in NOT_COUNTED}
    return {
        "concurrency": concurrency,
        "temperature": temperature,
        "steps_counted": len(drafting),
        "device_ops": sum(parts.values()),
        "device_ops_range": [min(totals), max(totals)],
        "target_forward_ops": drafting[mid][0].get("target forward", 0),
        "syncs_eager": syncs,
        "mb_moved": round(sum(v for p, v in moved.items() if p not in NOT_COUNTED) / 2**20, 2),
        "mb_moved_parts": {p: round(v / 2**20, 2) for p, v in moved.items() if p not in NOT_COUNTED},
        "parts": parts,
        "ops": {f"{p}: {o}": v for (p, o), v in sorted(ops.items()) if p not in NOT_COUNTED},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--steps", type=int, default=12, help="tokens per request (about steps / 2 pipelined steps)")
    ap.add_argument("--by-op", default=None, help="print this part's ops by name")
    ap.add_argument("--twin-draw", action="store_true", help="count the torch loop where CUDA runs the fused draw")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    _instrument()
    if not args.twin_draw:
        _count_fused_draw()
    rows = []
    for c in args.concurrency:
        for t in args.temperature:
            row = count(c, t, args.steps)
            rows.append(row)
            parts = ", ".join(f"{p} {v}" for p, v in row["parts"].items())
            print(f"C={c} T={t:g}: {row['device_ops']} device ops a step ({parts}); {row['mb_moved']} MB moved")
            if args.by_op:
                for key, v in row["ops"].items():
                    if key.startswith(args.by_op + ":"):
                        print(f"    {key} {v}")
    if args.output_json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(  # code, not results: a run rewriting its own JSON is not a change of code
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
            capture_output=True,
            text=True,
        )
        commit += "+uncommitted" if changed.stdout.strip() else ""
        head = {
            "command": "python " + " ".join(sys.argv),
            "commit": commit,  # of the checkout run from (the dspark imported may be another: PYTHONPATH)
            "dspark": str(Path(dspark.__file__).parent),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(torch.device("cpu")),
        }
        with open(args.output_json, "w") as f:
            json.dump(head | {"rows": rows}, f, indent=1)
    print("median device ops:", statistics.median(r["device_ops"] for r in rows))


if __name__ == "__main__":
    main()
