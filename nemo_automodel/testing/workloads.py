"""Document-length mixes and a q/k/v/o attention block: the workloads of the CP tests and benchmarks."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from nemo_automodel.components.distributed.blockdiag_cp import AttentionVariant, cp_blockdiag_sdpa


def sft_mix(total: int, longest: int, seed: int = 0, shortest: int = 16, lead: int = 0) -> list[int]:
    """A long-tailed SFT-like mix of document lengths filling exactly ``total`` tokens.

    Optionally a first document of ``lead`` tokens (e.g. 1.5 CP shards: one longer than a shard), then lengths
    drawn log-uniformly between the powers of two at or below ``shortest`` and ``longest`` (seeded), the last
    one cut to fit.
    """
    rng = random.Random(seed)
    low, high = shortest.bit_length() - 1, longest.bit_length() - 1
    out = [min(lead, total)] if lead else []
    while sum(out) < total:
        out.append(min(int(2 ** rng.uniform(low, high)), total - sum(out)))
    return out


class AttentionBlock(torch.nn.Module):
    """``x [1, L, Hq*D]`` -> q and k/v projections -> attention -> o projection -> ``[1, L, Hq*D]``.

    Args:
        heads / kv_heads / head_dim: ``Hq``, ``Hkv`` and ``D``.
        attention: ``attention(q [1, Hq, L, D], k, v [1, Hkv, L, D]) -> [1, Hq, L, D]``; default: CP attention
            (:func:`cp_blockdiag_sdpa`, grouped-query when ``Hq != Hkv``) with ``variant``.
        bias / dtype: Of the projections.
    """

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        attention: Callable[..., torch.Tensor] | None = None,
        variant: AttentionVariant | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.variant = variant or AttentionVariant()
        self.attention = attention or self._cp_attention
        self.q = torch.nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o = torch.nn.Linear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        q = self.q(x).view(1, length, self.heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).view(1, length, 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.attention(q, *kv.chunk(2, dim=1))
        return self.o(out.transpose(1, 2).reshape(1, length, -1))

    def _cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_blockdiag_sdpa(q, k, v, enable_gqa=self.heads != self.kv_heads, variant=self.variant)
