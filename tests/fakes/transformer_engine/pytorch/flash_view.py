"""Which flash-attn TE sees, by release (its version range: pytorch/attention.py, dot_product_attention/utils.py).

This is a stand-in helper, not a TE module: TE keeps the same facts in module
globals (<= 2.1) or in ``FlashAttentionUtils`` (2.2 on); the stand-in exposes
them at the path each release has them.
"""

from __future__ import annotations

import machine
from packaging.version import Version

TE = machine.release(machine.ACTIVE.te)
# (first TE release, flash-attn version_required, max_version) from each tag's source
_RANGES = (
    ((1, 9), "2.0.6", "2.5.8"),
    ((1, 11), "2.0.6", "2.6.3"),
    ((1, 12), "2.1.1", "2.6.3"),
    ((2, 0), "2.1.1", "2.7.3"),
    ((2, 1), "2.1.1", "2.7.4.post1"),
    ((2, 6), "2.1.1", "2.8.1"),
    ((2, 10), "2.1.1", "2.8.3"),
)
REQUIRED, MAX = next((low, high) for since, low, high in reversed(_RANGES) if since <= TE)
FLASH = machine.ACTIVE.flash
IN_RANGE = FLASH is not None and Version(REQUIRED) <= Version(FLASH) <= Version(MAX)
FA3 = machine.ACTIVE.fa3 is not None


class FlashAttentionUtils:
    """TE's view of flash-attn (TE 2.2 and later keep it in this class): installed within TE's range, FA3."""

    is_installed = IN_RANGE
    version = Version(FLASH if IN_RANGE else "0")
    version_required = Version(REQUIRED)
    version_required_blackwell = Version("2.7.3")
    max_version = Version(MAX)
    v3_is_installed = FA3
