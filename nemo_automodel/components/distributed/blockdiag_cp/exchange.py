"""Differentiable K/V collectives and the replicated needed-only exchange plan.

Three ways to give a rank the keys its local queries attend to:

- ``allgather``: every rank receives the whole sequence (``S_full - L`` tokens);
  backward reduce-scatters the key gradients.
- ``halo``: each rank receives from its left neighbour exactly the part of its
  first document that lives there; backward sends the gradients back.
- ``a2a``: all-to-all-v from every rank that holds needed keys (documents
  spanning more than two ranks); backward is the reverse all-to-all-v, with
  gradients of keys sent to several ranks summed by ``index_add``-style accumulation.

Every function here works on the fused ``[K; V]`` tensor ``kv [1, C, L, D]``
(``C = 2 * Hkv``), so one collective moves both. Each collective's output is
always kept in the autograd graph (at least as an empty slice), so its
backward collective runs on every rank even where this rank received nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp.layout import RankSegments

# (owner rank, start inside the owner's local chunk, length)
Piece = tuple[int, int, int]
# (start inside a local chunk, length)
Span = tuple[int, int]


@dataclass(frozen=True)
class KVPlan:
    """Which keys every rank needs and where they live; identical on every rank.

    Attributes:
        world: CP size.
        local_len: Local rows per rank ``L``.
        pieces: ``pieces[r]`` lists, in the order rank ``r``'s kernel consumes
            them, the pieces of other ranks' (or its own) chunks it needs.
    """

    world: int
    local_len: int
    pieces: tuple[tuple[Piece, ...], ...]

    def send_spans(self, src: int, dst: int) -> list[Span]:
        """Spans of ``src``'s chunk that ``dst`` needs, in ``dst``'s packed order."""
        if src == dst:
            return []
        return [(start, n) for owner, start, n in self.pieces[dst] if owner == src]

    def recv_count(self, dst: int, src: int) -> int:
        """Tokens ``dst`` receives from ``src``."""
        return sum(n for _, n in self.send_spans(src, dst))

    def remote_tokens(self, rank: int) -> int:
        """Tokens ``rank`` receives in total: exactly its lower bound."""
        return sum(n for owner, _, n in self.pieces[rank] if owner != rank)

    @cached_property
    def use_halo(self) -> bool:
        """True when every rank needs remote keys from its left neighbour only."""
        return all(owner in (r, r - 1) for r, pieces in enumerate(self.pieces) for owner, _, _ in pieces)


def _split_by_owner(start: int, end: int, local_len: int) -> list[Piece]:
    """Cut the global range ``[start, end)`` at chunk boundaries."""
    out: list[Piece] = []
    while start < end:
        owner = start // local_len
        stop = min(end, (owner + 1) * local_len)
        out.append((owner, start - owner * local_len, stop - start))
        start = stop
    return out


def compute_kv_plan(segments: list[RankSegments]) -> KVPlan:
    """Build the exchange plan from every rank's segments (no communication).

    Args:
        segments: :class:`RankSegments` of ranks ``0 .. cp-1``, all derived from
            the same replicated document ids.
    """
    local_len = segments[0].local_len
    pieces = tuple(
        tuple(p for start, end in seg.kv_ranges for p in _split_by_owner(start, end, local_len)) for seg in segments
    )
    return KVPlan(len(segments), local_len, pieces)


def _gather_spans(x: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """Concatenate ``x[:, :, start:start + n]`` over ``spans`` -> contiguous ``[1, C, sum n, D]``."""
    return torch.cat([x[:, :, s : s + n] for s, n in spans], dim=2).contiguous()


def _add_spans(grad_x: torch.Tensor, spans: list[Span], grad: torch.Tensor) -> None:
    """Accumulate ``grad [1, C, sum n, D]`` back onto the spans of ``grad_x`` (spans may repeat)."""
    offset = 0
    for s, n in spans:
        grad_x[:, :, s : s + n] += grad[:, :, offset : offset + n]
        offset += n


class _AllGatherKV(torch.autograd.Function):
    """``[1, C, L, D]`` local chunk -> ``[1, C, world * L, D]`` full sequence."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
        ctx.group, ctx.world = group, world
        kv = kv.contiguous()
        parts = [torch.empty_like(kv) for _ in range(world)]
        dist.all_gather(parts, kv, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Every rank's queries may read every key: the key gradient is the sum
        # over ranks of their slices, delivered to the owner.
        chunks = [c.contiguous() for c in grad.chunk(ctx.world, dim=2)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


class _HaloKV(torch.autograd.Function):
    """Left-neighbour exchange: send ``send_spans`` to the next rank, receive ``recv_count`` from the previous."""

    @staticmethod
    def forward(
        ctx: Any,
        kv: torch.Tensor,
        group: dist.ProcessGroup,
        send_spans: list[Span],
        recv_count: int,
        prev_peer: int,
        next_peer: int,
    ) -> torch.Tensor:
        ctx.group, ctx.send_spans, ctx.recv_count = group, send_spans, recv_count
        ctx.prev_peer, ctx.next_peer, ctx.kv_shape = prev_peer, next_peer, kv.shape
        b, c, _, d = kv.shape
        recv = kv.new_empty(b, c, recv_count, d)
        ops = []
        if send_spans:
            ops.append(dist.P2POp(dist.isend, _gather_spans(kv, send_spans), next_peer, group=group))
        if recv_count:
            ops.append(dist.P2POp(dist.irecv, recv, prev_peer, group=group))
        _run_p2p(ops)
        return recv

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        b, c, _, d = ctx.kv_shape
        grad_x = grad.new_zeros(ctx.kv_shape)
        grad_sent = grad.new_empty(b, c, sum(n for _, n in ctx.send_spans), d)
        ops = []
        if ctx.recv_count:
            ops.append(dist.P2POp(dist.isend, grad.contiguous(), ctx.prev_peer, group=ctx.group))
        if ctx.send_spans:
            ops.append(dist.P2POp(dist.irecv, grad_sent, ctx.next_peer, group=ctx.group))
        _run_p2p(ops)
        _add_spans(grad_x, ctx.send_spans, grad_sent)
        return grad_x, None, None, None, None, None


def _run_p2p(ops: list[dist.P2POp]) -> None:
    """Post and complete a batch of point-to-point ops (none is a no-op)."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _AllToAllKV(torch.autograd.Function):
    """All-to-all-v: send ``send_spans[dst]`` to each ``dst``; receive ``recv_counts[src]`` from each ``src``.

    The received tokens come back ordered by source rank, and within a source in
    the receiver's packed order.
    """

    @staticmethod
    def forward(
        ctx: Any, kv: torch.Tensor, group: dist.ProcessGroup, send_spans: list[list[Span]], recv_counts: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.send_spans, ctx.recv_counts, ctx.kv_shape = group, send_spans, recv_counts, kv.shape
        b, c, _, d = kv.shape
        flat = [span for spans in send_spans for span in spans]
        # all_to_all_single splits dim 0, so move tokens first: [T, 1, C, D].
        send = _gather_spans(kv, flat).permute(2, 0, 1, 3).contiguous() if flat else kv.new_empty(0, b, c, d)
        recv = kv.new_empty(sum(recv_counts), b, c, d)
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_counts,
            input_split_sizes=[sum(n for _, n in spans) for spans in send_spans],
            group=group,
        )
        return recv.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        b, c, _, d = ctx.kv_shape
        flat = [span for spans in ctx.send_spans for span in spans]
        grad_sent = grad.new_empty(sum(n for _, n in flat), b, c, d)
        dist.all_to_all_single(
            grad_sent,
            grad.permute(2, 0, 1, 3).contiguous(),
            output_split_sizes=[sum(n for _, n in spans) for spans in ctx.send_spans],
            input_split_sizes=ctx.recv_counts,
            group=ctx.group,
        )
        grad_x = grad.new_zeros(ctx.kv_shape)
        # A key sent to several ranks gets the sum of their gradients.
        _add_spans(grad_x, flat, grad_sent.permute(1, 2, 0, 3))
        return grad_x, None, None, None


def _assemble(
    kv: torch.Tensor, remote: torch.Tensor, pieces: tuple[Piece, ...], rank: int, recv_offsets: dict[int, int]
) -> torch.Tensor:
    """Concatenate ``pieces`` in packed order from the local chunk and the received buffer.

    ``remote[:, :, :0]`` always leads the concatenation so the collective that
    produced ``remote`` stays in the graph (its backward must run on every rank).
    """
    parts = [remote[:, :, :0]]
    cursor = dict(recv_offsets)
    for owner, start, n in pieces:
        if owner == rank:
            parts.append(kv[:, :, start : start + n])
        else:
            parts.append(remote[:, :, cursor[owner] : cursor[owner] + n])
            cursor[owner] += n
    return torch.cat(parts, dim=2)


def allgather_kv(
    kv: torch.Tensor, group: dist.ProcessGroup | None, world: int, kv_ranges: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, int]:
    """All-gather ``kv [1, C, L, D]`` and cut this rank's packed keys out of the full sequence.

    Returns:
        ``(packed [1, C, K, D], tokens received)``; with ``world == 1`` nothing is exchanged.
    """
    full = kv if world == 1 else _AllGatherKV.apply(kv, group, world)
    parts = [full[:, :, :0], *(full[:, :, s:e] for s, e in kv_ranges)]
    return torch.cat(parts, dim=2), (world - 1) * kv.shape[2]


def needed_kv(
    path: str, kv: torch.Tensor, group: dist.ProcessGroup, plan: KVPlan, rank: int
) -> tuple[torch.Tensor, int]:
    """Deliver exactly the needed keys with the ``halo`` or ``a2a`` exchange.

    Args:
        path: ``"halo"`` (requires ``plan.use_halo``) or ``"a2a"``.
        kv: Local fused keys/values ``[1, C, L, D]``.
        group: The CP process group.
        plan: The replicated :class:`KVPlan`.
        rank: This rank's index in ``group``.

    Returns:
        ``(packed [1, C, K, D], tokens received)``.
    """
    world = plan.world
    if path == "halo":
        prev_peer = dist.get_global_rank(group, (rank - 1) % world)
        next_peer = dist.get_global_rank(group, (rank + 1) % world)
        send = plan.send_spans(rank, rank + 1) if rank + 1 < world else []
        recv_count = plan.recv_count(rank, rank - 1) if rank > 0 else 0
        remote = _HaloKV.apply(kv, group, send, recv_count, prev_peer, next_peer)
        offsets = {rank - 1: 0}
    elif path == "a2a":
        send_spans = [plan.send_spans(rank, dst) for dst in range(world)]
        recv_counts = [plan.recv_count(rank, src) for src in range(world)]
        remote = _AllToAllKV.apply(kv, group, send_spans, recv_counts)
        offsets = {src: sum(recv_counts[:src]) for src in range(world)}
    else:
        raise ValueError(f"needed-only exchange path must be 'halo' or 'a2a', got {path!r}")
    return _assemble(kv, remote, plan.pieces[rank], rank, offsets), plan.remote_tokens(rank)
