"""Head-parallel CP's replicated plan: which heads each rank attends, and the whole row's kernel metadata.

Under ``kv_exchange="ulysses"`` (:mod:`.ulysses`) an all-to-all swaps the sequence
split for a head split: rank ``r`` then holds the whole row for query heads
``[a_r, b_r)`` and the K/V heads they read. Everything here is a pure function of
the head counts, the CP size and the replicated shard plan, so every rank derives
the same split and the same byte counts (the cost model uses them too).

Split rules:

- query heads are cut into ``cp`` contiguous ranges of near-equal size (sizes differ
  by at most one: an uneven split when ``cp`` does not divide ``Hq``; ranks get no
  head at all when ``Hq < cp``, which stays exact but idles them);
- each rank receives the K/V heads its query heads read (query head ``h`` reads K/V
  head ``h // (Hq / Hkv)``). When every one of them serves the same number of the
  rank's query heads they travel once each (GQA kept); otherwise one K/V head per
  query head travels (replicated, plain multi-head attention locally). With fewer
  K/V heads than ranks, a K/V head is thus sent to every rank whose heads read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from nemo_automodel.components.distributed.blockdiag_cp.layout import DocPiece, ShardPlan, make_shard_plan
from nemo_automodel.components.distributed.blockdiag_cp.metadata import VarlenMeta, build_window_plan

HeadRange = tuple[int, int]


@dataclass(frozen=True)
class HeadSplit:
    """Which heads every CP rank attends under head-parallel CP; identical on every rank.

    Attributes:
        heads: Query heads ``Hq`` of the call.
        kv_heads: K/V heads ``Hkv`` of the call.
        query: Per rank, its query heads ``[start, stop)`` (ranges tile ``[0, Hq)`` in rank order).
        kv: Per rank, the K/V heads it receives, in order (a head repeats when replicated per query head).
    """

    heads: int
    kv_heads: int
    query: tuple[HeadRange, ...]
    kv: tuple[tuple[int, ...], ...]

    @property
    def cp(self) -> int:
        return len(self.query)

    def n_query(self, rank: int) -> int:
        """Query heads of ``rank``."""
        start, stop = self.query[rank]
        return stop - start

    def width(self, rank: int, head_dim: int, value_dim: int) -> int:
        """Elements per token that ``rank`` receives from every peer: its q, k and v heads ``nq D + nkv (D + Dv)``."""
        return self.n_query(rank) * head_dim + len(self.kv[rank]) * (head_dim + value_dim)

    def all_to_all_elements(
        self, rank: int, local_len: int, head_dim: int, value_dim: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(sent, received)`` elements of ``rank`` in the q/k/v all-to-all, then in the output's return.

        The backward moves the same amounts the other way. A rank's own block stays local (not counted).
        """
        others = [d for d in range(self.cp) if d != rank]
        inputs = (
            local_len * sum(self.width(d, head_dim, value_dim) for d in others),
            len(others) * local_len * self.width(rank, head_dim, value_dim),
        )
        outputs = (
            len(others) * local_len * self.n_query(rank) * value_dim,
            local_len * sum(self.n_query(d) for d in others) * value_dim,
        )
        return inputs, outputs

    def forward_elements(self, rank: int, local_len: int, head_dim: int, value_dim: int) -> tuple[int, int]:
        """``(sent, received)`` elements of one forward on ``rank``: both all-to-alls together."""
        inputs, outputs = self.all_to_all_elements(rank, local_len, head_dim, value_dim)
        return inputs[0] + outputs[0], inputs[1] + outputs[1]

    @property
    def forward_messages(self) -> int:
        """Sends and receives of a rank in one forward: two all-to-alls, each with every peer."""
        return 2 * 2 * (self.cp - 1)


def _kv_heads_read(query: HeadRange, group: int) -> tuple[int, ...]:
    """K/V heads read by query heads ``query``: each once if each serves equally many, else one per query head."""
    per_query = [h // group for h in range(*query)]
    runs = [(head, len(list(run))) for head, run in itertools.groupby(per_query)]
    if len({n for _, n in runs}) <= 1:
        return tuple(head for head, _ in runs)
    return tuple(per_query)


def split_heads(heads: int, kv_heads: int, cp: int) -> HeadSplit:
    """The head split of ``heads`` query and ``kv_heads`` K/V heads over ``cp`` ranks (see the module docstring)."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads or cp < 1:
        raise ValueError(f"cannot split {heads} query / {kv_heads} K/V heads over cp={cp}")
    sizes = [heads // cp + (r < heads % cp) for r in range(cp)]
    bounds = [0, *itertools.accumulate(sizes)]
    query = tuple(itertools.pairwise(bounds))
    group = heads // kv_heads
    return HeadSplit(heads, kv_heads, query, tuple(_kv_heads_read(q, group) for q in query))


@dataclass(frozen=True)
class HeadExchange:
    """How one rank's all-to-all over a head group swaps its ``L`` rows of every head for ``n L`` rows of some heads.

    Shared by ``ulysses`` (the head group is the whole CP group) and the ``ulysses+*`` hybrids (groups of
    ``h`` consecutive CP ranks, :mod:`.hybrid`). The received rows arrive in the head group's physical
    order (member by member); the attention that follows reads them in its own *inner* order.

    Attributes:
        split: The head split over the head group's ``n`` members.
        kv_index: Per member, its K/V heads as a ``slice`` (a run without repeats) or an index tensor.
        to_inner: ``[n L]`` received row of every inner row (``None``: the same order).
        to_outer: ``[n L]`` inner row of every received row (``None``: the same order).
    """

    split: HeadSplit
    kv_index: tuple[slice | torch.Tensor, ...]
    to_inner: torch.Tensor | None
    to_outer: torch.Tensor | None


def head_exchange(
    heads: int, kv_heads: int, members: int, to_inner: torch.Tensor | None, device: torch.device | str
) -> HeadExchange:
    """The :class:`HeadExchange` of ``heads``/``kv_heads`` over ``members`` ranks, inner order ``to_inner``."""
    split = split_heads(heads, kv_heads, members)
    to_inner = None if to_inner is None else to_inner.to(device)
    to_outer = None if to_inner is None else torch.argsort(to_inner)
    return HeadExchange(split, tuple(_kv_index(kv, device) for kv in split.kv), to_inner, to_outer)


@dataclass(frozen=True)
class RowPlan:
    """One rank's head-parallel plan for one window or chunk of a packed row (host work once, reused by every layer).

    Attributes:
        exchange: The head all-to-all over the whole CP group; its inner order is the row's original order.
        meta: Kernel metadata of the whole row in its original order (the cp=1 metadata): rows ``[0, S_full)``.
    """

    exchange: HeadExchange
    meta: VarlenMeta

    @property
    def split(self) -> HeadSplit:
        return self.exchange.split

    @cached_property
    def describe(self) -> str:
        """Compact text for diagnostics."""
        return f"head-parallel (ulysses) heads {self.split.query} kv {self.split.kv}: {self.meta.describe()}"


def _kv_index(heads: tuple[int, ...], device: torch.device | str) -> slice | torch.Tensor:
    if heads and list(heads) == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    if not heads:
        return slice(0, 0)
    return torch.tensor(heads, dtype=torch.long, device=device)


def build_row_plan(
    shard: ShardPlan,
    heads: int,
    kv_heads: int,
    window: int | None,
    chunk: int | None,
    device: torch.device | str,
) -> RowPlan:
    """The head-parallel plan of ``shard``'s row for calls with ``heads``/``kv_heads`` and ``window`` or ``chunk``.

    The metadata is the one a single rank would use for the whole row (the row padded
    to ``S_full``, documents in their original order), so the kernels run exactly as at cp=1.
    """
    whole = make_shard_plan(shard.runs, 1)
    meta = build_window_plan(whole, 0, window, device, chunk).varlen_meta
    to_original = None if shard.is_identity else torch.argsort(shard.permutation)
    return RowPlan(head_exchange(heads, kv_heads, shard.cp, to_original, device), meta)


def _merged(pieces: itertools.chain[DocPiece]) -> tuple[DocPiece, ...]:
    """``pieces`` in order, a piece that continues the previous one's document joined to it."""
    out: list[DocPiece] = []
    for piece in pieces:
        if out and out[-1].doc == piece.doc and out[-1].stop == piece.start:
            out[-1] = DocPiece(piece.doc, out[-1].start, piece.stop)
        else:
            out.append(piece)
    return tuple(out)


def sequence_plan(shard: ShardPlan, h: int) -> ShardPlan:
    """``shard`` re-sharded over the sequence part: rank ``g`` holds the real rows of ranks ``[g h, (g + 1) h)``.

    Each rank's padding rows go to the tail of its union (the inner order of :func:`.hybrid.inner_order`).
    """
    pieces = tuple(
        _merged(itertools.chain.from_iterable(shard.pieces[g * h : (g + 1) * h])) for g in range(shard.cp // h)
    )
    return ShardPlan(shard.runs, shard.cp // h, h * shard.local_len, shard.layout, pieces)
