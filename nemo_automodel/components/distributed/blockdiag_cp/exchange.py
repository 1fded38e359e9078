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

What travels is token-major and fused: one row per key position holding that
position's keys and values of every K/V head, ``[T, F]`` with
``F = Hkv * Dk + Hkv * Dv`` (so value heads may be narrower or wider than key
heads). Only the sent positions are copied into the send buffer (all ``L`` for
``allgather``), and received keys are read in place as views.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan
from nemo_automodel.components.distributed.blockdiag_cp.rows import cat_rows

# (owner rank, start inside the owner's local chunk, length)
OwnedPiece = tuple[int, int, int]
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
    pieces: tuple[tuple[OwnedPiece, ...], ...]

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


def _split_by_owner(start: int, end: int, local_len: int) -> list[OwnedPiece]:
    """Cut the physical range ``[start, end)`` at chunk boundaries."""
    out: list[OwnedPiece] = []
    while start < end:
        owner = start // local_len
        stop = min(end, (owner + 1) * local_len)
        out.append((owner, start - owner * local_len, stop - start))
        start = stop
    return out


def compute_kv_plan(shard: ShardPlan, window: int | None = None) -> KVPlan:
    """The exchange plan of ``shard`` for attention with sliding ``window``: what every rank's remote segments need.

    No communication: the shard plan is replicated. With a window, only keys
    inside some local row's window are needed (the windowed lower bound).
    """
    pieces = []
    for seg in shard.windowed_segments(window):
        ranges = seg.packed_ranges(seg.split_local_remote()[1])
        pieces.append(tuple(p for s, e in ranges for p in _split_by_owner(s, e, shard.local_len)))
    return KVPlan(shard.cp, shard.local_len, tuple(pieces))


@dataclass
class ExchangeOp:
    """One layer's K/V exchange: start and finish it, forward and backward, with blocked time recorded.

    Subclasses implement ``_start``/``_start_backward`` (post the collective,
    return the work handles) and ``_finish``/``_finish_backward`` (after the
    handles completed). Forward moves the send buffer ``[T, F]`` and returns the
    received rows ``[R, F]``; backward moves their gradient the other way and
    returns the send buffer's gradient ``[T, F]``. ``after_backward(op)`` runs when the
    reverse exchange completed (the runtime accounts its time there); it takes the op as an argument
    so the op never refers to itself (a reference cycle would keep its buffers alive until the
    cyclic garbage collector runs).

    Nothing outlives its use: the work handles (which reference the collective's buffers, the
    received K/V among them) are dropped as soon as they completed, so an op kept by the autograd
    graph (until the step's loss is freed, under activation checkpointing too) holds no tensor.

    Attributes:
        group: The CP process group.
        wait_s: Seconds blocked waiting for the forward collective.
        backward_wait_s: Seconds blocked waiting for the reverse collective.
    """

    group: dist.ProcessGroup
    after_backward: Callable[[ExchangeOp], None] | None = None
    wait_s: float = 0.0
    backward_wait_s: float = 0.0
    _works: list[Any] = field(default_factory=list)
    _buffer: torch.Tensor | None = None
    _sent_rows: int = 0

    def start(self, send: torch.Tensor) -> None:
        """Post the collective for the send buffer ``[T, F]``."""
        self._sent_rows = send.shape[0]
        self._works = self._start(send.contiguous())

    def finish(self) -> torch.Tensor:
        """Block until the forward collective completed; returns the received rows ``[R, F]``."""
        self.wait_s += _wait(self._works)
        out, self._buffer, self._works = self._finish(), None, []
        return out

    def start_backward(self, grad: torch.Tensor) -> None:
        """Post the reverse collective for the received rows' gradient ``[R, F]``."""
        self._works = self._start_backward(grad.contiguous())

    def finish_backward(self) -> torch.Tensor:
        """Block until the reverse collective completed; returns the send buffer's gradient ``[T, F]``."""
        self.backward_wait_s += _wait(self._works)
        grad, self._buffer, self._works = self._finish_backward(), None, []
        if self.after_backward is not None:
            self.after_backward(self)
        return grad

    def _start(self, send: torch.Tensor) -> list[Any]:
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
    """``[L, F]`` local rows -> ``[world * L, F]`` the whole row; backward reduce-scatters."""

    world: int = 1
    _parts: list[torch.Tensor] = field(default_factory=list)

    def _start(self, send: torch.Tensor) -> list[Any]:
        self._parts = [torch.empty_like(send) for _ in range(self.world)]
        return [dist.all_gather(self._parts, send, group=self.group, async_op=True)]

    def _finish(self) -> torch.Tensor:
        full, self._parts = torch.cat(self._parts), []
        return full

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        # Every rank's queries may read every key: the owner gets the sum over ranks.
        chunks = list(grad.chunk(self.world))
        self._buffer = torch.empty_like(chunks[0])
        return [dist.reduce_scatter(self._buffer, chunks, op=dist.ReduceOp.SUM, group=self.group, async_op=True)]

    def _finish_backward(self) -> torch.Tensor:
        return self._buffer


@dataclass
class HaloOp(ExchangeOp):
    """Neighbour point-to-point: send the buffer to the next rank, receive ``recv_count`` rows from the previous."""

    recv_count: int = 0
    prev_peer: int = 0
    next_peer: int = 0

    def _start(self, send: torch.Tensor) -> list[Any]:
        self._buffer = send.new_empty(self.recv_count, send.shape[1])
        ops = []
        if send.shape[0]:
            ops.append(dist.P2POp(dist.isend, send, self.next_peer, group=self.group))
        if self.recv_count:
            ops.append(dist.P2POp(dist.irecv, self._buffer, self.prev_peer, group=self.group))
        return dist.batch_isend_irecv(ops) if ops else []

    def _finish(self) -> torch.Tensor:
        return self._buffer

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        self._buffer = grad.new_empty(self._sent_rows, grad.shape[1])
        ops = []
        if self.recv_count:
            ops.append(dist.P2POp(dist.isend, grad, self.prev_peer, group=self.group))
        if self._sent_rows:
            ops.append(dist.P2POp(dist.irecv, self._buffer, self.next_peer, group=self.group))
        return dist.batch_isend_irecv(ops) if ops else []

    def _finish_backward(self) -> torch.Tensor:
        return self._buffer


@dataclass
class AllToAllOp(ExchangeOp):
    """All-to-all-v: ``send_counts[dst]`` rows of the buffer to each ``dst``; ``recv_counts[src]`` from each ``src``."""

    send_counts: list[int] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)

    def _start(self, send: torch.Tensor) -> list[Any]:
        self._buffer = send.new_empty(sum(self.recv_counts), send.shape[1])
        work = dist.all_to_all_single(
            self._buffer,
            send,
            output_split_sizes=self.recv_counts,
            input_split_sizes=self.send_counts,
            group=self.group,
            async_op=True,
        )
        return [work]

    def _finish(self) -> torch.Tensor:
        return self._buffer

    def _start_backward(self, grad: torch.Tensor) -> list[Any]:
        self._buffer = grad.new_empty(sum(self.send_counts), grad.shape[1])
        work = dist.all_to_all_single(
            self._buffer,
            grad,
            output_split_sizes=self.send_counts,
            input_split_sizes=self.recv_counts,
            group=self.group,
            async_op=True,
        )
        return [work]

    def _finish_backward(self) -> torch.Tensor:
        return self._buffer


class _Post(torch.autograd.Function):
    """Start ``op`` on the send buffer; its backward completes the reverse collective (the buffer's gradient).

    The output is an empty token that orders :class:`_Wait` after it; the data travels inside ``op``.
    """

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
        ctx.op = op
        op.start(send)
        return send.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None]:
        op, ctx.op = ctx.op, None  # the layer's last exchange node: release the op with it
        return op.finish_backward(), None


class _Wait(torch.autograd.Function):
    """Complete ``op``; its backward starts the reverse collective with the received rows' gradient."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
        ctx.op = op
        return op.finish()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.op.start_backward(grad)
        return grad.new_zeros(0), None  # the real gradient travels inside the op, completed by _Post


class _RecomputeFence(torch.autograd.Function):
    """Identity on a call's output whose backward reads the one tensor it saved, packed after the exchange's wait.

    Under non-reentrant activation checkpointing both properties matter when the checkpointed function
    ends at the attention call. Reading a saved tensor makes this node (the call's first in backward)
    run the recompute on every rank before any reverse collective of the call; without it a rank whose
    groups need nothing received reaches ``_Wait``'s backward (the reverse collective) first, while its
    peers recompute (a forward collective) first. Being the call's last saved tensor, it makes every
    rank's recompute stop at the same point, after the wait, instead of after each rank's last kernel.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(out.new_empty(0))
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors  # noqa: B018  (the read is the point: under checkpointing it runs the recompute)
        return grad


def recompute_fence(out: torch.Tensor) -> torch.Tensor:
    """``out`` (any shape) behind :class:`_RecomputeFence`: call it after the exchange's wait, as the call's last op."""
    return _RecomputeFence.apply(out)


def post(send: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
    """Start the exchange of the send buffer ``[T, F]`` (differentiable)."""
    return _Post.apply(send, op)


def wait(token: torch.Tensor, op: ExchangeOp) -> torch.Tensor:
    """Complete the exchange started by :func:`post` (``token`` is its output).

    Returns the received rows ``[R, F]``: for ``allgather`` the whole row (``R = S_full``),
    else the received spans ordered by source rank, then position.
    """
    return _Wait.apply(token, op)


# Where a run of a group's packed keys comes from: (from the received rows?, start, length). Local
# runs start at a local row; received runs at a row of the received buffer.
KeySource = tuple[bool, int, int]
# The same run as pieces of its buffer: (from the received rows?, first piece, end piece). Local pieces
# are row views (one per distinct span read); received pieces are chunks of one split.
ChunkRun = tuple[bool, int, int]


def _cuts(length: int, runs: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], dict[int, int]]:
    """Chunk sizes partitioning ``[0, length)`` (the received rows) at every run's ends, and each cut point's
    chunk index.

    Taking runs as whole chunks of one ``split`` (instead of one slice each)
    matters in backward: autograd fills a buffer-sized zero gradient for every
    slice of a tensor, but only one for a ``split``.
    """
    points = sorted({0, length, *(p for s, n in runs for p in (s, s + n))})
    return tuple(b - a for a, b in itertools.pairwise(points)), {p: i for i, p in enumerate(points)}


@dataclass(frozen=True)
class Route:
    """How this step's layers get their keys, fixed on the first call and reused by every layer.

    The local keys are read as row views (:func:`~.rows.row_views`: one per distinct span, adjacent
    runs of a group joined, so a group of adjacent local keys is a view, not a copy; their gradients
    land in one buffer); the received rows are split once into chunks. A group's packed keys are a
    concatenation of such pieces (none when it reads one).

    Attributes:
        path: ``allgather``, ``halo``, ``a2a``, ``ulysses`` or ``ulysses+*`` (no K/V route: heads move; a
            hybrid's sequence part has its own route).
        reason: Why this path.
        plan: The replicated needed-only plan (``None`` for ``allgather``).
        local_spans: ``(start, length)`` of each local row view.
        received_cuts: Chunk sizes of the received rows.
        sources: Per attention group, its packed keys as runs of pieces, in packed order.
        send_chunks: Local views sent, in send order (an empty view when nothing is sent; ``None``:
            all ``L`` rows, ``allgather``).
        send_counts: Rows sent to each rank.
        recv_counts: Rows received from each rank.
        received_tokens: Rows this rank receives (``allgather``: the ``S_full - L`` others').
    """

    path: str
    reason: str
    plan: KVPlan | None
    local_spans: tuple[Span, ...]
    received_cuts: tuple[int, ...]
    sources: tuple[tuple[ChunkRun, ...], ...]
    send_chunks: tuple[int, ...] | None
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    received_tokens: int

    def new_op(self, group: dist.ProcessGroup, rank: int, world: int) -> ExchangeOp:
        """A fresh exchange op for one layer."""
        if self.path == "allgather":
            return AllGatherOp(group, world=world)
        if self.path == "halo":
            return HaloOp(
                group,
                recv_count=self.recv_counts[rank - 1] if rank > 0 else 0,
                prev_peer=dist.get_global_rank(group, (rank - 1) % world),
                next_peer=dist.get_global_rank(group, (rank + 1) % world),
            )
        return AllToAllOp(group, send_counts=list(self.send_counts), recv_counts=list(self.recv_counts))


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


def key_sources(
    kv_ranges: tuple[tuple[int, int], ...], path: str, rank: int, local_len: int, plan: KVPlan | None
) -> tuple[KeySource, ...]:
    """Where the packed keys of physical ranges ``kv_ranges`` are, on ``rank`` after ``path``'s exchange.

    Keys this rank holds are always read locally (also under ``allgather``), so a
    group of local keys never waits for the exchange.
    """
    offsets = _span_offsets(plan, rank) if plan is not None else {}
    sources: list[KeySource] = []
    for s, e in kv_ranges:
        for owner, start, n in _split_by_owner(s, e, local_len):
            if owner == rank:
                sources.append((False, start, n))
            elif path == "allgather":
                sources.append((True, owner * local_len + start, n))
            else:
                sources.append((True, _offset_in(offsets[owner], start), n))
    return tuple(sources)


def _joined(sources: Sequence[KeySource]) -> list[KeySource]:
    """``sources`` with each run that continues the previous one in the same buffer joined to it."""
    out: list[KeySource] = []
    for received, start, n in sources:
        if out and out[-1][0] == received and out[-1][1] + out[-1][2] == start:
            out[-1] = (received, out[-1][1], out[-1][2] + n)
        else:
            out.append((received, start, n))
    return out


def _chunk_runs(
    sources: tuple[KeySource, ...], local_index: dict[Span, int], received_index: dict[int, int]
) -> tuple[ChunkRun, ...]:
    """``sources`` (joined) as runs of pieces: one local view each, or whole received chunks (adjacent joined)."""
    out: list[ChunkRun] = []
    for received, start, n in sources:
        if not received:
            out.append((False, local_index[(start, n)], local_index[(start, n)] + 1))
            continue
        first, stop = received_index[start], received_index[start + n]
        if out and out[-1][0] == received and out[-1][2] == first:
            out[-1] = (received, out[-1][1], stop)
        else:
            out.append((received, first, stop))
    return tuple(out)


def make_route(
    path: str,
    reason: str,
    plan: KVPlan | None,
    group_ranges: Sequence[tuple[tuple[int, int], ...]],
    rank: int,
    world: int,
    local_len: int,
) -> Route:
    """Everything the layers of a step need to exchange and assemble keys along ``path`` (host work, once)."""
    if path.startswith("ulysses"):  # heads travel (ulysses.py, hybrid.py: its own route): local rows stay whole
        return Route(path, reason, None, ((0, local_len),), (), (), (), (0,) * world, (0,) * world, 0)
    if path != "allgather" and plan is None:
        raise ValueError(f"kv_exchange path {path!r} needs an exchange plan")
    sources = [tuple(_joined(key_sources(ranges, path, rank, local_len, plan))) for ranges in group_ranges]
    if path == "allgather":
        per_dst: list[list[Span]] = [[] for _ in range(world)]
        recv_counts = send_counts = (local_len,) * world
        received_len = world * local_len
    else:
        per_dst = [plan.send_spans(rank, dst) if dst != rank else [] for dst in range(world)]
        if path == "halo":  # a halo rank sends to its right neighbour only
            per_dst = [spans if dst == rank + 1 else [] for dst, spans in enumerate(per_dst)]
        recv_counts = tuple(plan.recv_count(rank, src) for src in range(world))
        send_counts = tuple(sum(n for _, n in spans) for spans in per_dst)
        received_len = sum(recv_counts)
    # what is sent, as few views as possible (an empty one when nothing is: the buffer stays in the graph)
    sends = [(s, n) for _, s, n in _joined([(False, s, n) for spans in per_dst for s, n in spans])] or [(0, 0)]
    local_runs = [(s, n) for group in sources for received, s, n in group if not received]
    local_index = {span: i for i, span in enumerate(dict.fromkeys(local_runs + sends))}
    received_cuts, received_index = _cuts(received_len, [(s, n) for g in sources for r, s, n in g if r])
    return Route(
        path=path,
        reason=reason,
        plan=plan,
        local_spans=tuple(local_index),
        received_cuts=received_cuts,
        sources=tuple(_chunk_runs(group, local_index, received_index) for group in sources),
        send_chunks=None if path == "allgather" else tuple(local_index[span] for span in sends),
        send_counts=send_counts,
        recv_counts=recv_counts,
        received_tokens=received_len - local_len if path == "allgather" else received_len,
    )


def send_buffer(
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    send: tuple[int, ...] | None,
) -> torch.Tensor:
    """Fused token-major rows to send: ``[T, F]`` from ``key [1, Hkv, L, Dk]`` and ``value [1, Hkv, L, Dv]``.

    ``chunks`` are the key and value row views of the route (:attr:`Route.local_spans`), ``send``
    the views to send, in order (``None``: all ``L`` rows). Nothing to send is one empty view: the
    buffer stays in the graph (its backward receives) and its gradient costs no bytes.
    """
    parts = []
    for whole, pieces in zip((key, value), chunks):
        picked = whole if send is None else cat_rows([pieces[i] for i in send])
        parts.append(picked.squeeze(0).transpose(0, 1))  # [T, Hkv, D]: a view (also in backward: no select)
    if key.shape[3] == value.shape[3]:
        return torch.cat(parts, dim=1).flatten(1)
    return torch.cat([t.flatten(1) for t in parts], dim=1)


@dataclass(frozen=True)
class Received:
    """The received rows ``[R, F]`` split once: key and value chunks ``[1, Hkv, n, D]`` and an anchor.

    Attributes:
        keys: Key chunks, in ``cuts`` order (views).
        values: Value chunks (views).
        anchor: ``[R, 0]``, an empty piece of the same split: it keeps the exchange in the graph
            (:func:`anchor_like`) at no cost, where a slice of the rows would get a zero-filled
            ``[R, F]`` gradient, added to the real one.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    anchor: torch.Tensor


def split_received(received: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cuts: tuple[int, ...]) -> Received:
    """The received rows ``[R, F]`` as key and value chunks ``[1, Hkv, n, D]`` (views, split once at ``cuts``)."""
    heads, key_dim = key.shape[1], key.shape[3]
    # one split per axis (autograd joins a split's gradients once; each slice would get a zero-filled buffer),
    # along tokens first, so the chunks' gradients join into token-major rows like the buffer's
    keys, values, anchor = received.split([heads * key_dim, heads * value.shape[3], 0], dim=1)

    def chunks(rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        pieces = (rows,) if len(cuts) == 1 else rows.split(cuts, dim=0)
        return tuple(c.unflatten(1, (heads, dim)).transpose(0, 1).unsqueeze(0) for c in pieces)

    return Received(chunks(keys, key_dim), chunks(values, value.shape[3]), anchor)


def assemble(
    local: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...] | None, runs: tuple[ChunkRun, ...]
) -> torch.Tensor:
    """A group's packed keys (or values) ``[1, Hkv, K, D]`` from local and received chunks ``[1, Hkv, n, D]``."""
    parts = chunks_in_order(local, received, runs)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def chunks_in_order(
    local: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...] | None, runs: tuple[ChunkRun, ...]
) -> list[torch.Tensor]:
    """A group's key (or value) chunks ``[1, Hkv, n, D]`` in packed order, from the local and received ones."""
    return [c for from_received, a, b in runs for c in (received if from_received else local)[a:b]]


def anchor_like(heads: int, dim: int, received: torch.Tensor) -> torch.Tensor:
    """An empty ``[1, heads, 0, dim]`` output slice that depends on ``received``.

    Concatenated into the output it keeps the exchange in the graph, so its
    backward runs on every rank (also one whose groups need nothing received).
    Its gradient is a zero-filled tensor of ``received``'s shape: pass :attr:`Received.anchor`
    (no bytes) when the rows were split.
    """
    return received[:0, :1].reshape(1, 1, 0, 1).expand(1, heads, 0, dim)
