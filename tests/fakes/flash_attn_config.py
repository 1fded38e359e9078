"""Stand-in for the ``flash_attn_config`` module FlashAttention-3's setup.py writes (2025-07-16 on).

hopper/setup.py ``create_build_config_file``: ``CONFIG = {"build_flags": {...}}``, one
boolean per ``FLASH_ATTENTION_DISABLE_*`` environment variable of the build; the
two HDIMDIFF keys are spelt ``FLASH_ATTENTION_DISABLE_...``, the others
``FLASHATTENTION_DISABLE_...``. Builds before that date install no such module.
"""

from __future__ import annotations

import machine

if machine.ACTIVE.fa3 not in ("2.8.3", "main"):
    raise ModuleNotFoundError("No module named 'flash_attn_config'", name="flash_attn_config")

_FLAGS = (
    "BACKWARD", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "FP8", "VARLEN", "CLUSTER",
    "HDIM64", "HDIM96", "HDIM128", "HDIM192", "HDIM256", "SM8x",
)  # fmt: skip
CONFIG = {
    "build_flags": {
        **{f"FLASHATTENTION_DISABLE_{flag}": flag in machine.ACTIVE.fa3_disabled for flag in _FLAGS},
        "FLASHATTENTION_ENABLE_VCOLMAJOR": False,
        **{
            f"FLASH_ATTENTION_DISABLE_{flag}": flag in machine.ACTIVE.fa3_disabled
            for flag in ("HDIMDIFF64", "HDIMDIFF192")
        },
    }
}
