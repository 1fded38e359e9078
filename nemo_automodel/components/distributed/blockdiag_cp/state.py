"""Runtime knobs, the typed per-step CP state, and its thread-shared slot.

The knob tables live here, in a dependency-free leaf module, so the runtime,
the batch builder and the recipe's config schema all derive the accepted values
(and their synonyms) from one place and can never disagree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape
    from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan
    from nemo_automodel.components.distributed.blockdiag_cp.metadata import WindowPlan

# Canonical value -> accepted spellings (the canonical value is one of them).
ATTN_BACKEND_SYNONYMS: dict[str, tuple[str, ...]] = {
    "auto": ("auto",),
    "fa3": ("fa3", "flash_attn_3", "flash_attention_3", "flash3", "flashattention3", "flash_attn3", "fa_3"),
    "flash": ("flash", "flash_attn", "flash_attention", "flash_attention_2", "fa", "fa2", "flash_varlen"),
    "te": ("te", "transformer_engine", "transformerengine", "te_thd"),
    "torch_varlen": ("torch_varlen", "varlen_attn", "torch_varlen_attn", "native_varlen", "nn_varlen"),
    "sdpa_varlen": ("sdpa_varlen", "varlen", "cpu_varlen", "per_doc", "sdpa_per_doc"),
    "dense": ("dense", "sdpa", "torch_sdpa", "masked_sdpa"),
}
KV_EXCHANGE_SYNONYMS: dict[str, tuple[str, ...]] = {
    "auto": ("auto", "cost_model"),
    "allgather": ("allgather", "all_gather", "ag"),
    "halo": ("halo", "neighbor", "neighbour", "needed", "needed_only", "p2p"),
    "a2a": ("a2a", "a2av", "all_to_all", "alltoall", "all_to_all_v", "needed_a2a"),
}
LAYOUT_SYNONYMS: dict[str, tuple[str, ...]] = {
    "auto": ("auto", "cost_model"),
    "contiguous": ("contiguous", "contig", "sequential", "chunked"),
    "balanced": ("balanced", "zigzag", "zig_zag", "load_balanced"),
}

# attn_backend `auto` resolves per call to the fastest kernel available for the
# dtype/device at hand (kernels.AUTO_PREFERENCE). kv_exchange `halo` is
# needed-only and upgrades itself to `a2a` when some rank needs keys from beyond
# its left neighbour; `auto` picks per step with the cost model (.cost).
ATTN_BACKEND_DEFAULT = "auto"
KV_EXCHANGE_DEFAULT = "halo"
LAYOUT_DEFAULT = "contiguous"

ATTN_BACKEND_VALUES: tuple[str, ...] = tuple(ATTN_BACKEND_SYNONYMS)
KV_EXCHANGE_VALUES: tuple[str, ...] = tuple(KV_EXCHANGE_SYNONYMS)
LAYOUT_VALUES: tuple[str, ...] = tuple(LAYOUT_SYNONYMS)

_DEFAULT_SPELLINGS = ("", "default", "none")


def _normalize(value: Any, field_name: str, synonyms: Mapping[str, tuple[str, ...]], default: str) -> str:
    """Map a user-facing knob value onto its canonical spelling.

    Raises:
        ValueError: naming the field, the bad value and every accepted value.
    """
    if value is None:
        return default
    cleaned = str(value).strip().lower().replace("-", "_")
    if cleaned in _DEFAULT_SPELLINGS:
        return default
    for canonical, spellings in synonyms.items():
        if cleaned in spellings:
            return canonical
    accepted = "; ".join(
        f"{canon} ({', '.join(s for s in spellings if s != canon) or 'no synonyms'})"
        for canon, spellings in synonyms.items()
    )
    raise ValueError(
        f"Unknown {field_name} {value!r}. Valid values: {', '.join(synonyms)} "
        f"(synonyms: {accepted}); None, '' and 'default' select {default!r}."
    )


def normalize_attn_backend(value: Any) -> str:
    """Canonicalize an ``attn_backend`` knob to one of :data:`ATTN_BACKEND_VALUES`."""
    return _normalize(value, "attn_backend", ATTN_BACKEND_SYNONYMS, ATTN_BACKEND_DEFAULT)


def normalize_kv_exchange(value: Any) -> str:
    """Canonicalize a ``kv_exchange`` knob to one of :data:`KV_EXCHANGE_VALUES`."""
    return _normalize(value, "kv_exchange", KV_EXCHANGE_SYNONYMS, KV_EXCHANGE_DEFAULT)


def normalize_layout(value: Any) -> str:
    """Canonicalize a ``layout`` knob to one of :data:`LAYOUT_VALUES`."""
    return _normalize(value, "layout", LAYOUT_SYNONYMS, LAYOUT_DEFAULT)


CONSENSUS_SYNONYMS: dict[str, tuple[str, ...]] = {
    "step": ("step", "per_step", "deferred"),
    "call": ("call", "per_call", "debug"),
}
# `step`: a kernel failure is recorded on its rank and settled once per step (no collective per call);
# `call`: every CP attention call ends with a failure consensus (one all-reduce and host sync per call
# and direction: for debugging, it names the failing call at once).
CONSENSUS_DEFAULT = "step"
CONSENSUS_VALUES: tuple[str, ...] = tuple(CONSENSUS_SYNONYMS)


def normalize_consensus(value: Any) -> str:
    """Canonicalize a ``consensus`` knob to one of :data:`CONSENSUS_VALUES`."""
    return _normalize(value, "consensus", CONSENSUS_SYNONYMS, CONSENSUS_DEFAULT)


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


@dataclass(frozen=True)
class CPOptions:
    """Every block-diagonal CP knob of a step, validated and canonical.

    Synonyms are parsed once, here; the object is frozen, so a step's knobs
    cannot change under it. The batch builder snapshots one into each step state
    and the runtime reads only that snapshot.

    Attributes:
        attn_backend: Kernel (``auto`` or a kernel name; any synonym).
        kv_exchange: ``auto``, ``allgather``, ``halo`` or ``a2a`` (any synonym).
        layout: ``auto``, ``contiguous`` or ``balanced`` (any synonym).
        overlap: Attend local-key documents while the K/V exchange is in flight.
        check_finite: Record, without a host sync, whether each call's q/k/v are finite.
        attn_shape: The model's attention shape for ``layout=auto``'s cost model
            (``cost.Shape``; ``None``: a generic 8 x 128 bf16 shape).
        consensus: ``step`` (settle kernel failures once per step) or ``call`` (after
            every call; debugging).
    """

    attn_backend: str = ATTN_BACKEND_DEFAULT
    kv_exchange: str = KV_EXCHANGE_DEFAULT
    layout: str = LAYOUT_DEFAULT
    overlap: bool = True
    check_finite: bool = True
    attn_shape: Shape | None = None
    consensus: str = CONSENSUS_DEFAULT

    def __post_init__(self) -> None:
        from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape  # cost imports this leaf

        canonical = {
            "attn_backend": normalize_attn_backend(self.attn_backend),
            "kv_exchange": normalize_kv_exchange(self.kv_exchange),
            "layout": normalize_layout(self.layout),
            "consensus": normalize_consensus(self.consensus),
        }
        for name, value in canonical.items():
            object.__setattr__(self, name, value)
        _require_bool("overlap", self.overlap)
        _require_bool("check_finite", self.check_finite)
        if self.attn_shape is not None and not isinstance(self.attn_shape, Shape):
            raise ValueError(
                f"attn_shape: expected blockdiag_cp.cost.Shape(heads, kv_heads, head_dim, elem_bytes) or None, "
                f"got {type(self.attn_shape).__name__}"
            )

    def replace(self, **changes: Any) -> CPOptions:
        """A copy with ``changes`` applied (validated like a new object)."""
        return dataclasses.replace(self, **changes)


_DEFAULT_OPTIONS = CPOptions()


def configure_cp_varlen(
    *,
    attn_backend: str | None = None,
    kv_exchange: str | None = None,
    layout: str | None = None,
    overlap: bool = True,
    check_finite: bool = True,
    consensus: str | None = None,
) -> None:
    """Set the process default :class:`CPOptions` for callers that pass no options to the batch builder.

    The training path never reads this default: the batch builder snapshots
    options into each step state (the recipe passes its own). Every value is
    validated before anything changes, so a bad value leaves the previous default in place.

    Args:
        attn_backend: Kernel name or synonym (``None``/``""``/``"default"`` -> ``auto``).
        kv_exchange: Exchange name or synonym (``None``/``""``/``"default"`` -> ``halo``).
        layout: ``contiguous``, ``balanced`` or ``auto`` (``None`` -> ``contiguous``).
        overlap: Compute local-key segments while the K/V exchange is in flight.
        check_finite: Record, without a host sync, whether every call's q/k/v are finite
            (read once per step with ``nonfinite_attention_inputs``).
        consensus: ``step`` (default) or ``call`` (see :class:`CPOptions`).
    """
    global _DEFAULT_OPTIONS
    _DEFAULT_OPTIONS = CPOptions(attn_backend, kv_exchange, layout, overlap, check_finite, None, consensus)


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
class StepCache:
    """Values computed lazily during one step and reused by every layer and by recompute.

    Attributes:
        windows: Per sliding window (``None``: full causal), this rank's :class:`WindowPlan`.
        agreed: Whether the step-start agreement check passed.
        kernel: Per call signature, the concrete kernel, or why the requested one cannot run.
        shape: The attention shape of the first call (for the cost model).
        finite: Per CP call, a device bool ``[3]``: are q, k, v all finite (no host sync).
    """

    windows: dict[int | None, WindowPlan] = field(default_factory=dict)
    agreed: bool = False
    kernel: dict[KernelKey, tuple[str | None, Exception | None]] = field(default_factory=dict)
    shape: Shape | None = None
    finite: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StepStats:
    """What this step's CP attention calls did on this rank (read with ``exchange_stats``).

    Attributes:
        calls: CP attention calls (forward and activation-checkpoint recompute).
        path / reason: The K/V exchange path and why it was chosen.
        attn_backend: The concrete kernel the calls ran.
        kv_tokens_received / kv_bytes_received: K/V the last call received (the same for every
            layer of one window).
        windows: Per sliding window seen this step (``None``: full causal): ``(path, K/V tokens
            received, lower bound)`` of one of its calls.
        exchange_wait_s / exchange_backward_wait_s: Seconds blocked on the exchange, forward / backward.
        exchange_calls: Exchanges posted.
    """

    calls: int = 0
    path: str | None = None
    reason: str | None = None
    attn_backend: str | None = None
    kv_tokens_received: int = 0
    kv_bytes_received: int = 0
    windows: dict[int | None, tuple[str, int, int]] = field(default_factory=dict)
    exchange_wait_s: float = 0.0
    exchange_backward_wait_s: float = 0.0
    exchange_calls: int = 0


@dataclass
class FailureLog:
    """Kernel failures recorded on this rank during one step: ``(CP call index, diagnostic)`` per direction.

    A failing kernel yields zeros so every collective of the step stays in
    lockstep; the log is settled once per step (``consensus.settle_step``, or
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


@dataclass(frozen=True)
class BlockdiagCpModelState:
    """The model-facing, read-only view of an active block-diagonal CP step.

    Models with their own sequence mixers (recurrent layers, convolutions) or
    that embed inputs inside ``forward`` (``shard_primary=False``) read it with
    ``current_blockdiag_cp_state()``.

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
    cp_rank: int
    cp_size: int
    row_offset: int
    local_len: int
    padded_seq_len: int
    layout: str
    positions: torch.Tensor


@dataclass
class StepState:
    """Everything one training step's CP attention calls need, fixed at batch-build time.

    Internal to the package and the step's owner; models read :attr:`model_view`
    (``current_blockdiag_cp_state()``).

    Attributes:
        group: The CP process group (``None`` only when ``cp_size == 1``).
        cp_rank: This rank's index in the CP group.
        cp_size: Number of CP ranks.
        doc_ids: Replicated per-position document ids ``[B, S_full]`` in physical order (0 == pad).
        row_offset: Physical position of this rank's first local row (``cp_rank * local_len``);
            under the contiguous layout also its original position.
        local_len: Local rows per rank ``L = S_full / cp_size``.
        shard_plan: Where every document piece lives (identical on every rank).
        packed_cu_seqlens: Boundaries of the physical row ``[n_runs + 1]`` (device).
        packed_cu_seqlens_cpu: The same boundaries on the host.
        positions: Original position of each local row ``[L]`` (device).
        options: The step's knobs (frozen).
        cache: Per-step memo (per-window plans and routes, agreement, kernel).
        stats: What the calls did (path, K/V received, time blocked on exchanges).
        failures: Kernel failures recorded on this rank, settled once per step.
    """

    group: dist.ProcessGroup | None
    cp_rank: int
    cp_size: int
    doc_ids: torch.Tensor
    row_offset: int
    local_len: int
    shard_plan: ShardPlan
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor
    positions: torch.Tensor
    options: CPOptions = field(default_factory=CPOptions)
    cache: StepCache = field(default_factory=StepCache)
    stats: StepStats = field(default_factory=StepStats)
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


_STEP_STATE: ThreadSharedSlot[StepState] = ThreadSharedSlot()
# The most recently exited step state: read only by the seed API's `exchange_stats()` and
# `cp_attn_fire_count()` after a step, never by the step path.
_LAST_STATE: ThreadSharedSlot[StepState] = ThreadSharedSlot()


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
def activate_step_state(step_state: StepState) -> Iterator[StepState]:
    """Make ``step_state`` the active one; restore the previous state on exit, also on exceptions."""
    token = _STEP_STATE.set(step_state)
    _EXITED_CALLS.add(-step_state.stats.calls)  # while active, its calls are counted from the state itself
    try:
        yield step_state
    finally:
        _STEP_STATE.reset(token)
        _LAST_STATE.set(step_state)
        _EXITED_CALLS.add(step_state.stats.calls)


def current_step_state() -> StepState | None:
    """Return the active per-step CP state (internal), or ``None`` outside a step context."""
    return _STEP_STATE.get()


def last_step_state() -> StepState | None:
    """The active step state, else the most recently exited one (``None`` before any step)."""
    return _STEP_STATE.get() or _LAST_STATE.get()


def current_blockdiag_cp_state() -> BlockdiagCpModelState | None:
    """The frozen model-facing view of the active step (:class:`BlockdiagCpModelState`), or ``None``.

    Models with their own sequence mixers (e.g. recurrent layers) read the global
    packed boundaries ``packed_cu_seqlens`` / ``packed_cu_seqlens_cpu``, the group
    and where their rows came from (``row_offset``, ``positions``) here.
    """
    active = _STEP_STATE.get()
    return None if active is None else active.model_view


def cp_attn_fire_count() -> int:
    """CP attention calls (forward and recompute) since the last reset, the active step's included."""
    active = _STEP_STATE.get()
    return _EXITED_CALLS.value + (active.stats.calls if active is not None else 0)


def reset_cp_attn_fire_count() -> None:
    """Zero the CP attention fire count (the active step's calls so far included)."""
    _EXITED_CALLS.reset()
    active = _STEP_STATE.get()
    if active is not None:
        _EXITED_CALLS.add(-active.stats.calls)
