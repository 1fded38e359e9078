"""Attention variants real model families ask for: sliding windows, chunks, logit soft-capping, attention sinks.

Semantics (those of transformers' eager attention, per document):

- ``window=W`` (transformers' ``sliding_window``): the query at document position
  ``i`` attends the keys ``j`` of its own document with ``i - W < j <= i`` (``W``
  keys, itself included). flash-attn's ``window_size=(W - 1, 0)``.
- ``softcap=c``: every score ``s`` (after scaling) becomes ``c * tanh(s / c)``
  before masking and softmax (Gemma 2).
- ``sinks`` ``[Hq]``: one learned logit per query head that joins every row's
  softmax denominator and carries no value (gpt-oss ``s_aux``): the row's weights
  sum to less than one.

A kernel that cannot express a variant refuses it by name (see
:func:`~nemo_automodel.components.distributed.blockdiag_cp.kernels.kernel_unavailable_reason`);
nothing is ever dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PlanKey = int | None | tuple[str, int]
"""Key of one attention plan of a row: a sliding window (``None``: full causal) or ``("chunk", C)``."""


def plan_key(window: int | None, chunk: int | None) -> PlanKey:
    """The :data:`PlanKey` of attention with sliding ``window`` or attention ``chunk`` (never both)."""
    return window if chunk is None else ("chunk", chunk)


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    """What one attention call computes beyond per-document causal softmax attention.

    Attributes:
        window: Sliding window ``W >= 1`` in keys (``None``: full causal).
        chunk: Chunk ``C >= 1`` in positions (``None``: unchunked); not combined with ``window``.
        softcap: Logit soft-cap ``c > 0`` (``None``: none).
        sinks: Sink logits ``[Hq]`` (``None``: none); a parameter, so it gets a gradient.
        source: Where the variant comes from (e.g. ``"MistralForCausalLM layer 3"``), named in errors.
    """

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    source: str = ""

    def __post_init__(self) -> None:
        where = f" ({self.source})" if self.source else ""
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(
                f"sliding_window={self.window!r}{where}: must be a positive int (or None for full attention)"
            )
        if self.chunk is not None and (
            isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1
        ):
            raise ValueError(
                f"attention_chunk_size={self.chunk!r}{where}: must be a positive int (or None for unchunked)"
            )
        if self.chunk is not None and self.window is not None:
            raise ValueError(
                f"sliding_window={self.window} with attention_chunk_size={self.chunk}{where}: a layer with both "
                "is not supported; use one of them per layer"
            )
        if self.softcap is not None and (
            isinstance(self.softcap, bool)
            or not isinstance(self.softcap, (int, float))
            or not math.isfinite(self.softcap)
            or self.softcap <= 0
        ):
            raise ValueError(f"softcap={self.softcap!r}{where}: must be a positive finite number (or None)")
        if self.sinks is not None and (
            not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1 or not self.sinks.is_floating_point()
        ):
            shape = tuple(self.sinks.shape) if isinstance(self.sinks, torch.Tensor) else type(self.sinks).__name__
            raise ValueError(f"s_aux (attention sinks){where}: must be a floating [num_heads] tensor, got {shape}")

    @property
    def plain(self) -> bool:
        """True when this is plain per-document causal attention."""
        return self.window is None and self.chunk is None and self.softcap is None and self.sinks is None

    @property
    def scores_changed(self) -> bool:
        """True when the softmax itself changes (soft-cap or sinks): SDPA-style kernels cannot express it."""
        return self.softcap is not None or self.sinks is not None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The variant's differentiable inputs (the sinks, if any): kernels and guards keep them in the graph."""
        return () if self.sinks is None else (self.sinks,)

    @property
    def key(self) -> tuple[int | None, bool, bool]:
        """What kernel choice depends on: ``(window, has softcap, has sinks)`` (a chunk is in the plan only)."""
        return self.window, self.softcap is not None, self.sinks is not None

    @property
    def plan_key(self) -> PlanKey:
        """Which attention plan the call uses: its window (``None``: full causal), or ``("chunk", C)``."""
        return plan_key(self.window, self.chunk)

    def features(self) -> list[str]:
        """The variant's features as a user would name them, e.g. ``["sliding_window=4096", "softcap=50.0"]``."""
        names = []
        if self.window is not None:
            names.append(f"sliding_window={self.window}")
        if self.chunk is not None:
            names.append(f"attention_chunk_size={self.chunk}")
        if self.softcap is not None:
            names.append(f"softcap={self.softcap}")
        if self.sinks is not None:
            names.append("s_aux (attention sinks)")
        return names

    def describe(self, feature: str) -> str:
        """``feature`` followed by where it comes from, e.g. ``"sliding_window=4096 (MistralForCausalLM layer 3)"``."""
        return f"{feature} ({self.source})" if self.source else feature


PLAIN = AttentionVariant()
