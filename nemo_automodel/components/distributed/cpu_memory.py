"""CPU training: fixed glibc malloc thresholds, so freed tensors leave RSS at once and peak RSS tracks live tensors.

Torch's CPU allocator takes every tensor from ``malloc``. glibc serves a request above its mmap threshold with its
own ``mmap`` and unmaps it on ``free``; smaller requests come from the heap, whose freed chunks stay resident
(only the heap's free top above the trim threshold is returned). Both thresholds are dynamic by default: each freed
mapped block raises the mmap threshold to its size (up to 32 MiB on 64-bit) and the trim threshold to twice that,
so after the first large frees most tensors come from the heap and its free top is kept. A training step then peaks
above its live tensors by an amount that grows with the row, and more so at higher ``cp``, where a rank's per-head
and per-document pieces are smaller (``benchmarks/recipe_throughput.py --scaling --counts``, ``docs/performance.md``).

:func:`set_malloc_thresholds` fixes both thresholds (which also turns glibc's dynamic adjustment off); the recipe
calls it once per CPU worker at start-up with ``dist.cpu_malloc_threshold_kib``. The environment wins: a threshold
the user set with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` (glibc read it at
start) is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_THRESHOLD_KIB = 32 << 10  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more


@dataclass(frozen=True)
class _Threshold:
    """One glibc malloc threshold: its ``mallopt`` parameter (malloc.h) and the environment names that set it."""

    name: str
    param: int
    env: str
    tunable: str


THRESHOLDS = (
    _Threshold("mmap", -3, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    _Threshold("trim", -1, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
)


def _user_setting(threshold: _Threshold) -> str | None:
    """How the environment sets ``threshold`` (``NAME=value``), or ``None`` when it does not."""
    if os.environ.get(threshold.env):
        return f"{threshold.env}={os.environ[threshold.env]}"
    for item in os.environ.get("GLIBC_TUNABLES", "").replace(":", " ").split():
        if item.startswith(threshold.tunable + "="):
            return f"GLIBC_TUNABLES {item}"
    return None


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or ``None`` off glibc (musl and macOS have none)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def set_malloc_thresholds(threshold_kib: int | None) -> str:
    """Fix glibc's mmap and trim thresholds of this process at ``threshold_kib``; return what was done (to log once).

    ``None`` leaves glibc's dynamic thresholds. A threshold set in the environment is kept and named in the result.
    """
    if threshold_kib is None:
        return "glibc's dynamic thresholds (dist.cpu_malloc_threshold_kib=null)"
    mallopt = _mallopt()
    if mallopt is None:
        return "not glibc: dist.cpu_malloc_threshold_kib has no effect"
    done, kept = [], []
    for threshold in THRESHOLDS:
        user = _user_setting(threshold)
        if user is not None:
            kept.append(f"{threshold.name} kept from the environment ({user})")
        elif mallopt(threshold.param, threshold_kib << 10) == 1:
            done.append(threshold.name)
        else:
            kept.append(f"{threshold.name} refused by mallopt (glibc's dynamic threshold stays)")
    fixed = f"{' and '.join(done)} threshold{'s' if len(done) > 1 else ''} fixed at {threshold_kib} KiB" if done else ""
    return "; ".join(x for x in (fixed, *kept) if x) + " (dist.cpu_malloc_threshold_kib)"
