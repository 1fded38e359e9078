"""Zero control collectives and zero host syncs per attention layer, forward and backward, on every exchange.

Counted with ``nemo_automodel.testing.syncs.count_syncs`` over one training step of a CP
attention stack with ``N`` and ``N + k`` layers: the difference divided by ``k``
is the per-layer figure (per-step work, like the agreement check and the
settlement of kernel failures, cancels out). ``consensus="call"`` adds one
all-reduce and one host sync per call and direction, which the same count sees,
so the check can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import CPOptions, make_cp_blockdiag_batch_and_ctx
from nemo_automodel.testing.cases import cp_mesh, layout
from nemo_automodel.testing.syncs import count_syncs
from tests.faults.injection import AttentionStack, Injector

LAYERS = (1, 4)


def _counts_per_step(layers: int, options: CPOptions, ids: torch.Tensor) -> tuple[int, int, int]:
    """(control collectives, host syncs, exchange collectives) of one forward + backward step on this rank."""
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, options=options)
    torch.manual_seed(0)
    model = AttentionStack(layers, Injector(None, None, dist.get_rank()))
    x = torch.randn(1, shard.padded_seq_len, AttentionStack.HIDDEN, dtype=torch.float64)
    x = x.index_select(1, shard.positions).requires_grad_()
    with count_syncs() as counts, ctx():
        model(x).pow(2).sum().backward()
    return counts.control_collectives, counts.host_syncs, sum(counts.exchange.values())


def _per_layer(options: CPOptions, name: str) -> tuple[float, float, float]:
    ids = layout(name, dist.get_world_size())
    (c1, h1, e1), (c2, h2, e2) = (_counts_per_step(n, options, ids) for n in LAYERS)
    k = LAYERS[1] - LAYERS[0]
    return (c2 - c1) / k, (h2 - h1) / k, (e2 - e1) / k


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a", "auto"])
@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
def test_no_control_collective_or_host_sync_per_layer(pools, kv_exchange, shard_layout):
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange=kv_exchange, layout=shard_layout)
    for control, host, moved in pools.get(3).run_ok(_per_layer, options, "spans_many"):
        assert (control, host) == (0, 0)
        assert moved > 0 or kv_exchange != "allgather"  # the exchange itself is counted apart


def test_per_call_consensus_costs_one_collective_and_one_sync_per_direction(pools):
    """The counter sees what the default mode removed: the check above can fail."""
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="halo", consensus="call")
    for control, host, _ in pools.get(2).run_ok(_per_layer, options, "straddle"):
        assert (control, host) == (2, 2)
