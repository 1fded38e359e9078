"""Row splits and joins of attention tensors ``[B, H, L, D]`` in the token-major frame.

Models build ``q``, ``k`` and ``v`` as transposed views of ``[B, L, H, D]`` projections and read the
attention output back through ``transpose(1, 2)``; torch's CPU flash kernel also works in that
token-major frame and copies any other layout into it first. A plain ``torch.cat`` along ``L`` (and
autograd's backward of ``split``, which is a ``cat``) returns a head-major tensor, which the kernel
and then the model each copy back. Splitting and joining along ``L`` as ``[B, L, H, D]`` keeps every
result, forward and backward, token-major, so none of those conversions happen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_major(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, L, D]`` laid out as ``[B, L, H, D]`` (a copy only when it is not already)."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def split_rows(t: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``t [B, H, L, D]`` cut along ``L`` into views ``[B, H, n_i, D]`` (``sum(sizes) == L``).

    One piece is ``t`` itself: a split into one piece would still cost a copy in backward.
    """
    if len(sizes) == 1:
        return (t,)
    return tuple(p.transpose(1, 2) for p in t.transpose(1, 2).split(list(sizes), dim=1))


def cat_rows(parts: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """``parts [B, H, n_i, D]`` joined along ``L`` (``dim=2``) or ``B`` (``dim=0``) into a token-major tensor."""
    if len(parts) == 1:
        return parts[0]
    frame = 1 if dim == 2 else dim
    return torch.cat([p.transpose(1, 2) for p in parts], dim=frame).transpose(1, 2)
