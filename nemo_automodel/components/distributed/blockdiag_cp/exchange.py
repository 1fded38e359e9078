"""Differentiable, asynchronous K/V collectives and the replicated needed-only exchange plan.

Three ways to give a rank the keys its remote segments attend to:

- ``allgather``: every rank receives the whole sequence (``S_full - L`` tokens);
  backward reduce-scatters the key gradients.
- ``halo``: each rank receives, from its left neighbour only, exactly the keys it
  needs from there; backward sends their gradients back.
- ``a2a``: all-to-all-v from every rank that holds needed keys (documents
  spanning more than two ranks, or the balanced layout); backward is the reverse
  all-to-all-v, and gradients of keys sent to several ranks are summed.

Each exchange is split in two autograd nodes, :class:`_Post` (starts the
collective) and :class:`_Wait` (completes it), so the caller can compute the
segments whose keys are all local in between. Backward mirrors it: ``_Wait``'s
backward starts the reverse collective and ``_Post``'s backward (the last node
of the layer) completes it, so local-segment gradients are computed while the
key gradients travel.

Everything works on the fused ``[K; V]`` tensor ``kv [1, C, L, D]``
(``C = 2 * Hkv``): one collective moves both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan

# (owner rank, start inside the owner's local chunk, length)
Piece = tuple[int, int, int]
# (start inside a local chunk, length)
Span = tuple[int, int]


def _merge_spans(spans: list[Span]) -> list[Span]:
    """Sort and merge overlapping or touching spans."""
    out: list[Span] = []
    for s, n in sorted(spans):
        if out and s <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][0] + out[-1][1], s + n) - out[-1][0])
        else:
            out.append((s, n))
    return out


@dataclass(frozen=True)
class KVPlan:
    """Which keys every rank needs and where they live; identical on every rank.

    Attributes:
        world: CP size.
        local_len: Local rows per rank ``L``.
        pieces: ``pieces[r]``: the pieces of rank ``r``'s packed remote-group keys,
            in packed order (a piece may repeat keys another piece also needs).
    """

    world: int
    local_len: int
    pieces: tuple[tuple[Piece, ...], ...]

    @cached_property
    def _spans(self) -> dict[tuple[int, int], list[Span]]:
        """``(dst, src) -> `` merged spans of ``src``'s chunk that ``dst`` receives (each key once)."""
        wanted: dict[tuple[int, int], list[Span]] = {}
        for dst, pieces in enumerate(self.pieces):
            for owner, start, n in pieces:
                if owner != dst:
                    wanted.setdefault((dst, owner), []).append((start, n))
        return {key: _merge_spans(spans) for key, spans in wanted.items()}

    def send_spans(self, src: int, dst: int) -> list[Span]:
        """Spans of ``src``'s chunk sent to ``dst`` (sorted, disjoint)."""
        return self._spans.get((dst, src), [])

    def recv_count(self, dst: int, src: int) -> int:
        """Tokens ``dst`` receives from ``src``."""
        return sum(n for _, n in self.send_spans(src, dst))

    def remote_tokens(self, rank: int) -> int:
        """Tokens ``rank`` receives in total: exactly its lower bound."""
        return sum(self.recv_count(rank, src) for src in range(self.world))

    def peers(self, rank: int) -> int:
        """Ranks that ``rank`` receives from."""
        return sum(1 for src in range(self.world) if self.recv_count(rank, src))

    @cached_property
    def use_halo(self) -> bool:
        """True when every rank needs remote keys from its left neighbour only."""
        return all(src == dst - 1 for dst, src in self._spans)


def _split_by_owner(start: int, end: int, local_len: int) -> list[Piece]:
    """Cut the physical range ``[start, end)`` at chunk boundaries."""
    out: list[Piece] = []
    while start < end:
        owner = start // local_len
        stop = min(end, (owner + 1) * local_len)
        out.append((owner, start - owner * local_len, stop - start))
        start = stop
    return out


def compute_kv_plan(shard: ShardPlan) -> KVPlan:
    """The exchange plan of ``shard``: what every rank's remote segments need (no communication)."""
    pieces = []
    for seg in shard.all_segments:
        ranges = seg.packed_ranges(seg.split_local_remote()[1])
        pieces.append(tuple(p for s, e in ranges for p in _split_by_owner(s, e, shard.local_len)))
    return KVPlan(shard.cp, shard.local_len, tuple(pieces))


def _gather_spans(x: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """Concatenate ``x[:, :, start:start + n]`` over ``spans`` -> contiguous ``[1, C, sum n, D]``."""
    if not spans:
        return x.new_empty(x.shape[0], x.shape[1], 0, x.shape[3])
    return torch.cat([x[:, :, s : s + n] for s, n in spans], dim=2).contiguous()


def _add_spans(grad_x: torch.Tensor, spans: list[Span], grad: torch.Tensor) -> None:
    """Accumulate ``grad [1, C, sum n, D]`` onto the spans of ``grad_x``."""
    offset = 0
    for s, n in spans:
        grad_x[:, :, s : s + n] += grad[:, :, offset : offset + n]
        offset += n


@dataclass
class ExchangeOp:
    """One layer's K/V exchange: start and finish it, forward and backward, with blocked time recorded.

    Subclasses implement ``_start``/``_start_backward`` (post the collective,
    return the work handles) and ``_finish``/``_finish_backward`` (after the
    handles completed). ``after_backward`` runs when the reverse exchange
    completed: the runtime's backward failure consensus hooks in there.

    Attributes:
        group: The CP process group.
        wait_s: Seconds blocked waiting for the forward collective.
        backward_wait_s: Seconds blocked waiting for the reverse collective.
    """

    group: dist.ProcessGroup
    after_backward: Callable[[], None] | None = None
    wait_s: float = 0.0
    backward_wait_s: float = 0.0
    _works: list[Any] = field(default_factory=list)
    _shape: tuple[int, ...] = ()

    def start(self, kv: torch.Tensor) -> None:
        """Post the collective for ``kv [1, C, L, D]``."""
        self._shape = tuple(kv.shape)
        self._works = self._start(kv)

    def finish(self) -> torch.Tensor:
        """Block until the forward collective completed; returns the received keys."""
        self.wait_s += _wait(self._works)
        return self._finish()

    def start_backward(self, grad: torch.Tensor) -> None:
        """Post the reverse collective for the received keys' gradient."""
        self._works = self._start_backward(grad.contiguous())

    def finish_backward(self) -> torch.Tensor:
        """Block until the reverse collective completed; returns the gradient of ``kv``."""
        self.backward_wait_s += _wait(self._works)
        grad = self._finish_backward()
        if self.after_backward is not None:
            self.after_backward()
        return grad

    def _start(self, kv: torch.Tensor) -> list[Any]:
        raise NotImplementedError

    def _finish(self) -> torch.Tensor:
        raise NotImplementedError

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        raise NotImplementedError

    def _finish_backward(self) -> torch.Tensor:
        raise NotImplementedError


def _wait(works: list[Any]) -> float:
    start = time.perf_counter()
    for work in works:
        work.wait()
    return time.perf_counter() - start


@dataclass
class AllGatherOp(ExchangeOp):
    """``[1, C, L, D]`` local chunk -> ``[1, C, world * L, D]`` full sequence; backward reduce-scatters."""

    world: int = 1
    _parts: list[torch.Tensor] = field(default_factory=list)

    def _start(self, kv: torch.Tensor) -> list[Any]:
        kv = kv.contiguous()
        self._parts = [torch.empty_like(kv) for _ in range(self.world)]
        return [dist.all_gather(self._parts, kv, group=self.group, async_op=True)]

    def _finish(self) -> torch.Tensor:
        full, self._parts = torch.cat(self._parts, dim=2), []
        return full

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        # Every rank's queries may read every key: the owner gets the sum over ranks.
        chunks = [c.contiguous() for c in grad.chunk(self.world, dim=2)]
        self._parts = [torch.empty_like(chunks[0])]
        return [dist.reduce_scatter(self._parts[0], chunks, op=dist.ReduceOp.SUM, group=self.group, async_op=True)]

    def _finish_backward(self) -> torch.Tensor:
        grad, self._parts = self._parts[0], []
        return grad


@dataclass
class HaloOp(ExchangeOp):
    """Left-neighbour point-to-point: send ``send_spans`` to the next rank, receive ``recv_count`` from the previous."""

    send_spans: list[Span] = field(default_factory=list)
    recv_count: int = 0
    prev_peer: int = 0
    next_peer: int = 0
    _recv: torch.Tensor | None = None
    _grad_sent: torch.Tensor | None = None

    def _start(self, kv: torch.Tensor) -> list[Any]:
        b, c, _, d = kv.shape
        self._recv = kv.new_empty(b, c, self.recv_count, d)
        ops = []
        if self.send_spans:
            ops.append(dist.P2POp(dist.isend, _gather_spans(kv, self.send_spans), self.next_peer, group=self.group))
        if self.recv_count:
            ops.append(dist.P2POp(dist.irecv, self._recv, self.prev_peer, group=self.group))
        return dist.batch_isend_irecv(ops) if ops else []

    def _finish(self) -> torch.Tensor:
        recv, self._recv = self._recv, None
        return recv

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        b, c, _, d = self._shape
        self._grad_sent = grad.new_empty(b, c, sum(n for _, n in self.send_spans), d)
        ops = []
        if self.recv_count:
            ops.append(dist.P2POp(dist.isend, grad, self.prev_peer, group=self.group))
        if self.send_spans:
            ops.append(dist.P2POp(dist.irecv, self._grad_sent, self.next_peer, group=self.group))
        return dist.batch_isend_irecv(ops) if ops else []

    def _finish_backward(self) -> torch.Tensor:
        grad_x = self._grad_sent.new_zeros(self._shape)
        _add_spans(grad_x, self.send_spans, self._grad_sent)
        self._grad_sent = None
        return grad_x


@dataclass
class AllToAllOp(ExchangeOp):
    """All-to-all-v: ``send_spans[dst]`` to each ``dst``; ``recv_counts[src]`` from each ``src``, in source order."""

    send_spans: list[list[Span]] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    _buffer: torch.Tensor | None = None

    def _start(self, kv: torch.Tensor) -> list[Any]:
        b, c, _, d = kv.shape
        # all_to_all_single splits dim 0, so tokens go first: [T, 1, C, D].
        send = _gather_spans(kv, [s for spans in self.send_spans for s in spans]).permute(2, 0, 1, 3).contiguous()
        self._buffer = kv.new_empty(sum(self.recv_counts), b, c, d)
        work = dist.all_to_all_single(
            self._buffer,
            send,
            output_split_sizes=self.recv_counts,
            input_split_sizes=[sum(n for _, n in s) for s in self.send_spans],
            group=self.group,
            async_op=True,
        )
        return [work]

    def _finish(self) -> torch.Tensor:
        out, self._buffer = self._buffer.permute(1, 2, 0, 3), None
        return out

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        b, c, _, d = self._shape
        sent = [sum(n for _, n in s) for s in self.send_spans]
        self._buffer = grad.new_empty(sum(sent), b, c, d)
        work = dist.all_to_all_single(
            self._buffer,
            grad.permute(2, 0, 1, 3).contiguous(),
            output_split_sizes=sent,
            input_split_sizes=self.recv_counts,
            group=self.group,
            async_op=True,
        )
        return [work]

    def _finish_backward(self) -> torch.Tensor:
        grad_x = self._buffer.new_zeros(self._shape)
        # A key sent to several ranks gets the sum of their gradients.
        _add_spans(grad_x, [s for spans in self.send_spans for s in spans], self._buffer.permute(1, 2, 0, 3))
        self._buffer = None
        return grad_x


class _Post(torch.autograd.Function):
    """Start ``op`` on ``kv``; its backward completes the reverse collective (and returns ``kv``'s gradient).

    The output is an empty token that orders :class:`_Wait` after it; the data travels inside ``op``.
    """

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
        ctx.op = op
        op.start(kv)
        return kv.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.op.finish_backward(), None


class _Wait(torch.autograd.Function):
    """Complete ``op``; its backward starts the reverse collective with the received keys' gradient."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
        ctx.op = op
        return op.finish()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.op.start_backward(grad)
        return grad.new_zeros(0), None  # the real gradient travels inside the op, completed by _Post


def make_exchange_op(path: str, group: dist.ProcessGroup, rank: int, world: int, plan: KVPlan | None) -> ExchangeOp:
    """The exchange op of ``path`` for ``rank`` (``plan`` is needed for ``halo`` and ``a2a``)."""
    if path == "allgather":
        return AllGatherOp(group, world=world)
    if plan is None:
        raise ValueError(f"kv_exchange path {path!r} needs an exchange plan")
    if path == "halo":
        return HaloOp(
            group,
            send_spans=plan.send_spans(rank, rank + 1) if rank + 1 < world else [],
            recv_count=plan.recv_count(rank, rank - 1) if rank > 0 else 0,
            prev_peer=dist.get_global_rank(group, (rank - 1) % world),
            next_peer=dist.get_global_rank(group, (rank + 1) % world),
        )
    if path == "a2a":
        return AllToAllOp(
            group,
            send_spans=[plan.send_spans(rank, dst) for dst in range(world)],
            recv_counts=[plan.recv_count(rank, src) for src in range(world)],
        )
    raise ValueError(f"unknown kv_exchange path {path!r}")


def post(kv: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
    """Start the exchange of ``kv [1, C, L, D]`` (differentiable)."""
    return _Post.apply(kv, op)


def wait(token: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
    """Complete the exchange started by :func:`post` (``token`` is its output).

    Returns the received keys: for ``allgather`` the full sequence ``[1, C, S, D]``,
    else ``[1, C, R, D]``, the received spans ordered by source rank, then position.
    """
    return _Wait.apply(token, op)


def assemble(
    kv: torch.Tensor,
    received: torch.Tensor,
    path: str,
    rank: int,
    local_len: int,
    kv_ranges: tuple[tuple[int, int], ...],
    plan: KVPlan | None,
) -> torch.Tensor:
    """Pack a group's keys ``[1, C, K, D]`` in packed order from the local chunk and the received keys.

    ``received[:, :, :0]`` always leads the concatenation, so the exchange stays
    in the graph and its backward runs on every rank (even one that received
    nothing and sent something).

    Args:
        kv: Local fused keys ``[1, C, L, D]``.
        received: Output of :func:`wait` (full sequence for ``allgather``; else
            the received spans ordered by source rank, then position).
        path: ``allgather``, ``halo`` or ``a2a``.
        rank: This rank.
        local_len: Rows per rank.
        kv_ranges: The group's physical key ranges in packed order.
        plan: The :class:`KVPlan` (``halo``/``a2a``).
    """
    parts = [received[:, :, :0]]
    if path == "allgather":
        parts += [received[:, :, s:e] for s, e in kv_ranges]
        return torch.cat(parts, dim=2)
    offsets = _span_offsets(plan, rank)
    for s, e in kv_ranges:
        for owner, start, n in _split_by_owner(s, e, local_len):
            if owner == rank:
                parts.append(kv[:, :, start : start + n])
            else:
                at = _offset_in(offsets[owner], start)
                parts.append(received[:, :, at : at + n])
    return torch.cat(parts, dim=2)


def _span_offsets(plan: KVPlan, rank: int) -> dict[int, list[tuple[int, int, int]]]:
    """Per source: ``(span start, span length, offset in the receive buffer)``."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    offset = 0
    for src in range(plan.world):
        for s, n in plan.send_spans(src, rank):
            out.setdefault(src, []).append((s, n, offset))
            offset += n
    return out


def _offset_in(spans: list[tuple[int, int, int]], start: int) -> int:
    """Receive-buffer offset of chunk position ``start`` (it lies inside one of ``spans``)."""
    for s, n, offset in spans:
        if s <= start < s + n:
            return offset + start - s
    raise AssertionError(f"position {start} was not received")


def anchor_like(query: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """An empty ``[1, Hq, 0, D]`` slice of ``received``; concatenated into the output it keeps the
    exchange in the graph, so its backward runs on every rank (also one whose groups need nothing)."""
    return received[:, :1, :0, :].expand(query.shape[0], query.shape[1], 0, query.shape[3])
