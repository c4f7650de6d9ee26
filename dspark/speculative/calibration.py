"""How well confidences predict acceptance: reliability bins shared by the engine's online monitor and the drafter's
offline calibration (train/calibrate.py)."""

from __future__ import annotations

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
