"""The padded sizes CUDA graphs are captured for (the target's steps and the drafter's passes share the grid)."""

from __future__ import annotations


def capture_sizes(max_tokens: int) -> list[int]:
    """Padded token counts: fine where a step is cheap, then about 8 sizes per doubling (at most ~25% padding), so an
    engine captures a few dozen graphs per query length, not hundreds."""
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    while sizes[-1] < 8192:
        step = sizes[-1] // 4
        sizes += [sizes[-1] + step * i for i in range(1, 5)]
    return [s for s in sizes if s < max_tokens] + [max_tokens]
