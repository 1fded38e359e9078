"""cp_size == 1 packed path: hooked stock-SDPA calls run block-diagonal; SDPA is untouched elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nemo_automodel.components.distributed.blockdiag_cp import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    packed_varlen_sdpa,
)
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant
from nemo_automodel.testing.reference import doc_ids_from_lengths, reference_attention

STOCK_SDPA = F.scaled_dot_product_attention


class NaiveAttention(torch.nn.Module):
    """Calls stock SDPA as an unaware model would: one causal document."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = NaiveAttention()

    def forward(self, q, k, v):
        return self.self_attn(q, k, v)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer()])

    def forward(self, q, k, v, ckpt=None):
        layer = self.layers[0]
        if ckpt is None:
            return layer(q, k, v)
        return checkpoint(layer, q, k, v, use_reentrant=ckpt == "reentrant")


@pytest.fixture
def model():
    m = Model()
    handles = attach_cp1_packed_varlen_hooks(m)
    yield m
    for h in handles:
        h.remove()
    disable_cp1_packed_varlen()


def _inputs(length=24):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, length, 8), (1, 2, length, 8), (1, 2, length, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


IDS = doc_ids_from_lengths([5, 9, 1, 6], 24)


def _grads_of(fn, inputs):
    out = fn(*inputs)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()  # reentrant checkpoint needs .backward()
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("backend", ["sdpa_varlen", "dense", "auto"])
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
def test_hooked_attention_is_block_diagonal(model, backend, ckpt):
    enable_cp1_packed_varlen(IDS, backend)
    assert cp1_packed_varlen_backend() == backend
    out, grads = _grads_of(lambda q, k, v: model(q, k, v, ckpt=ckpt), _inputs())
    ref, ref_grads = _grads_of(lambda q, k, v: reference_attention(q, k, v, IDS), _inputs())
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_sdpa_is_stock_outside_hooked_forwards_even_after_an_exception(model):
    enable_cp1_packed_varlen(IDS)
    assert F.scaled_dot_product_attention is STOCK_SDPA
    model(*_inputs())
    assert F.scaled_dot_product_attention is STOCK_SDPA
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="differs from key head dim"):
        model(q, k[..., :3], v)
    assert F.scaled_dot_product_attention is STOCK_SDPA


def test_calls_that_do_not_match_the_armed_row_pass_through(model):
    enable_cp1_packed_varlen(IDS)
    q, k, v = _inputs(length=10)  # another length: e.g. a vision tower's attention
    torch.testing.assert_close(model(q, k, v), STOCK_SDPA(q, k, v, is_causal=True, enable_gqa=True))
    disable_cp1_packed_varlen()
    assert cp1_packed_varlen_backend() is None
    q, k, v = _inputs()
    torch.testing.assert_close(model(q, k, v), STOCK_SDPA(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("backend", ["sdpa_varlen", "dense"])
@pytest.mark.parametrize("spec", [{"window": 3}, {"window": 4, "softcap": 1.5, "sinks": True}, {"softcap": 3.0}])
def test_armed_row_honours_attention_variants(backend, spec):
    """``packed_varlen_sdpa(variant=...)``: windows, soft-cap and sinks on the armed row equal the reference."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    variant = AttentionVariant(
        window=spec.get("window"), softcap=spec.get("softcap"), sinks=sinks if spec.get("sinks") else None
    )
    inputs = [*_inputs(), sinks] if variant.sinks is not None else _inputs()
    enable_cp1_packed_varlen(IDS, backend=backend)
    try:
        out, grads = _grads_of(
            lambda q, k, v, *s: packed_varlen_sdpa(q, k, v, enable_gqa=True, variant=variant), inputs
        )
    finally:
        disable_cp1_packed_varlen()
    grads = [g.clone() for g in grads]
    for x in inputs:
        x.grad = None
    ref, ref_grads = _grads_of(
        lambda q, k, v, *s: reference_attention(q, k, v, IDS, None, variant.window, variant.softcap, variant.sinks),
        inputs,
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
