"""Where the regime chooser's learned rates and wall time part. One adaptive engine runs a batch of prompts round after
round, each round with the chooser held in a regime (`regime.held`: draft, plain) or free, and every engine step is
logged: its wall interval (from one core step's start to the next, the front's processing included), its kind, load
and tokens, and what the chooser was told about it (observe's ms and tokens, a step later).

    python benchmarks/drafter/rate_probe.py OUT.json [DRAFTER] [--rounds mt-bench:draft,mt-bench:plain,gsm8k:free]

Per round it reports: the round's tokens/ms; each regime's tokens/ms over the steady decode steps of the batch's own
level (wall), the same steps' tokens over the ms the chooser was told (told), and the chooser's learned rate after
the round (learned); the share of the round's time in prefill, in steps of lower levels (the batch's tail, once some
requests have finished) and in steps that switched regime. A learned rate above the wall one is a regime priced
cheaper than it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from provenance import provenance

from dspark import LLM, SamplingParams
from dspark.bench.throughput import load_prompts, tokenize

HOLD = {"free": None, "draft": True, "plain": False}


def instrument(llm: LLM) -> list[dict[str, Any]]:
    """Log every core step and every regime observation into the returned list (one dict a step)."""
    core = llm.engine.core
    regime = core.planner.regime
    steps: list[dict[str, Any]] = []
    step, observe = core.step, regime.observe

    def logged_step() -> Any:
        start = time.perf_counter()
        out = step()
        ended = core._ended
        if ended is not None:
            continued, live, emitted, drafted, _wait, verified = ended
            steps.append(
                {
                    "start": start,
                    "kind": core.last_step_kind,
                    "continued": continued,
                    "live": live,
                    "emitted": emitted,
                    "drafted": drafted,
                    "verified": verified,
                }
            )
        return out

    def logged_observe(num_requests: int, verified: bool, drafted: bool, tokens: int, ms: float, **kw: Any) -> None:
        # CPU: a step is timed when the next core step starts (end_step), so this observation is of the last logged one
        if steps:
            steps[-1]["told"] = {"n": num_requests, "spec": drafted, "tokens": tokens, "ms": ms}
        observe(num_requests, verified, drafted, tokens, ms, **kw)

    core.step = logged_step  # type: ignore[method-assign]
    regime.observe = logged_observe  # type: ignore[method-assign]
    return steps


def summarise(steps: list[dict[str, Any]], end: float, level: int, regime_level: Any) -> dict[str, Any]:
    for a, b in zip(steps, [*steps[1:], {"start": end}], strict=True):
        a["wall_ms"] = (b["start"] - a["start"]) * 1e3
    total = sum(s["wall_ms"] for s in steps)
    by: dict[str, Any] = {}
    for regime in ("spec", "plain"):
        kind = "verify+draft" if regime == "spec" else "plain"
        own = [s for s in steps if s["kind"] == kind and s["live"].bit_length() == level]
        told = [s for s in own if "told" in s]
        by[regime] = {
            "steps": len(own),
            "wall_rate": sum(s["emitted"] for s in own) / max(sum(s["wall_ms"] for s in own), 1e-9),
            "told_steps": len(told),
            "told_rate": sum(s["told"]["tokens"] for s in told) / max(sum(s["told"]["ms"] for s in told), 1e-9),
            "told_wall_rate": sum(s["emitted"] for s in told) / max(sum(s["wall_ms"] for s in told), 1e-9),
            "tokens_per_step": sum(s["emitted"] for s in own) / max(len(own), 1),
            "wall_ms_per_step": sum(s["wall_ms"] for s in own) / max(len(own), 1),
            "told_ms_per_step": sum(s["told"]["ms"] for s in told) / max(len(told), 1),
            "learned_rate": None if regime_level is None else regime_level.rate.get(regime == "spec"),
            "learned_ms": None if regime_level is None else regime_level.ms.get(regime == "spec"),
        }

    def share(pred: Any) -> float:
        return sum(s["wall_ms"] for s in steps if pred(s)) / total

    return {
        "tok_per_ms": sum(s["emitted"] for s in steps) / total,
        "steps": len(steps),
        "prefill_share": share(lambda s: s["kind"] == "prefill"),
        "tail_share": share(lambda s: s["kind"] != "prefill" and s["live"].bit_length() < level),
        "switch_share": share(lambda s: s["kind"] in ("verify", "draft")),
        "regimes": by,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("drafter", nargs="?", default="dspark/assets/smollm2-135m-dspark")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument(
        "--rounds", default="mt-bench:draft,mt-bench:plain,mt-bench:free", help="SET:HOLD,... (free, draft or plain)"
    )
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(speculative_config={"method": "dspark", "model": args.drafter}, max_num_seqs=args.num_prompts)
    regime = llm.engine.core.planner.regime
    steps = instrument(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    level = regime.level(args.num_prompts)
    rows = []
    for r, spec in enumerate(args.rounds.split(",")):
        name, hold = spec.split(":")
        ids = tokenize(llm, load_prompts(str(Path(args.data) / f"{name}.jsonl"), args.num_prompts), True)
        regime.held = HOLD[hold]
        steps.clear()
        start = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        end = time.perf_counter()
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {
            "round": r,
            "set": name,
            "hold": hold,
            "round_tok_per_ms": made / ((end - start) * 1e3),
            "chosen": {str(k): dict(v) for k, v in regime.num_chosen.items()},
            **summarise(list(steps), end, level, regime.levels.get(level)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.output).write_text(json.dumps({**provenance(), "level": level, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
