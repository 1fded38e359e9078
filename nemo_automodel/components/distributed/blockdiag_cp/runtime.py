"""The SDPA entry point and the collective-safe path decisions.

:func:`cp_blockdiag_sdpa` replaces ``torch.nn.functional.scaled_dot_product_attention``.
Outside a step context it *is* stock SDPA. Inside one it exchanges K/V over the
CP group and runs the local queries against them with a per-document causal
mask rebuilt from the replicated document ids.

Every rank must take the same path, or the group's collectives desynchronize
and hang. Hence: the path is decided from replicated data (document ids,
configuration) plus small MIN-style consensus collectives; every downgrade
names its reason; and a kernel failure on one rank makes *every* rank raise.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_automodel.components.distributed.blockdiag_cp import exchange, kernels
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan
from nemo_automodel.components.distributed.blockdiag_cp.layout import all_rank_segments
from nemo_automodel.components.distributed.blockdiag_cp.state import StepState

logger = logging.getLogger(__name__)

# Torch's SDPA as imported, before any patch can replace the module attribute.
_ORIGINAL_SDPA = F.scaled_dot_product_attention
# Seed flags: the chosen path and the cross-node downgrade are each logged once per process.
_KV_EXCHANGE_PATH_LOGGED = False
_KV_XNODE_LOGGED = False


@dataclass(frozen=True)
class ExchangeStats:
    """What the latest CP attention call on this rank did."""

    path: str
    reason: str
    attn_backend: str
    kv_tokens_received: int
    kv_bytes_received: int


_LAST_STATS: ExchangeStats | None = None


def exchange_stats() -> dict[str, Any] | None:
    """Stats of the latest CP attention call on this rank, or ``None`` before the first.

    Returns:
        ``{"path", "reason", "attn_backend", "kv_tokens_received", "kv_bytes_received"}``.
    """
    return None if _LAST_STATS is None else asdict(_LAST_STATS)


def _local_world_size() -> int:
    """Processes on this node: ``LOCAL_WORLD_SIZE``, else ``NPROC_PER_NODE``, else visible GPUs (0 = unknown)."""
    for var in ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cp_group_spans_nodes(group: dist.ProcessGroup | None) -> bool:
    """True when the CP group is larger than this node's world size.

    Needed-only exchanges are peer-to-peer heavy; across nodes they depend on the
    fabric, so they are disabled (one warning per process) and all-gather is
    used. ``NEMO_CP_ALLOW_XNODE=1`` forces ``False``. When the node size is
    unknown (no launcher variables, no GPUs) the group is assumed node-local.
    """
    if os.environ.get("NEMO_CP_ALLOW_XNODE") == "1":
        return False
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = _local_world_size()
    spans = 0 < local < world
    global _KV_XNODE_LOGGED
    if spans and not _KV_XNODE_LOGGED:
        _KV_XNODE_LOGGED = True
        logger.warning(
            "needed-only KV exchange disabled: the CP group (cp_size=%d) spans nodes (local world size %d); "
            "using all-gather. Set NEMO_CP_ALLOW_XNODE=1 to force needed-only exchange across nodes.",
            world,
            local,
        )
    return spans


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _failed_ranks(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Group ranks that reported ``ok=False`` (one all-reduce of a ``[world]`` int vector).

    Every rank gets the same list, so every rank can act on it identically.
    """
    world = _group_size(group)
    if world == 1:
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = 0 if ok else 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def _needed_only_kernel_succeeded_on_all_ranks(
    out: torch.Tensor | None, group: dist.ProcessGroup | None, device: torch.device, diagnostic: str | None = None
) -> bool:
    """Collective: ``False`` on every rank when ``out is None`` on any rank.

    An all-padding rank launches no kernel and always succeeds locally; it must
    still learn that a peer's kernel failed before anyone starts another
    collective. ``diagnostic`` is logged on the failing rank.
    """
    if out is None:
        logger.error("CP attention kernel failed on this rank: %s", diagnostic or "no diagnostic")
    return not _failed_ranks(out is not None, group, device)


def _snapshot_value(state: StepState | Mapping[str, Any], name: str) -> str | None:
    if isinstance(state, Mapping):
        return state.get(name)
    return getattr(state, name)


def _resolve_cp_varlen_config(state: StepState | Mapping[str, Any]) -> tuple[str, str]:
    """``(attn_backend, kv_exchange)`` for this step: the state's snapshot wins, else the module config."""
    configured = state_module.cp_varlen_runtime_config()
    backend = _snapshot_value(state, "attn_backend")
    kv_exchange = _snapshot_value(state, "kv_exchange")
    return (
        configured["attn_backend"] if backend is None else state_module.normalize_attn_backend(backend),
        configured["kv_exchange"] if kv_exchange is None else state_module.normalize_kv_exchange(kv_exchange),
    )


def _needed_only_preflight(
    state: StepState,
    group: dist.ProcessGroup | None,
    backend: str,
    query_dtype: torch.dtype,
    device: torch.device,
    query_len: int,
    key_len: int,
) -> tuple[bool, str | None]:
    """MIN-consensus: can every rank run ``backend`` with this dtype, device and metadata?

    Cached in the step state per ``(backend, dtype, device, query_len, key_len)``,
    so one small all-reduce per step at most.

    Returns:
        ``(ok, reason_or_None)``; the reason names the failing ranks and, on a
        failing rank, its own cause.
    """
    key = (backend, str(query_dtype), str(device), int(query_len), int(key_len))
    cached = state.cache.preflight.get(key)
    if cached is not None:
        return cached
    local_reason = None
    if backend != "auto":
        local_reason = kernels.kernel_unavailable_reason(backend, query_dtype, device)
    if local_reason is None:
        local_reason = kernels._varlen_metadata_unavailable_reason(
            state.varlen_meta, query_len=query_len, key_len=key_len, device=device
        )
    failed = _failed_ranks(local_reason is None, group, device)
    result: tuple[bool, str | None] = (True, None)
    if failed:
        result = (False, f"rank(s) {failed} cannot run {backend}" + (f" ({local_reason})" if local_reason else ""))
    state.cache.preflight[key] = result
    return result


def _select_kv_exchange_path(
    state: StepState,
    group: dist.ProcessGroup | None,
    doc_ids: torch.Tensor,
    local_len: int,
    device: torch.device,
    offset: int,
    query_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
) -> tuple[str, KVPlan | None, str]:
    """Decide this step's K/V path and say why.

    Args:
        state: The active step state (memoizes the plan and the preflight).
        group: The CP process group.
        doc_ids: Replicated document ids ``[B, S_full]`` (0 == pad).
        local_len: Local rows ``L``.
        device: Device for consensus tensors.
        offset: Global position of this rank's first local row.
        query_dtype: Query dtype for the kernel preflight (skipped when ``None``).
        dropout_p: Attention dropout (every kernel supports it; kept for the seed signature).

    Returns:
        ``(path, plan, reason)``: ``path`` is ``"halo"``, ``"a2a"`` or
        ``"allgather"``; ``plan`` is the memoized :class:`KVPlan` for the
        needed-only paths (``None`` for all-gather); ``reason`` names the cause.
    """
    del dropout_p  # dropout never forces a downgrade: every kernel supports it
    backend, kv_exchange = _resolve_cp_varlen_config(state)
    if offset != state.row_offset:
        raise ValueError(f"offset={offset} disagrees with the step state's row_offset={state.row_offset}")
    if _group_size(group) == 1:
        return "allgather", None, "cp_size=1: nothing to exchange"
    if kv_exchange == "allgather":
        return "allgather", None, "kv_exchange=allgather (configured)"
    if state.varlen_meta is None:
        return "allgather", None, "no varlen metadata in the step state"
    if _cp_group_spans_nodes(group):
        return "allgather", None, "CP group spans nodes (set NEMO_CP_ALLOW_XNODE=1 to force needed-only)"
    if query_dtype is not None:
        ok, why = _needed_only_preflight(state, group, backend, query_dtype, device, local_len, doc_ids.shape[-1])
        if not ok:
            return "allgather", None, f"needed-only preflight failed: {why}"
    plan = state.cache.kv_plan
    if plan is None:
        plan = exchange.compute_kv_plan(all_rank_segments(state.runs, state.cp_size))
        state.cache.kv_plan = plan  # reused by every layer and by recompute this step
    if kv_exchange == "a2a":
        return "a2a", plan, "kv_exchange=a2a (configured)"
    if plan.use_halo:
        return "halo", plan, "kv_exchange=halo: every document spans at most two ranks"
    return "a2a", plan, "kv_exchange=halo upgraded to a2a: a document spans more than two ranks"


def _log_path(path: str, reason: str, kernel: str, state: StepState) -> None:
    global _KV_EXCHANGE_PATH_LOGGED
    if not _KV_EXCHANGE_PATH_LOGGED:
        _KV_EXCHANGE_PATH_LOGGED = True
        logger.info(
            "block-diagonal CP: KV exchange path=%s (%s); kernel=%s; cp_size=%d local_len=%d",
            path,
            reason,
            kernel,
            state.cp_size,
            state.local_len,
        )


def _attend(
    kernel: str,
    query: torch.Tensor,
    kv: torch.Tensor,
    n_kv_heads: int,
    state: StepState,
    scale: float | None,
    dropout_p: float,
) -> tuple[torch.Tensor | None, str | None]:
    """Run the kernel; a failure becomes ``(None, diagnostic)`` so the group can fail together."""
    key, value = kv.split(n_kv_heads, dim=1)
    try:
        return kernels.blockdiag_attention(kernel, query, key, value, state.varlen_meta, scale, dropout_p), None
    except Exception as exc:  # any kernel error must reach the consensus, not unwind this rank alone
        return None, f"{type(exc).__name__}: {exc} [kernel={kernel} {state.varlen_meta.describe()}]"


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """Block-diagonal context-parallel drop-in for ``scaled_dot_product_attention``.

    Without an active step state this is stock SDPA with every argument
    forwarded. Inside the context of
    :func:`~nemo_automodel.components.distributed.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx`,
    K/V are exchanged over the CP group and each local query attends the keys
    of its own document up to itself; ``attn_mask`` and ``is_causal`` are ignored.

    Args:
        query: Local queries ``[1, Hq, L, D]``.
        key: Local keys ``[1, Hkv, L, D]`` (``Hq % Hkv == 0``).
        value: Local values ``[1, Hkv, L, D]``.
        attn_mask: Ignored on the CP path.
        dropout_p: Attention dropout probability.
        is_causal: Ignored on the CP path (attention is always per-document causal).
        scale: Softmax scale (``None``: ``D ** -0.5``).
        enable_gqa: Must be True when ``Hq != Hkv`` (as for stock SDPA).
        **kwargs: Forwarded to stock SDPA outside CP; ignored inside.

    Returns:
        ``[1, Hq, L, D]``; padding rows are zero.

    Raises:
        RuntimeError: on every rank when the kernel failed on any rank.
    """
    state = state_module.current_step_state()
    if state is None:
        return _ORIGINAL_SDPA(
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
    kernels.validate_qkv(query, key, value, enable_gqa, state.local_len)
    state_module.record_cp_attn_call()
    path, plan, reason = _select_kv_exchange_path(
        state,
        state.group,
        state.doc_ids,
        query.shape[2],
        query.device,
        state.row_offset,
        query_dtype=query.dtype,
        dropout_p=dropout_p,
    )
    backend, _ = _resolve_cp_varlen_config(state)
    kernel = kernels.select_kernel(backend, query.dtype, query.device)
    _log_path(path, reason, kernel, state)

    kv = torch.cat((key, value), dim=1)  # one collective moves both: [1, 2 * Hkv, L, D]
    if plan is None:
        packed, received = exchange.allgather_kv(kv, state.group, state.cp_size, state.segments.kv_ranges)
    else:
        packed, received = exchange.needed_kv(path, kv, state.group, plan, state.cp_rank)
    out, diagnostic = _attend(kernel, query, packed, key.shape[1], state, scale, dropout_p)
    if diagnostic is not None:
        logger.error("CP attention kernel failed on CP rank %d: %s", state.cp_rank, diagnostic)
    failed = _failed_ranks(out is not None, state.group, query.device)
    if failed:
        own = f"; this rank: {diagnostic}" if diagnostic else ""
        raise RuntimeError(
            f"block-diagonal CP attention failed on CP rank(s) {failed} after the {path} K/V exchange "
            f"(kernel={kernel}); every rank raises instead of falling back, which would desynchronize the "
            f"group's collectives{own}"
        )
    assert out is not None
    global _LAST_STATS
    bytes_per_token = kv.shape[1] * kv.shape[3] * kv.element_size()
    _LAST_STATS = ExchangeStats(path, reason, kernel, received, received * bytes_per_token)
    return out


@contextlib.contextmanager
def patch_sdpa() -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through :func:`cp_blockdiag_sdpa` while active.

    For models that call stock SDPA directly. Enter it together with the step
    context and keep both open through backward (activation-checkpoint
    recompute calls SDPA again). Outside a step state the patched function is
    stock SDPA, so other attention in the process is unaffected; the previous
    function is restored on exit, also on exceptions.
    """
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = cp_blockdiag_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
