"""The trace-driven simulator of confidence-scheduled verification, on synthetic traces written to tmp_path."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch

from dspark.bench.simulate import (
    CONFIDENCE_POLICIES,
    StepInputs,
    b300_like,
    ema_study,
    ema_update,
    get_policy,
    load_cost,
    policy_names,
    run_all,
    simulate,
    simulate_policies,
)
from dspark.bench.simulate_report import markdown_table, plot
from dspark.cli.simulate import add_parser
from dspark.errors import ConfigError
from dspark.speculative.budget import survival
from dspark.speculative.cost_model import CostModel
from dspark.speculative.trace import TraceError, load_trace

K = 7


def _write_trace(path: Path, streams: list[list[tuple[list[float], int]]], k: int = K) -> Path:
    """One header line, then step t holds block t of every stream that has one (all drafts verified: fixed k)."""
    lines = [{"type": "header", "K": k, "method": "dspark", "model": "synthetic", "device": "cpu", "adaptive": False}]
    for t in range(max(len(s) for s in streams)):
        requests = [
            {"id": f"req-{i}", "confidences": s[t][0], "num_drafts": len(s[t][0])}
            | {"num_verified": len(s[t][0]), "num_accepted": s[t][1]}
            for i, s in enumerate(streams)
            if t < len(s)
        ]
        lines.append({"type": "step", "step": t, "num_other_tokens": len(requests), "requests": requests})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def _informative_streams(
    num_streams: int = 48, num_blocks: int = 30, seed: int = 0
) -> list[list[tuple[list[float], int]]]:
    """Calibrated confidences: c = sigmoid(stream ease + noise), and L = the leading draws u_j < c_j."""
    rng = random.Random(seed)
    streams = []
    for _ in range(num_streams):
        ease = rng.gauss(1.5, 1.0)
        blocks = []
        for _ in range(num_blocks):
            conf = [1.0 / (1.0 + math.exp(-(ease + rng.gauss(0.0, 1.5)))) for _ in range(K)]
            accepted = 0
            while accepted < K and rng.random() < conf[accepted]:
                accepted += 1
            blocks.append((conf, accepted))
        streams.append(blocks)
    return streams


@pytest.fixture(scope="module")
def informative(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_trace(tmp_path_factory.mktemp("trace") / "informative.jsonl", _informative_streams())


def _flat() -> CostModel:
    """Verification free: every step costs the same whatever its size."""
    return CostModel.from_points({1: 2.0, 1 << 16: 2.0}, {1: 0.1, 1 << 16: 0.1})


def _steep() -> CostModel:
    """Each token costs as much as a one-token step: verify_ms(n) = n."""
    return CostModel.from_points({1: 1.0, 1 << 16: float(1 << 16)}, {1: 0.01, 1 << 16: 0.01})


# ---- trace --------------------------------------------------------------------------------------------------------


def test_load_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"type": "header", "K": 4, "method": "ngram", "model": "m", "device": "cpu", "adaptive": False},
        {
            "type": "step",
            "step": 0,
            "num_other_tokens": 2,
            "requests": [
                {"id": "a", "confidences": [0.9, 0.8, 0.7, 0.6], "num_drafts": 4, "num_verified": 4, "num_accepted": 2},
                {"id": "b", "confidences": [0.5], "num_drafts": 1, "num_verified": 1, "num_accepted": 1},
            ],
        },
        {
            "type": "step",
            "step": 1,
            "num_other_tokens": 2,
            "requests": [
                # partly verified, a rejection seen: L = 1 is known; the confidences cover the verified drafts
                {"id": "a", "confidences": [0.9, 0.8], "num_drafts": 4, "num_verified": 2, "num_accepted": 1},
                # partly verified and all accepted: L unknown, skipped and counted
                {"id": "b", "confidences": [0.5, 0.4], "num_drafts": 3, "num_verified": 2, "num_accepted": 2},
                {"id": "c", "confidences": [], "num_drafts": 0, "num_verified": 0, "num_accepted": 0},
            ],
        },
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    trace = load_trace(path)
    assert trace.K == 4 and trace.header["method"] == "ngram" and trace.num_censored == 1
    assert list(trace.streams) == ["a", "b", "c"]
    assert [(b.num_drafts, b.accepted) for b in trace.streams["a"]] == [(4, 2), (2, 1)]
    assert trace.streams["a"][1].confidences == [0.9, 0.8]
    assert [(b.num_drafts, b.accepted) for b in trace.streams["b"]] == [(1, 1)]
    assert trace.num_blocks == 4


HEADER = '{"type": "header", "K": 3}'


def _req(**fields: object) -> str:
    request = {"id": "r", "confidences": [0.9, 0.5], "num_drafts": 2, "num_verified": 2, "num_accepted": 1} | fields
    return json.dumps({"type": "step", "step": 0, "requests": [request]})


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        (["{not json"], 1, "not JSON"),
        (['{"type": "step", "requests": []}'], 1, "first line must be the header"),
        (['{"type": "header", "K": 0}'], 1, "K=0"),
        ([HEADER, "[1, 2]"], 2, "JSON object"),
        ([HEADER, _req(), '{"type": "header", "K": 3}'], 3, "every line must be a step"),
        ([HEADER, '{"type": "step", "requests": 5}'], 2, "requests=5"),
        ([HEADER, _req(), _req(confidences=[0.9, 1.5])], 3, "confidences"),
        ([HEADER, _req(num_accepted=3)], 2, "num_accepted <= num_verified"),
        ([HEADER, _req(num_drafts=4, confidences=[0.9] * 4, num_verified=4)], 2, "exceeds K=3"),
        ([HEADER, _req(num_verified=-1)], 2, "num_verified=-1"),
        ([HEADER, _req(num_drafts=True)], 2, "num_drafts=True"),
        ([HEADER, _req(confidences=[0.9])], 2, "1 confidences"),
        ([HEADER, "", json.dumps({"type": "step", "requests": [json.loads(_req())["requests"][0]] * 2})], 3, "twice"),
    ],
)
def test_malformed_trace_names_the_line(tmp_path: Path, lines: list[str], line: int, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:{line}: .*{problem}"):
        load_trace(path)


def test_unreadable_traces(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="empty"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match=r"missing\.jsonl: cannot be read"):
        load_trace(tmp_path / "missing.jsonl")


# ---- policies -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", policy_names(K))
@pytest.mark.parametrize("cost", [_flat(), _steep(), b300_like()], ids=["flat", "steep", "b300"])
def test_policy_counts_are_prefixes_within_the_drafts(name: str, cost: CostModel) -> None:
    g = torch.Generator().manual_seed(1)
    policy = get_policy(name)
    for num_reqs in (1, 5, 64):
        num_drafts = torch.randint(0, K + 1, (num_reqs,), generator=g)
        has = torch.arange(K)[None, :] < num_drafts[:, None]
        live = survival(torch.rand(num_reqs, K, generator=g, dtype=torch.float64)) * has
        stale = survival(torch.rand(num_reqs, K, generator=g, dtype=torch.float64)) * has
        accepted = (torch.rand(num_reqs, generator=g) * (num_drafts + 1)).long()
        counts = policy(StepInputs(live, stale, num_drafts, accepted), cost)
        assert counts.shape == (num_reqs,) and counts.dtype == torch.int64
        assert (counts >= 0).all() and (counts <= num_drafts).all()  # a count l means drafts 1..l: a prefix
        if name == "oracle":
            assert (counts <= accepted).all()


def test_no_spec_is_one_token_per_request_step(informative: Path) -> None:
    trace, cost = load_trace(informative), b300_like()
    r = simulate(trace, cost, "no-spec", 8, steps=50)
    assert r["acceptance_length"] == 1.0 and r["mean_verify_len"] == 0.0 and r["tokens"] == 8 * 50
    assert r["ms"] == pytest.approx(50 * cost.step_ms(0, 8))  # no drafting cost
    assert r["pred_minus_real"] is None


def test_oracle_beats_every_policy_on_a_flat_curve(informative: Path) -> None:
    trace = load_trace(informative)
    for c in (1, 16, 128):
        results = {
            r["policy"]: r["tokens_per_s"]
            for r in simulate_policies(trace, _flat(), policy_names(K), c, min_blocks=400)
        }
        assert all(results["oracle"] >= tps for tps in results.values()), (c, results)


def test_flat_curve_adaptive_verifies_every_draft(informative: Path) -> None:
    trace = load_trace(informative)
    for c in (1, 32):
        async_, sync, fixed = simulate_policies(
            trace, _flat(), ["adaptive-async", "adaptive-sync", f"fixed-{K}"], c, steps=100
        )
        assert async_["mean_verify_len"] == fixed["mean_verify_len"] == K
        assert async_["tokens"] == fixed["tokens"] and async_["tokens_per_s"] == pytest.approx(fixed["tokens_per_s"])
        assert sync["tokens"] == fixed["tokens"]


def test_steep_curve_adaptive_verifies_little_and_beats_fixed_k(informative: Path) -> None:
    trace = load_trace(informative)
    for c in (1, 16, 128):
        async_, sync, fixed = simulate_policies(
            trace, _steep(), ["adaptive-async", "adaptive-sync", f"fixed-{K}"], c, steps=100
        )
        assert async_["mean_verify_len"] < 1.0 and sync["mean_verify_len"] < 1.0
        assert async_["tokens_per_s"] > 1.5 * fixed["tokens_per_s"]


# ---- EMA ----------------------------------------------------------------------------------------------------------


def test_ema_update() -> None:
    state = torch.tensor([[0.5, 0.5, 0.2]], dtype=torch.float64)
    known = torch.tensor([[True, True, False]])
    current = torch.tensor([[1.0, 0.0, 0.9]], dtype=torch.float64)
    has = torch.tensor([[True, True, True]])
    new, new_known = ema_update(state, known, current, has, 0.0)
    assert torch.equal(new, current) and new_known.all()
    new, _ = ema_update(state, known, current, has, 0.5)
    assert torch.allclose(new, torch.tensor([[0.75, 0.25, 0.9]], dtype=torch.float64))  # a new position: its value
    new, _ = ema_update(state, known, current, torch.tensor([[True, False, False]]), 0.5)
    assert torch.allclose(new, torch.tensor([[0.75, 0.5, 0.2]], dtype=torch.float64))  # no draft: kept


def test_ema_alpha_zero_predicts_from_raw_confidences(tmp_path: Path) -> None:
    streams = _informative_streams(num_streams=5, num_blocks=7, seed=3)
    trace = load_trace(_write_trace(tmp_path / "t.jsonl", streams))
    blocks = [b for s in trace.streams.values() for b in s]
    # one slot playing every block once; a tiny threshold verifies every draft
    r = simulate(trace, _flat(), "threshold", 1, ema_alpha=0.0, threshold=1e-12, steps=len(blocks))
    raw = sum(float(survival(torch.tensor(b.confidences, dtype=torch.float64)).sum()) for b in blocks)
    verified = sum(b.num_drafts for b in blocks)
    assert r["mean_verify_len"] * len(blocks) == verified
    assert r["pred_minus_real_per_draft"] * verified == pytest.approx(raw - sum(b.accepted for b in blocks))


# ---- informative confidences on the B300-like curve ---------------------------------------------------------------

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def informative_results(informative: Path) -> dict[int, dict[str, dict]]:
    trace, cost = load_trace(informative), b300_like()
    names = [f"fixed-{k}" for k in range(1, K + 1)] + ["adaptive-async", "oracle"]
    return {
        c: {r["policy"]: r for r in simulate_policies(trace, cost, names, c, min_blocks=1000)} for c in CONCURRENCIES
    }


def test_informative_adaptive_beats_best_fixed_k(informative_results: dict[int, dict[str, dict]]) -> None:
    for c, results in informative_results.items():
        best = max(results[f"fixed-{k}"]["tokens_per_s"] for k in range(1, K + 1))
        assert results["adaptive-async"]["tokens_per_s"] >= best, c


def test_informative_adaptive_against_the_oracle(informative_results: dict[int, dict[str, dict]]) -> None:
    """Where the project's target, 'within 10% of the oracle', holds, and where it does not (measured on this
    seeded trace, and kept as a floor so a regression shows): the oracle verifies exactly the drafts that survive;
    calibrated but uncertain confidences cannot. On this trace adaptive-async reaches 0.94-1.00 of the oracle at
    C <= 8 and 0.78-0.92 at C = 16..256, where verification starts to cost (against 1.00-1.09x the best of no-spec and
    fixed k)."""
    ratios = {
        c: r["adaptive-async"]["tokens_per_s"] / r["oracle"]["tokens_per_s"] for c, r in informative_results.items()
    }
    assert all(ratios[c] >= 0.93 for c in (1, 2, 4, 8)), ratios
    assert all(ratio >= 0.75 for ratio in ratios.values()), ratios


# ---- cost curves, reports, command line ---------------------------------------------------------------------------


def test_b300_like_curve() -> None:
    cost = b300_like()
    v = cost.verify_ms(torch.tensor([1, 64, 65, 72, 512, 513, 1024]))
    assert v[0] == v[1] == 2.0  # flat up to 64 tokens
    assert v[2] == v[3] == pytest.approx(2.0 + 0.004 * 8)  # captured sizes every 8 tokens: padded up
    assert v[4] == pytest.approx(2.0 + 0.004 * 448)
    assert v[5] == pytest.approx(1.6 * (2.0 + 0.004 * 449))  # eager past the capture limit
    assert v[6] == pytest.approx(1.6 * (2.0 + 0.004 * 960))
    assert cost.draft_ms(256) == pytest.approx(0.6 + 0.0015 * 256)
    assert load_cost("b300").verify.sizes == cost.verify.sizes


def test_load_cost_from_json(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    _steep().save(path)
    assert load_cost(str(path)).verify_ms(torch.tensor([10])).item() == 10.0
    with pytest.raises(ConfigError, match="cost"):
        load_cost(str(tmp_path / "missing.json"))


def test_run_all_and_ema_study(informative: Path, tmp_path: Path) -> None:
    trace, cost = load_trace(informative), b300_like()
    rows = run_all(trace, cost, (1, 64), steps=30)
    for c in (1, 64):
        group = {r["policy"]: r for r in rows if r["concurrency"] == c}
        assert set(group) == {*policy_names(K), "best-fixed"}
        assert group["oracle"]["ratio_to_oracle"] == 1.0
        best = group["best-fixed"]
        assert best["tokens_per_s"] == max(group[f"fixed-{k}"]["tokens_per_s"] for k in range(1, K + 1))
        assert group[f"fixed-{best['k']}"]["tokens_per_s"] == best["tokens_per_s"]
        for name in CONFIDENCE_POLICIES:
            assert group[name]["pred_minus_real"] is not None
    table = markdown_table([{"curve": "b300", **r} for r in rows])
    assert table.startswith("| curve | C | no-spec | fixed-7 |") and len(table.splitlines()) == 4

    study = ema_study(trace, cost, (1, 64), alphas=(0.0, 0.8), steps=30)
    assert [(s["alpha"], s["concurrency"]) for s in study] == [(0.0, 1), (0.0, 64), (0.8, 1), (0.8, 64)]
    assert all(isinstance(s["pred_minus_real_per_draft"], float) for s in study)

    pytest.importorskip("matplotlib")
    plot([{"curve": "b300", **r} for r in rows] + [{"curve": "flat", **r} for r in rows], tmp_path / "sim.png")
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_command(informative: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    parser = argparse.ArgumentParser(prog="dspark")
    add_parser(parser.add_subparsers(dest="command"))
    cost_json = tmp_path / "steep.json"
    _steep().save(cost_json)
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    argv = ["simulate", str(informative), "--cost", "b300", "--cost", str(cost_json), "--concurrency", "1", "8"]
    args = parser.parse_args([*argv, "--steps", "10", "--output-json", str(out), "--output-plot", str(png)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "| b300 | 8 |" in printed and "| steep | 1 |" in printed and "adaptive-async at" in printed
    result = json.loads(out.read_text())
    assert {"command", "trace", "settings", "rows", "ema_study"} <= result.keys()
    assert result["trace"]["num_streams"] == 48 and result["settings"]["costs"] == ["b300", str(cost_json)]
    assert len(result["rows"]) == 2 * 2 * (len(policy_names(K)) + 1)
    assert png.stat().st_size > 0

    bad = parser.parse_args(["simulate", str(informative), "--ema-alpha", "1.0"])
    with pytest.raises(ConfigError, match="ema_alpha"):
        bad.func(bad)
