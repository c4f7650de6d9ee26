"""The host time of adaptive verification's bookkeeping per step, by planner phase, at R requests.

    python benchmarks/planner_host.py --requests 1 256 1024 [--device cuda]

A steady loop of the planner's calls as the engine makes them (with --prepare, also prepare() before observe, as the
engine calls it while the drafting pass runs on the device), with synthetic drafts and outcomes and a synthetic
cost curve: every step verifies last step's drafts (plan, record), then drafts again (should_draft, observe), and is
timed (step_started, step_finished). A "plain" loop runs the calls of a step that neither verifies nor drafts.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from dspark.config import SamplingParams
from dspark.core.request import Request
from dspark.core.scheduler import ScheduledRequest, SchedulerOutput
from dspark.speculative.cost_model import CostModel
from dspark.speculative.planner import VerificationPlanner
from dspark.speculative.step_timer import StepTimer

K = 7


def _cost() -> CostModel:
    # A SmolLM2-like GPU profile: a flat 1.4 ms step up to 512 tokens, then linear; the drafter pass ~1 ms
    verify = {1: 1.4, 512: 1.5, 2048: 3.0, 8192: 9.0}
    draft = {1: 1.0, 1024: 3.0}
    return CostModel.from_points(verify, draft, capture_limit=512)


def run(num_reqs: int, device: torch.device, steps: int, drafting: bool, prepare: bool = False) -> dict[str, float]:
    planner = VerificationPlanner(K, "async", 0.8, _cost(), device)
    reqs = []
    for i in range(num_reqs):
        req = Request(f"r{i}", None, [1, 2, 3, 4], SamplingParams(), 0, None)
        req.num_computed_tokens = 3
        reqs.append(req)
    ids = [r.request_id for r in reqs]
    gen = torch.Generator().manual_seed(0)
    acc: collections.Counter[str] = collections.Counter()

    def timed(label: str, f, *args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = f(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        acc[label] += time.perf_counter() - start
        return out

    timer = StepTimer(planner)
    conf = torch.rand(num_reqs, K, generator=gen).to(device)
    planner.observe(ids, [K] * num_reqs, conf)
    planner.observe(ids, [K] * num_reqs, conf)
    for step in range(steps + 5):
        if step == 5:  # the first steps warm up (and harvest the first copies)
            acc.clear()
        sched = SchedulerOutput(
            [ScheduledRequest(r, 1 + K, [7] * K) if drafting else ScheduledRequest(r, 1) for r in reqs]
        )
        timed("step_started", timer.step_started)
        timed("plan", planner.plan, sched)
        if drafting:
            outcomes = [
                (s.request.request_id, len(s.spec_token_ids), min(2, len(s.spec_token_ids))) for s in sched.scheduled
            ]
            timed("record", planner.record, outcomes)
        pays = timed("should_draft", planner.should_draft, ids)
        if drafting:
            if prepare:  # as the engine does while the drafting pass runs on the device
                timed("prepare", planner.prepare, ids, [K] * num_reqs, num_reqs, num_reqs)
            timed("observe", planner.observe, ids, [K] * num_reqs, conf)
        timed("step_finished", timer.step_finished, drafting and pays, num_reqs)
    return {k: v / steps * 1e6 for k, v in acc.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 256, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--prepare", action="store_true", help="also drafting steps whose budget is prepared while drafting (engine)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    loops = [(False, False), (True, False)] + ([(True, True)] if args.prepare else [])
    for drafting, prepare in loops:
        for r in args.requests:
            us = run(r, device, args.steps, drafting, prepare)
            phases = ", ".join(f"{k} {v:.0f}" for k, v in sorted(us.items(), key=lambda kv: -kv[1]))
            kind = ("drafting, prepared" if prepare else "drafting") if drafting else "plain"
            print(f"{kind} R={r}: {sum(us.values()):.0f} us/step | {phases}", flush=True)


if __name__ == "__main__":
    main()
