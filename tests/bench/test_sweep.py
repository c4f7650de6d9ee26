"""`dspark bench sweep` on a tiny random llama in fp32: one row per arm, concurrency and temperature with every key,
greedy outputs that no arm changes (transformers' continuous batching included), the three output files, the prompt
set (the data directory's mix, else the built-in set), and bad arguments named before any model is loaded."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dspark.bench import sweep as sweep_module
from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.bench.sweep import (
    ADAPTIVE_K,
    DATA_DIR_ENV,
    Sweep,
    _hf_concurrencies,
    num_prompts_for,
    parse_arm,
    run_sweep,
    sweep_prompts,
)
from dspark.bench.sweep_report import paired_adaptive_ratio, write_outputs
from dspark.cli import main
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.errors import ConfigError

ARMS = ["no-spec", "fixed-1", "adaptive"]
CONCURRENCIES = [1, 4]
HF_CONCURRENCIES = [4]  # a subset: the table shows "-" for hf at C = 1
TEMPERATURES = [0.0, 1.0]
NUM_PROMPTS, OUTPUT_LEN = 8, 8
ROW_KEYS = {
    "arm",
    "step_ms_by_kind",
    "step_wall_ms",
    "step_device_ms",
    "concurrency",
    "temperature",
    "output_throughput",
    "rounds_output_throughput",
    "rounds_step_median_ms",
    "acceptance_length",
    "mean_verify_len",
    "duration",
    "completed",
    "max_in_flight",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "total_token_throughput",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "p99") for name in ("ttft", "tpot", "e2el")),
    "num_preemptions",
    "spec_decode_acceptance_length",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "verify_budget_mean",
    "num_steps_without_drafting",
    "num_steps",
    "plan_time_fraction",
    "regime_tokens_per_ms",
    "regime_steps",
    "spec_steps",
    "rounds_spec_steps",
    "identical_to_no_spec",
}


# A data directory laid out as ../shared/data, a few records per source: GSM8K in DeepSpec's copy, MT-bench and
# HumanEval only as the raw sets (so each source's fallback file is read too).
GSM8K = ["Tom has 3 apples and buys 4 more. How many now?", "A pen costs $2. What do 5 pens cost?", "What is 9 x 7?"]
MT_BENCH = ["Write a haiku about rain.", "Explain recursion to a child."]
HUMANEVAL = ['def add(a: int, b: int) -> int:\n    """Add two numbers."""\n', "def is_even(n: int) -> bool:\n"]
MIX = [GSM8K[0], MT_BENCH[0], HUMANEVAL[0], GSM8K[1], MT_BENCH[1], HUMANEVAL[1], GSM8K[2]]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for sub in ("deepspec_eval", "mt_bench", "humaneval"):
        (root / sub).mkdir()
    (root / "deepspec_eval" / "gsm8k.jsonl").write_text("\n".join(json.dumps({"turns": [q]}) for q in GSM8K))
    (root / "mt_bench" / "question.jsonl").write_text(
        "\n".join(json.dumps({"question_id": i, "turns": [q, "a second turn"]}) for i, q in enumerate(MT_BENCH))
    )
    records = "\n".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": p}) for i, p in enumerate(HUMANEVAL))
    (root / "humaneval" / "HumanEval.jsonl.gz").write_bytes(gzip.compress(records.encode()))
    return root


@pytest.fixture(scope="module")
def sweep(tiny_model_dirs: dict[str, Path], data_dir: Path) -> Sweep:
    # fp32: greedy outputs of transformers and dspark agree token for token (bf16 would round differently)
    config = EngineConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=128)
    return run_sweep(
        config,
        arms=ARMS,
        concurrencies=CONCURRENCIES,
        temperatures=TEMPERATURES,
        output_len=OUTPUT_LEN,
        num_prompts=NUM_PROMPTS,
        data_dir=str(data_dir),
        hf_concurrencies=HF_CONCURRENCIES,
        command="test",
    )


def test_rows(sweep: Sweep) -> None:
    rows = sweep.result["rows"]
    assert [(r["temperature"], r["concurrency"], r["arm"]) for r in rows] == [
        (t, c, a)
        for t in TEMPERATURES
        for c in CONCURRENCIES
        for a in [*ARMS, *(["hf"] if c in HF_CONCURRENCIES else [])]
    ]
    for row in rows:
        assert row.keys() == ROW_KEYS
        assert row["completed"] == NUM_PROMPTS
        assert row["step_device_ms"] is None  # CPU: no device events
        assert (row["step_wall_ms"] is None) == (row["arm"] == "hf")
        if row["arm"] != "hf":
            decode = [k for kind, k in row["step_ms_by_kind"].items() if kind != "prefill"]
            lo, hi = min(k["median_ms"] for k in decode), max(k["max_ms"] for k in decode)
            assert lo - 1e-3 <= row["step_wall_ms"] <= hi + 1e-3  # the kinds' figures are rounded to the microsecond
        kinds = row["step_ms_by_kind"]  # the engine's steps, each timed once under what it ran; hf has none
        assert sum(k["steps"] for k in kinds.values()) == (row["num_steps"] if row["arm"] != "hf" else 0)
        assert all(0 < k["median_ms"] <= k["max_ms"] <= k["total_ms"] for k in kinds.values())
        # the row's speculative steps, in order, one entry per step of such a kind (fewer than SPEC_STEPS_KEPT here)
        spec_kinds = ("draft", "verify", "verify+draft")
        assert len(row["spec_steps"]) == sum(kinds.get(kind, {}).get("steps", 0) for kind in spec_kinds)
        assert all(kind in spec_kinds and 0 < n <= row["concurrency"] for _, n, kind, _ in row["spec_steps"])
        assert [i for i, *_ in row["spec_steps"]] == sorted({i for i, *_ in row["spec_steps"]})
        assert row["rounds_spec_steps"] == [len(row["spec_steps"])]  # one round
        assert row["rounds_step_median_ms"] == [{k: v["median_ms"] for k, v in kinds.items()}]
        assert row["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: every request runs to the end
        assert row["max_in_flight"] == row["concurrency"]  # the limit holds and is reached
        assert row["output_throughput"] > 0 and row["rounds_output_throughput"] == [row["output_throughput"]]
        assert row["output_throughput"] == pytest.approx(row["total_output_tokens"] / row["duration"])
        assert 0 < row["mean_ttft_ms"] <= row["p99_ttft_ms"] and row["mean_tpot_ms"] > 0
        assert row["total_input_tokens"] == sweep.result["rows"][0]["total_input_tokens"]  # the same prompts
        if row["arm"] in ("no-spec", "hf"):
            assert row["acceptance_length"] is None and row["mean_verify_len"] is None
            assert row["spec_decode_num_drafts"] is None and row["verify_budget_mean"] is None
            assert (row["num_preemptions"] is None) == (row["arm"] == "hf")  # transformers does not count them
            continue
        k = 1 if row["arm"] == "fixed-1" else ADAPTIVE_K
        assert (
            row["spec_decode_accepted_tokens"] <= row["spec_decode_draft_tokens"] <= k * row["spec_decode_num_drafts"]
        )
        assert row["acceptance_length"] == row["spec_decode_acceptance_length"]
        steps = row["total_output_tokens"] - row["spec_decode_accepted_tokens"]
        assert row["mean_verify_len"] == pytest.approx(row["spec_decode_draft_tokens"] / steps)
        # Greedy, the random model repeats itself and n-grams match; sampled, they do not. Adaptive verification may
        # rightly verify none (it follows measured step times, which on a busy CI machine are noise at this size).
        if row["temperature"] == 0 and row["arm"] != "adaptive":
            assert row["spec_decode_num_drafts"] > 0 and row["acceptance_length"] >= 1
        if row["arm"] == "adaptive":
            assert row["num_steps_without_drafting"] >= 0
            assert row["verify_budget_mean"] is not None or row["spec_decode_num_drafts"] == 0
            assert 0 <= row["plan_time_fraction"] < 1
            # what the regime measured, per load level: positive tokens/ms
            rates = row["regime_tokens_per_ms"]
            assert rates and all(v > 0 for level in rates.values() for v in level.values())
            # the row's drafting choices per level: the plain ones are its steps without drafting
            steps = row["regime_steps"]
            assert steps and sum(n["plain"] for n in steps.values()) == row["num_steps_without_drafting"]
            assert sum(n["spec"] + n["plain"] for n in steps.values()) <= row["num_steps"]
        else:
            assert row["verify_budget_mean"] is None and row["num_steps_without_drafting"] is None
            assert row["regime_tokens_per_ms"] is None and row["regime_steps"] is None


def test_greedy_outputs_match_no_spec(sweep: Sweep) -> None:
    for c in CONCURRENCIES:
        base = sweep.token_ids["no-spec", c, 0.0]
        assert len(base) == NUM_PROMPTS and all(len(t) == OUTPUT_LEN for t in base)
        for arm in [*ARMS, *(["hf"] if c in HF_CONCURRENCIES else [])]:
            assert sweep.token_ids[arm, c, 0.0] == base
    for row in sweep.result["rows"]:
        assert row["identical_to_no_spec"] == (f"{NUM_PROMPTS}/{NUM_PROMPTS}" if row["temperature"] == 0 else None)


def test_hf_rows(sweep: Sweep) -> None:
    """transformers ran every prompt to exactly OUTPUT_LEN tokens, sampled ones included, and says how it ran."""
    for t in TEMPERATURES:
        outputs = sweep.token_ids["hf", 4, t]
        assert len(outputs) == NUM_PROMPTS and all(len(o) == OUTPUT_LEN for o in outputs)
    assert ("hf", 1, 0.0) not in sweep.token_ids
    settings = sweep.result["config"]["arms"]["hf"]
    assert settings["concurrencies"] == HF_CONCURRENCIES
    assert settings["attn_implementation"] in ("sdpa", "paged|sdpa")  # CPU, no flash attention: 5.24 / 5.17
    assert settings["num_blocks"] == {"4": 4 * 2}  # one 256-token block per short request, plus one
    assert settings["max_batch_tokens"] == {"4": EngineConfig(model="m").max_num_batched_tokens}
    assert settings["transformers_version"] == sweep.result["machine"]["transformers_version"]


def test_writes_json_plot_and_markdown(sweep: Sweep, tmp_path: Path) -> None:
    paths = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "s.md"
    write_outputs(sweep.result, *paths)
    result = json.loads(paths[0].read_text())
    assert {"command", "config", "device", "dtype", "machine", "rows"} <= result.keys()
    assert list(result["config"]["arms"]) == [*ARMS, "hf"] and result["config"]["arms"]["no-spec"] is None
    assert result["config"]["prompt_set"]["name"] == "gsm8k+mt-bench+humaneval"
    assert result["config"]["prompt_set"]["num_prompts"] == len(MIX) == result["config"]["num_unique_prompts"]
    assert result["config"]["arms"]["adaptive"]["num_speculative_tokens"] == ADAPTIVE_K
    assert result["config"]["engine"]["max_num_seqs"] == max(CONCURRENCIES)
    assert "token_ids" not in paths[0].read_text()
    assert paths[1].read_bytes().startswith(b"\x89PNG")
    table = paths[2].read_text().splitlines()
    ends = "| hf tok/s | adaptive / max(no-spec, best fixed) | no-spec / hf | no-spec step wall / device ms |"
    assert table[0].endswith(ends)  # one round: no paired ratios
    lines = [line.strip("| ").split(" | ") for line in table if line.startswith("| ")]
    assert len(lines) == 1 + len(TEMPERATURES) * len(CONCURRENCIES)
    for cells in lines[1:]:
        assert (cells[-4] == "-") == (cells[-2] == "-") == (int(cells[1]) not in HF_CONCURRENCIES)
        assert cells[-1].endswith(" / -")  # a decode step's wall ms; no device ms on CPU
    assert table[-1].startswith("adaptive / max(no-spec, best fixed): median")
    assert "; no-spec / hf: " in table[-1] and "(C=4, T=0)" in table[-1]


def test_cli(
    tiny_model_dirs: dict[str, Path], data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "sweep", "--model", str(tiny_model_dirs["llama"]), "--num-kv-blocks", "128", "--arm", "no-spec"]
    argv += ["--concurrency", "2", "--temperature", "0", "--num-prompts", "3", "--output-len", "4"]
    argv += ["--data-dir", str(data_dir), "--hf-concurrency", "2"]  # --hf-concurrency turns the hf arm on
    assert main([*argv, "--output-json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "| T | C | no-spec tok/s | hf tok/s | no-spec / hf | no-spec step wall / device ms |"
    assert out[-1].startswith("fastest arm: ") and "no-spec / hf: " in out[-1]
    result = json.loads((tmp_path / "s.json").read_text())
    assert [r["arm"] for r in result["rows"]] == ["no-spec", "hf"]
    for row in result["rows"]:
        assert row["total_output_tokens"] == 12 and row["max_in_flight"] == 2


def test_hf_needs_continuous_batching(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    owner = next(c for c in transformers.GenerationMixin.__mro__ if "init_continuous_batching" in vars(c))
    monkeypatch.delattr(owner, "init_continuous_batching")
    assert main(["bench", "sweep", "--model", "/no/such/model", "--hf"]) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert err.startswith("error: hf=True is invalid: transformers with continuous batching") and "5.17" in err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--arm", "fixed-x"], "arm"),
        (["--arm", "fixed-0"], "arm"),
        (["--concurrency", "4", "0"], "concurrency"),
        (["--dataset-path", "/no/such.jsonl"], "dataset_path"),
        (["--num-prompts", "0"], "num_prompts"),
        (["--temperature", "-1"], "temperature"),
        (["--hf-concurrency", "3"], "hf_concurrency"),  # not one of the sweep's
        (["--hf-concurrency", "0"], "hf_concurrency"),
        (["--concurrency", "512", "--hf"], "hf_concurrency"),  # none up to 256: name them
        (["--data-dir", "/no/such/dir"], "data_dir"),
        (["--output-plot", "/no/such/dir/x.png"], "output_plot"),
    ],
)
def test_bad_arguments(flags: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sweep", "--model", "/no/such/model", *flags]) == 2  # named before any model is loaded
    assert capsys.readouterr().err.startswith(f"error: {field}=")


def test_prompt_sets(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    mix = sweep_prompts([], str(data_dir))
    assert mix.prompts == MIX and mix.name == "gsm8k+mt-bench+humaneval"
    assert mix.files == [
        str(data_dir / f)
        for f in ("deepspec_eval/gsm8k.jsonl", "mt_bench/question.jsonl", "humaneval/HumanEval.jsonl.gz")
    ]
    monkeypatch.setattr(sweep_module, "REPO_DATA_DIR", data_dir)  # the default: ../shared/data beside the checkout
    assert sweep_prompts([]) == mix
    monkeypatch.setattr(sweep_module, "REPO_DATA_DIR", tmp_path / "absent")
    monkeypatch.setenv(DATA_DIR_ENV, str(data_dir))
    assert sweep_prompts([]) == mix
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))  # named, but holds no prompt set: an error, not the fallback
    with pytest.raises(ConfigError, match=DATA_DIR_ENV):
        sweep_prompts([])
    with pytest.raises(ConfigError, match="data_dir"):
        sweep_prompts([], str(tmp_path / "absent"))

    monkeypatch.delenv(DATA_DIR_ENV)
    capsys.readouterr()
    builtin = sweep_prompts([])  # no data anywhere: the built-in set, said so
    assert "note: no prompt data at" in capsys.readouterr().err
    assert builtin.name == "builtin" and builtin.files == []
    assert sorted(builtin.prompts) == sorted(BUILTIN_PROMPTS) and builtin == sweep_prompts([])  # a fixed order

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a1", "a2", "a3")))
    b.write_text(json.dumps({"turns": ["b1", "later"]}))
    files = sweep_prompts([str(a), str(b)], str(data_dir))  # files win over the data directory
    assert files.prompts == ["a1", "b1", "a2", "a3"] and files.name == "dataset-path"
    assert [num_prompts_for(c, None) for c in (1, 8, 64)] == [16, 16, 128]
    assert num_prompts_for(64, 10) == 10


@pytest.mark.skipif(not sweep_module.REPO_DATA_DIR.is_dir(), reason="no ../shared/data beside the checkout")
def test_default_prompt_mix_of_shared_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    mix = sweep_prompts([])
    assert mix.name == "gsm8k+mt-bench+humaneval" and len(mix.prompts) == 1319 + 80 + 164
    assert mix.prompts[0].startswith("Janet") and "ducks lay 16 eggs per day" in mix.prompts[0]  # GSM8K test
    assert mix.prompts[1].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert "def has_close_elements(" in mix.prompts[2]  # HumanEval/0
    gsm8k = sweep_prompts([mix.files[0]]).prompts
    assert mix.prompts[80 * 3 + (164 - 80) * 2 :] == gsm8k[164:]  # MT-bench runs out at 80, HumanEval at 164


def test_hf_concurrencies() -> None:
    sweep_concurrencies = [1, 16, 32, 64, 128, 256, 512, 1024]
    assert _hf_concurrencies(False, None, sweep_concurrencies) == []
    assert _hf_concurrencies(True, None, sweep_concurrencies) == [1, 16, 32, 64, 128, 256]
    assert _hf_concurrencies(False, [256, 1, 16, 1], sweep_concurrencies) == [1, 16, 256]
    with pytest.raises(ConfigError, match="hf_concurrency"):
        _hf_concurrencies(True, [2], sweep_concurrencies)


def test_arm_configs() -> None:
    base = EngineConfig(model="m")
    assert parse_arm("no-spec").config(base, SpeculativeConfig("ngram")).spec is None
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, enable_adaptive_verification=True)
    fixed = parse_arm("fixed-3").config(base, spec).spec
    assert fixed is not None and (fixed.num_speculative_tokens, fixed.enable_adaptive_verification) == (3, False)
    adaptive = parse_arm("adaptive").config(base, spec).spec
    assert adaptive is not None and (adaptive.num_speculative_tokens, adaptive.enable_adaptive_verification) == (
        4,
        True,
    )
    default = parse_arm("adaptive").config(base, SpeculativeConfig("ngram")).spec
    assert default is not None and default.num_speculative_tokens == ADAPTIVE_K
    with pytest.raises(ConfigError, match="arm"):
        parse_arm("fixed-33")


def test_sync_arms_turn_async_scheduling_off_and_keep_their_base_arm() -> None:
    """ARM:sync is ARM with async scheduling off: the gain of async scheduling, measured in the same run."""
    base = EngineConfig(model="m")
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, enable_adaptive_verification=True)
    plain = parse_arm("no-spec:sync").config(base, spec)
    assert plain.spec is None and plain.async_scheduling is False
    assert parse_arm("no-spec").config(base, spec).async_scheduling is None  # the engine's default (on for CUDA)
    fixed = parse_arm("fixed-3:sync")
    assert (fixed.name, fixed.k, fixed.sync, fixed.speculates) == ("fixed-3:sync", 3, True, True)
    cfg = fixed.config(base, spec)
    assert cfg.async_scheduling is False and cfg.spec is not None and cfg.spec.num_speculative_tokens == 3
    adaptive = parse_arm("adaptive:sync").config(base, spec)
    assert adaptive.spec is not None and adaptive.spec.enable_adaptive_verification and not adaptive.async_scheduling
    for bad in ("no-spec:async", "sync", ":sync", "fixed-33:sync", "no-spec:sync:sync"):
        with pytest.raises(ConfigError, match="arm"):
            parse_arm(bad)


def test_the_held_plain_arm_is_adaptives_engine_that_never_drafts(
    tiny_model_dirs: dict[str, Path], data_dir: Path
) -> None:
    """adaptive:plain builds adaptive's engine (the drafter and its context kept) with the regime held plain: no step
    drafts, its outputs are no-spec's, and it is not a baseline of the paired ratio."""
    base = EngineConfig(model="m")
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    arm = parse_arm("adaptive:plain")
    cfg = arm.config(base, spec).spec
    assert arm.held_plain and cfg is not None and cfg.enable_adaptive_verification
    assert parse_arm("adaptive:plain:sync").sync and not parse_arm("adaptive").held_plain
    config = EngineConfig(
        model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=128, speculative_config=spec
    )
    result = run_sweep(
        config,
        arms=["no-spec", "adaptive:plain", "adaptive"],
        concurrencies=[4],
        temperatures=[0.0],
        output_len=OUTPUT_LEN,
        num_prompts=NUM_PROMPTS,
        data_dir=str(data_dir),
        interleave=True,
    ).result
    rows = {r["arm"]: r for r in result["rows"]}
    held = rows["adaptive:plain"]
    assert held["spec_decode_num_drafts"] == 0 and held["identical_to_no_spec"] == f"{NUM_PROMPTS}/{NUM_PROMPTS}"
    assert result["config"]["arms"]["adaptive:plain"]["enable_adaptive_verification"] is True
    arms = {a: {"rounds_output_throughput": [1.0, 1.0]} for a in ("no-spec", "adaptive")}
    arms["adaptive:plain"] = {"rounds_output_throughput": [9.0, 9.0]}
    assert paired_adaptive_ratio(arms) == pytest.approx(1.0)


def test_interleaved_arms_take_turns_row_by_row(
    tiny_model_dirs: dict[str, Path], data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--interleave: every arm's engine is built once and lives through the run, the arms take turns row by row with
    the first rotating by round, and the rows are what the engines-in-turn sweep gives (greedy outputs equal to
    no-spec's; each row's rounds all there)."""
    config = EngineConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=128)
    built: list[str] = []
    real_llm = sweep_module.LLM

    def counting_llm(**kwargs: object) -> object:
        spec = kwargs.get("speculative_config")
        built.append("no-spec" if spec is None else f"fixed-{spec['num_speculative_tokens']}")  # type: ignore[index]
        return real_llm(**kwargs)

    sweep_module.LLM = counting_llm  # type: ignore[assignment]
    try:
        result = run_sweep(
            config,
            arms=["no-spec", "fixed-1"],
            concurrencies=[1, 4],
            temperatures=[0.0],
            output_len=OUTPUT_LEN,
            num_prompts=NUM_PROMPTS,
            data_dir=str(data_dir),
            repeats=2,
            interleave=True,
        ).result
    finally:
        sweep_module.LLM = real_llm  # type: ignore[assignment]
    assert built == ["no-spec", "fixed-1"]  # once each, not once a round
    labels = [line.split(":")[0] for line in capsys.readouterr().err.splitlines() if " ROW " in line]
    assert labels == [
        "no-spec C=1 T=0.0 r1",
        "fixed-1 C=1 T=0.0 r1",
        "no-spec C=4 T=0.0 r1",
        "fixed-1 C=4 T=0.0 r1",
        "fixed-1 C=1 T=0.0 r2",
        "no-spec C=1 T=0.0 r2",
        "fixed-1 C=4 T=0.0 r2",
        "no-spec C=4 T=0.0 r2",
    ]
    assert result["config"]["interleave"] is True
    rows = {(r["arm"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(a, c) for a in ("no-spec", "fixed-1") for c in (1, 4)}
    assert all(len(r["rounds_output_throughput"]) == 2 for r in rows.values())
    assert rows["fixed-1", 4]["identical_to_no_spec"] == f"{NUM_PROMPTS}/{NUM_PROMPTS}"
    assert rows["fixed-1", 4]["spec_decode_num_drafts"] > 0


def test_paired_ratio_pairs_rounds() -> None:
    """The paired ratio divides each round's adaptive throughput by the best baseline arm's in that round, and takes
    the median: a slow round shared by all arms cancels, where the ratio of medians would pair rounds unevenly."""
    arms = {
        "no-spec": {"rounds_output_throughput": [100.0, 50.0, 90.0]},
        "fixed-1": {"rounds_output_throughput": [60.0, 70.0, 40.0]},
        "adaptive": {"rounds_output_throughput": [98.0, 69.0, 45.0]},
    }
    # rounds: 98 / 100, 69 / 70, 45 / 90 -> median 0.98 (the ratio of medians: 69 / 90)
    assert paired_adaptive_ratio(arms) == pytest.approx(0.98)
    assert paired_adaptive_ratio({"adaptive": arms["adaptive"]}) is None
    one_round = {a: {"rounds_output_throughput": r["rounds_output_throughput"][:1]} for a, r in arms.items()}
    assert paired_adaptive_ratio(one_round) is None
