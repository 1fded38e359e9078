"""Head-parallel CP (DeepSpeed-Ulysses): ``kv_exchange="ulysses"``.

Needed-only exchange moves keys; head-parallel CP moves heads. One all-to-all turns
every rank's ``[L, H, D]`` shard of q, k and v (any layout) into the whole row for a
subset of heads (:mod:`.heads`: near-equal query head ranges, K/V heads replicated
where query heads of several ranks read them); the row's block-diagonal attention then
runs with the kernel a single rank would use (the cp=1 metadata, every kernel of the
registry, every variant: windows, chunks and soft-caps are per row, sinks are per head
and travel with their heads); a second all-to-all returns each rank's rows of every
head. Both all-to-alls are differentiable (the backward is the reverse all-to-all, on
the exchange ops of :mod:`.exchange`), so the gradient of a K/V head read by several
ranks is summed at its owner.

What travels is token-major: for each destination ``d``, this rank's ``L`` rows of
``d``'s heads, ``[L, nq_d D + nkv_d (D + Dv)]`` flattened, so the receiver reads its
q, k and v as views of ``[S_full, F]``. Under the balanced layout the received rows
are in physical order; one ``index_select`` restores the original order before the
kernel (and one more puts the output back).

Failures: the kernel runs guarded (:func:`.consensus.guarded`), so a failure on one
rank yields zeros there, both all-to-alls still run on every rank, and the step's
settlement makes every rank raise. No attention call issues a control collective or
a host sync. Every step of the call needs the received rows, so nothing overlaps the
all-to-alls inside the call (``overlap`` has no effect on this path).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import exchange, kernels
from nemo_automodel.components.distributed.blockdiag_cp.call import KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.exchange import AllToAllOp, ExchangeOp
from nemo_automodel.components.distributed.blockdiag_cp.heads import HeadExchange, RowPlan, build_row_plan
from nemo_automodel.components.distributed.blockdiag_cp.state import RowState, RowStats
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant, PlanKey

# (q [1, nq, S, D], k [1, nkv, S, D], v [1, nkv, S, Dv]) in inner order -> [1, nq, S, Dv] in inner order
InnerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def row_plan(state: RowState, query: torch.Tensor, key: torch.Tensor, variant: AttentionVariant) -> RowPlan:
    """This row's head-parallel plan for the call's heads and window or chunk (built once, reused by every layer)."""
    memo_key = (variant.plan_key, query.shape[1], key.shape[1])
    if memo_key not in state.cache.ulysses:
        state.cache.ulysses[memo_key] = build_row_plan(
            state.shard_plan, query.shape[1], key.shape[1], variant.window, variant.chunk, query.device
        )
    return state.cache.ulysses[memo_key]


def _heads(t: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """Heads ``index`` of a token-major ``[L, H, D]`` view."""
    return t[:, index] if isinstance(index, slice) else t.index_select(1, index)


def _pack_inputs(plan: HeadExchange, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The send buffer ``[sum_d L F_d, 1]``: for each member ``d``, the local rows of its q/k/v heads ``[L, F_d]``."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D] views
    blocks = []
    for (start, stop), kv in zip(plan.split.query, plan.kv_index):
        parts = (q[:, start:stop], _heads(k, kv), _heads(v, kv))
        blocks.append(torch.cat([p.flatten(1) for p in parts], dim=1).flatten())
    return torch.cat(blocks).unsqueeze(1)


def _unpack_inputs(
    plan: HeadExchange, received: torch.Tensor, rank: int, rows: int, head_dim: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This member's heads over the ``rows`` received rows in inner order.

    Returns:
        q ``[1, nq, rows, D]``, k ``[1, nkv, rows, D]``, v ``[1, nkv, rows, Dv]``.
    """
    nq, nkv = plan.split.n_query(rank), len(plan.split.kv[rank])
    table = received.view(rows, -1)  # [n L, F] in physical order
    if plan.to_inner is not None:
        table = table.index_select(0, plan.to_inner)
    q, k, v = table.split([nq * head_dim, nkv * head_dim, nkv * value_dim], dim=1)
    return (
        q.unflatten(1, (nq, head_dim)).transpose(0, 1).unsqueeze(0),
        k.unflatten(1, (nkv, head_dim)).transpose(0, 1).unsqueeze(0),
        v.unflatten(1, (nkv, value_dim)).transpose(0, 1).unsqueeze(0),
    )


def _pack_output(plan: HeadExchange, out: torch.Tensor) -> torch.Tensor:
    """``[1, nq, n L, Dv]`` (inner order) -> ``[n L nq Dv, 1]`` token-major in physical order (member by member)."""
    rows = out[0].transpose(0, 1)  # [n L, nq, Dv]
    rows = rows.index_select(0, plan.to_outer) if plan.to_outer is not None else rows.contiguous()
    return rows.reshape(-1, 1)


def _unpack_output(plan: HeadExchange, returned: torch.Tensor, local_len: int, value_dim: int) -> torch.Tensor:
    """Every member's heads of this rank's rows ``[sum_s L nq_s Dv, 1]`` -> ``[1, Hq, L, Dv]``."""
    sizes = [local_len * plan.split.n_query(s) * value_dim for s in range(plan.split.cp)]
    blocks = [b.view(local_len, -1, value_dim) for b in returned.split(sizes) if b.numel()]
    return torch.cat(blocks, dim=1).transpose(0, 1).unsqueeze(0)


def exchange_heads(
    group: dist.ProcessGroup,
    rank: int,
    plan: HeadExchange,
    local_len: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inner: InnerAttention,
    stats: RowStats,
    after_backward: Callable[[ExchangeOp], None],
) -> torch.Tensor:
    """All-to-all to ``n L`` rows x this member's heads, ``inner`` attention, all-to-all back.

    Args:
        group: The head group (``n`` members; the whole CP group under ``ulysses``).
        rank: This rank in ``group``.
        plan: The head split and the inner row order.
        local_len: Local rows ``L`` of every member.
        query: Local queries ``[1, Hq, L, D]``; ``key`` ``[1, Hkv, L, D]``, ``value`` ``[1, Hkv, L, Dv]``.
        inner: The attention over the received rows (inner order): the cp=1 kernel, or the sequence part.
        stats: Where the time blocked on both all-to-alls is accounted.
        after_backward: Called with the q/k/v exchange op once its reverse all-to-all (the call's last
            backward node) completed.

    Returns:
        ``[1, Hq, L, Dv]`` in local row order.
    """
    members, head_dim, value_dim = plan.split.cp, query.shape[3], value.shape[3]
    widths = [plan.split.width(d, head_dim, value_dim) for d in range(members)]
    sent, received_counts = [local_len * w for w in widths], [local_len * widths[rank]] * members
    inputs = AllToAllOp(group, send_counts=sent, recv_counts=received_counts)
    inputs.after_backward = after_backward  # called with the op: no op -> callback -> op reference cycle
    received = exchange.wait(exchange.post(_pack_inputs(plan, query, key, value), inputs), inputs)
    out = inner(*_unpack_inputs(plan, received, rank, members * local_len, head_dim, value_dim))
    mine = local_len * plan.split.n_query(rank) * value_dim
    theirs = [local_len * plan.split.n_query(s) * value_dim for s in range(members)]
    outputs = AllToAllOp(group, send_counts=[mine] * members, recv_counts=theirs)
    outputs.after_backward = functools.partial(_account_backward, stats)
    returned = exchange.wait(exchange.post(_pack_output(plan, out), outputs), outputs)
    stats.exchange_wait_s += inputs.wait_s + outputs.wait_s
    stats.exchange_calls += 2
    return _unpack_output(plan, returned, local_len, value_dim)


def _account_backward(stats: RowStats, op: ExchangeOp) -> None:
    """The output all-to-all's reverse completed: account the time blocked on it."""
    stats.exchange_backward_wait_s += op.backward_wait_s


def _attend_row(
    plan: RowPlan, rank: int, call: KernelCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Guarded cp=1 kernel over the whole row (original order) for this rank's heads: ``[1, nq, S, Dv]``.

    ``k``/``v`` hold every row; the metadata's key length ``K`` (the real tokens) is what the kernel reads.
    """
    start, stop = plan.split.query[rank]
    variant = call.variant
    if variant.sinks is not None:
        variant = dataclasses.replace(variant, sinks=variant.sinks[start:stop])
    k, v = k[:, :, : plan.meta.kv_len], v[:, :, : plan.meta.kv_len]
    if start == stop:  # no head here (Hq < cp): zeros that keep both all-to-alls' backward on this rank
        return kernels.zeros_attached(q, k, v, *variant.tensors, width=v.shape[3])

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run_variant: AttentionVariant) -> torch.Tensor:
        return kernels.blockdiag_attention(call.kernel, q, k, v, plan.meta, call.scale, call.dropout_p, run_variant)

    return call.guarded(run, plan.describe, q, k, v, variant)


def attend(
    state: RowState,
    call: KernelCall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    after_backward: Callable[[ExchangeOp], None],
) -> torch.Tensor:
    """Head-parallel block-diagonal attention of one call: ``[1, Hq, L, D]`` local queries -> ``[1, Hq, L, Dv]``.

    Args:
        state: The row's state (CP group, rank, shard plan; memoizes the plan).
        call: The resolved kernel (the same registry entry a cp=1 row would use), scale, dropout, variant
            (sinks ``[Hq]``: each rank uses its heads' sinks) and failure recorder.
        query: Local queries ``[1, Hq, L, D]``; ``key`` ``[1, Hkv, L, D]``, ``value`` ``[1, Hkv, L, Dv]``.
        after_backward: Called with the q/k/v exchange op once its reverse all-to-all completed.

    Returns:
        ``[1, Hq, L, Dv]`` in local row order; padding rows are zero.
    """
    plan = row_plan(state, query, key, call.variant)
    rank = state.cp_rank
    inner = functools.partial(_attend_row, plan, rank, call)
    out = exchange_heads(
        state.group, rank, plan.exchange, state.local_len, query, key, value, inner, state.stats, after_backward
    )
    record_stats(state, plan, call.variant.plan_key, query.shape[3], value.shape[3], query.element_size())
    return out


def record_stats(state: RowState, plan: RowPlan, key: PlanKey, head_dim: int, value_dim: int, elem_bytes: int) -> None:
    """What one head-parallel call moved on this rank, for ``exchange_stats`` (host ints only).

    ``kv_tokens_received``: K/V rows received from other ranks (each for this rank's K/V heads only);
    ``kv_bytes_received``: their bytes; ``stats.ulysses``: the head split and every byte sent and received.
    """
    stats, rank, local_len = state.stats, state.cp_rank, state.local_len
    n_kv = len(plan.split.kv[rank])
    rows = (state.cp_size - 1) * local_len if n_kv else 0
    sent, received = plan.split.forward_elements(rank, local_len, head_dim, value_dim)
    stats.kv_tokens_received = rows
    stats.kv_bytes_received = rows * n_kv * (head_dim + value_dim) * elem_bytes
    stats.windows[key] = ("ulysses", rows, stats.windows[key][2])
    stats.ulysses = {
        "query_heads": plan.split.query[rank],
        "kv_heads": plan.split.kv[rank],
        "bytes_sent": sent * elem_bytes,
        "bytes_received": received * elem_bytes,
    }
