"""Activation checkpointing (reentrant and not, recompute in another thread) gives the same gradients."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from nemo_automodel.testing.cases import cp_mesh, layout
from nemo_automodel.testing.workloads import AttentionBlock


def _grads(mode: str, kv_exchange: str):
    torch.manual_seed(0)
    block = AttentionBlock(heads=4, kv_heads=2, head_dim=8, bias=True, dtype=torch.float64)
    ids = layout("spans_many", 2)
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, kv_exchange=kv_exchange)
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(1, shard.padded_seq_len, 32, generator=gen, dtype=torch.float64)
    x = x_full[:, shard.row_offset : shard.row_offset + shard.local_len].clone().requires_grad_()
    with ctx():
        if mode == "none":
            out = block(x)
        else:  # "other_thread" checkpoints too, so its recompute happens inside that thread
            out = checkpoint(block, x, use_reentrant=(mode == "reentrant"))
        loss = (out**2).sum()
        if mode == "other_thread":
            # recompute runs where backward runs: here in a thread that never entered the context
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
        else:
            loss.backward()
    return [x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_gradients_equal_plain_gradients(pools, kv_exchange, mode):
    plain = pools.get(2).run_ok(_grads, "none", kv_exchange)
    ckpt = pools.get(2).run_ok(_grads, mode, kv_exchange)
    for rank_plain, rank_ckpt in zip(plain, ckpt):
        for a, b in zip(rank_plain, rank_ckpt):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_recompute_in_another_thread_still_sees_the_step_state(pools):
    plain = pools.get(2).run_ok(_grads, "none", "halo")
    threaded = pools.get(2).run_ok(_grads, "other_thread", "halo")
    for rank_plain, rank_threaded in zip(plain, threaded):
        for a, b in zip(rank_plain, rank_threaded):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
