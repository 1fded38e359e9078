"""The attention core of a packed row, its SDPA adapter, and the collective-safe path decisions.

:func:`attend_row` is the core: it takes the row's state and the attention variant as
arguments, exchanges the needed K/V over the CP group and runs each attention group's
local queries against its packed keys with a varlen kernel (per-document, bottom-right
causal), from metadata built on the host out of the replicated shard plan
(:mod:`.metadata`): no mask is built per call. A call does no host I/O, lookup of the
group's hosts, library import or environment access: the row's build did those.
:func:`cp_blockdiag_sdpa` is its adapter for code that calls SDPA: it reads the active
row from the thread-shared slot (:mod:`.state`), and outside a row it *is* stock SDPA
(:mod:`.outside`).

Every rank must take the same path, or the group's collectives desynchronize
and hang. Hence: the path is decided from replicated data (document ids, the
step's options) and checked once per step by the agreement collective; every
downgrade names its reason; and a kernel failure on one rank is recorded, the
rank continues with zeros, and the step's settlement makes *every* rank raise.
No attention call issues a control collective or a host sync of its own
(``consensus="call"`` adds one per call and direction, for debugging).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_automodel.components.distributed.blockdiag_cp import (
    consensus,
    cost,
    exchange,
    hybrid,
    kernel_io,
    kernels,
    outside,
    ulysses,
)
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.call import KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.consensus import CallRecorder, group_size
from nemo_automodel.components.distributed.blockdiag_cp.exchange import ExchangeOp, KVPlan, Route
from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.metadata import AttentionGroup, WindowPlan, build_window_plan
from nemo_automodel.components.distributed.blockdiag_cp.options import SEQUENCE_PART
from nemo_automodel.components.distributed.blockdiag_cp.rows import row_views
from nemo_automodel.components.distributed.blockdiag_cp.state import RowState
from nemo_automodel.components.distributed.blockdiag_cp.topology import GroupHosts
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant, PlanKey, plan_key

logger = logging.getLogger(__name__)


def exchange_stats(state: RowState | None = None) -> dict[str, Any] | None:
    """What the CP attention calls of a step did on this rank, or ``None`` before the first call.

    Args:
        state: The step (default: the active step, else the most recently exited one).

    Returns:
        ``{"path", "reason", "attn_backend", "kv_tokens_received", "kv_bytes_received"}`` of the
        last call (every layer of one sliding window takes the same path); ``"windows"``: per
        window (``None``: full causal) ``{"path", "kv_tokens_received", "kv_tokens_lower_bound"}``
        (the lower bound: the needed keys held by other ranks, inside the window); ``"chunks"``:
        the same per attention chunk size ``C`` (lower bound: keys of each query's own chunk); plus the
        step's time blocked on exchanges: ``exchange_wait_s`` (forward),
        ``exchange_backward_wait_s`` and ``exchange_calls``; ``"ulysses"`` (``kv_exchange="ulysses"`` only, else
        ``None``): this rank's ``query_heads`` ``[start, stop)``, ``kv_heads`` and the ``bytes_sent`` /
        ``bytes_received`` of one forward (both all-to-alls; the backward moves as much the other way);
        ``"hybrid"`` (``kv_exchange="ulysses+*"`` only, else ``None``): the factorization ``heads`` x ``sequence``,
        the ``sequence_path`` taken, this rank's ``query_heads`` / ``kv_heads`` in its head group, and per part
        the bytes of one forward: ``heads_bytes_sent`` / ``heads_bytes_received`` (both all-to-alls of the head
        group), ``sequence_kv_tokens_received`` / ``sequence_bytes_received`` (the K/V exchange of the sequence
        group, for this rank's K/V heads).
    """
    state = state or state_module.last_row_state()
    if state is None or state.stats.path is None:
        return None
    stats = state.stats
    return {
        "path": stats.path,
        "reason": stats.reason,
        "attn_backend": stats.attn_backend,
        "kv_tokens_received": stats.kv_tokens_received,
        "kv_bytes_received": stats.kv_bytes_received,
        "windows": {
            key: {"path": path, "kv_tokens_received": received, "kv_tokens_lower_bound": bound}
            for key, (path, received, bound) in stats.windows.items()
            if not isinstance(key, tuple)
        },
        "chunks": {
            key[1]: {"path": path, "kv_tokens_received": received, "kv_tokens_lower_bound": bound}
            for key, (path, received, bound) in stats.windows.items()
            if isinstance(key, tuple)
        },
        "exchange_wait_s": stats.exchange_wait_s,
        "exchange_backward_wait_s": stats.exchange_backward_wait_s,
        "exchange_calls": stats.exchange_calls,
        "ulysses": stats.ulysses,
        "hybrid": stats.hybrid,
    }


def reset_exchange_stats(state: RowState | None = None) -> None:
    """Zero the time blocked on exchanges of ``state`` (default: the active or last step)."""
    state = state or state_module.last_row_state()
    if state is not None:
        state.stats.exchange_wait_s = state.stats.exchange_backward_wait_s = 0.0
        state.stats.exchange_calls = 0


def _cp_group_spans_nodes(hosts: GroupHosts | None, allow_cross_node: bool) -> bool:
    """True when the CP group's ranks run on more than one host (their real hostnames) and that disables needed-only.

    Needed-only exchanges are point-to-point messages between any two CP ranks; those
    between nodes pay the inter-node link's latency and bandwidth, so they are disabled
    (the reason logged once per process) and all-gather is used, unless ``allow_cross_node``
    (``CPOptions.allow_cross_node``, from ``NEMO_CP_ALLOW_XNODE=1`` when the options were built).

    Args:
        hosts: The group's hosts, gathered when the row was built (:mod:`.topology`; ``None``: one host).
        allow_cross_node: Keep needed-only exchanges across nodes.
    """
    if hosts is None or not hosts.spans_nodes:
        return False
    log_once(
        logger,
        "cp-group-spans-nodes",
        logging.WARNING,
        "the CP group spans nodes (%s): %s",
        hosts.describe(),
        "NEMO_CP_ALLOW_XNODE=1 keeps needed-only K/V exchanges across nodes"
        if allow_cross_node
        else "needed-only K/V exchange disabled (its point-to-point messages between nodes would cross the "
        "inter-node link); only collectives cross nodes (all-gather; with kv_exchange=auto also ulysses and "
        "ulysses+allgather). Set NEMO_CP_ALLOW_XNODE=1 to force needed-only exchange across nodes.",
    )
    return not allow_cross_node


def _needed_only_kernel_succeeded_on_all_ranks(
    out: torch.Tensor | None, group: dist.ProcessGroup | None, device: torch.device, diagnostic: str | None = None
) -> bool:
    """Collective: ``False`` on every rank when ``out is None`` on any rank.

    The per-call consensus of ``consensus="call"``. An all-padding rank launches
    no kernel and always succeeds locally; it must still learn that a peer's
    kernel failed before anyone starts another collective. ``diagnostic`` is
    logged on the failing rank.
    """
    if out is None:
        logger.error("CP attention kernel failed on this rank: %s", diagnostic or "no diagnostic")
    return not consensus.failed_ranks(out is not None, group, device)


def _exchange_path(state: RowState, device: torch.device, key: PlanKey) -> tuple[str, KVPlan | None, str]:
    """Decide the row's K/V path for a window or chunk and say why (no communication: every input is replicated).

    Args:
        state: The row's state (memoizes the exchange plan and ``auto``'s choice).
        device: Device of the attention inputs (picks ``auto``'s machine model).
        key: The calls' window or ``("chunk", C)`` (:func:`~.variant.plan_key`); each has its own plan.

    Returns:
        ``(path, kv_plan, reason)``: ``path`` is ``"halo"``, ``"a2a"``, ``"allgather"`` or
        ``"ulysses"``; ``kv_plan`` is the memoized :class:`KVPlan` for the
        needed-only paths (``None`` for all-gather and ulysses); ``reason`` names the cause.
    """
    kv_exchange = state.options.kv_exchange
    if group_size(state.group) == 1:
        return "allgather", None, "cp_size=1: nothing to exchange"
    if kv_exchange == "allgather":
        return "allgather", None, "kv_exchange=allgather (configured)"
    if kv_exchange == "ulysses":  # a collective like all-gather: kept across nodes, as asked
        return "ulysses", None, "kv_exchange=ulysses (configured): heads travel, not keys"
    if kv_exchange in SEQUENCE_PART:  # explicit: its sequence part stays needed-only across nodes (hybrid.py)
        if state.hosts is not None and state.hosts.spans_nodes:  # said first: the sequence row's line would not fit
            log_once(
                logger,
                "cp-group-spans-nodes",
                logging.WARNING,
                "the CP group spans nodes (%s): kv_exchange=%s (configured) keeps its sequence part's exchange "
                "between nodes, as asked",
                state.hosts.describe(),
                kv_exchange,
            )
        groups = state.hybrid
        reason = f"kv_exchange={kv_exchange} (configured): heads {groups.heads} x sequence {groups.sequence}"
        return kv_exchange, None, reason
    if kv_exchange == "auto":  # the cost model knows the topology (needed-only between nodes only if allowed)
        _cp_group_spans_nodes(state.hosts, state.options.allow_cross_node)  # says why, once per process
        kv_plan = _kv_plan(state, key, device)
        path, reason = _auto_choice(state, kv_plan, device, key)
        return path, kv_plan if path in ("halo", "a2a") else None, reason
    if _cp_group_spans_nodes(state.hosts, state.options.allow_cross_node):
        return "allgather", None, "CP group spans nodes (set NEMO_CP_ALLOW_XNODE=1 to force needed-only)"
    kv_plan = _kv_plan(state, key, device)
    if kv_exchange == "a2a":
        return "a2a", kv_plan, "kv_exchange=a2a (configured)"
    if kv_plan.use_halo:
        return "halo", kv_plan, "kv_exchange=halo: every rank needs remote keys from its left neighbour only"
    return "a2a", kv_plan, "kv_exchange=halo upgraded to a2a: some rank needs keys from beyond its left neighbour"


def _auto_choice(state: RowState, plan: KVPlan, device: torch.device, key: PlanKey) -> tuple[str, str]:
    """``kv_exchange=auto``: the cost model's path for this window or chunk (same on every rank: replicated inputs)."""
    memo = _window_plan(state, key, device)
    if memo.auto_choice is None:
        shape = state.cache.shape or cost.Shape()
        machine = cost.machine_for(device)
        nodes = state.hosts.nodes if state.hosts is not None else None
        options = state.options
        best, reason = cost.choose_auto(
            memo.shard_plan, plan, shape, machine, options.overlap, memo.window, nodes, options.allow_cross_node
        )
        path = best.path
        # the hybrid candidates are those of the row's sub-groups (the same default factorization, batch.py)
        memo.auto_choice = (path, reason)
        # each path's first pick at INFO; mixed rows flip the pick per step, which would flood the log
        if not log_once(
            logger, f"auto-path:{path}", logging.INFO, "%s (first pick of %s; every pick at DEBUG)", reason, path
        ):
            logger.debug("%s", reason)
    return memo.auto_choice


def _window_plan(state: RowState, key: PlanKey, device: torch.device) -> WindowPlan:
    """This rank's plan for a window or ``("chunk", C)``: built once per step from the replicated shard plan."""
    if key not in state.cache.windows:
        window, chunk = (None, key[1]) if isinstance(key, tuple) else (key, None)
        state.cache.windows[key] = build_window_plan(state.shard_plan, state.cp_rank, window, device, chunk)
    return state.cache.windows[key]


def _kv_plan(state: RowState, key: PlanKey = None, device: torch.device | None = None) -> KVPlan:
    """The replicated exchange plan of a window or chunk, computed once per row, reused by every layer and recompute."""
    return _window_plan(state, key, device or state.positions.device).kv_plan()


def _route(state: RowState, device: torch.device, kernel: str | None, variant: AttentionVariant = PLAIN) -> Route:
    """The K/V route of ``variant``'s window or chunk (path, sends, where each group's keys are), built once per row.

    The path and its reason are logged once per process and window when the route is built (never per call).
    """
    window, chunk = variant.window, variant.chunk

    def choose(_: WindowPlan) -> tuple[str, KVPlan | None, str]:
        path, kv_plan, reason = _exchange_path(state, device, plan_key(window, chunk))
        if window is not None:
            reason = f"{reason} (sliding_window={window}: keys inside the window only)"
        if chunk is not None:
            reason = f"{reason} (attention_chunk_size={chunk}: keys of the query's own chunk only)"
        log_once(
            logger,
            f"kv-path:{variant.plan_key}",
            logging.INFO,
            "block-diagonal CP: KV exchange path=%s (%s); kernel=%s; cp_size=%d local_len=%d",
            path,
            reason,
            kernel,
            state.cp_size,
            state.local_len,
        )
        return path, kv_plan, reason

    return _window_plan(state, plan_key(window, chunk), device).route(choose)


def _kernel_for(
    state: RowState, query: torch.Tensor, value: torch.Tensor, dropout_p: float, variant: AttentionVariant
) -> tuple[str | None, kernels.KernelUnavailableError | None]:
    """The concrete kernel for this call, or why the requested one cannot run; memoized per step.

    An explicit kernel that cannot run (also one that cannot express the call's
    window, soft-cap or sinks) is never replaced: the error travels into the step
    agreement (so every rank raises together) and is raised after it. A variant
    first seen after the agreement raises on every rank as well: the variant
    comes from the model, the same on every rank.
    """
    key = (str(query.dtype), str(query.device), query.shape[3], value.shape[3], dropout_p > 0, variant.key)
    if key not in state.cache.kernel:
        try:
            name = kernels.select_kernel(
                state.options.attn_backend,
                query.dtype,
                query.device,
                head_dim=query.shape[3],
                value_head_dim=value.shape[3],
                dropout_p=dropout_p,
                variant=variant,
                libraries=state.libraries,
            )
            state.cache.kernel[key] = (name, None)
        except kernels.KernelUnavailableError as exc:
            state.cache.kernel[key] = (None, exc)
    return state.cache.kernel[key]


def _agreement_fields(
    state: RowState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: str,
    route: Route,
    variant: AttentionVariant = PLAIN,
) -> dict[str, Any]:
    """What every CP rank of a row must agree on: every setting, resolved kernel, path and layout, lengths, shapes.

    Every field of :class:`~.options.CPOptions` but the caller's cost-model hint ``attn_shape`` (its effect,
    the resolved layout, is agreed): a new setting is agreed without touching this function. The q/k/v
    shapes are the call's with the row's local length (the rows of one step differ only there).
    """
    shard_plan = state.shard_plan
    settings = {f.name: getattr(state.options, f.name) for f in dataclasses.fields(state.options)}
    del settings["attn_shape"]
    length = state.local_len
    return {
        "cp_size": state.cp_size,
        "sequence length": shard_plan.runs.total_len,
        "local length": length,
        **settings,
        "resolved kernel": kernel,
        "resolved kv path": route.path,
        "resolved layout": shard_plan.layout,
        "document layout": (shard_plan.runs.starts, shard_plan.runs.ends, shard_plan.pieces),
        "attention variant": tuple(variant.features()),
        "query/key/value shapes and dtype": (
            (*query.shape[:2], length, query.shape[3]),
            (*key.shape[:2], length, key.shape[3]),
            (*value.shape[:2], length, value.shape[3]),
            str(query.dtype),
        ),
    }


def _row_fields(
    row: RowState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    variant: AttentionVariant,
    shape: cost.Shape,
) -> dict[str, Any]:
    """:func:`_agreement_fields` of ``row`` for this call's q/k/v (the row's kernel and route decided now)."""
    if row.cache.shape is None:  # the step's rows run one model: the first call's shape is every row's
        row.cache.shape = shape
    kernel, unavailable = _kernel_for(row, query, value, dropout_p, variant)
    route = _route(row, query.device, kernel, variant)
    return _agreement_fields(row, query, key, value, kernel or f"unavailable: {unavailable}", route, variant)


def _agree_on_rows(
    state: RowState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    variant: AttentionVariant,
) -> None:
    """At the optimizer step's first CP call: every rank must run the same configuration on the same rows.

    One all-reduce for all rows of the step (``state.agreement``: ``grad_accum`` rows, or this row
    alone), before any path-dependent collective, so a disagreement (a rank with different
    options, kernel availability, exchange path, sequence length, document layout or q/k/v shape,
    in any of the rows, or a different number of rows) makes every rank raise the same error
    instead of hanging in mismatched collectives. Later calls are not re-checked: their kernel
    and path were decided here from the same replicated inputs (a rank whose shapes change
    mid-step while its peers' do not is not detected).
    """
    scope = state.agreement
    if scope.agreed:
        return
    if state.cp_size > 1:
        shape = state.cache.shape or cost.Shape()
        rows = [_row_fields(row, query, key, value, dropout_p, variant, shape) for row in scope.rows]
        # the same field names on every rank, whatever its number of rows: a collective of one size
        fields = rows[0] if len(rows) == 1 else {name: tuple(row[name] for row in rows) for name in rows[0]}
        consensus.check_agreement({**fields, "rows agreed at once": len(rows)}, state.group, query.device)
    scope.agreed = True


def _run_group(
    group: AttentionGroup, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: KernelCall
) -> torch.Tensor:
    """Guarded kernel call on the group's queries and packed keys/values, in the kernel's format."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: AttentionVariant) -> torch.Tensor:
        return kernels.attend_packed(call.kernel, q, k, v, group.meta, call.scale, call.dropout_p, variant)

    return call.guarded(run, group.label, query, key, value)


def _attend(
    state: RowState,
    plan: WindowPlan,
    route: Route,
    call: KernelCall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """Exchange K/V and attend every group; local-key groups run while the exchange is in flight.

    Queries, keys and values are packed once into the kernel's format and every group's
    output is written once into the returned tensor (:mod:`.kernel_io`).

    Returns:
        ``[1, Hq, L, Dv]`` in local row order (a view of a token-major buffer); padding rows are zero.
    """
    layout = kernels.KERNELS[call.kernel].layout
    local = (row_views(key, route.local_spans), row_views(value, route.local_spans))
    op: ExchangeOp | None = None
    token = received = None
    if state.cp_size > 1:
        op = route.new_op(state.group, state.cp_rank, state.cp_size)
        op.after_backward = functools.partial(_after_backward, state, call.recorder, query.device)
        token = exchange.post(exchange.send_buffer(key, value, local, route.send_chunks), op)
        if not state.options.overlap:
            received = exchange.wait(token, op)
    remote: exchange.Received | None = None
    rows = [group.rows for group in plan.groups]
    queries, padding = kernel_io.query_parts(query, rows, plan.segments.n_real, layout)
    outputs = []
    for group, q, runs in zip(plan.groups, queries, route.sources):  # local group first: needs nothing received
        if not group.local and remote is None:
            received = received if received is not None else exchange.wait(token, op)
            remote = exchange.split_received(received, key, value, route.received_cuts)
        k, v = (
            kernel_io.pack_keys(exchange.chunks_in_order(mine, theirs, runs), layout)
            for mine, theirs in zip(local, (None, None) if remote is None else (remote.keys, remote.values))
        )
        outputs.append(_run_group(group, q, k, v, call))
    if op is not None and received is None:
        received = exchange.wait(token, op)
    # kept in the graph with zero gradients: the padding queries (every rank's query gets a gradient), the
    # exchange (its backward runs on every rank, also one whose groups need nothing received) and the sinks
    # (an empty padding slice is left out: its zero gradient would cost a query-sized zero fill and sum)
    deps = [
        *([padding] if padding.shape[2] or not outputs else []),
        *([] if received is None else [exchange.anchor_like(1, 1, received if remote is None else remote.anchor)]),
        *call.variant.tensors,
    ]
    shape = (query.shape[2], query.shape[1], value.shape[3])
    out = kernel_io.unpack(outputs, rows, layout, query, shape, *deps)
    if op is not None:
        state.stats.exchange_wait_s += op.wait_s
        state.stats.exchange_calls += 1
    if op is not None and consensus.saved_tensor_hooks_active():  # checkpointed: one recompute, same on every rank
        out = exchange.recompute_fence(out)
    return out


def _after_backward(state: RowState, recorder: CallRecorder, device: torch.device, op: ExchangeOp) -> None:
    """Runs when a layer's reverse exchange completed: account its wait (and, per call, agree on failures)."""
    state.stats.exchange_backward_wait_s += op.backward_wait_s
    if state.options.consensus == "call":
        _settle_call(state, recorder, "backward", device)


def _settle_call(state: RowState, recorder: CallRecorder, direction: str, device: torch.device) -> None:
    """``consensus="call"``: after this call's ``direction``, agree whether it failed anywhere; if so all raise."""
    failed_here = recorder.failed(direction)
    diagnostic = "; ".join(text for call, text in getattr(state.failures, direction) if call == recorder.call)
    sentinel = None if failed_here else torch.empty(0)
    if not _needed_only_kernel_succeeded_on_all_ranks(sentinel, state.group, device, diagnostic):
        consensus.settle_failures([state.failures], state.group, device)  # names every failing rank, then raises


def attend_row(
    state: RowState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    variant: AttentionVariant = PLAIN,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The core: one attention call of the packed row ``state`` (its metadata and knobs passed in, as arguments).

    K/V are exchanged over the row's CP group and each local query attends the keys of its own
    document up to itself (inside ``variant.window`` or ``variant.chunk``, with its soft-cap and sinks).
    Reads no process-wide state: the row's build gathered the group's hosts and probed the GPU
    libraries; the kernel, the route and the agreement are decided once per row (and call signature).

    Args:
        state: The packed row's state (``train_ctx()`` of
            :func:`~nemo_automodel.components.distributed.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx`).
        query: Local queries ``[1, Hq, L, D]``.
        key: Local keys ``[1, Hkv, L, D]`` (``Hq % Hkv == 0``).
        value: Local values ``[1, Hkv, L, Dv]`` (``Dv`` may differ from ``D``: MLA models).
        variant: Sliding window, attention chunk, logit soft-cap and attention sinks (plain causal by default).
        dropout_p: Attention dropout probability.
        scale: Softmax scale (``None``: ``D ** -0.5``).
        enable_gqa: Must be True when ``Hq != Hkv`` (as for stock SDPA).

    Returns:
        ``[1, Hq, L, Dv]``; padding rows are zero.

    Raises:
        RuntimeError: on every rank, when the row agreement fails, or (``consensus="call"``)
            when a kernel failed on any rank. With the default ``consensus="step"`` kernel
            failures are raised on every rank when the row's context exits (or by the
            recipe's step all-reduce).
        ValueError: on every rank, when the requested kernel cannot run (or cannot
            express the variant) on some rank; before any collective, for bad inputs.
    """
    kernels.validate_qkv(query, key, value, enable_gqa, state.local_len, variant)
    call = state.stats.calls
    state.stats.calls += 1
    if state.options.check_finite:  # device-side flags, read once per step: no host sync per layer
        # An fp32 sum is non-finite exactly when some element is (activations never reach 3e38), and it
        # is one read of each tensor instead of an element-wise mask and a reduction.
        sums = [t.detach().sum(dtype=torch.float32) for t in (query, key, value)]
        state.cache.finite.append(torch.stack(sums).isfinite())
    if state.cache.shape is None:
        state.cache.shape = cost.Shape(query.shape[1], key.shape[1], query.shape[3], query.element_size())
    kernel, unavailable = _kernel_for(state, query, value, dropout_p, variant)
    route = _route(state, query.device, kernel, variant)
    _agree_on_rows(state, query, key, value, dropout_p, variant)
    if unavailable is not None:  # every rank agreed that it cannot run: all raise here, together
        raise unavailable
    window_plan = state.cache.windows[variant.plan_key]
    recorder = CallRecorder(state.failures, call)
    kernel_call = KernelCall(kernel, scale, dropout_p, variant, recorder)
    _record_stats(state, window_plan, route, kernel, key, value)  # the head paths refine it with what they moved
    # every path's last backward node settles the call's failures with consensus="call" (_after_backward)
    after_backward = functools.partial(_after_backward, state, recorder, query.device)
    if route.path == "ulysses":
        out = ulysses.attend(state, kernel_call, query, key, value, after_backward)
    elif route.path in SEQUENCE_PART:
        out = _attend_hybrid(state, route.path, kernel_call, query, key, value, after_backward)
    else:
        out = _attend(state, window_plan, route, kernel_call, query, key, value)
    if state.options.consensus == "call":
        _settle_call(state, recorder, "forward", query.device)
    return out


def _attend_hybrid(
    state: RowState,
    path: str,
    call: KernelCall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    after_backward: Callable[[ExchangeOp], None],
) -> torch.Tensor:
    """``kv_exchange="ulysses+*"`` (:mod:`.hybrid`): head all-to-all, the sequence part's :func:`_attend`, back.

    Args:
        state: The row's state (its hybrid sub-groups were created when it was built).
        path: ``ulysses+halo``, ``ulysses+a2a`` or ``ulysses+allgather`` (configured, or ``auto``'s pick).
        call: The kernel call (sinks ``[Hq]``: the sequence part runs with this rank's heads' slice).
        query: Local queries ``[1, Hq, L, D]``; ``key`` ``[1, Hkv, L, D]``, ``value`` ``[1, Hkv, L, Dv]``.
        after_backward: Runs once the head group's reverse q/k/v all-to-all (the call's last backward node) completed.

    Returns:
        ``[1, Hq, L, Dv]`` in local row order; padding rows are zero.
    """
    groups, sequence = state.hybrid, hybrid.sequence_row(state, path)
    plan = hybrid.head_plan(state, query.shape[1], key.shape[1])
    start, stop = plan.split.query[groups.head_rank]
    variant = call.variant
    if variant.sinks is not None:
        variant = dataclasses.replace(variant, sinks=variant.sinks[start:stop])
    route = _route(sequence, query.device, call.kernel, variant) if start < stop else None

    def inner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's heads ``[1, nq, h L, D]`` of the head group's rows: the sequence group's attention."""
        if route is None:  # no head in this sequence group (Hq < h): none of its members exchanges anything
            return kernels.zeros_attached(q, k, v, *variant.tensors, width=v.shape[3])
        window_plan = sequence.cache.windows[variant.plan_key]
        return _attend(sequence, window_plan, route, dataclasses.replace(call, variant=variant), q, k, v)

    group, rank, stats = groups.head_group, groups.head_rank, state.stats
    out = ulysses.exchange_heads(group, rank, plan, state.local_len, query, key, value, inner, stats, after_backward)
    dims = (query.shape[3], value.shape[3], query.element_size())
    hybrid.record_stats(state, path, plan, route, variant.plan_key, *dims)
    return out


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: AttentionVariant | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Block-diagonal CP drop-in for ``scaled_dot_product_attention``: :func:`attend_row` of the active row.

    The active row is the one whose ``train_ctx()`` (of
    :func:`~nemo_automodel.components.distributed.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx`)
    is open, read from the thread-shared slot. Inside it, ``attn_mask`` and ``is_causal`` are ignored
    (attention is per-document causal). Without an active row this is stock SDPA with every argument
    forwarded (:func:`.outside.stock_sdpa`, the policy shared with ``packed_varlen_sdpa``).

    Args:
        query: Local queries ``[1, Hq, L, D]``.
        key: Local keys ``[1, Hkv, L, D]`` (``Hq % Hkv == 0``).
        value: Local values ``[1, Hkv, L, Dv]``.
        attn_mask: Ignored inside a row.
        dropout_p: Attention dropout probability.
        is_causal: Ignored inside a row.
        scale: Softmax scale (``None``: ``D ** -0.5``).
        enable_gqa: Must be True when ``Hq != Hkv`` (as for stock SDPA).
        variant: Sliding window, soft-cap and attention sinks (``None``: plain causal). Stock SDPA
            cannot express them, so outside a row a non-plain variant raises.
        **kwargs: Forwarded to stock SDPA outside a row; inside one any of them is an error.

    Returns:
        ``[1, Hq, L, Dv]``; padding rows are zero.

    Raises:
        TypeError: for a keyword argument the row cannot honour.
        ValueError / RuntimeError: as :func:`attend_row`; outside a row, for a non-plain variant.
    """
    variant = variant or PLAIN
    state = state_module.current_row_state()
    if state is None:
        remedy = (
            "call it inside the step context of make_cp_blockdiag_batch_and_ctx, or use the model's own (eager) "
            "attention outside training"
        )
        call = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, kwargs)
        return outside.stock_sdpa("cp_blockdiag_sdpa outside a CP step", remedy, *call)
    outside.refuse_keywords("cp_blockdiag_sdpa inside a CP step", kwargs)
    return attend_row(
        state, query, key, value, variant=variant, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )


def _record_stats(
    state: RowState, window_plan: WindowPlan, route: Route, kernel: str, key: torch.Tensor, value: torch.Tensor
) -> None:
    """What this call did, for :func:`exchange_stats` (host ints only)."""
    stats = state.stats
    stats.path, stats.reason, stats.attn_backend = route.path, route.reason, kernel
    stats.kv_tokens_received = route.received_tokens
    row_bytes = key.shape[1] * (key.shape[3] + value.shape[3]) * key.element_size()
    stats.kv_bytes_received = route.received_tokens * row_bytes
    stats.windows[plan_key(window_plan.window, window_plan.chunk)] = (
        route.path,
        route.received_tokens,
        window_plan.segments.remote_kv_tokens,
    )


def attention_inputs_nonfinite(rows: Sequence[RowState], device: torch.device) -> torch.Tensor:
    """Device scalar ``float64``: did any CP attention call of ``rows`` see NaN/Inf in q, k or v (no host sync).

    For a caller that folds the flag into its own step all-reduce (``check_finite=True`` records it per call).
    """
    flags = [flag for row in rows for flag in row.cache.finite]
    if not flags:
        return torch.zeros((), dtype=torch.float64, device=device)
    return (~torch.stack(flags).all()).double()


def nonfinite_attention_inputs(state: RowState | None = None) -> list[str]:
    """Which CP attention calls of the step saw NaN/Inf in q, k or v (one host sync for the whole step).

    Args:
        state: The row state (default: the active one). Calls are numbered in
            execution order (activation-checkpoint recompute calls count again).

    Returns:
        One line per offending call, e.g. ``"CP attention call 3: key, value"``; empty when all are finite.
    """
    state = state or state_module.current_row_state()
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
    recompute calls SDPA again). Outside a row state the patched function is
    stock SDPA, so other attention in the process is unaffected; the previous
    function is restored on exit, also on exceptions.
    """
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = cp_blockdiag_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
