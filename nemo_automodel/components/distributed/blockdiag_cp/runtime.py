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

from nemo_automodel.components.distributed.blockdiag_cp import consensus, cost, exchange, kernels, topology
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.consensus import CallStatus, group_size
from nemo_automodel.components.distributed.blockdiag_cp.exchange import ExchangeOp, KVPlan
from nemo_automodel.components.distributed.blockdiag_cp.kernels import AttentionGroup
from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.state import StepState

logger = logging.getLogger(__name__)

# Torch's SDPA as imported, before any patch can replace the module attribute.
_ORIGINAL_SDPA = F.scaled_dot_product_attention
# Seed flag: the chosen path is logged once per process.
_KV_EXCHANGE_PATH_LOGGED = False


@dataclass(frozen=True)
class ExchangeStats:
    """What the latest CP attention call on this rank did."""

    path: str
    reason: str
    attn_backend: str
    kv_tokens_received: int
    kv_bytes_received: int


@dataclass
class _WaitClock:
    """Seconds this rank spent blocked on K/V exchanges (forward and backward) since the last reset."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    calls: int = 0


_LAST_STATS: ExchangeStats | None = None
_CLOCK = _WaitClock()
_AUTO_PATHS_LOGGED: set[str] = set()


def exchange_stats() -> dict[str, Any] | None:
    """Stats of the latest CP attention call on this rank, or ``None`` before the first.

    Returns:
        ``{"path", "reason", "attn_backend", "kv_tokens_received", "kv_bytes_received"}`` of the
        latest call, plus the time blocked on exchanges since :func:`reset_exchange_stats`:
        ``exchange_wait_s`` (forward), ``exchange_backward_wait_s`` and ``exchange_calls``.
    """
    if _LAST_STATS is None:
        return None
    return {
        **asdict(_LAST_STATS),
        "exchange_wait_s": _CLOCK.forward_s,
        "exchange_backward_wait_s": _CLOCK.backward_s,
        "exchange_calls": _CLOCK.calls,
    }


def reset_exchange_stats() -> None:
    """Zero the exchange wait clock (e.g. at the start of a step)."""
    global _CLOCK
    _CLOCK = _WaitClock()


def _cp_group_spans_nodes(group: dist.ProcessGroup | None) -> bool:
    """True when the CP group's ranks run on more than one host (their real hostnames).

    Needed-only exchanges are point-to-point messages between any two CP ranks; those
    between nodes pay the inter-node link's latency and bandwidth, so they are disabled
    (the reason logged once per process) and all-gather is used. ``NEMO_CP_ALLOW_XNODE=1`` forces ``False``.
    The hostnames are gathered once per group (:mod:`.topology`: at mesh build in the
    recipe, else at the first call, which every CP rank reaches at the same point).
    """
    where = topology.group_hosts(group)
    if not where.spans_nodes:
        return False
    allowed = os.environ.get("NEMO_CP_ALLOW_XNODE") == "1"
    log_once(
        logger,
        "cp-group-spans-nodes",
        logging.WARNING,
        "the CP group spans nodes (%s): %s",
        where.describe(),
        "NEMO_CP_ALLOW_XNODE=1 keeps needed-only K/V exchanges across nodes"
        if allowed
        else "needed-only K/V exchange disabled (its point-to-point messages between nodes would cross the "
        "inter-node link); using all-gather. Set NEMO_CP_ALLOW_XNODE=1 to force needed-only exchange across nodes.",
    )
    return not allowed


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
    return not consensus.failed_ranks(out is not None, group, device)


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
    failed = consensus.failed_ranks(local_reason is None, group, device)
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
    if group_size(group) == 1:
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
    plan = _kv_plan(state)
    if kv_exchange == "auto":
        path, reason = _auto_choice(state, plan, device)
        return path, None if path == "allgather" else plan, reason
    if kv_exchange == "a2a":
        return "a2a", plan, "kv_exchange=a2a (configured)"
    if plan.use_halo:
        return "halo", plan, "kv_exchange=halo: every rank needs remote keys from its left neighbour only"
    return "a2a", plan, "kv_exchange=halo upgraded to a2a: some rank needs keys from beyond its left neighbour"


def _auto_choice(state: StepState, plan: KVPlan, device: torch.device) -> tuple[str, str]:
    """``kv_exchange=auto``: the cost model's path for this step (same on every rank: replicated inputs)."""
    if state.cache.auto_choice is None:
        shape = state.cache.shape or cost.Shape()
        path, reason, _ = cost.choose(state.shard_plan, plan, shape, cost.machine_for(device), state.overlap)
        state.cache.auto_choice = (path, reason)
        # each path's first pick at INFO; mixed rows flip the pick per step, which would flood the log
        if path not in _AUTO_PATHS_LOGGED:
            _AUTO_PATHS_LOGGED.add(path)
            logger.info("%s (first pick of %s; every pick is logged at DEBUG)", reason, path)
        else:
            logger.debug("%s", reason)
    return state.cache.auto_choice


def _kv_plan(state: StepState) -> KVPlan:
    """The step's replicated exchange plan, computed once and reused by every layer and by recompute."""
    if state.cache.kv_plan is None:
        state.cache.kv_plan = exchange.compute_kv_plan(state.shard_plan)
    return state.cache.kv_plan


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


def _agree_on_step(state: StepState, query: torch.Tensor, key: torch.Tensor) -> None:
    """On the step's first call: every rank must run the same configuration on the same layout.

    Runs before any path-dependent collective, so a disagreement (a rank with a
    different ``kv_exchange``, kernel, sequence length, document layout or
    q/k/v shape) makes every rank raise the same error instead of hanging in
    mismatched collectives. Later calls are not re-checked (a rank whose shapes
    change mid-step while its peers' do not is not detected).
    """
    if state.cache.agreed or state.cp_size == 1:
        return
    backend, kv_exchange = _resolve_cp_varlen_config(state)
    plan = state.shard_plan
    consensus.check_step_agreement(
        {
            "cp_size": state.cp_size,
            "sequence length": plan.runs.total_len,
            "local length": state.local_len,
            "attn_backend": backend,
            "kv_exchange": kv_exchange,
            "layout": plan.layout,
            "overlap": state.overlap,
            "document layout": (plan.runs.starts, plan.runs.ends, plan.pieces),
            "query/key shapes and dtype": (tuple(query.shape), tuple(key.shape), str(query.dtype)),
        },
        state.group,
        query.device,
    )
    state.cache.agreed = True


def _group_keys(
    group: AttentionGroup,
    kv: torch.Tensor,
    received: torch.Tensor | None,
    path: str,
    plan: KVPlan | None,
    state: StepState,
) -> torch.Tensor:
    """Packed keys ``[1, C, K, D]`` of one attention group."""
    if group.local:
        base = state.row_offset
        parts = [kv[:, :, s - base : e - base] for s, e in group.kv_ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return exchange.assemble(kv, received, path, state.cp_rank, state.local_len, group.kv_ranges, plan)


def _run_group(
    group: AttentionGroup,
    query: torch.Tensor,
    packed: torch.Tensor,
    n_kv_heads: int,
    kernel: str,
    status: CallStatus,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Guarded kernel call on the group's rows ``[1, Hq, n_rows, D]``."""
    key, value = packed.split(n_kv_heads, dim=1)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernels.blockdiag_attention(kernel, q, k, v, group.meta, scale, dropout_p)

    describe = f"kernel={kernel} {'local' if group.local else 'remote'} group: {group.meta.describe()}"
    return consensus.guarded(attend, status, describe, group.take_rows(query), key, value)


def _attend(
    state: StepState,
    path: str,
    plan: KVPlan | None,
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Exchange K/V and attend every group; local-key groups run while the exchange is in flight.

    Returns:
        ``[1, Hq, L, D]`` in local row order; padding rows are zero.
    """
    kv = torch.cat((key, value), dim=1)  # one collective moves both: [1, 2 * Hkv, L, D]
    status = CallStatus()
    what = f"path={path} kernel={kernel}"
    op: ExchangeOp | None = None
    token = received = None
    if state.cp_size > 1:
        op = exchange.make_exchange_op(path, state.group, state.cp_rank, state.cp_size, plan)
        op.after_backward = lambda: _after_backward(op, status, state, query.device, what)
        token = exchange.post(kv, op)
        if not state.overlap:
            received = exchange.wait(token, op)
    outputs = []
    for group in state.groups:  # local group first when it exists: it needs nothing from the exchange
        if not group.local and received is None:
            received = exchange.wait(token, op)
        packed = _group_keys(group, kv, received, path, plan, state)
        outputs.append(_run_group(group, query, packed, key.shape[1], kernel, status, scale, dropout_p))
    if op is not None and received is None:
        received = exchange.wait(token, op)
    n_real = state.segments.n_real
    parts = [] if received is None else [exchange.anchor_like(query, received)]
    parts += [*outputs, kernels.zeros_attached(query[:, :, n_real:])] if n_real < state.local_len else outputs
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    if state.merge_index is not None:
        out = out.index_select(2, state.merge_index)
    if op is not None:
        _CLOCK.forward_s += op.wait_s
        _CLOCK.calls += 1
    status.raise_if_failed("forward", state.group, query.device, state.cp_rank, what)
    return out


def _after_backward(op: ExchangeOp, status: CallStatus, state: StepState, device: torch.device, what: str) -> None:
    """Runs when a layer's reverse exchange completed: account its wait and agree on backward failures."""
    _CLOCK.backward_s += op.backward_wait_s
    status.raise_if_failed("backward", state.group, device, state.cp_rank, what)


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
    if state.check_finite:  # device-side flags, read once per step: no host sync per layer
        state.cache.finite.append(torch.stack([t.isfinite().all() for t in (query, key, value)]))
    _agree_on_step(state, query, key)
    state.cache.shape = cost.Shape(query.shape[1], key.shape[1], query.shape[3], query.element_size())
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
    out = _attend(state, path, plan, kernel, query, key, value, scale, dropout_p)
    received = plan.remote_tokens(state.cp_rank) if plan is not None else state.local_len * (state.cp_size - 1)
    global _LAST_STATS
    bytes_per_token = 2 * key.shape[1] * key.shape[3] * key.element_size()
    _LAST_STATS = ExchangeStats(path, reason, kernel, received, received * bytes_per_token)
    return out


def nonfinite_attention_inputs(state: StepState | None = None) -> list[str]:
    """Which CP attention calls of the step saw NaN/Inf in q, k or v (one host sync for the whole step).

    Args:
        state: The step state (default: the active one). Calls are numbered in
            execution order (activation-checkpoint recompute calls count again).

    Returns:
        One line per offending call, e.g. ``"CP attention call 3: key, value"``; empty when all are finite.
    """
    state = state or state_module.current_step_state()
    if state is None or not state.cache.finite:
        return []
    flags = torch.stack(state.cache.finite).cpu().tolist()
    names = ("query", "key", "value")
    return [
        f"CP attention call {i}: {', '.join(n for n, ok in zip(names, row) if not ok)}"
        for i, row in enumerate(flags)
        if not all(row)
    ]


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
