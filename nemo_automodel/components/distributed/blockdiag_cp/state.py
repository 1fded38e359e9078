"""The typed state of a packed row under block-diagonal CP, its thread-shared slot, and the seed's process default.

The settings themselves are defined once, in :mod:`.options`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp.options import CPOptions

if TYPE_CHECKING:
    from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape
    from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import GpuLibraries
    from nemo_automodel.components.distributed.blockdiag_cp.heads import HeadExchange, RowPlan
    from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan
    from nemo_automodel.components.distributed.blockdiag_cp.metadata import WindowPlan
    from nemo_automodel.components.distributed.blockdiag_cp.topology import GroupHosts
    from nemo_automodel.components.distributed.blockdiag_cp.variant import PlanKey

_DEFAULT_OPTIONS = CPOptions()


def configure_cp_varlen(
    *,
    attn_backend: str | None = None,
    kv_exchange: str | None = None,
    layout: str | None = None,
    overlap: bool = True,
    check_finite: bool = False,
    consensus: str | None = None,
) -> None:
    """Set the process default :class:`CPOptions` for callers that pass no options to the batch builder.

    The training path never reads this default: the batch builder snapshots
    options into each row state (the recipe passes its own). Every value is
    validated before anything changes, so a bad value leaves the previous default in place.

    Args:
        attn_backend: Kernel name or its upstream spelling (``None`` -> ``auto``).
        kv_exchange: Exchange name or its upstream spelling (``None`` -> ``halo``).
        layout: ``contiguous``, ``balanced`` or ``auto`` (``None`` -> ``contiguous``).
        overlap: Compute local-key segments while the K/V exchange is in flight.
        check_finite: Record, without a host sync, whether every call's q/k/v are finite
            (read once per step with ``nonfinite_attention_inputs``; off by default, see :class:`CPOptions`).
        consensus: ``step`` (default) or ``call`` (see :class:`CPOptions`).
    """
    global _DEFAULT_OPTIONS
    _DEFAULT_OPTIONS = CPOptions(
        attn_backend=attn_backend,
        kv_exchange=kv_exchange,
        layout=layout,
        overlap=overlap,
        check_finite=check_finite,
        consensus=consensus,
    )


def default_options() -> CPOptions:
    """The process default set by :func:`configure_cp_varlen`."""
    return _DEFAULT_OPTIONS


def cp_varlen_runtime_config() -> dict[str, Any]:
    """The process default as ``{"attn_backend", "kv_exchange", "layout", "overlap", "check_finite", "consensus"}``."""
    options = _DEFAULT_OPTIONS
    return {
        "attn_backend": options.attn_backend,
        "kv_exchange": options.kv_exchange,
        "layout": options.layout,
        "overlap": options.overlap,
        "check_finite": options.check_finite,
        "consensus": options.consensus,
    }


# (dtype, device, head_dim, dropout > 0, AttentionVariant.key)
KernelKey = tuple[str, str, int, bool, tuple[Any, ...]]


@dataclass
class RowCache:
    """Values computed lazily during one step and reused by every layer and by recompute.

    Attributes:
        windows: Per sliding window (``None``: full causal) or ``("chunk", C)``, this rank's :class:`WindowPlan`.
        kernel: Per call signature, the concrete kernel, or why the requested one cannot run.
        shape: The attention shape of the first call (for the cost model).
        finite: Per CP call, a device bool ``[3]``: are q, k, v all finite (no host sync).
        preflight: Answers of the seed's ``compat._needed_only_preflight`` (its collective runs once per key).
        ulysses: Per (window or chunk, Hq, Hkv), the head-parallel plan of ``kv_exchange="ulysses"``.
        hybrid: Per hybrid path, its sequence part's row state (built at its first call).
        hybrid_heads: Per (Hq, Hkv), the hybrid's head-group all-to-all plan.
    """

    windows: dict[PlanKey, WindowPlan] = field(default_factory=dict)
    kernel: dict[KernelKey, tuple[str | None, Exception | None]] = field(default_factory=dict)
    shape: Shape | None = None
    finite: list[torch.Tensor] = field(default_factory=list)
    preflight: dict[tuple[str, str, str, int, int], tuple[bool, str | None]] = field(default_factory=dict)
    ulysses: dict[tuple[PlanKey, int, int], RowPlan] = field(default_factory=dict)
    hybrid: dict[str, RowState] = field(default_factory=dict)
    hybrid_heads: dict[tuple[int, int], HeadExchange] = field(default_factory=dict)


@dataclass
class RowStats:
    """What this step's CP attention calls did on this rank (read with ``exchange_stats``).

    Attributes:
        calls: CP attention calls (forward and activation-checkpoint recompute).
        path / reason: The K/V exchange path and why it was chosen.
        attn_backend: The concrete kernel the calls ran.
        kv_tokens_received / kv_bytes_received: K/V the last call received (the same for every
            layer of one window).
        windows: Per sliding window seen this step (``None``: full causal) or ``("chunk", C)``:
            ``(path, K/V tokens received, lower bound)`` of one of its calls.
        exchange_wait_s / exchange_backward_wait_s: Seconds blocked on the exchange, forward / backward.
        exchange_calls: Exchanges posted.
        ulysses: Head-parallel calls only: this rank's heads and the bytes one forward sent and received.
        hybrid: ``ulysses+*`` calls only: the factorization and what each part moved.
    """

    calls: int = 0
    path: str | None = None
    reason: str | None = None
    attn_backend: str | None = None
    kv_tokens_received: int = 0
    kv_bytes_received: int = 0
    windows: dict[PlanKey, tuple[str, int, int]] = field(default_factory=dict)
    exchange_wait_s: float = 0.0
    exchange_backward_wait_s: float = 0.0
    exchange_calls: int = 0
    ulysses: dict[str, Any] | None = None
    hybrid: dict[str, Any] | None = None


@dataclass
class FailureLog:
    """Kernel failures recorded on this rank during one step: ``(CP call index, diagnostic)`` per direction.

    A failing kernel yields zeros so every collective of the step stays in
    lockstep; the log is settled once per step (``consensus.settle_failures``, or
    the recipe's step all-reduce) and every rank raises together.
    """

    forward: list[tuple[int, str]] = field(default_factory=list)
    backward: list[tuple[int, str]] = field(default_factory=list)

    def record(self, direction: str, call: int, diagnostic: str) -> None:
        """Note that CP attention call ``call`` failed in ``direction`` (``forward``/``backward``)."""
        getattr(self, direction).append((call, diagnostic))

    def first(self, direction: str) -> int | None:
        """Index of the first failing call in ``direction`` (``None``: none failed)."""
        entries = getattr(self, direction)
        return min(call for call, _ in entries) if entries else None

    def __bool__(self) -> bool:
        return bool(self.forward or self.backward)


@dataclass(eq=False)
class StepAgreement:
    """The packed rows of one optimizer step, agreed on by one collective (whatever ``grad_accum`` is).

    The first CP attention call of any of its rows fingerprints every row (settings, lengths,
    document layout, resolved kernel and exchange path) and runs the one agreement all-reduce;
    the other rows' calls then agree on nothing. Every row must be built (added here) before
    that first call, which the batch builder enforces.

    Attributes:
        rows: The step's row states, in build order (micro-batch order).
        agreed: Whether the agreement ran.
    """

    rows: list[RowState] = field(default_factory=list)
    agreed: bool = False

    def add(self, row: RowState) -> None:
        """Add ``row`` (same process group as the rows already added; before the agreement ran)."""
        if self.agreed:
            raise ValueError(
                "agreement: this optimizer step's rows were already agreed on; build every row of the step (and "
                "pass the same StepAgreement to each) before the first forward, or pass a new StepAgreement"
            )
        if self.rows and self.rows[0].group is not row.group:
            raise ValueError("agreement: the rows of one StepAgreement must share one CP process group")
        self.rows.append(row)


@dataclass(frozen=True)
class BlockdiagCpModelState:
    """The model-facing, read-only view of an active block-diagonal CP row.

    Models with their own sequence mixers (recurrent layers, convolutions) or
    that embed inputs inside ``forward`` (``shard_primary=False``) read it with
    ``current_blockdiag_cp_state()``. Upstream's three fields (``group``,
    ``packed_cu_seqlens``, ``packed_cu_seqlens_cpu``) are enough to build one: the
    others then describe a contiguous layout over the group (``cp_rank``/``cp_size``
    from ``group``, ``L = S_full / cp_size``).

    Attributes:
        group: The CP process group (``None`` when ``cp_size == 1``).
        packed_cu_seqlens: Boundaries of the physical packed row ``[n_runs + 1]`` on the compute
            device: documents (pieces of documents under the balanced layout) and padding runs.
        packed_cu_seqlens_cpu: The same boundaries on the host.
        cp_rank: This rank in the CP group.
        cp_size: CP ranks.
        row_offset: Physical position of this rank's first local row.
        local_len: Local rows ``L`` per rank.
        padded_seq_len: ``S_full = cp_size * L``.
        layout: ``contiguous`` or ``balanced``.
        positions: Original (padded-row) position of every local row ``[L]`` on the compute device.
    """

    group: dist.ProcessGroup | None
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor
    cp_rank: int | None = None
    cp_size: int | None = None
    row_offset: int | None = None
    local_len: int | None = None
    padded_seq_len: int | None = None
    layout: str = "contiguous"
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        grouped = self.group is not None
        size = self.cp_size if self.cp_size is not None else (dist.get_world_size(self.group) if grouped else 1)
        rank = self.cp_rank if self.cp_rank is not None else (dist.get_rank(self.group) if grouped else 0)
        total = self.padded_seq_len if self.padded_seq_len is not None else int(self.packed_cu_seqlens_cpu[-1])
        local = self.local_len if self.local_len is not None else total // size
        offset = self.row_offset if self.row_offset is not None else rank * local
        derived = {"cp_size": size, "cp_rank": rank, "padded_seq_len": total, "local_len": local, "row_offset": offset}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        if self.positions is None:
            rows = torch.arange(offset, offset + local, device=self.packed_cu_seqlens.device)
            object.__setattr__(self, "positions", rows)


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two sub-groups (:mod:`.hybrid`) of a ``h x s`` factorization of its CP group.

    Attributes:
        heads: Head-parallel degree ``h`` (members of a head group).
        sequence: Sequence degree ``s = cp / h`` (members of a sequence group).
        head_group: This rank's head group (CP ranks ``[g h, (g + 1) h)``).
        sequence_group: This rank's sequence group (CP ranks ``j, h + j, ...``).
        head_rank: ``j``, this rank's index in its head group (``cp_rank % h``).
        sequence_rank: ``g``, its index in its sequence group (``cp_rank // h``).
        sequence_hosts: The sequence group's hosts (``None``: one host).
    """

    heads: int
    sequence: int
    head_group: dist.ProcessGroup = field(repr=False)
    sequence_group: dist.ProcessGroup = field(repr=False)
    head_rank: int
    sequence_rank: int
    sequence_hosts: GroupHosts | None = None


@dataclass
class RowState:
    """Everything one training step's CP attention calls need, fixed at batch-build time.

    Internal to the package and the step's owner; models read :attr:`model_view`
    (``current_blockdiag_cp_state()``).

    Attributes:
        group: The CP process group (``None`` only when ``cp_size == 1``).
        cp_rank: This rank's index in the CP group.
        cp_size: Number of CP ranks.
        row_offset: Physical position of this rank's first local row (``cp_rank * local_len``);
            under the contiguous layout also its original position.
        local_len: Local rows per rank ``L = S_full / cp_size``.
        shard_plan: Where every document piece lives (identical on every rank).
        packed_cu_seqlens: Boundaries of the physical row ``[n_runs + 1]`` (device).
        packed_cu_seqlens_cpu: The same boundaries on the host.
        positions: Original position of each local row ``[L]`` (device).
        options: The step's knobs (frozen).
        hosts: Where the group's ranks run, gathered when the row was built (``None``: one rank; a
            state built by hand without them is taken to run on one host).
        libraries: The GPU libraries probed when the row was built (``None``: probed at the first call).
        hybrid: The head and sequence sub-groups of a ``ulysses+*`` hybrid, created when the row was built.
        agreement: The rows agreed on together with this one (the builder adds the row to it).
        cache: Per-step memo (per-window plans and routes, agreement, kernel).
        stats: What the calls did (path, K/V received, time blocked on exchanges).
        failures: Kernel failures recorded on this rank, settled once per step.
    """

    group: dist.ProcessGroup | None
    cp_rank: int
    cp_size: int
    row_offset: int
    local_len: int
    shard_plan: ShardPlan
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor
    positions: torch.Tensor
    options: CPOptions = field(default_factory=CPOptions)
    hosts: GroupHosts | None = None
    libraries: GpuLibraries | None = None
    hybrid: HybridGroups | None = None
    agreement: StepAgreement = field(default_factory=StepAgreement)
    cache: RowCache = field(default_factory=RowCache)
    stats: RowStats = field(default_factory=RowStats)
    failures: FailureLog = field(default_factory=FailureLog)

    @cached_property
    def model_view(self) -> BlockdiagCpModelState:
        """The frozen view handed to models."""
        return BlockdiagCpModelState(
            group=self.group,
            packed_cu_seqlens=self.packed_cu_seqlens,
            packed_cu_seqlens_cpu=self.packed_cu_seqlens_cpu,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            row_offset=self.row_offset,
            local_len=self.local_len,
            padded_seq_len=self.shard_plan.runs.total_len,
            layout=self.shard_plan.layout,
            positions=self.positions,
        )


T = TypeVar("T")


class ThreadSharedSlot(Generic[T]):
    """A ``ContextVar``-like get/set/reset holder that every thread sees.

    Activation-checkpoint recompute runs layer forwards inside autograd's worker
    thread during backward. A real ``ContextVar`` reads its default there, which
    would silently turn CP attention into local-only attention mid-recompute.
    Training steps are sequential, so one shared slot with token-based restore
    (which supports nesting) is safe; backward only reads it.
    """

    def __init__(self) -> None:
        self._value: T | None = None

    def get(self) -> T | None:
        """Return the current value (``None`` when unset)."""
        return self._value

    def set(self, value: T | None) -> T | None:
        """Install ``value``; return the previous value as the token for :meth:`reset`."""
        token, self._value = self._value, value
        return token

    def reset(self, token: T | None) -> None:
        """Restore the value that :meth:`set` returned as ``token``."""
        self._value = token


_ROW_STATE: ThreadSharedSlot[RowState] = ThreadSharedSlot()
# The most recently exited row state: read only by the seed API's `exchange_stats()` and
# `cp_attn_fire_count()` after a step, never by the step path.
_LAST_STATE: ThreadSharedSlot[RowState] = ThreadSharedSlot()


class _FireCounter:
    """CP attention calls of exited steps, so the seed API's fire count spans steps until reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, calls: int) -> None:
        with self._lock:
            self._count += calls

    def reset(self) -> None:
        with self._lock:
            self._count = 0

    @property
    def value(self) -> int:
        return self._count


_EXITED_CALLS = _FireCounter()


@contextlib.contextmanager
def activate_row_state(row_state: RowState) -> Iterator[RowState]:
    """Make ``row_state`` the active one; restore the previous state on exit, also on exceptions."""
    token = _ROW_STATE.set(row_state)
    _EXITED_CALLS.add(-row_state.stats.calls)  # while active, its calls are counted from the state itself
    try:
        yield row_state
    finally:
        _ROW_STATE.reset(token)
        _LAST_STATE.set(row_state)
        _EXITED_CALLS.add(row_state.stats.calls)


def current_row_state() -> RowState | None:
    """Return the active per-step CP state (internal), or ``None`` outside a step context."""
    return _ROW_STATE.get()


def last_row_state() -> RowState | None:
    """The active row state, else the most recently exited one (``None`` before any step)."""
    return _ROW_STATE.get() or _LAST_STATE.get()


def current_blockdiag_cp_state() -> BlockdiagCpModelState | None:
    """The frozen model-facing view of the active step (:class:`BlockdiagCpModelState`), or ``None``.

    Models with their own sequence mixers (e.g. recurrent layers) read the global
    packed boundaries ``packed_cu_seqlens`` / ``packed_cu_seqlens_cpu``, the group
    and where their rows came from (``row_offset``, ``positions``) here.
    """
    active = _ROW_STATE.get()
    return None if active is None else active.model_view


def cp_attn_fire_count() -> int:
    """CP attention calls (forward and recompute) since the last reset, the active step's included."""
    active = _ROW_STATE.get()
    return _EXITED_CALLS.value + (active.stats.calls if active is not None else 0)


def reset_cp_attn_fire_count() -> None:
    """Zero the CP attention fire count (the active step's calls so far included)."""
    _EXITED_CALLS.reset()
    active = _ROW_STATE.get()
    if active is not None:
        _EXITED_CALLS.add(-active.stats.calls)
