"""What the fault tests measured (trials run, time to failure per fault), printed after the run.

Tests call :func:`record`; ``tests/faults/conftest.py`` prints :func:`summary` in pytest's terminal
summary, so every run of the suite reports the figures the issue asks for.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

_SECONDS: dict[str, list[float]] = defaultdict(list)


def record(fault: str, seconds: list[float]) -> None:
    """Time to failure of each trial of ``fault`` (seconds from the fault to the last rank's error)."""
    _SECONDS[fault].extend(seconds)


def summary() -> list[str]:
    """One line per fault: trials, median and max time to failure."""
    return [
        f"{fault:<58} trials {len(s):>3}  time to failure median {statistics.median(s):7.3f} s  max {max(s):7.3f} s"
        for fault, s in sorted(_SECONDS.items())
    ]
