"""Progress bars for the data phases (reading and tokenizing, packing, writing the cache), on rank 0 only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

# A data phase shows a progress bar on stderr once it has run this long.
PROGRESS_AFTER_S = 3.0


def progress(items: Iterable[Any] | None, what: str, show: bool, total: int | None = None, unit: str = "it") -> Any:
    """``items`` with a bar ``data: <what>`` that appears after :data:`PROGRESS_AFTER_S` (``show``: rank 0).

    ``items=None``: a bar to ``update()`` by hand (``unit="B"``: counted in bytes, shown as kB/MB/GB).
    """
    return tqdm(
        items,
        desc=f"data: {what}",
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        delay=PROGRESS_AFTER_S,
        mininterval=1.0,
        leave=False,
        disable=not show,
    )
