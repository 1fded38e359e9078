"""The seed's private functions and upstream's state forms, kept with their documented signatures; retired names.

Nothing here is on the typed core's path: the runtime calls none of it. Callers of
the seed API (and its tests) may; each function delegates to the typed core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import consensus, kernels, options, runtime
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan
from nemo_automodel.components.distributed.blockdiag_cp.state import (
    RowCache,
    RowState,
    RowStats,
    activate_row_state,
    current_row_state,
    last_row_state,
)
from nemo_automodel.components.distributed.blockdiag_cp.variant import plan_key

# Names before "step" meant only the optimizer step (a packed row's state was a "step state"), kept importable.
StepState = RowState
StepCache = RowCache
StepStats = RowStats
current_step_state = current_row_state
activate_step_state = activate_row_state
last_step_state = last_row_state
check_step_agreement = consensus.check_agreement
settle_step = consensus.settle_failures


def row_doc_ids(state: RowState) -> torch.Tensor:
    """The row's replicated document ids ``[1, S_full]`` in physical order (0 == pad), on the row's device.

    The seed kept them in its row state; the typed core plans from the shard plan and never builds them.
    """
    plan = state.shard_plan
    ids = torch.zeros(plan.runs.total_len, dtype=torch.long)
    for start, end, doc in zip(plan.runs.starts, plan.runs.ends, plan.runs.ids, strict=True):
        ids[start:end] = doc
    if not plan.is_identity:
        ids = ids.index_select(0, plan.permutation)
    return ids[None].to(state.positions.device)


def _resolve_cp_varlen_config(state: RowState | Mapping[str, Any]) -> tuple[str, str]:
    """``(attn_backend, kv_exchange)`` of a row: its options, or (upstream's dict state) the keys it sets.

    A mapping falls back to the process default of ``configure_cp_varlen`` for a missing or ``None`` knob.
    """
    if isinstance(state, RowState):
        return state.options.attn_backend, state.options.kv_exchange
    default = state_module.default_options()
    backend, kv_exchange = state.get("attn_backend"), state.get("kv_exchange")
    return (
        default.attn_backend if backend is None else options.normalize_attn_backend(backend),
        default.kv_exchange if kv_exchange is None else options.normalize_kv_exchange(kv_exchange),
    )


def _select_kv_exchange_path(
    state: RowState,
    group: dist.ProcessGroup | None,
    doc_ids: torch.Tensor,
    local_len: int,
    device: torch.device,
    offset: int,
    query_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    chunk: int | None = None,
) -> tuple[str, KVPlan | None, str]:
    """The seed's path decision: the row's K/V path for a window or chunk, and why (no communication).

    ``group``, ``doc_ids``, ``query_dtype`` and ``dropout_p`` are the seed's parameters: the
    path comes from the row's group and shard plan (built from the same ids), and whether the
    kernel can run is part of the row agreement. ``local_len`` and ``offset`` must be the row's.

    Returns:
        ``(path, plan, reason)`` as the core's decision (``plan``: the needed-only
        :class:`KVPlan`, ``None`` for all-gather).
    """
    del group, doc_ids, query_dtype, dropout_p
    if offset != state.row_offset:
        raise ValueError(f"offset={offset} disagrees with the row state's row_offset={state.row_offset}")
    if local_len != state.local_len:
        raise ValueError(f"local_len={local_len} disagrees with the row state's local_len={state.local_len}")
    return runtime._exchange_path(state, device, plan_key(window, chunk))


def _needed_only_preflight(
    state: RowState,
    group: dist.ProcessGroup | None,
    backend: str,
    query_dtype: torch.dtype,
    device: torch.device,
    query_len: int,
    key_len: int,
) -> tuple[bool, str | None]:
    """Collective: can every rank run ``backend`` for this dtype, device and these lengths?

    One all-reduce over ``group`` the first time a row asks with a key, memoized in the
    row's state per ``(backend, dtype, device, query_len, key_len)``: per-layer calls cost nothing.

    Args:
        state: The row's state.
        group: The CP process group (every rank of it must call with the same key).
        backend: ``attn_backend`` (canonical or upstream's spelling; ``auto`` always runs).
        query_dtype: Query dtype.
        device: Query device.
        query_len: Local query rows (must be the row's local length ``L``).
        key_len: Local key rows (must be ``L``: keys are exchanged after this check).

    Returns:
        ``(ok, reason)``: ``reason`` names the failing ranks and, on a failing rank, its own cause.
    """
    canonical = options.normalize_attn_backend(backend)
    key = (canonical, str(query_dtype), str(device), int(query_len), int(key_len))
    memo = state.cache.preflight
    if key not in memo:
        reason = None
        if canonical != "auto":
            reason = kernels.kernel_unavailable_reason(canonical, query_dtype, torch.device(device))
        if reason is None and (query_len, key_len) != (state.local_len, state.local_len):
            reason = f"query/key length {query_len}/{key_len} differs from the row's local length {state.local_len}"
        failed = consensus.failed_ranks(reason is None, group, torch.device(device))
        memo[key] = (True, None)
        if failed:
            memo[key] = (False, f"rank(s) {failed} cannot run {canonical}" + (f" ({reason})" if reason else ""))
    return memo[key]
