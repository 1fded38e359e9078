"""Kernel paths on one process: every way a segment with earlier keys is attended equals the reference."""

from __future__ import annotations

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import kernels
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant
from tests.reference import reference_attention


def _segment(q_len: int, k_len: int, heads: tuple[int, int]):
    gen = torch.Generator().manual_seed(q_len * 7 + k_len)
    hq, hkv = heads
    q = torch.randn(1, hq, q_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, k_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, k_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _reference(q, k, v):
    """The segment's rows are the last rows of one document: embed them in a full-row reference."""
    prefix = k.shape[2] - q.shape[2]
    q_full = torch.cat((q.new_zeros(1, q.shape[1], prefix, q.shape[3]), q), dim=2)
    return reference_attention(q_full, k, v, torch.ones(1, k.shape[2], dtype=torch.long))[:, :, prefix:]


def _grads(fn, q, k, v):
    out = fn(q, k, v)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize(("q_len", "k_len"), [(5, 40), (37, 37 + 300), (64, 65)])
@pytest.mark.parametrize("path", ["prefix_then_causal", "masked_tiles", "masked_tiles_recomputed"])
def test_segment_with_earlier_keys_matches_reference(monkeypatch, heads, q_len, k_len, path):
    q, k, v = _segment(q_len, k_len, heads)
    if path == "prefix_then_causal":
        fn = lambda q, k, v: kernels._bottom_right_causal(q, k, v, None, 0.0)  # noqa: E731
    else:
        if path == "masked_tiles_recomputed":  # tiles small enough to be checkpointed
            monkeypatch.setattr(kernels, "_MASK_BUDGET", 128)
            monkeypatch.setattr(kernels, "_TILE_ROWS", 4)
        fn = lambda q, k, v: kernels._masked_tiles(q, k, v, None, 0.0, PLAIN, None)  # noqa: E731
    out, grads = _grads(fn, q, k, v)
    ref, ref_grads = _grads(_reference, q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_cpu_path_saves_no_mask_sized_tensor():
    q, k, v = _segment(32, 4096, (2, 2))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        kernels._bottom_right_causal(q, k, v, None, 0.0)
    assert max(saved) < 32 * 4096  # inputs, output and log-sum-exp only: nothing [Q, K]-sized


def test_dropout_uses_the_masked_path_and_still_runs():
    q, k, v = _segment(8, 24, (2, 2))
    out = kernels._bottom_right_causal(q.float(), k.float(), v.float(), None, 0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()


VARIANTS = {
    "window": {"window": 5},
    "window-softcap": {"window": 9, "softcap": 1.5},
    "sinks-softcap": {"softcap": 2.0, "sinks": True},
    "window-sinks": {"window": 3, "sinks": True},
}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(("q_len", "k_len"), [(6, 20), (17, 17)])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_masked_tiles_variants_match_reference(monkeypatch, name, q_len, k_len, recompute):
    """Windows, soft-cap and sinks on a segment with earlier keys, with and without per-tile recompute."""
    if recompute:
        monkeypatch.setattr(kernels, "_MASK_BUDGET", 16)
        monkeypatch.setattr(kernels, "_TILE_ROWS", 4)
    spec = VARIANTS[name]
    q, k, v = _segment(q_len, k_len, (4, 2))
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64, requires_grad=True) if spec.get("sinks") else None
    variant = AttentionVariant(window=spec.get("window"), softcap=spec.get("softcap"), sinks=sinks)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

    def ours(q, k, v, *s):
        return kernels._masked_tiles(q, k, v, None, 0.0, variant, variant.window)

    def reference(q, k, v, *s):
        prefix = k.shape[2] - q.shape[2]
        q_full = torch.cat((q.new_zeros(1, q.shape[1], prefix, q.shape[3]), q), dim=2)
        ids = torch.ones(1, k.shape[2], dtype=torch.long)
        full = reference_attention(q_full, k, v, ids, None, variant.window, variant.softcap, sinks)
        return full[:, :, prefix:]

    got, got_grads = _grads_all(ours, inputs)
    want, want_grads = _grads_all(reference, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def _grads_all(fn, inputs):
    out = fn(*inputs)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), grads


def test_value_head_dim_may_differ_from_query_head_dim():
    """MLA models (DeepSeek-V3): ``Dv != D`` through the prefix path's fallback and SDPA."""
    q, k, _ = _segment(6, 20, (4, 2))
    v = torch.randn(1, 2, 20, 5, dtype=torch.float64, requires_grad=True)
    out, grads = _grads_all(lambda q, k, v: kernels._bottom_right_causal(q, k, v, None, 0.0), (q, k, v))
    ref, ref_grads = _grads_all(_reference, (q, k, v))
    assert out.shape == (1, 4, 6, 5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
    for g, w in zip(grads, ref_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
