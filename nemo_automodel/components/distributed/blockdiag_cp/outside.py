"""The one policy of the SDPA replacements for a call that is not part of a packed row.

:func:`~.runtime.cp_blockdiag_sdpa` (outside a row's context) and :func:`~.packed.packed_varlen_sdpa`
(a call that is not the armed row) both are stock SDPA there: every argument forwarded, so vision towers,
evaluation and unpacked attention are unaffected. A sliding window, soft-cap or sinks cannot be expressed by
stock SDPA and raise instead of being dropped. Inside a row, a keyword the row cannot honour raises.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp.cpu_kernels import TORCH_SDPA
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant


def stock_sdpa(
    caller: str,
    remedy: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    variant: AttentionVariant,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Torch's own SDPA of a call outside any packed row: ``[B, Hq, Lq, D]`` queries -> ``[B, Hq, Lq, Dv]``.

    Args:
        caller: Names the replacement and where the call is, e.g. ``"cp_blockdiag_sdpa outside a CP step"``.
        remedy: What to do instead when ``variant`` is not plain.
        variant: The call's attention variant; a non-plain one raises.
        kwargs: Further keywords, forwarded to stock SDPA.

    Raises:
        ValueError: for a sliding window, soft-cap or sinks (stock SDPA cannot express them).
    """
    if not variant.plain:
        raise ValueError(
            f"{caller}: {', '.join(map(variant.describe, variant.features()))} cannot be expressed by torch's "
            f"scaled_dot_product_attention; {remedy}"
        )
    return TORCH_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        **kwargs,
    )


def refuse_keywords(caller: str, kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` for keywords a packed row's call cannot honour (never silently dropped).

    Args:
        caller: Names the replacement and where the call is, e.g. ``"cp_blockdiag_sdpa inside a CP step"``.
        kwargs: The call's extra keywords.
    """
    if kwargs:
        raise TypeError(
            f"{caller} got keyword argument(s) it cannot honour: {', '.join(sorted(kwargs))}; "
            "pass a sliding window, soft-cap or sinks as variant=AttentionVariant(...)"
        )
