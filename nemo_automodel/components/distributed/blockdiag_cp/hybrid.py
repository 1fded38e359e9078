"""Heads x sequence hybrid CP: ``kv_exchange="ulysses+halo"`` (``+a2a``, ``+allgather``).

The CP group of ``cp`` ranks factors into ``h`` x ``s`` (``CPOptions.head_parallel = h``):

- a *head group* is ``h`` consecutive CP ranks (``[g h, (g + 1) h)``; consecutive so that, with ranks
  numbered node by node, a head group sits inside a node). Its members swap heads for rows with the
  all-to-all of :mod:`.ulysses` (:func:`.ulysses.exchange_heads`): member ``j`` then holds the union of the
  group's ``h L`` rows for its share of the heads (:func:`.heads.split_heads` over ``h``: uneven splits,
  replicated K/V heads, idle members when ``Hq < h``, exactly as under ``ulysses``);
- a *sequence group* is the ``s`` ranks that hold the same head share (``j, h + j, ...``). Over those
  unions they run the needed-only (or all-gather) exchange and attention of any sequence-split row: the
  row is re-sharded over ``s`` ranks of ``h L`` rows (:func:`.heads.sequence_plan`), and a sequence row state
  (:func:`sequence_row`) runs the existing path on it, kernel failures guarded the same way;
- the reverse all-to-all returns every rank's rows of every head.

``h = cp`` is ``ulysses``; ``h = 1`` is the plain sequence path. Both sub-groups are created when the row
is built (:func:`build_groups`: every member creates its two groups, in the same order on every rank, never
inside an attention call) and reused by every later row of the same CP ranks.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import cost
from nemo_automodel.components.distributed.blockdiag_cp.exchange import Route
from nemo_automodel.components.distributed.blockdiag_cp.heads import HeadExchange, head_exchange, sequence_plan
from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan
from nemo_automodel.components.distributed.blockdiag_cp.metadata import build_window_plan
from nemo_automodel.components.distributed.blockdiag_cp.options import SEQUENCE_PART, CPOptions
from nemo_automodel.components.distributed.blockdiag_cp.state import HybridGroups, RowCache, RowState
from nemo_automodel.components.distributed.blockdiag_cp.topology import GroupHosts
from nemo_automodel.components.distributed.blockdiag_cp.variant import PlanKey


def factor(kv_exchange: str, cp: int, head_parallel: int | None, hosts: GroupHosts | None) -> int:
    """The head-parallel degree ``h`` of ``kv_exchange`` over ``cp`` ranks (replicated inputs: same on every rank).

    Raises:
        ValueError: naming ``head_parallel`` and the fix when ``h`` does not divide ``cp`` into ``1 < h < cp``.
    """
    h = head_parallel if head_parallel is not None else cost.default_degree(cp, hosts.nodes if hosts else None)
    if h is None or cp % h or not 1 < h < cp:
        given = f"head_parallel={head_parallel}" if head_parallel is not None else "head_parallel=None (default)"
        divisors = [d for d in range(2, cp) if cp % d == 0]
        fix = (
            f"set head_parallel to one of {divisors}"
            if divisors
            else f"cp={cp} has no such factorization: use kv_exchange='ulysses' or {SEQUENCE_PART[kv_exchange]!r}"
        )
        raise ValueError(
            f"kv_exchange={kv_exchange!r} needs head_parallel = h with 1 < h < cp_size and cp_size % h == 0 "
            f"(the CP group factors into h head-parallel x cp/h sequence ranks); {given} does not fit "
            f"cp_size={cp}: {fix}"
        )
    return h


def degree(options: CPOptions, cp: int, hosts: GroupHosts | None) -> int | None:
    """The row's head-parallel degree: a hybrid's (checked), ``auto``'s candidate (``None``: none), else ``None``."""
    if options.kv_exchange in SEQUENCE_PART:
        return factor(options.kv_exchange, cp, options.head_parallel, hosts)
    if options.kv_exchange == "auto":
        return cost.default_degree(cp, hosts.nodes if hosts else None)
    return None


# Sub-groups per (CP group's global ranks, h), with the CP group they were made for: created once, by their
# members only, reused by every row; a new CP group of the same ranks (a fresh mesh after another was destroyed)
# gets its own, so none outlives the group it serves.
_SUBGROUPS: dict[tuple[tuple[int, ...], int], tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]] = {}


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """``group``'s own collective timeout, for its sub-groups (``None``: not readable, torch's default applies).

    Without it a sub-group would wait torch's default (30 min on gloo) where its CP group errors after
    ``dist.pg_timeout_s``. c10d exposes it only on the backend's private options: guarded.
    """
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def build_groups(group: dist.ProcessGroup, cp_rank: int, h: int, hosts: GroupHosts | None) -> HybridGroups:
    """This rank's head and sequence groups of ``group`` factored as ``h x cp/h`` (a collective the first time).

    Each rank creates its own two groups, head group first (``use_local_synchronization``: only the members
    of a group take part in its creation, so the other CP groups of the world need not join), with
    ``group``'s timeout.
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    cp = len(ranks)
    g, j = divmod(cp_rank, h)
    head_ranks = [ranks[g * h + i] for i in range(h)]
    sequence_ranks = [ranks[t * h + j] for t in range(cp // h)]
    cached = _SUBGROUPS.get((ranks, h))
    if cached is None or cached[0] is not group:
        backend, timeout = dist.get_backend(group), group_timeout(group)
        head = dist.new_group(head_ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
        sequence = dist.new_group(sequence_ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
        _SUBGROUPS[ranks, h] = (group, head, sequence)
    _, head, sequence = _SUBGROUPS[ranks, h]
    sequence_hosts = hosts.subgroup(sequence_ranks) if hosts is not None else None
    return HybridGroups(h, cp // h, head, sequence, j, g, sequence_hosts)


def inner_order(shard: ShardPlan, g: int, h: int) -> torch.Tensor | None:
    """``[h L]``: received row (member by member) of every row of head group ``g``'s union; ``None``: identity.

    Real rows keep their order, each member's padding tail moves behind every real row.
    """
    local_len = shard.local_len
    real = [sum(p.length for p in shard.pieces[g * h + i]) for i in range(h)]
    order = [i * local_len + t for i in range(h) for t in range(real[i])]
    order += [i * local_len + t for i in range(h) for t in range(real[i], local_len)]
    return None if order == list(range(h * local_len)) else torch.tensor(order)


def sequence_row(state: RowState, path: str) -> RowState:
    """The sequence part of hybrid ``path``: ``s`` ranks of ``h L`` rows over the sequence group (once per row).

    It shares the row's options (with the sequence part's exchange), failures and stats; it is never agreed
    on by itself (the row's agreement covers it: every input is replicated).
    """
    if path not in state.cache.hybrid:
        groups = state.hybrid
        plan = sequence_plan(state.shard_plan, groups.heads)
        rank, local_len = groups.sequence_rank, plan.local_len
        device = state.positions.device
        cu_cpu = torch.tensor(plan.physical_cu_seqlens(), dtype=torch.int32)
        # The needed-only part was asked for explicitly: it stays needed-only also between nodes. Its calls
        # settle failures with the whole CP group's (consensus="call" runs at the row's level, never per part).
        options = state.options.replace(
            kv_exchange=SEQUENCE_PART[path],
            head_parallel=None,
            allow_cross_node=True,
            consensus="step",
        )
        state.cache.hybrid[path] = RowState(
            group=groups.sequence_group,
            cp_rank=rank,
            cp_size=plan.cp,
            row_offset=rank * local_len,
            local_len=local_len,
            shard_plan=plan,
            packed_cu_seqlens=cu_cpu.to(device),
            packed_cu_seqlens_cpu=cu_cpu,
            positions=plan.permutation[rank * local_len : (rank + 1) * local_len].to(device),
            options=options,
            hosts=groups.sequence_hosts,
            libraries=state.libraries,
            cache=RowCache(windows={None: build_window_plan(plan, rank, None, device)}),
            stats=state.stats,
            failures=state.failures,
        )
    return state.cache.hybrid[path]


def head_plan(state: RowState, heads: int, kv_heads: int) -> HeadExchange:
    """The head group's all-to-all plan for ``heads``/``kv_heads`` (memoized per head counts)."""
    memo_key = (heads, kv_heads)
    if memo_key not in state.cache.hybrid_heads:
        groups = state.hybrid
        order = inner_order(state.shard_plan, groups.sequence_rank, groups.heads)
        state.cache.hybrid_heads[memo_key] = head_exchange(heads, kv_heads, groups.heads, order, state.positions.device)
    return state.cache.hybrid_heads[memo_key]


def record_stats(
    state: RowState,
    path: str,
    plan: HeadExchange,
    route: Route | None,
    key: PlanKey,
    head_dim: int,
    value_dim: int,
    elem_bytes: int,
) -> None:
    """What one hybrid call moved on this rank, per part, for ``exchange_stats`` (host ints only).

    ``kv_tokens_received``: K/V rows received for this rank's K/V heads, by both parts (the head group's
    ``(h - 1) L`` and the sequence exchange's); ``stats.hybrid``: the factorization and each part's bytes.
    """
    groups, stats, local_len = state.hybrid, state.stats, state.local_len
    j = groups.head_rank
    n_kv = len(plan.split.kv[j])
    head_rows = (groups.heads - 1) * local_len if n_kv else 0
    sequence_rows = route.received_tokens if route is not None else 0
    sent, received = plan.split.forward_elements(j, local_len, head_dim, value_dim)
    row_bytes = n_kv * (head_dim + value_dim) * elem_bytes
    stats.kv_tokens_received = head_rows + sequence_rows
    stats.kv_bytes_received = stats.kv_tokens_received * row_bytes
    stats.windows[key] = (path, stats.kv_tokens_received, stats.windows[key][2])
    stats.hybrid = {
        "heads": groups.heads,
        "sequence": groups.sequence,
        "sequence_path": route.path if route is not None else None,
        "query_heads": plan.split.query[j],
        "kv_heads": plan.split.kv[j],
        "heads_bytes_sent": sent * elem_bytes,
        "heads_bytes_received": received * elem_bytes,
        "sequence_kv_tokens_received": sequence_rows,
        "sequence_bytes_received": sequence_rows * row_bytes,
    }
