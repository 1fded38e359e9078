"""``FlashAttentionUtils`` where TE 2.2 keeps it."""

from transformer_engine.pytorch.flash_view import FlashAttentionUtils

__all__ = ["FlashAttentionUtils"]
