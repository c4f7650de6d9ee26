"""Sequential Temperature Scaling on synthetic drafts whose true acceptance is known."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.train.calibrate import (
    calibrated_survival,
    expected_calibration_error,
    fit_sts,
    logits_from_confidences,
    survival_outcomes,
)


def _synthetic(
    n: int, true_temps: list[float], seed: int = 0, true_biases: list[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, and how many drafts of each block survive when draft k survives with sigmoid(logit_k / T_k + b_k)."""
    g = torch.Generator().manual_seed(seed)
    k = len(true_temps)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64) * 2 + 1
    shift = torch.tensor(true_biases or [0.0] * k, dtype=torch.float64)
    p = torch.sigmoid(logits / torch.tensor(true_temps, dtype=torch.float64) + shift)
    alive = torch.rand(n, k, generator=g, dtype=torch.float64) < p
    num_accepted = torch.cumprod(alive.long(), dim=1).sum(1)
    return logits, num_accepted


def _write_trace(path: Path, confidences: torch.Tensor, num_accepted: torch.Tensor, **header: object) -> Path:
    """A fixed-k trace: one fully verified block per step, its recorded confidences and accepted count."""
    import json

    k = confidences.shape[1]
    lines = [json.dumps({"type": "header", "K": k, **header})]
    for i in range(len(confidences)):
        block = {"id": f"r{i}", "confidences": confidences[i].tolist(), "num_drafts": k, "num_verified": k}
        lines.append(
            json.dumps({"type": "step", "step": i, "requests": [{**block, "num_accepted": int(num_accepted[i])}]})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _tiny_drafter(directory: Path, block_size: int) -> Path:
    """A random drafter for a tiny 4-layer target, saved: calibration only edits its config.json."""
    from dspark.models.config import ModelConfig
    from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
    from dspark.speculative.drafters.dspark.config import DSparkConfig

    target = ModelConfig(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
    )
    cfg = DSparkConfig.for_target(target, num_layers=1, block_size=block_size, num_taps=1, markov_rank=4)
    return save_drafter(random_drafter(cfg, seed=0), directory)


def test_ece_of_perfect_and_of_wrong_predictions() -> None:
    assert expected_calibration_error(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.0
    assert abs(expected_calibration_error(torch.full((10,), 0.9, dtype=torch.float64), torch.zeros(10)) - 0.9) < 1e-12
    # Two bins, each right on average: calibrated even though single predictions miss.
    pred = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.75, 0.75, 0.75, 0.75])
    assert expected_calibration_error(pred, torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0])) < 1e-12


def test_survival_outcomes() -> None:
    assert survival_outcomes(torch.tensor([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_sts_recovers_the_temperatures_and_calibrates_survival() -> None:
    true_temps = [0.5, 2.0, 1.0, 3.0]
    logits, accepted = _synthetic(20000, true_temps)
    survived = survival_outcomes(accepted, 4)
    temps, biases = fit_sts(logits, survived)
    for got, want in zip(temps, true_temps, strict=True):
        assert abs(got / want - 1) < 0.15, (temps, true_temps)
    assert biases == [0.0] * 4  # no shift where none is needed
    held_out_logits, held_out_accepted = _synthetic(20000, true_temps, seed=1)
    held_out = survival_outcomes(held_out_accepted, 4)
    before = calibrated_survival(held_out_logits, [1.0] * 4)
    after = calibrated_survival(held_out_logits, temps, biases)
    for k in range(4):
        ece_before = expected_calibration_error(before[:, k], held_out[:, k])
        ece_after = expected_calibration_error(after[:, k], held_out[:, k])
        assert ece_after < 0.02 and ece_after <= ece_before, (k, ece_before, ece_after)


def test_an_overconfident_head_needs_the_shift() -> None:
    """Drafts survive far less often than the head says (sigmoid(logit - 2)): no temperature alone can bring positive
    logits under 0.5; the fitted shift does, and the ECE on new blocks falls below 2%."""
    true_temps, true_biases = [1.0, 1.5, 0.8], [-2.0, -1.0, -1.5]
    logits, accepted = _synthetic(20000, true_temps, true_biases=true_biases)
    temps, biases = fit_sts(logits, survival_outcomes(accepted, 3))
    assert abs(biases[0] + 2.0) < 0.35 and abs(temps[0] - 1.0) < 0.2, (temps, biases)
    new_logits, new_accepted = _synthetic(20000, true_temps, seed=2, true_biases=true_biases)
    new = survival_outcomes(new_accepted, 3)
    temp_only = fit_sts(logits, survival_outcomes(accepted, 3), bias_grid=torch.zeros(1, dtype=torch.float64))
    for k in range(3):
        shifted = expected_calibration_error(calibrated_survival(new_logits, temps, biases)[:, k], new[:, k])
        scaled = expected_calibration_error(calibrated_survival(new_logits, *temp_only)[:, k], new[:, k])
        assert shifted < 0.02 < scaled, (k, shifted, scaled)


def test_sts_preserves_the_order_of_confidences_at_each_position() -> None:
    logits, accepted = _synthetic(5000, [0.7, 1.5])
    temps, biases = fit_sts(logits, survival_outcomes(accepted, 2), bias_grid=torch.tensor([-1.0, 0.5]))
    a = calibrated_survival(logits, temps, biases)
    c = torch.sigmoid(logits[:, 0])
    assert torch.equal(torch.argsort(a[:, 0]), torch.argsort(c))  # position 1: a monotone map of the raw confidence
    assert (a[:, 1] <= a[:, 0]).all()


def test_calibrate_drafter_from_a_fixed_k_trace(tmp_path: Path) -> None:
    """A trace whose confidences are sigmoid(logit) while drafts truly survive with sigmoid(logit / T_k): the fitted
    temperatures land in the drafter's config (where the loader reads them) and cut the survival ECE."""
    import json

    from dspark.speculative.drafters.dspark.config import DSparkConfig
    from dspark.train.calibrate import calibrate_drafter

    true_temps = [2.0, 0.5, 1.5, 1.0]
    logits, num_accepted = _synthetic(4000, true_temps, seed=5)
    trace = _write_trace(tmp_path / "trace.jsonl", torch.sigmoid(logits), num_accepted)
    drafter = _tiny_drafter(tmp_path / "drafter", block_size=6)
    (report,) = calibrate_drafter(trace, drafter)["fits"]
    assert report["num_blocks"] == 4000 and report["sampling_temperature"] == 1.0  # not recorded: the default
    assert report["ece_after"] < 0.02 < report["ece_before"]
    temps = report["temperatures"]
    assert abs(temps[0] - 2.0) < 0.3 and abs(temps[1] - 0.5) < 0.15
    loaded = DSparkConfig.from_json(json.loads((drafter / "config.json").read_text()), "test")
    assert loaded.sts_temperatures is not None and list(loaded.sts_temperatures[:4]) == temps
    assert loaded.sts_temperatures[4:] == (1.0, 1.0)  # past the trace's K: untouched
    assert loaded.sts_biases is not None and list(loaded.sts_biases[:4]) == report["biases"]
    assert loaded.sts_biases[4:] == (0.0, 0.0)


def test_confidences_invert_to_the_head_logits_with_temperatures_and_shifts() -> None:
    z = torch.linspace(-4, 4, 21, dtype=torch.float64)[:, None].expand(21, 3)
    temps, biases = [0.5, 2.0, 1.3], [-1.0, 0.7, 0.0]
    c = torch.sigmoid(z / torch.tensor(temps, dtype=torch.float64) + torch.tensor(biases, dtype=torch.float64))
    torch.testing.assert_close(logits_from_confidences(c, temps, biases), z)
    assert (logits_from_confidences(c, temps) - z).abs().max() > 0.5  # the shift matters


def test_a_trace_is_undone_with_the_scaling_it_was_recorded_with(tmp_path: Path) -> None:
    """The header says the confidences were recorded with T = 2: fitting twice on one trace (the drafter's config
    changed in between) gives the same scaling."""

    from dspark.train.calibrate import calibrate_drafter

    logits, num_accepted = _synthetic(3000, [1.0, 0.7], seed=9)
    trace = _write_trace(
        tmp_path / "trace.jsonl",
        torch.sigmoid(logits / 2.0),
        num_accepted,
        sts_temperatures=[2.0, 2.0],
        sts_biases=None,
    )
    drafter = _tiny_drafter(tmp_path / "drafter", block_size=2)
    (first,) = calibrate_drafter(trace, drafter)["fits"]
    (second,) = calibrate_drafter(trace, drafter)["fits"]
    assert first["temperatures"] == second["temperatures"] and first["biases"] == second["biases"]
    assert abs(first["temperatures"][0] - 1.0) < 0.2, first  # the head's own logits, not the recorded ones


# ---- fits per sampling temperature --------------------------------------------------------------------------------


def _table_trace(path: Path, parts: list[tuple[float, torch.Tensor, torch.Tensor]], **header: object) -> Path:
    """A fixed-k trace whose blocks record their request's sampling temperature: (temperature, confidences,
    accepted) per part."""
    import json

    k = parts[0][1].shape[1]
    lines = [json.dumps({"type": "header", "K": k, **header})]
    n = 0
    for t, conf, accepted in parts:
        for i in range(len(conf)):
            block = {"id": f"r{n}", "confidences": conf[i].tolist(), "num_drafts": k, "num_verified": k}
            block |= {"num_accepted": int(accepted[i]), "temperature": t}
            lines.append(json.dumps({"type": "step", "step": n, "requests": [block]}))
            n += 1
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_table_interpolates_scales_and_shifts_between_its_fits() -> None:
    import numpy as np

    from dspark.speculative.calibration import StsEntry, StsTable

    table = StsTable([StsEntry(1.0, (4.0, 1.0), (1.0, 0.0)), StsEntry(0.0, (1.0, 0.5), (-1.0, 0.0))])
    assert table.sampling_temperatures == [0.0, 1.0]  # kept in order
    inv, bias = table.at(np.array([0.0, 0.25, 1.0, 3.0]))
    np.testing.assert_allclose(inv, [[1.0, 2.0], [0.8125, 1.75], [0.25, 1.0], [0.25, 1.0]])  # 1/T, linearly
    np.testing.assert_allclose(bias, [[-1.0, 0.0], [-0.5, 0.0], [1.0, 0.0], [1.0, 0.0]])
    single = StsTable.single(2, [2.0, 2.0], None)
    np.testing.assert_allclose(single.at(np.array([0.0, 0.7]))[0], [[0.5, 0.5]] * 2)  # one fit serves every T
    replaced = table.with_entry(StsEntry(1.0, (2.0, 2.0), (0.0, 0.0)))
    assert replaced.entries[0] == table.entries[0] and replaced.entries[1].temperatures == (2.0, 2.0)
    for bad in (
        [StsEntry(1.0, (1.0,), (0.0,)), StsEntry(1.0, (2.0,), (0.0,))],  # one temperature twice
        [StsEntry(-0.5, (1.0,), (0.0,))],
        [StsEntry(0.0, (1.0, 1.0), (0.0,))],
        [StsEntry(0.0, (0.0,), (0.0,))],
    ):
        with pytest.raises(ValueError):
            StsTable(bad)


def test_greedy_and_sampled_blocks_get_their_own_fits(tmp_path: Path) -> None:
    """Drafts that survive with sigmoid(logit / 2) when greedy and sigmoid(logit / 0.5) when sampled: one trace
    holding both gives two fits, each near its truth; recalibrating at T = 1 alone keeps the greedy fit."""
    import json

    from dspark.speculative.drafters.dspark.config import DSparkConfig
    from dspark.train.calibrate import calibrate_drafter

    greedy = _synthetic(4000, [2.0, 2.0], seed=1)
    sampled = _synthetic(4000, [0.5, 0.5], seed=2)
    parts = [(0.0, torch.sigmoid(greedy[0]), greedy[1]), (1.0, torch.sigmoid(sampled[0]), sampled[1])]
    trace = _table_trace(tmp_path / "both.jsonl", parts)
    drafter = _tiny_drafter(tmp_path / "drafter", block_size=2)
    fits = calibrate_drafter(trace, drafter)["fits"]
    assert [f["sampling_temperature"] for f in fits] == [0.0, 1.0]
    assert abs(fits[0]["temperatures"][0] - 2.0) < 0.3 and abs(fits[1]["temperatures"][0] - 0.5) < 0.1
    assert all(f["ece_after"] < 0.02 for f in fits)
    # One scaling for both would be off for one of them: the same logits survive differently.
    mixed = torch.cat([greedy[0], sampled[0]])
    outcomes = survival_outcomes(torch.cat([greedy[1], sampled[1]]), 2)
    pooled_t, pooled_b = fit_sts(mixed, outcomes)
    per_t = [calibrated_survival(greedy[0], pooled_t, pooled_b), calibrated_survival(sampled[0], pooled_t, pooled_b)]
    assert expected_calibration_error(per_t[0], survival_outcomes(greedy[1], 2)) > 0.05

    config_path = drafter / "config.json"
    raw = json.loads(config_path.read_text())
    assert "sts_temperatures" not in raw["dspark_config"] and len(raw["dspark_config"]["sts_by_temperature"]) == 2
    (again,) = calibrate_drafter(_table_trace(tmp_path / "t1.jsonl", parts[1:]), drafter)["fits"]
    table = DSparkConfig.from_json(json.loads(config_path.read_text()), "test").sts_table
    assert table.sampling_temperatures == [0.0, 1.0]
    assert list(table.entries[0].temperatures) == fits[0]["temperatures"]  # the greedy fit stays
    assert list(table.entries[1].temperatures) == again["temperatures"]


def test_a_drafter_calibrated_once_at_t0_keeps_that_temperature(tmp_path: Path) -> None:
    """A first fit serves every temperature, and records where it was fitted: a later T = 1 fit joins it rather
    than replacing it (the plain sts_temperatures keys would read as a fit at T = 1)."""
    import json

    from dspark.speculative.drafters.dspark.config import DSparkConfig
    from dspark.train.calibrate import calibrate_drafter

    logits, accepted = _synthetic(2000, [2.0], seed=3)
    drafter = _tiny_drafter(tmp_path / "drafter", block_size=1)
    calibrate_drafter(_table_trace(tmp_path / "t0.jsonl", [(0.0, torch.sigmoid(logits), accepted)]), drafter)
    table = DSparkConfig.from_json(json.loads((drafter / "config.json").read_text()), "test").sts_table
    assert table.sampling_temperatures == [0.0]
    calibrate_drafter(_table_trace(tmp_path / "t1.jsonl", [(1.0, torch.sigmoid(logits), accepted)]), drafter)
    table = DSparkConfig.from_json(json.loads((drafter / "config.json").read_text()), "test").sts_table
    assert table.sampling_temperatures == [0.0, 1.0]


def test_each_block_is_undone_with_the_fit_at_its_temperature(tmp_path: Path) -> None:
    """Confidences recorded with a two-fit table (header): every block's raw logits come back, whatever its
    request's temperature, including one between the fits."""
    import numpy as np

    from dspark.speculative.calibration import StsEntry, StsTable
    from dspark.speculative.trace import load_trace
    from dspark.train.calibrate import raw_logits, recorded_table

    table = StsTable([StsEntry(0.0, (2.0, 0.5), (0.3, -0.2)), StsEntry(1.0, (0.7, 1.5), (-1.0, 0.4))])
    z = torch.linspace(-3, 3, 12, dtype=torch.float64).reshape(6, 2)
    temps = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0]
    inv, bias = table.at(np.array(temps))
    conf = torch.sigmoid(z * torch.from_numpy(inv) + torch.from_numpy(bias))
    parts = [(t, conf[i : i + 1], torch.tensor([0])) for i, t in enumerate(temps)]
    trace = load_trace(_table_trace(tmp_path / "trace.jsonl", parts, sts_by_temperature=table.to_json()))
    blocks = [b for s in trace.streams.values() for b in s]
    stored = StsTable.single(2, None, None)
    assert recorded_table(trace.header, stored) == table
    torch.testing.assert_close(raw_logits(blocks, recorded_table(trace.header, stored), 1.0), z)
