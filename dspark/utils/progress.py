"""Progress bars for the slow first-start work (downloading the model, converting its weights, profiling step costs,
capturing CUDA graphs), on stderr with tqdm. Shown on a terminal only, so logs and pipes get no carriage-return lines;
DSPARK_PROGRESS=1 shows them anywhere, 0 nowhere."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def enabled() -> bool | None:
    """tqdm's `disable`, inverted: True (show), False (hide) or None (tqdm decides: a terminal only)."""
    value = os.environ.get("DSPARK_PROGRESS", "").strip()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return None


def shown() -> bool:
    """Whether bars show now: as enabled() says, else when stderr is a terminal."""
    show = enabled()
    if show is not None:
        return show
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed (a test harness)
        return False


def bar(desc: str, total: float | None = None, unit: str = "it", **kwargs: Any) -> tqdm:
    show = enabled()
    disable = None if show is None else not show
    return tqdm(total=total, desc=f"dspark: {desc}", unit=unit, file=sys.stderr, disable=disable, leave=False, **kwargs)


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate with a bar (total: len(items) when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(desc, total, unit) as progress:
        for item in items:
            yield item
            progress.update(1)
