"""The explicit-state core: ``runtime.attend_row(row, q, k, v, variant=...)`` needs no active row or process state.

Two packed rows with different settings are attended alternately, without entering either row's context
(the thread-shared slot stays empty): each call uses only the row it is given. The calls read no module-level
mutable object but the read-only kernel and machine tables and log-once's memo (profiled with
``tests.step_globals``): no slot, no host table, no probe cache, no environment.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import (
    CPOptions,
    cp_blockdiag_sdpa,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
    runtime,
    state,
)
from nemo_automodel.testing.cases import cp_mesh, layout
from tests.step_globals import mutable_globals_read

# Module-level objects the core may read: tables fixed at import, and log-once's memo of keys already logged.
READ_ONLY = {"kernels.KERNELS", "cost.MACHINES", "logs._SEEN", "logs._LOCK"}


def _two_rows_without_context() -> tuple[list[str], bool, set[str]]:
    ids = layout("spans_many", dist.get_world_size())
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    rows, outputs = [], []
    for kv_exchange in ("halo", "allgather"):
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
            cp_mesh(), None, batch, options=CPOptions(kv_exchange=kv_exchange)
        )
        with ctx() as row:  # only to take the state out: the calls below run with the slot empty
            pass
        rows.append(row)
    torch.manual_seed(0)
    q = torch.randn(1, 4, shard.local_len, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 2, shard.local_len, 8, dtype=torch.float64, requires_grad=True)
    assert state.current_row_state() is None
    with mutable_globals_read() as read:
        for row in rows + rows:
            out = runtime.attend_row(row, q, kv, kv, enable_gqa=True)
            out.pow(2).sum().backward()
            outputs.append(out.detach())
    same = all(torch.allclose(outputs[0], o) for o in outputs[1:])
    return [exchange_stats(row)["path"] for row in rows], same, set(read)


def test_rows_with_different_settings_attend_side_by_side_without_the_slot(pools):
    for paths, same, read in pools.get(2).run_ok(_two_rows_without_context):
        assert paths == ["halo", "allgather"] and same
        assert read <= READ_ONLY, f"the core read process-wide state: {sorted(read - READ_ONLY)}"


def _adapter_reads_the_slot() -> set[str]:
    ids = layout("straddle", dist.get_world_size())
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, options=CPOptions())
    q = torch.randn(1, 2, shard.local_len, 4)
    with ctx(), mutable_globals_read() as read:
        cp_blockdiag_sdpa(q, q, q)
    return set(read)


def test_the_sdpa_adapter_adds_only_the_slot(pools):
    """The profile sees process state: through the adapter, the slot is read (the check above can fail)."""
    for read in pools.get(2).run_ok(_adapter_reads_the_slot):
        assert read - READ_ONLY == {"state._ROW_STATE"}
