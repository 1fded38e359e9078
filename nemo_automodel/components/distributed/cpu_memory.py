"""CPU training: return freed tensor memory to the system at once (glibc's malloc), so peak RSS tracks live tensors.

Torch's CPU allocator takes every tensor from ``malloc``. glibc serves requests above its mmap threshold
with their own ``mmap`` and unmaps them on ``free``, but the threshold is dynamic: each freed mapped block
raises it to that block's size (up to 32 MiB on 64-bit), so after the first step most activation-sized
tensors come from the heap, whose freed chunks stay resident and fragment. A training step then peaks well
above its live tensors, by an amount that grows with the row (``benchmarks/recipe_throughput.py --scaling
--census``, ``docs/performance.md``). A fixed threshold (which also turns the dynamic adjustment off) keeps
every block above it mapped and returned on free.

The environment wins: a process started with ``MALLOC_MMAP_THRESHOLD_`` set keeps that value.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
DEFAULT_THRESHOLD_BYTES = 1 << 20  # blocks of 1 MiB and more (a 1K-token fp32 activation of width 256) are mapped


def fix_mmap_threshold(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold to ``threshold_bytes`` in this process; return whether it was set.

    Does nothing (returns ``False``) when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (glibc read it at
    start) or the C library is not glibc (no ``mallopt``, or it refuses the value).
    """
    if os.environ.get(MMAP_THRESHOLD_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS none either)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold_bytes) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) refused: freed CPU tensors may stay resident", threshold_bytes)
        return False
    return True
