"""Runtime knobs, the typed per-step CP state, and its thread-shared slot.

The knob tables live here, in a dependency-free leaf module, so the runtime,
the batch builder and the recipe's config schema all derive the accepted values
(and their synonyms) from one place and can never disagree.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape
    from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan
    from nemo_automodel.components.distributed.blockdiag_cp.kernels import AttentionGroup, VarlenMeta
    from nemo_automodel.components.distributed.blockdiag_cp.layout import RankSegments, ShardPlan

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


@dataclass(frozen=True)
class RuntimeConfig:
    """Process-wide defaults, used when a step state carries no snapshot."""

    attn_backend: str = ATTN_BACKEND_DEFAULT
    kv_exchange: str = KV_EXCHANGE_DEFAULT
    layout: str = LAYOUT_DEFAULT
    overlap: bool = True
    check_finite: bool = True


_RUNTIME_CONFIG = RuntimeConfig()


def configure_cp_varlen(
    *,
    attn_backend: str | None = None,
    kv_exchange: str | None = None,
    layout: str | None = None,
    overlap: bool = True,
    check_finite: bool = True,
) -> None:
    """Set the process-wide block-diagonal CP defaults.

    Every value is validated before anything changes, so a bad value leaves the
    previous configuration in place.

    Args:
        attn_backend: Kernel name or synonym (``None``/``""``/``"default"`` -> ``auto``).
        kv_exchange: Exchange name or synonym (``None``/``""``/``"default"`` -> ``halo``).
        layout: ``contiguous`` or ``balanced`` (``None`` -> ``contiguous``).
        overlap: Compute local-key segments while the K/V exchange is in flight.
        check_finite: Record, without a host sync, whether every call's q/k/v are finite
            (read once per step with ``nonfinite_attention_inputs``).
    """
    global _RUNTIME_CONFIG
    _RUNTIME_CONFIG = RuntimeConfig(
        normalize_attn_backend(attn_backend),
        normalize_kv_exchange(kv_exchange),
        normalize_layout(layout),
        bool(overlap),
        bool(check_finite),
    )


def cp_varlen_runtime_config() -> dict[str, Any]:
    """Return the configured ``{"attn_backend", "kv_exchange", "layout", "overlap", "check_finite"}``."""
    return {
        "attn_backend": _RUNTIME_CONFIG.attn_backend,
        "kv_exchange": _RUNTIME_CONFIG.kv_exchange,
        "layout": _RUNTIME_CONFIG.layout,
        "overlap": _RUNTIME_CONFIG.overlap,
        "check_finite": _RUNTIME_CONFIG.check_finite,
    }


@dataclass
class StepCache:
    """Values computed lazily during one step and reused by every layer and by recompute.

    Attributes:
        kv_plan: The replicated exchange plan (set on the first needed-only call).
        preflight: ``(backend, dtype, device, query_len, key_len) -> (ok, reason)``.
        agreed: Whether the step-start agreement check passed.
        auto_choice: ``kv_exchange=auto``'s ``(path, reason)`` for this step.
        shape: The attention shape of the current call (for the cost model).
        finite: Per CP call, a device bool ``[3]``: are q, k, v all finite (no host sync).
    """

    kv_plan: KVPlan | None = None
    preflight: dict[tuple[str, str, str, int, int], tuple[bool, str | None]] = field(default_factory=dict)
    agreed: bool = False
    auto_choice: tuple[str, str] | None = None
    shape: Shape | None = None
    finite: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StepState:
    """Everything one training step's CP attention calls need, fixed at batch-build time.

    Public, model-facing fields: ``doc_ids``, ``packed_cu_seqlens``,
    ``packed_cu_seqlens_cpu``, ``row_offset``, ``local_len``, ``cp_rank``,
    ``cp_size``, ``group`` and ``shard_plan`` (``shard_plan.permutation`` maps
    physical to original positions under the balanced layout).

    Attributes:
        group: The CP process group (``None`` only when ``cp_size == 1``).
        cp_rank: This rank's index in the CP group.
        cp_size: Number of CP ranks.
        doc_ids: Replicated per-position document ids ``[B, S_full]`` in physical order (0 == pad).
        row_offset: Physical position of this rank's first local row (``cp_rank * local_len``);
            under the contiguous layout also its original position.
        local_len: Local rows per rank ``L = S_full / cp_size``.
        shard_plan: Where every document piece lives (identical on every rank).
        segments: This rank's local segments and the keys they need.
        varlen_meta: Kernel metadata of all this rank's segments over its ``L`` rows.
        groups: This rank's attention groups (local keys first, then remote keys).
        merge_index: Row permutation restoring local order after concatenating the
            groups' outputs and the padding rows (``None``: already in order).
        packed_cu_seqlens: Boundaries of the physical row ``[n_runs + 1]`` (device): documents
            (pieces, under the balanced layout) and padding runs.
        packed_cu_seqlens_cpu: The same boundaries on the host.
        attn_backend: Snapshot of the kernel knob (``None`` -> module config).
        kv_exchange: Snapshot of the exchange knob (``None`` -> module config).
        overlap: Compute local-key segments while the exchange is in flight.
        check_finite: Record whether each call's q/k/v are finite (see ``StepCache.finite``).
        cache: Per-step memo (plan, preflight results).
    """

    group: dist.ProcessGroup | None
    cp_rank: int
    cp_size: int
    doc_ids: torch.Tensor
    row_offset: int
    local_len: int
    shard_plan: ShardPlan
    segments: RankSegments
    varlen_meta: VarlenMeta | None
    groups: tuple[AttentionGroup, ...]
    merge_index: torch.Tensor | None
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor
    attn_backend: str | None = None
    kv_exchange: str | None = None
    overlap: bool = True
    check_finite: bool = True
    cache: StepCache = field(default_factory=StepCache)


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


@contextlib.contextmanager
def activate_step_state(step_state: StepState) -> Iterator[StepState]:
    """Make ``step_state`` the active one; restore the previous state on exit, also on exceptions."""
    token = _STEP_STATE.set(step_state)
    try:
        yield step_state
    finally:
        _STEP_STATE.reset(token)


def current_step_state() -> StepState | None:
    """Return the active per-step CP state, or ``None`` outside a step context."""
    return _STEP_STATE.get()


def current_blockdiag_cp_state() -> StepState | None:
    """Model-facing view of the active step (see :class:`StepState` for the public fields).

    Models with their own sequence mixers (e.g. recurrent layers) read the global
    packed boundaries ``packed_cu_seqlens`` / ``packed_cu_seqlens_cpu`` and the
    contiguous layout (``row_offset``, ``local_len``) from here.
    """
    return _STEP_STATE.get()


class _FireCounter:
    """Counts CP attention calls so a recipe can fail loudly when CP never engaged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def increment(self) -> None:
        with self._lock:
            self._count += 1

    def reset(self) -> None:
        with self._lock:
            self._count = 0

    @property
    def value(self) -> int:
        return self._count


_FIRE_COUNTER = _FireCounter()


def cp_attn_fire_count() -> int:
    """Number of CP attention calls (forward and recompute) since the last reset."""
    return _FIRE_COUNTER.value


def reset_cp_attn_fire_count() -> None:
    """Zero the CP attention fire counter."""
    _FIRE_COUNTER.reset()


def record_cp_attn_call() -> None:
    """Count one CP attention call (called by the runtime)."""
    _FIRE_COUNTER.increment()
