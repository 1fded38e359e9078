"""Kernel metadata, attention groups and per-window plans of one rank's packed row.

Every kernel (:mod:`.cpu_kernels`, :mod:`.gpu_kernels`, selected through the
registry :mod:`.kernels`) attends local queries ``q [1, Hq, L, D]`` against a
packed key/value tensor ``k [1, Hkv, K, D]``, ``v [1, Hkv, K, Dv]`` described by a
:class:`VarlenMeta` (per-segment ``cu_seqlens``). Segment ``i`` owns query rows
``[cu_q[i], cu_q[i+1])`` and keys ``[cu_k[i], cu_k[i+1])``; causality is aligned
bottom-right, because a segment may have more keys than queries: its beginning
lives on other ranks (under the contiguous layout only the first local document;
under ``balanced`` any piece after a document's first). Rows past ``n_real`` are
padding: their output is zero.

A rank's segments split into :class:`AttentionGroup` s (local keys, remote keys);
a :class:`WindowPlan` holds them for one sliding window (or one attention
chunk size, over the documents re-cut into chunks: :meth:`ShardPlan.chunked`)
together with its exchange plan and K/V route, each computed once on first use.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan, Route, compute_kv_plan, make_route
from nemo_automodel.components.distributed.blockdiag_cp.layout import RankSegments, ShardPlan

# A window's K/V path decision: (plan) -> (path, exchange plan or None for all-gather, reason).
PathChoice = Callable[["WindowPlan"], tuple[str, "KVPlan | None", str]]


@dataclass(frozen=True)
class VarlenMeta:
    """Kernel metadata of one group of local segments, computed once per step and validated on the host.

    Attributes:
        local_len: Query rows the kernel receives ``L``.
        n_real: Real rows among them (a prefix of the ``L`` rows).
        q_lens: Query rows per segment.
        k_lens: Packed keys per segment (``k_lens[i] >= q_lens[i]``: a segment's
            rows are the last ``q_lens[i]`` positions of its ``k_lens[i]`` keys).
        cu_q: Cumulative query offsets ``[n_segments + 1]`` int32 on the compute device.
        cu_k: Cumulative key offsets ``[n_segments + 1]`` int32 on the compute device.
        max_q: Longest query run.
        max_k: Longest key run.
        window: Sliding window ``W`` of these segments (``None``: full causal). Each segment's
            keys are then only those inside the window of one of its rows, and row ``a`` of a
            segment attends its bottom-right-aligned keys ``[a + k_len - q_len - (W - 1), a + k_len - q_len]``
            (flash-attn's ``window_size=(W - 1, 0)``).
    """

    local_len: int
    n_real: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: int | None = None
    _masks: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # host structures a kernel derives from the metadata, built at its first call and reused by every layer
    _derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_len(self) -> int:
        """Length ``K`` of the packed key tensor."""
        return sum(self.k_lens)

    def segments(self) -> Iterator[tuple[int, int, int, int]]:
        """Yield ``(q_start, q_len, k_start, k_len)`` per segment, in order."""
        q_start = k_start = 0
        for q_len, k_len in zip(self.q_lens, self.k_lens):
            yield q_start, q_len, k_start, k_len
            q_start += q_len
            k_start += k_len

    @cached_property
    def batches(self) -> tuple[SegmentBatch, ...]:
        """Segments grouped by ``(q_len, k_len)``, in order of first appearance: each group is one kernel call."""
        grouped: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(zip(self.q_lens, self.k_lens)):
            grouped.setdefault(shape, []).append(i)
        return tuple(SegmentBatch(q_len, k_len, tuple(members)) for (q_len, k_len), members in grouped.items())

    def describe(self) -> str:
        """Compact text for diagnostics (no device access)."""
        prefixed = sum(k > q for q, k in zip(self.q_lens, self.k_lens))
        return (
            f"n_real={self.n_real}/{self.local_len} segments={len(self.q_lens)} (with earlier keys: {prefixed}) "
            f"kv_len={self.kv_len} max_q={self.max_q} max_k={self.max_k}"
        )


@dataclass(frozen=True)
class SegmentBatch:
    """Segments of one shape that one batched kernel call attends (``sdpa_varlen``).

    Attributes:
        q_len: Query rows of each segment.
        k_len: Keys of each segment (``> q_len``: its rows are the last ``q_len`` of ``k_len`` keys).
        indices: The segments' positions in the metadata's segment order.
    """

    q_len: int
    k_len: int
    indices: tuple[int, ...]


def build_varlen_meta(
    q_lens: tuple[int, ...],
    k_lens: tuple[int, ...],
    local_len: int,
    device: torch.device | str,
    window: int | None = None,
) -> VarlenMeta:
    """Build and validate the metadata of segments whose rows are the first ``sum(q_lens)`` of ``local_len``.

    Raises:
        ValueError: if the segments are inconsistent (a bug upstream, caught on
            the host before any kernel can read out of bounds).
    """
    cu_q = [0, *itertools.accumulate(q_lens)]
    cu_k = [0, *itertools.accumulate(k_lens)]
    meta = VarlenMeta(
        local_len=local_len,
        n_real=cu_q[-1],
        q_lens=q_lens,
        k_lens=k_lens,
        cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_q=max(q_lens, default=0),
        max_k=max(k_lens, default=0),
        window=window,
    )
    reason = _host_metadata_problem(meta)
    if reason is not None:
        raise ValueError(f"inconsistent varlen metadata: {reason}")
    return meta


def precompute_blockdiag_varlen_meta(segments: RankSegments, device: torch.device | str) -> VarlenMeta:
    """Metadata of all of a rank's segments over its ``L`` local rows (padding rows last)."""
    return build_varlen_meta(segments.q_lens, segments.k_lens, segments.local_len, device, segments.window)


def _host_metadata_problem(meta: VarlenMeta) -> str | None:
    """Check every index a varlen kernel will trust; ``None`` when all are safe."""
    if len(meta.q_lens) != len(meta.k_lens):
        return "q_lens and k_lens differ in length"
    if not 0 <= meta.n_real <= meta.local_len:
        return f"{meta.n_real} real rows outside [0, {meta.local_len}]"
    if any(q <= 0 for q in meta.q_lens):
        return "every segment must have at least one query row"
    if any(k < q for q, k in zip(meta.q_lens, meta.k_lens)):
        return "a segment has fewer keys than queries"
    return None


@dataclass(frozen=True)
class AttentionGroup:
    """Segments of one rank that one kernel call attends together.

    A rank's segments split into a *local* group (every key on this rank: it can
    run while the K/V exchange is in flight) and a *remote* group (needs
    exchanged keys). Each group packs its own keys.

    Attributes:
        local: True for the group whose keys are all local.
        rows: Local query rows of the group, ``(start, stop)`` when contiguous,
            else an index tensor ``[n_rows]`` on the compute device.
        kv_ranges: Physical ``[start, end)`` key ranges, in packed order.
        meta: Kernel metadata over the group's rows.
    """

    local: bool
    rows: tuple[int, int] | torch.Tensor
    kv_ranges: tuple[tuple[int, int], ...]
    meta: VarlenMeta

    @cached_property
    def label(self) -> str:
        """Compact text for diagnostics (built once: failures name the group)."""
        return f"{'local' if self.local else 'remote'} group: {self.meta.describe()}"

    def take_rows(self, q: torch.Tensor) -> torch.Tensor:
        """The group's query rows of ``q [1, H, L, D]`` -> ``[1, H, n_rows, D]``."""
        if isinstance(self.rows, tuple):
            return q[:, :, self.rows[0] : self.rows[1]]
        return q.index_select(2, self.rows)


def _group(segments: RankSegments, members: list[int], local: bool, device: torch.device | str) -> AttentionGroup:
    starts = [0, *itertools.accumulate(segments.q_lens)]
    rows = [r for i in members for r in range(starts[i], starts[i + 1])]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return AttentionGroup(
        local=local,
        rows=(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, dtype=torch.long, device=device),
        kv_ranges=segments.packed_ranges(members),
        meta=build_varlen_meta(
            tuple(segments.q_lens[i] for i in members),
            tuple(segments.k_lens[i] for i in members),
            len(rows),
            device,
            segments.window,
        ),
    )


def plan_attention_groups(
    segments: RankSegments, device: torch.device | str
) -> tuple[tuple[AttentionGroup, ...], torch.Tensor | None]:
    """Split a rank's segments into its local and remote groups, and how to merge their outputs.

    Returns:
        ``(groups, merge_index)``: the non-empty groups in the order their outputs
        are concatenated (by first row), then the padding rows; ``merge_index``
        restores local row order from that concatenation (``None`` when it already is).
    """
    local, remote = segments.split_local_remote()
    members = sorted((m for m in (local, remote) if m), key=lambda m: m[0])  # segments are in row order
    groups = [_group(segments, m, m is local, device) for m in members]
    order = [r for g in groups for r in (range(*g.rows) if isinstance(g.rows, tuple) else g.rows.tolist())]
    order += range(segments.n_real, segments.local_len)
    if order == list(range(segments.local_len)):
        return tuple(groups), None
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return tuple(groups), torch.tensor(inverse, dtype=torch.long, device=device)


@dataclass
class WindowPlan:
    """This rank's attention plan for one sliding window (``None``: full causal) or chunk, shared by its layers.

    Built from the replicated shard plan (no communication): the full-attention
    plan at batch-build time, a windowed one at the row's first call with that
    window. The exchange plan and the route are computed on first use.

    Attributes:
        window: The sliding window ``W`` (``None``: full causal).
        shard_plan: Where every document piece lives (replicated); for a chunked plan, the pieces of the
            documents re-cut into chunks (:meth:`ShardPlan.chunked`).
        rank: This rank in the CP group.
        segments: This rank's local segments and the keys inside their window.
        varlen_meta: Kernel metadata of all the segments over the ``L`` rows.
        groups: The attention groups (local keys first, then remote keys).
        merge_index: Row permutation restoring local order after concatenating the
            groups' outputs and the padding rows (``None``: already in order).
        auto_choice: ``kv_exchange=auto``'s ``(path, reason)`` for this window.
        chunk: The attention chunk size ``C`` of a chunked plan (``None``: unchunked).
    """

    window: int | None
    shard_plan: ShardPlan
    rank: int
    segments: RankSegments
    varlen_meta: VarlenMeta
    groups: tuple[AttentionGroup, ...]
    merge_index: torch.Tensor | None
    auto_choice: tuple[str, str] | None = None
    chunk: int | None = None
    _kv_plan: KVPlan | None = field(default=None, repr=False)
    _route: Route | None = field(default=None, repr=False)

    def kv_plan(self) -> KVPlan:
        """The replicated needed-only exchange plan of this window, computed once and reused by every layer."""
        if self._kv_plan is None:
            self._kv_plan = compute_kv_plan(self.shard_plan, self.window)
        return self._kv_plan

    def route(self, choose: PathChoice) -> Route:
        """The K/V route of this window's calls (path, sends, where each group's keys are), built on first use.

        Args:
            choose: Decides ``(path, plan, reason)`` from replicated data; called once.
        """
        if self._route is None:
            path, plan, reason = choose(self)
            ranges = [group.kv_ranges for group in self.groups]
            self._route = make_route(path, reason, plan, ranges, self.rank, self.shard_plan.cp, self.segments.local_len)
        return self._route


def build_window_plan(
    plan: ShardPlan, rank: int, window: int | None, device: torch.device | str, chunk: int | None = None
) -> WindowPlan:
    """Rank ``rank``'s :class:`WindowPlan` for sliding ``window`` or attention ``chunk`` (host work only)."""
    plan = plan if chunk is None else plan.chunked(chunk)
    segments = plan.segments(rank, window)
    groups, merge_index = plan_attention_groups(segments, device)
    meta = precompute_blockdiag_varlen_meta(segments, device)
    return WindowPlan(window, plan, rank, segments, meta, groups, merge_index, chunk=chunk)
