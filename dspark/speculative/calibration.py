"""How well confidences predict acceptance: reliability bins shared by the engine's online monitor and the drafter's
offline calibration (train/calibrate.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

NUM_BINS = 20  # reliability-diagram bins over [0, 1]


@dataclass
class CalibrationMonitor:
    """Predicted vs realised acceptance of the drafts actually verified."""

    num_blocks: int = 0
    predicted: float = 0.0  # sum over verified blocks of the survivals of their verified slots
    realised: float = 0.0  # sum of their accepted drafts
    bin_count: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    bin_predicted: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    bin_realised: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))

    def add_blocks(
        self, survivals: np.ndarray, outcomes: np.ndarray, verified: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Many blocks at once: survivals and outcomes ([m] fp64 / bool) of all their verified slots, flattened;
        verified and accepted ([n, 1]) per block. Blocks that verified nothing do not count."""
        bins = np.clip((survivals * NUM_BINS).astype(np.int64), 0, NUM_BINS - 1)
        self.bin_count += np.bincount(bins, minlength=NUM_BINS)
        self.bin_predicted += np.bincount(bins, weights=survivals, minlength=NUM_BINS)
        self.bin_realised += np.bincount(bins, weights=outcomes.astype(np.float64), minlength=NUM_BINS)
        counted = verified > 0
        self.num_blocks += int(counted.sum())
        self.predicted += float(survivals.sum())
        self.realised += int(accepted[counted].sum())

    @property
    def ece(self) -> float:
        total = float(self.bin_count.sum())
        return float(np.abs(self.bin_predicted - self.bin_realised).sum()) / total if total else 0.0


@dataclass(frozen=True)
class StsEntry:
    """One STS fit (train/calibrate.py): per-position temperatures and shifts, fitted on drafts verified at one
    sampling temperature (0: greedy requests)."""

    sampling_temperature: float
    temperatures: tuple[float, ...]
    biases: tuple[float, ...]


class StsTable:
    """A drafter's confidence calibration: STS fits at one or more sampling temperatures.

    Drafts survive differently under argmax matching and under rejection sampling, so one scaling fitted at T = 1 is
    off at T = 0 (the shipped drafter: ECE 3.6% on GSM8K at T = 0 against 0.7% at T = 1). A request takes the fit at
    its own temperature; between two fits, the linear interpolation of their logit scales 1/T_k and shifts b_k (the
    scaled logit is linear in both, so this blends the two calibrated logits); outside them, the nearest fit."""

    def __init__(self, entries: Sequence[StsEntry]) -> None:
        if not entries:
            raise ValueError("an STS table needs at least one fit")
        k = len(entries[0].temperatures)
        ordered = sorted(entries, key=lambda e: e.sampling_temperature)
        for e in ordered:
            if e.sampling_temperature < 0 or not math.isfinite(e.sampling_temperature):
                raise ValueError(f"sampling_temperature={e.sampling_temperature!r} must be a finite number >= 0")
            if len(e.temperatures) != k or len(e.biases) != k:
                raise ValueError(f"every fit needs {k} temperatures and {k} biases, got {e}")
            if not all(t > 0 for t in e.temperatures):
                raise ValueError(f"temperatures={list(e.temperatures)} must all be > 0")
        points = [e.sampling_temperature for e in ordered]
        if len(set(points)) < len(points):
            raise ValueError(f"sampling temperatures {points} repeat: one fit per temperature")
        self.entries: tuple[StsEntry, ...] = tuple(ordered)

    @classmethod
    def single(cls, k: int, temperatures: Sequence[float] | None, biases: Sequence[float] | None) -> StsTable:
        """One fit for every temperature (the sts_temperatures / sts_biases keys, or none: the identity)."""
        temps = tuple(temperatures) if temperatures is not None else (1.0,) * k
        return cls([StsEntry(1.0, temps, tuple(biases) if biases is not None else (0.0,) * k)])

    @property
    def num_positions(self) -> int:
        return len(self.entries[0].temperatures)

    @property
    def sampling_temperatures(self) -> list[float]:
        return [e.sampling_temperature for e in self.entries]

    def scales(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sampling temperatures [E], logit scales 1/T [E, K], shifts [E, K]), fp64."""
        points = np.array(self.sampling_temperatures, dtype=np.float64)
        inv = 1.0 / np.array([e.temperatures for e in self.entries], dtype=np.float64)
        return points, inv, np.array([e.biases for e in self.entries], dtype=np.float64)

    def weights(self, sampling_temperatures: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per request: the fits below and above its temperature ([n] indices) and the weight of the one above."""
        points = np.array(self.sampling_temperatures, dtype=np.float64)
        t = np.clip(np.asarray(sampling_temperatures, dtype=np.float64), points[0], points[-1])
        if len(points) == 1:
            zeros = np.zeros(t.shape, dtype=np.int64)
            return zeros, zeros, np.zeros_like(t)
        hi = np.clip(np.searchsorted(points, t, side="right"), 1, len(points) - 1).astype(np.int64)
        lo = hi - 1
        return lo, hi, (t - points[lo]) / (points[hi] - points[lo])

    def at(self, sampling_temperatures: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The scaling of requests at these temperatures ([n]): logit scales 1/T [n, K] and shifts [n, K]."""
        _, inv, bias = self.scales()
        lo, hi, w = self.weights(sampling_temperatures)
        w = w[:, None]

        def lerp(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # torch.lerp's form: exact at w = 0 and at w = 1
            return np.where(w < 0.5, a + w * (b - a), b - (b - a) * (1 - w))

        return lerp(inv[lo], inv[hi]), lerp(bias[lo], bias[hi])

    def with_entry(self, entry: StsEntry) -> StsTable:
        """This table with the fit at entry's temperature replaced (or added)."""
        kept = [e for e in self.entries if e.sampling_temperature != entry.sampling_temperature]
        return StsTable([*kept, entry])

    def to_json(self) -> list[dict[str, object]]:
        return [
            {
                "sampling_temperature": e.sampling_temperature,
                "temperatures": list(e.temperatures),
                "biases": list(e.biases),
            }
            for e in self.entries
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StsTable) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"StsTable({list(self.entries)})"
