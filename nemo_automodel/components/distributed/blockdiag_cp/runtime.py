"""The SDPA entry point and the collective-safe path decisions.

:func:`cp_blockdiag_sdpa` replaces ``torch.nn.functional.scaled_dot_product_attention``.
Outside a row's context it *is* stock SDPA. Inside one it exchanges the needed K/V
over the CP group and runs each attention group's local queries against its packed
keys with a varlen kernel (per-document, bottom-right causal), from metadata built on
the host out of the replicated shard plan (:mod:`.metadata`): no mask is built per call.

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
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_automodel.components.distributed.blockdiag_cp import consensus, cost, exchange, kernels, options, topology
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.consensus import CallRecorder, group_size
from nemo_automodel.components.distributed.blockdiag_cp.exchange import ExchangeOp, KVPlan, Route
from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.metadata import AttentionGroup, WindowPlan, build_window_plan
from nemo_automodel.components.distributed.blockdiag_cp.rows import cat_rows, split_rows
from nemo_automodel.components.distributed.blockdiag_cp.state import StepState
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant, PlanKey, plan_key

logger = logging.getLogger(__name__)

# Torch's SDPA as imported, before any patch can replace the module attribute.
_ORIGINAL_SDPA = F.scaled_dot_product_attention


def exchange_stats(state: StepState | None = None) -> dict[str, Any] | None:
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
        ``exchange_backward_wait_s`` and ``exchange_calls``.
    """
    state = state or state_module.last_step_state()
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
    }


def reset_exchange_stats(state: StepState | None = None) -> None:
    """Zero the time blocked on exchanges of ``state`` (default: the active or last step)."""
    state = state or state_module.last_step_state()
    if state is not None:
        state.stats.exchange_wait_s = state.stats.exchange_backward_wait_s = 0.0
        state.stats.exchange_calls = 0


def _cp_group_spans_nodes(group: dist.ProcessGroup | None, allow_cross_node: bool) -> bool:
    """True when the CP group's ranks run on more than one host (their real hostnames) and that disables needed-only.

    Needed-only exchanges are point-to-point messages between any two CP ranks; those
    between nodes pay the inter-node link's latency and bandwidth, so they are disabled
    (the reason logged once per process) and all-gather is used, unless ``allow_cross_node``
    (``CPOptions.allow_cross_node``, from ``NEMO_CP_ALLOW_XNODE=1`` when the options were built).
    The hostnames are gathered once per group (:mod:`.topology`: at mesh build in the
    recipe, else at the first call, which every CP rank reaches at the same point).
    """
    where = topology.group_hosts(group)
    if not where.spans_nodes:
        return False
    log_once(
        logger,
        "cp-group-spans-nodes",
        logging.WARNING,
        "the CP group spans nodes (%s): %s",
        where.describe(),
        "NEMO_CP_ALLOW_XNODE=1 keeps needed-only K/V exchanges across nodes"
        if allow_cross_node
        else "needed-only K/V exchange disabled (its point-to-point messages between nodes would cross the "
        "inter-node link); using all-gather. Set NEMO_CP_ALLOW_XNODE=1 to force needed-only exchange across nodes.",
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


def _resolve_cp_varlen_config(state: StepState | Mapping[str, Any]) -> tuple[str, str]:
    """``(attn_backend, kv_exchange)`` for this step.

    A step state carries its options; a mapping (the seed API's dict state) falls
    back to the process default for a missing or ``None`` knob.
    """
    if isinstance(state, StepState):
        return state.options.attn_backend, state.options.kv_exchange
    default = state_module.default_options()
    backend, kv_exchange = state.get("attn_backend"), state.get("kv_exchange")
    return (
        default.attn_backend if backend is None else options.normalize_attn_backend(backend),
        default.kv_exchange if kv_exchange is None else options.normalize_kv_exchange(kv_exchange),
    )


def _select_kv_exchange_path(
    state: StepState,
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
    """Decide this step's K/V path and say why (no communication: every input is replicated).

    Args:
        state: The active step state (memoizes the plan and ``auto``'s choice).
        group: The CP process group.
        doc_ids: Replicated document ids ``[B, S_full]`` (0 == pad).
        local_len: Local rows ``L``.
        device: Device of the attention inputs (picks ``auto``'s machine model).
        offset: Global position of this rank's first local row.
        query_dtype: Kept for the seed signature; whether the kernel can run is part of the
            step agreement check, which makes every rank raise together when it cannot.
        dropout_p: Kept for the seed signature (dropout never changes the path).
        window: The calls' sliding window (``None``: full causal); each window has its own plan.
        chunk: The calls' attention chunk size (``None``: unchunked); each chunk size has its own plan.

    Returns:
        ``(path, plan, reason)``: ``path`` is ``"halo"``, ``"a2a"`` or
        ``"allgather"``; ``plan`` is the memoized :class:`KVPlan` for the
        needed-only paths (``None`` for all-gather); ``reason`` names the cause.
    """
    del doc_ids, query_dtype, dropout_p  # the plan comes from the state's shard plan (the same ids)
    _, kv_exchange = _resolve_cp_varlen_config(state)
    if offset != state.row_offset:
        raise ValueError(f"offset={offset} disagrees with the step state's row_offset={state.row_offset}")
    if local_len != state.local_len:
        raise ValueError(f"local_len={local_len} disagrees with the step state's local_len={state.local_len}")
    if group_size(group) == 1:
        return "allgather", None, "cp_size=1: nothing to exchange"
    if kv_exchange == "allgather":
        return "allgather", None, "kv_exchange=allgather (configured)"
    if _cp_group_spans_nodes(group, state.options.allow_cross_node):
        return "allgather", None, "CP group spans nodes (set NEMO_CP_ALLOW_XNODE=1 to force needed-only)"
    key = plan_key(window, chunk)
    plan = _kv_plan(state, key, device)
    if kv_exchange == "auto":
        path, reason = _auto_choice(state, plan, device, key)
        return path, None if path == "allgather" else plan, reason
    if kv_exchange == "a2a":
        return "a2a", plan, "kv_exchange=a2a (configured)"
    if plan.use_halo:
        return "halo", plan, "kv_exchange=halo: every rank needs remote keys from its left neighbour only"
    return "a2a", plan, "kv_exchange=halo upgraded to a2a: some rank needs keys from beyond its left neighbour"


def _auto_choice(state: StepState, plan: KVPlan, device: torch.device, key: PlanKey) -> tuple[str, str]:
    """``kv_exchange=auto``: the cost model's path for this window or chunk (same on every rank: replicated inputs)."""
    memo = _window_plan(state, key, device)
    if memo.auto_choice is None:
        shape = state.cache.shape or cost.Shape()
        machine = cost.machine_for(device)
        path, reason, _ = cost.choose(memo.shard_plan, plan, shape, machine, state.options.overlap, memo.window)
        memo.auto_choice = (path, reason)
        # each path's first pick at INFO; mixed rows flip the pick per step, which would flood the log
        if not log_once(
            logger, f"auto-path:{path}", logging.INFO, "%s (first pick of %s; every pick at DEBUG)", reason, path
        ):
            logger.debug("%s", reason)
    return memo.auto_choice


def _window_plan(state: StepState, key: PlanKey, device: torch.device) -> WindowPlan:
    """This rank's plan for a window or ``("chunk", C)``: built once per step from the replicated shard plan."""
    if key not in state.cache.windows:
        window, chunk = (None, key[1]) if isinstance(key, tuple) else (key, None)
        state.cache.windows[key] = build_window_plan(state.shard_plan, state.cp_rank, window, device, chunk)
    return state.cache.windows[key]


def _kv_plan(state: StepState, key: PlanKey = None, device: torch.device | None = None) -> KVPlan:
    """The replicated exchange plan of a window or chunk, computed once per row, reused by every layer and recompute."""
    return _window_plan(state, key, device or state.positions.device).kv_plan()


def _route(state: StepState, device: torch.device, window: int | None = None, chunk: int | None = None) -> Route:
    """The K/V route of the calls of ``window`` or ``chunk`` (path, sends, where each group's keys are), built once."""

    def choose(_: WindowPlan) -> tuple[str, KVPlan | None, str]:
        if state.cp_size > 1:  # before any knob decides anything: every rank takes part in the (one-time) gather
            topology.group_hosts(state.group)
        path, plan, reason = _select_kv_exchange_path(
            state, state.group, state.doc_ids, state.local_len, device, state.row_offset, window=window, chunk=chunk
        )
        if window is not None:
            reason = f"{reason} (sliding_window={window}: keys inside the window only)"
        if chunk is not None:
            reason = f"{reason} (attention_chunk_size={chunk}: keys of the query's own chunk only)"
        return path, plan, reason

    return _window_plan(state, plan_key(window, chunk), device).route(choose)


def _kernel_for(
    state: StepState, query: torch.Tensor, value: torch.Tensor, dropout_p: float, variant: AttentionVariant
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
            )
            state.cache.kernel[key] = (name, None)
        except kernels.KernelUnavailableError as exc:
            state.cache.kernel[key] = (None, exc)
    return state.cache.kernel[key]


def _agreement_fields(
    state: StepState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: str,
    route: Route,
    variant: AttentionVariant = PLAIN,
) -> dict[str, Any]:
    """What every CP rank of a row must agree on: every setting, resolved kernel, path and layout, lengths, shapes.

    Every field of :class:`~.options.CPOptions` but the caller's cost-model hint ``attn_shape`` (its effect,
    the resolved layout, is agreed): a new setting is agreed without touching this function.
    """
    plan = state.shard_plan
    settings = {f.name: getattr(state.options, f.name) for f in dataclasses.fields(state.options)}
    del settings["attn_shape"]
    return {
        "cp_size": state.cp_size,
        "sequence length": plan.runs.total_len,
        "local length": state.local_len,
        **settings,
        "resolved kernel": kernel,
        "resolved kv path": route.path,
        "resolved layout": plan.layout,
        "document layout": (plan.runs.starts, plan.runs.ends, plan.pieces),
        "attention variant": tuple(variant.features()),
        "query/key/value shapes and dtype": (
            tuple(query.shape),
            tuple(key.shape),
            tuple(value.shape),
            str(query.dtype),
        ),
    }


def _agree_on_step(
    state: StepState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: str,
    route: Route,
    variant: AttentionVariant,
) -> None:
    """On the step's first call: every rank must run the same configuration on the same layout.

    One all-reduce, before any path-dependent collective, so a disagreement (a
    rank with different options, kernel availability, exchange path, sequence
    length, document layout or q/k/v shape) makes every rank raise the same
    error instead of hanging in mismatched collectives. Later calls are not
    re-checked (a rank whose shapes change mid-step while its peers' do not is
    not detected).
    """
    if state.cache.agreed or state.cp_size == 1:
        return
    fields = _agreement_fields(state, query, key, value, kernel, route, variant)
    consensus.check_step_agreement(fields, state.group, query.device)
    state.cache.agreed = True


def _run_group(
    group: AttentionGroup,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: str,
    recorder: CallRecorder,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
) -> torch.Tensor:
    """Guarded kernel call on the group's rows ``query [1, Hq, n_rows, D]`` over its packed ``[1, Hkv, K, D]`` keys."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *sinks: torch.Tensor) -> torch.Tensor:
        # the guard hands in its own (detached) sinks: their gradient flows through it
        call_variant = dataclasses.replace(variant, sinks=sinks[0]) if sinks else variant
        return kernels.blockdiag_attention(kernel, q, k, v, group.meta, scale, dropout_p, call_variant)

    describe = f"kernel={kernel} {group.label}"
    return consensus.guarded(attend, recorder, describe, query, key, value, *variant.tensors)


def _query_parts(plan: WindowPlan, query: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each group's query rows ``[1, Hq, n_g, D]`` and the padding rows, in group order.

    One token-major ``split`` when every group's rows are contiguous (they then tile the
    real rows in order; the layout orders them so): autograd fills one zero gradient for it,
    not one per slice, and joins the groups' gradients in the model's layout.
    """
    n_real = plan.segments.n_real
    if all(isinstance(group.rows, tuple) for group in plan.groups):
        sizes = [group.rows[1] - group.rows[0] for group in plan.groups]
        padding = query.shape[2] - n_real
        parts = split_rows(query, [*sizes, padding] if padding else sizes)
        return list(parts[: len(sizes)]), parts[-1] if padding else query[:, :, n_real:]
    return [group.take_rows(query) for group in plan.groups], query[:, :, n_real:]


def _attend(
    state: StepState,
    plan: WindowPlan,
    route: Route,
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
    recorder: CallRecorder,
) -> torch.Tensor:
    """Exchange K/V and attend every group; local-key groups run while the exchange is in flight.

    Returns:
        ``[1, Hq, L, Dv]`` in local row order; padding rows are zero.
    """
    local = (split_rows(key, route.local_cuts), split_rows(value, route.local_cuts))
    op: ExchangeOp | None = None
    token = received = None
    if state.cp_size > 1:
        op = route.new_op(state.group, state.cp_rank, state.cp_size)
        op.after_backward = functools.partial(_after_backward, state, recorder, query.device)
        token = exchange.post(exchange.send_buffer(key, value, local, route.send_chunks), op)
        if not state.options.overlap:
            received = exchange.wait(token, op)
    remote: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
    queries, padding = _query_parts(plan, query)
    outputs = []
    for group, q, runs in zip(plan.groups, queries, route.sources):  # local group first: needs nothing received
        if not group.local and remote is None:
            received = received if received is not None else exchange.wait(token, op)
            remote = exchange.split_received(received, key, value, route.received_cuts)
        k = exchange.assemble(key, local[0], None if remote is None else remote[0], runs)
        v = exchange.assemble(value, local[1], None if remote is None else remote[1], runs)
        outputs.append(_run_group(group, q, k, v, kernel, recorder, scale, dropout_p, variant))
    if op is not None and received is None:
        received = exchange.wait(token, op)
    parts = [] if received is None else [exchange.anchor_like(query.shape[1], value.shape[3], received)]
    if padding.shape[2] or not outputs:
        # keeps sinks in the graph on a rank with no real rows: its (zero) gradient is defined on every rank
        outputs.append(kernels.zeros_attached(padding, *variant.tensors, width=value.shape[3]))
    parts += outputs
    out = cat_rows(parts)  # token-major: the model reads it back through transpose(1, 2) without a copy
    if plan.merge_index is not None:
        out = out.index_select(2, plan.merge_index)
    if op is not None:
        state.stats.exchange_wait_s += op.wait_s
        state.stats.exchange_calls += 1
    if state.options.consensus == "call":
        _settle_call(state, recorder, "forward", query.device)
    return out


def _after_backward(state: StepState, recorder: CallRecorder, device: torch.device, op: ExchangeOp) -> None:
    """Runs when a layer's reverse exchange completed: account its wait (and, per call, agree on failures)."""
    state.stats.exchange_backward_wait_s += op.backward_wait_s
    if state.options.consensus == "call":
        _settle_call(state, recorder, "backward", device)


def _settle_call(state: StepState, recorder: CallRecorder, direction: str, device: torch.device) -> None:
    """``consensus="call"``: after this call's ``direction``, agree whether it failed anywhere; if so all raise."""
    failed_here = recorder.failed(direction)
    diagnostic = "; ".join(text for call, text in getattr(state.failures, direction) if call == recorder.call)
    sentinel = None if failed_here else torch.empty(0)
    if not _needed_only_kernel_succeeded_on_all_ranks(sentinel, state.group, device, diagnostic):
        consensus.settle_step([state.failures], state.group, device)  # names every failing rank, then raises


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
    """Block-diagonal context-parallel drop-in for ``scaled_dot_product_attention``.

    Without an active step state this is stock SDPA with every argument
    forwarded. Inside the context of
    :func:`~nemo_automodel.components.distributed.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx`,
    K/V are exchanged over the CP group and each local query attends the keys
    of its own document up to itself (inside ``variant.window``, with its
    soft-cap and sinks); ``attn_mask`` and ``is_causal`` are ignored.

    Args:
        query: Local queries ``[1, Hq, L, D]``.
        key: Local keys ``[1, Hkv, L, D]`` (``Hq % Hkv == 0``).
        value: Local values ``[1, Hkv, L, Dv]`` (``Dv`` may differ from ``D``: MLA models).
        attn_mask: Ignored on the CP path.
        dropout_p: Attention dropout probability.
        is_causal: Ignored on the CP path (attention is always per-document causal).
        scale: Softmax scale (``None``: ``D ** -0.5``).
        enable_gqa: Must be True when ``Hq != Hkv`` (as for stock SDPA).
        variant: Sliding window, logit soft-cap and attention sinks
            (:class:`~nemo_automodel.components.distributed.blockdiag_cp.variant.AttentionVariant`;
            ``None``: plain causal). Stock SDPA cannot express them, so outside a CP
            step a non-plain variant raises.
        **kwargs: Forwarded to stock SDPA outside CP; inside a CP step any of them is an error.

    Returns:
        ``[1, Hq, L, Dv]``; padding rows are zero.

    Raises:
        RuntimeError: on every rank, when the step agreement fails, or (``consensus="call"``)
            when a kernel failed on any rank. With the default ``consensus="step"`` kernel
            failures are raised on every rank when the step's context exits (or by the
            recipe's step all-reduce).
        ValueError: on every rank, when the requested kernel cannot run (or cannot
            express the variant) on some rank; before any collective, for bad inputs.
        TypeError: for a keyword argument the CP path cannot honour.
    """
    variant = variant or PLAIN
    state = state_module.current_step_state()
    if state is None:
        if not variant.plain:
            raise ValueError(
                f"cp_blockdiag_sdpa outside a CP step: {', '.join(map(variant.describe, variant.features()))} "
                "cannot be expressed by torch's scaled_dot_product_attention; call it inside the step context "
                "of make_cp_blockdiag_batch_and_ctx, or use the model's own (eager) attention outside training"
            )
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
    if kwargs:
        raise TypeError(
            "cp_blockdiag_sdpa inside a CP step got keyword argument(s) it cannot honour: "
            f"{', '.join(sorted(kwargs))}; "
            "pass a sliding window, soft-cap or sinks as variant=AttentionVariant(...)"
        )
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
    route = _route(state, query.device, variant.window, variant.chunk)
    _agree_on_step(state, query, key, value, kernel or f"unavailable: {unavailable}", route, variant)
    if unavailable is not None:  # every rank agreed that it cannot run: all raise here, together
        raise unavailable
    log_once(
        logger,
        f"kv-path:{variant.plan_key}",
        logging.INFO,
        "block-diagonal CP: KV exchange path=%s (%s); kernel=%s; cp_size=%d local_len=%d",
        route.path,
        route.reason,
        kernel,
        state.cp_size,
        state.local_len,
    )
    plan = state.cache.windows[variant.plan_key]
    recorder = CallRecorder(state.failures, call)
    out = _attend(state, plan, route, kernel, query, key, value, scale, dropout_p, variant, recorder)
    _record_stats(state, plan, route, kernel, key, value)
    return out


def _record_stats(
    state: StepState, plan: WindowPlan, route: Route, kernel: str, key: torch.Tensor, value: torch.Tensor
) -> None:
    """What this call did, for :func:`exchange_stats` (host ints only)."""
    stats = state.stats
    stats.path, stats.reason, stats.attn_backend = route.path, route.reason, kernel
    stats.kv_tokens_received = route.received_tokens
    row_bytes = key.shape[1] * (key.shape[3] + value.shape[3]) * key.element_size()
    stats.kv_bytes_received = route.received_tokens * row_bytes
    stats.windows[plan_key(plan.window, plan.chunk)] = (
        route.path,
        route.received_tokens,
        plan.segments.remote_kv_tokens,
    )


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
