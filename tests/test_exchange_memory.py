"""Received K/V and exchange buffers do not outlive their use, with and without activation checkpointing.

The autograd graph keeps a layer's exchange op (through its ``_Post``/``_Wait`` nodes) until the step's
loss is freed, which the recipe does after the optimizer step. An op holds its collective's work
handles, and a handle references the collective's buffers (the received K/V among them), so the op
must drop them once used and must not sit in a reference cycle (which only the cyclic garbage collector
frees). With ``gc`` disabled, these tests see what plain reference counting frees.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, exchange
from nemo_automodel.testing.cases import layout
from tests.test_runtime import _local_qkv, _step


def _layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention followed by an op that saves its output, like a decoder layer's projection.

    A function ending at the attention call is covered by tests/test_checkpointed_attention.py.
    """
    out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
    return out * out


def _exchange_ops_after_step(kv_exchange: str, checkpointed: bool) -> tuple[list[int], bool]:
    """Forward and backward of one attention call (the output kept alive, like the recipe's loss).

    Returns the tensors each live exchange op still holds, and whether every op died with the output.
    """
    ctx, shard = _step(layout("straddle", 2), kv_exchange=kv_exchange, attn_backend="sdpa_varlen")
    q, k, v = _local_qkv(shard, requires_grad=True)
    created: list[weakref.ref] = []
    original_start = exchange.ExchangeOp.start

    def tracked_start(op: exchange.ExchangeOp, send: torch.Tensor) -> None:
        created.append(weakref.ref(op))
        original_start(op, send)

    exchange.ExchangeOp.start = tracked_start
    gc.disable()
    try:
        with ctx():
            out = checkpoint(_layer, q, k, v, use_reentrant=False) if checkpointed else _layer(q, k, v)
            out.sum().backward()
        ops = [ref() for ref in created if ref() is not None]
        held = [len(op._works) + (op._buffer is not None) for op in ops]
        del ops, out
        freed = all(ref() is None for ref in created)
    finally:
        gc.enable()
        exchange.ExchangeOp.start = original_start
    return held, freed and bool(created)


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_exchange_ops_hold_no_buffers_after_backward_and_die_with_the_graph(pools, kv_exchange, checkpointed):
    for held, freed in pools.get(2).run_ok(_exchange_ops_after_step, kv_exchange, checkpointed):
        assert held and all(n == 0 for n in held), f"exchange ops still hold work handles or buffers: {held}"
        assert freed, "an exchange op outlived its graph (a reference cycle keeps it until gc runs)"
