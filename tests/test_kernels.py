"""Kernel paths on one process: every way a segment with earlier keys is attended equals the reference."""

from __future__ import annotations

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import cpu_kernels, kernels
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant
from nemo_automodel.testing.reference import reference_attention


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
        fn = lambda q, k, v: cpu_kernels._bottom_right_causal(q, k, v, None, 0.0)  # noqa: E731
    else:
        if path == "masked_tiles_recomputed":  # tiles small enough to be checkpointed
            monkeypatch.setattr(cpu_kernels, "_MASK_BUDGET", 128)
            monkeypatch.setattr(cpu_kernels, "_TILE_ROWS", 4)
        fn = lambda q, k, v: cpu_kernels._masked_tiles(q, k, v, None, 0.0, PLAIN, None)  # noqa: E731
    out, grads = _grads(fn, q, k, v)
    ref, ref_grads = _grads(_reference, q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_cpu_path_saves_no_mask_sized_tensor():
    q, k, v = _segment(32, 4096, (2, 2))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        cpu_kernels._bottom_right_causal(q, k, v, None, 0.0)
    assert max(saved) < 32 * 4096  # inputs, output and log-sum-exp only: nothing [Q, K]-sized


def test_dropout_uses_the_masked_path_and_still_runs():
    q, k, v = _segment(8, 24, (2, 2))
    out = cpu_kernels._bottom_right_causal(q.float(), k.float(), v.float(), None, 0.5)
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
        monkeypatch.setattr(cpu_kernels, "_MASK_BUDGET", 16)
        monkeypatch.setattr(cpu_kernels, "_TILE_ROWS", 4)
    spec = VARIANTS[name]
    q, k, v = _segment(q_len, k_len, (4, 2))
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64, requires_grad=True) if spec.get("sinks") else None
    variant = AttentionVariant(window=spec.get("window"), softcap=spec.get("softcap"), sinks=sinks)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

    def ours(q, k, v, *s):
        return cpu_kernels._masked_tiles(q, k, v, None, 0.0, variant, variant.window)

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
    out, grads = _grads_all(lambda q, k, v: cpu_kernels._bottom_right_causal(q, k, v, None, 0.0), (q, k, v))
    ref, ref_grads = _grads_all(_reference, (q, k, v))
    assert out.shape == (1, 4, 6, 5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
    for g, w in zip(grads, ref_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def _window_segments(batch: int, q_len: int, k_len: int, heads: tuple[int, int], dim: int = 8):
    gen = torch.Generator().manual_seed(q_len * 131 + k_len * 7 + batch)
    hq, hkv = heads
    shapes = ((batch, hq, q_len, dim), (batch, hkv, k_len, dim), (batch, hkv, k_len, dim))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes)


def _window_reference(q, k, v, window):
    """Each batch entry is one segment: its rows are the last rows of a document, embedded in a full row."""
    prefix = k.shape[2] - q.shape[2]
    ids = torch.ones(1, k.shape[2], dtype=torch.long)
    outs = []
    for b in range(q.shape[0]):
        q_full = torch.cat((q.new_zeros(1, q.shape[1], prefix, q.shape[3]), q[b : b + 1]), dim=2)
        outs.append(reference_attention(q_full, k[b : b + 1], v[b : b + 1], ids, None, window)[:, :, prefix:])
    return torch.cat(outs)


# (q_len, prefix, window): Q < W, Q == W - 1, Q a multiple of W - 1 or not; P = 0, P < W - 1, P == W - 1,
# P > W - 1; W = 2 (one-row tiles) and W = 3.
WINDOW_SHAPES = [
    (5, 0, 9),
    (5, 3, 9),
    (5, 7, 9),
    (8, 0, 9),
    (8, 3, 9),
    (8, 8, 9),
    (24, 0, 9),
    (24, 5, 9),
    (24, 8, 9),
    (29, 0, 9),
    (29, 3, 9),
    (29, 8, 9),
    (29, 12, 9),
    (7, 0, 2),
    (7, 1, 2),
    (7, 4, 2),
    (10, 2, 3),
    (33, 31, 32),
]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize(("q_len", "prefix", "window"), WINDOW_SHAPES)
@pytest.mark.parametrize("tile_rows", [None, 3, 4])
@pytest.mark.parametrize("call_elements", [None, 1])
def test_sliding_window_is_mask_free_and_matches_reference(
    monkeypatch, batch, heads, q_len, prefix, window, tile_rows, call_elements
):
    """The CPU window path (forward, dq/dk/dv) equals the explicit reference, without touching the masked tiles.

    ``tile_rows`` below ``window - 1`` gives each tile a full key block between its two triangles that
    overlaps the next tile's (3: overlaps in pieces of 3 and a short one; 4: in whole pieces).
    ``call_elements=1`` cuts every run of tiles into one call per tile.
    """

    def no_masks(*args, **kwargs):
        raise AssertionError("the CPU window path fell back to masked tiles")

    monkeypatch.setattr(cpu_kernels, "_masked_tiles", no_masks)
    if tile_rows is not None:
        monkeypatch.setattr(cpu_kernels, "_WINDOW_TILE_ROWS", tile_rows)
    if call_elements is not None:
        monkeypatch.setattr(cpu_kernels, "_WINDOW_CALL_ELEMENTS", call_elements)
    q, k, v = _window_segments(batch, q_len, q_len + prefix, heads)
    got, got_grads = _grads_all(lambda q, k, v: cpu_kernels._bottom_right_window(q, k, v, None, 0.0, window), (q, k, v))
    want, want_grads = _grads_all(lambda q, k, v: _window_reference(q, k, v, window), (q, k, v))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize(("q_len", "prefix", "window", "dim_v"), [(6, 0, 1, 8), (6, 3, 1, 8), (9, 2, 4, 5)])
def test_sliding_window_fallbacks_match_reference(q_len, prefix, window, dim_v):
    """``W == 1`` (no tile of ``W - 1`` rows) and ``Dv != D`` (the flash op's limit) take the masked tiles."""
    q, k, _ = _window_segments(2, q_len, q_len + prefix, (4, 2))
    v = torch.randn(2, 2, q_len + prefix, dim_v, dtype=torch.float64, requires_grad=True)
    got, got_grads = _grads_all(lambda q, k, v: cpu_kernels._bottom_right_window(q, k, v, None, 0.0, window), (q, k, v))
    want, want_grads = _grads_all(lambda q, k, v: _window_reference(q, k, v, window), (q, k, v))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_sdpa_varlen_window_batches_segments_like_dense():
    """Through the kernel entry point: same-shape segments batched, windows shorter than some segments only."""
    q_lens, k_lens = (6, 6, 11, 3, 6), (9, 9, 11, 3, 8)
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=4)
    variant = AttentionVariant(window=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, meta.local_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, meta.kv_len, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    got, got_grads = _grads_all(lambda q, k, v: cpu_kernels.sdpa_varlen(q, k, v, meta, None, 0.0, variant), (q, k, v))
    want, want_grads = _grads_all(lambda q, k, v: cpu_kernels.dense(q, k, v, meta, None, 0.0, variant), (q, k, v))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_sliding_window_saves_no_mask_sized_tensor():
    q, k, v = _window_segments(1, 2048, 2048 + 511, (2, 2))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        cpu_kernels._bottom_right_window(q, k, v, None, 0.0, 512)
    # q/k/v, the output and the log-sum-exp only: nothing [Q, K]- or [tile, W]-sized (a masked tile would be 256 x 767).
    assert max(saved) <= k.numel() < 256 * 767


def test_sliding_window_calls_stay_within_their_key_budget(monkeypatch):
    """A long segment's tiles are cut into calls whose key blocks hold at most ``_WINDOW_CALL_ELEMENTS``
    elements: the flash backward returns key gradients that size (overlapping tiles repeat each key), so an
    uncut run of a long document under a long window would allocate many times the keys' bytes."""
    budget = 20_000
    monkeypatch.setattr(cpu_kernels, "_WINDOW_CALL_ELEMENTS", budget)
    sizes: list[int] = []
    backward = cpu_kernels._CPU_FLASH_BACKWARD

    def counting(grad, q, k, *args, **kwargs):
        sizes.append(k.numel())
        return backward(grad, q, k, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "_CPU_FLASH_BACKWARD", counting)
    q, k, v = _window_segments(1, 2048, 2048, (2, 2), dim=8)
    cpu_kernels._bottom_right_window(q, k, v, None, 0.0, 512).sum().backward()
    # 383-key middle blocks of 2 x 8 elements per key: 3 tiles per call, not the 12 tiles that share a shape
    assert max(sizes) <= budget
    assert max(sizes) == 3 * 383 * 2 * 8


def test_sliding_window_bfloat16_close_to_reference():
    q, k, v = _window_segments(2, 70, 70 + 20, (4, 2), dim=16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    got = cpu_kernels._bottom_right_window(*half, None, 0.0, 21)
    got_grads = torch.autograd.grad(got, half, grad.bfloat16())
    want = _window_reference(q, k, v, 21)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=5e-2)


FAST_VARIANTS = {
    "sinks": {"sinks": True},
    "softcap": {"softcap": 1.5},
    "sinks-softcap": {"softcap": 2.0, "sinks": True},
    "window-sinks": {"window": 3, "sinks": True},
    "window-softcap": {"window": 4, "softcap": 1.5},
    "window-sinks-softcap": {"window": 5, "softcap": 2.5, "sinks": True},
}


def _variant_of(spec: dict, sinks: torch.Tensor) -> AttentionVariant:
    return AttentionVariant(
        window=spec.get("window"), softcap=spec.get("softcap"), sinks=sinks if spec.get("sinks") else None
    )


@pytest.mark.parametrize("tile_rows", [256, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("name", sorted(FAST_VARIANTS))
def test_sdpa_varlen_variants_take_the_mask_free_paths_and_match_dense(monkeypatch, name, heads, tile_rows):
    """Soft-cap (:class:`_SoftcapTiles`) and sinks (the flash output rescaled) through the kernel entry point:
    square, straddling and batched same-shape segments, forward and every gradient (sinks included) equal the
    explicit-score ``dense`` kernel, and the explicit masked tiles are never used."""
    # several tiles per segment, windows across them
    monkeypatch.setattr(cpu_kernels, "_TILE_ROWS", tile_rows)
    monkeypatch.setattr(cpu_kernels, "_SOFTCAP_TILE_ROWS", tile_rows)
    spec = FAST_VARIANTS[name]
    q_lens, k_lens = (6, 6, 11, 3, 9), (9, 9, 11, 3, 30)
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=spec.get("window"))
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, heads[0], meta.local_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(1, heads[1], meta.kv_len, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv"
    )
    sinks = torch.linspace(-1.0, 2.0, heads[0], dtype=torch.float64, requires_grad=True)
    variant = _variant_of(spec, sinks)
    inputs = (q, k, v, sinks) if variant.sinks is not None else (q, k, v)
    want, want_grads = _grads_all(lambda q, k, v, *s: cpu_kernels.dense(q, k, v, meta, None, 0.0, variant), inputs)

    def no_masks(*args, **kwargs):
        raise AssertionError("a variant fell back to explicit masked tiles")

    monkeypatch.setattr(cpu_kernels, "_masked_tiles", no_masks)
    got, got_grads = _grads_all(lambda q, k, v, *s: cpu_kernels.sdpa_varlen(q, k, v, meta, None, 0.0, variant), inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("spec", [{"sinks": True}, {"softcap": 2.0, "sinks": True}])
def test_variant_fallbacks_match_dense(spec):
    """Dropout-free calls the mask-free paths cannot take (sinks with ``Dv != D``) still equal ``dense``."""
    q_lens, k_lens = (6, 5), (6, 12)
    meta = kernels.build_varlen_meta(q_lens, k_lens, 11, "cpu")
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 18, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 18, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    variant = _variant_of(spec, sinks)
    inputs = (q, k, v, sinks)
    got, got_grads = _grads_all(lambda q, k, v, s: cpu_kernels.sdpa_varlen(q, k, v, meta, None, 0.0, variant), inputs)
    want, want_grads = _grads_all(lambda q, k, v, s: cpu_kernels.dense(q, k, v, meta, None, 0.0, variant), inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("spec", [{"softcap": 30.0}, {"sinks": True}, {"softcap": 30.0, "window": 600}])
def test_variants_save_no_score_sized_tensor(spec):
    """Soft-cap and sinks keep q/k/v, the output, the log-sum-exp and the sinks for backward: nothing [Q, K]."""
    q, k, v = _segment(1024, 2048, (2, 2))
    meta = kernels.build_varlen_meta((1024,), (2048,), 1024, "cpu", window=spec.get("window"))
    variant = _variant_of(spec, torch.zeros(2, dtype=torch.float64, requires_grad=True))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        cpu_kernels.sdpa_varlen(q, k, v, meta, None, 0.0, variant)
    assert max(saved) <= k.numel() < 256 * 1024  # a score tile of 256 rows over even half the keys is larger


def test_softcap_bfloat16_close_to_reference():
    """Half precision through the soft-cap tiles: math in fp32, outputs and gradients in bf16."""
    q, k, v = _window_segments(2, 70, 70 + 20, (4, 2), dim=16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kernel = cpu_kernels._SoftcapTiles(2.0, 21, None)
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    half_sinks = sinks.detach().bfloat16().requires_grad_()
    got = cpu_kernels._LseAttention.apply(*half, half_sinks, kernel)
    got_grads = torch.autograd.grad(got, (*half, half_sinks), grad.bfloat16())
    want = cpu_kernels._LseAttention.apply(q, k, v, sinks, kernel)
    want_grads = torch.autograd.grad(want, (q, k, v, sinks), grad)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=5e-2)
