"""A checkpointed function that ends at the CP attention call: every rank recomputes in step, gradients are exact.

Non-reentrant activation checkpointing recomputes when backward first reads a saved tensor of the
function and stops once the last one is back. With nothing after the attention call, a rank whose
groups need nothing received used to start the reverse exchange before recomputing (a forward
exchange), while its peers recomputed first: the ranks' collectives desynchronized (gloo: "Received
data size doesn't match expected size", or a timeout). ``exchange.recompute_fence`` fixes the order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from nemo_automodel.components.distributed.blockdiag_cp import CPOptions, cp_blockdiag_sdpa
from nemo_automodel.testing.cases import layout
from tests.test_runtime import _local_qkv, _step


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The checkpointed function: the CP attention call and nothing after it."""
    return cp_blockdiag_sdpa(q, k, v, enable_gqa=True)


def _two_layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Two attention calls in one checkpointed function, the second one last."""
    return _attention(_attention(q, k, v), k, v)


FUNCTIONS = {"attention": _attention, "two_layers": _two_layers}


def _grads(name: str, kv_exchange: str, function: str, checkpointed: bool, consensus: str) -> list[torch.Tensor]:
    """q/k/v gradients ``[1, H, L, D]`` of a weighted sum of the function's output, and the output itself."""
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange=kv_exchange, consensus=consensus)
    ctx, shard = _step(layout(name, dist.get_world_size()), options=options)
    q, k, v = _local_qkv(shard, requires_grad=True)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
    fn = FUNCTIONS[function]
    with ctx():
        out = checkpoint(fn, q, k, v, use_reentrant=False) if checkpointed else fn(q, k, v)
        (out * weight).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _checkpointed_matches_plain(name: str, kv_exchange: str, function: str, consensus: str) -> list[str]:
    """Names of the tensors (output, gradients) where the checkpointed run differs from the plain one."""
    plain = _grads(name, kv_exchange, function, False, consensus)
    checkpointed = _grads(name, kv_exchange, function, True, consensus)
    names = ("output", "q.grad", "k.grad", "v.grad")
    return [n for n, a, b in zip(names, plain, checkpointed) if not torch.equal(a, b)]


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a", "ulysses"])
@pytest.mark.parametrize("cp", [2, 3])
def test_checkpointed_function_ending_at_attention_keeps_ranks_in_step(pools, cp, kv_exchange):
    try:
        for name in ("straddle", "spans_many", "pad_rank"):
            # a desync fails here: a gloo size mismatch kills a rank, a mismatched order times out (HangError)
            differing = pools.get(cp).run_ok(_checkpointed_matches_plain, name, kv_exchange, "attention", "step")
            assert all(not d for d in differing), f"{name}: checkpointed run differs from the plain one: {differing}"
    finally:
        pools.ensure_healthy(cp)  # a desync leaves the group broken: the next test gets a fresh one


@pytest.mark.parametrize("consensus", ["step", "call"])
def test_two_checkpointed_attention_calls_and_per_call_consensus(pools, consensus):
    """The recompute runs both calls (and, per call, their consensus collectives) in step on every rank."""
    try:
        for kv_exchange in ("allgather", "a2a"):
            differing = pools.get(3).run_ok(
                _checkpointed_matches_plain, "straddle", kv_exchange, "two_layers", consensus
            )
            assert all(not d for d in differing), f"{kv_exchange}: checkpointed run differs: {differing}"
    finally:
        pools.ensure_healthy(3)
