"""GPU kernels on CPU: faithful stand-ins, real availability checks, selection, and the kernels' call contracts.

The stand-ins (``tests/fakes``) are held to the real libraries here: their
signatures equal the real ones, and their semantics (windows, soft-capping,
sinks, the log-sum-exp) equal an independent dense float64 reference.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
from pathlib import Path

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    configure_cp_varlen,
    gpu_kernels,
    gpu_libraries,
    kernels,
    make_cp_blockdiag_batch_and_ctx,
    state,
)
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.logs import reset_log_once
from nemo_automodel.components.distributed.blockdiag_cp.options import choices
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant
from nemo_automodel.testing.reference import segments_reference
from tests.cases import fake_kernels

# ----------------------------------------------------------------------------- the real signatures

# Parameter lists, with defaults, as the real sources spell them (see the README's Kernels section):
# flash-attn v2.8.3 flash_attn/flash_attn_interface.py:1370 and :1135 (identical in v2.7.4.post1 :1375, :1140),
# flash-attention main 0251105a hopper/flash_attn_interface.py:890 and :809,
# TransformerEngine main d0067d0da pytorch/attention/dot_product_attention/dot_product_attention.py:670, :1380.
FA2_VARLEN = (
    "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, "
    "causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False, block_table=None"
)
FA2_FIXED = (
    "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "alibi_slopes=None, deterministic=False, return_attn_probs=False"
)
FA3_VARLEN = (
    "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None, "
    "softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, "
    "window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, "
    "sm_margin=0, return_attn_probs=False"
)
FA3_FIXED = (
    "q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, "
    "window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, "
    "sm_margin=0, return_attn_probs=False"
)
TE_INIT = (
    "num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0, qkv_format='sbhd', "
    "attn_mask_type='causal', window_size=None, bottom_right_diagonal=None, sequence_parallel=False, tp_size=1, "
    "get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type='self', cp_group=None, "
    "cp_global_ranks=None, cp_stream=None, cp_comm_type='p2p', softmax_scale=None, softmax_type='vanilla', "
    "return_max_logit=False, name=None"
)
TE_FORWARD = (
    "query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None, cu_seqlens_q=None, "
    "cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None, "
    "max_seqlen_kv=None, attn_mask_type=None, window_size=None, bottom_right_diagonal=None, "
    "checkpoint_core_attention=False, core_attention_bias_type='no_bias', core_attention_bias=None, "
    "alibi_slopes=None, fast_zero_fill=True, inference_params=None, pad_between_seqs=None, fp8_output=False, "
    "bf16_backward=False, num_splits=1, score_mod=None, score_mod_bprop=None, score_mod_tensors=None, "
    "score_mod_bprop_tensors=None, qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3"
)
# Older releases our calls must also satisfy: FA3 at flash-attention v2.8.3 (no return_attn_probs),
# TE 2.10 (pytorch/attention/dot_product_attention/dot_product_attention.py:318 and :799).
FA3_VARLEN_283 = FA3_VARLEN.removesuffix(", return_attn_probs=False")
TE_INIT_210 = TE_INIT.replace("bottom_right_diagonal=None, ", "").removesuffix(", name=None")
TE_FORWARD_210_NAMES = {
    "query_layer", "key_layer", "value_layer", "attention_mask", "qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
    "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "attn_mask_type", "window_size",
    "checkpoint_core_attention", "core_attention_bias_type", "core_attention_bias", "alibi_slopes", "fast_zero_fill",
    "inference_params", "pad_between_seqs", "fp8_output", "num_splits",
}  # fmt: skip


def _parameters(fn) -> str:
    return ", ".join(str(p) for p in inspect.signature(fn).parameters.values())


def _names(spelled: str) -> set[str]:
    return {part.split("=")[0].strip() for part in spelled.split(", ")}


def test_stand_in_signatures_are_the_real_ones():
    """No **kwargs, every real parameter with its real default: a misspelt keyword fails like the real call."""
    with fake_kernels():
        import flash_attn
        import flash_attn_interface
        import torch_flash_cpu
        from transformer_engine.pytorch import DotProductAttention

        assert _parameters(flash_attn.flash_attn_varlen_func) == FA2_VARLEN
        assert _parameters(flash_attn.flash_attn_func) == FA2_FIXED
        assert _parameters(flash_attn_interface.flash_attn_varlen_func) == FA3_VARLEN
        assert _parameters(flash_attn_interface.flash_attn_func) == FA3_FIXED
        assert _parameters(DotProductAttention.__init__).removeprefix("self, ") == TE_INIT
        assert _parameters(DotProductAttention.forward).removeprefix("self, ") == TE_FORWARD
        for stand_in, op in ((torch_flash_cpu._forward, "_flash_attention_forward"),
                             (torch_flash_cpu._backward, "_flash_attention_backward")):  # fmt: skip
            schema = getattr(torch.ops.aten, op).default._schema
            assert list(inspect.signature(stand_in).parameters) == [a.name for a in schema.arguments]
        q = torch.zeros(4, 2, 8, dtype=torch.float64)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        with pytest.raises(TypeError, match="softmax_scal"):
            flash_attn.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, softmax_scal=0.5)


def _recorded_keywords(monkeypatch, module, name):
    """Wrap ``module.name`` so that the keyword arguments of every call are collected."""
    seen: set[str] = set()
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_our_calls_use_only_keywords_every_supported_release_has(monkeypatch):
    meta, q, k, v = _group((5, 3), (9, 3), heads=(4, 2), head_dim=8)
    with fake_kernels():
        import flash_attn_interface
        import transformer_engine.pytorch as te

        fa3_seen = _recorded_keywords(monkeypatch, flash_attn_interface, "flash_attn_varlen_func")
        init_seen = _recorded_keywords(monkeypatch, te.DotProductAttention, "__init__")
        forward_seen = _recorded_keywords(monkeypatch, te.DotProductAttention, "forward")
        kernels.blockdiag_attention("fa3", q, k, v, meta, None, 0.0)
        kernels.blockdiag_attention("te", q, k, v, meta, None, 0.0)
    assert fa3_seen and fa3_seen <= _names(FA3_VARLEN_283) & _names(FA3_VARLEN)
    assert init_seen and init_seen <= _names(TE_INIT_210) & _names(TE_INIT)
    assert forward_seen and forward_seen <= TE_FORWARD_210_NAMES & _names(TE_FORWARD)
    assert init_seen >= {"attention_type", "attn_mask_type", "qkv_format"}


# ----------------------------------------------------------------------------- an independent dense reference


def _dense_reference(q, k, v, q_lens, k_lens, *, scale, left=-1, right=0, softcap=0.0, sink=None):
    """Row by row: ``q [Tq, Hq, D]`` over ``k/v [Tk, Hkv, D]`` -> ``(out [Tq, Hq, D], lse [Hq, Tq])``.

    Query row ``i`` of a segment is key position ``sk - sq + i`` (bottom-right);
    it sees keys ``[pos - left, pos + right]`` (negative: unbounded). ``sink[h]``
    is one more logit in the softmax's denominator and nowhere else.
    """
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for sq, sk in zip(q_lens, k_lens):
        for i in range(sq):
            pos = sk - sq + i
            lo = 0 if left < 0 else max(0, pos - left)
            hi = sk - 1 if right < 0 else min(sk - 1, pos + right)
            keys = list(range(k0 + lo, k0 + hi + 1))
            row_out, row_lse = [], []
            for h in range(q.shape[1]):
                s = (k[keys, h // rep] @ q[q0 + i, h]) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                logits = s if sink is None else torch.cat((s, sink[h : h + 1].to(s.dtype)))
                norm = torch.logsumexp(logits, 0)
                row_out.append(torch.exp(s - norm) @ v[keys, h // rep])
                row_lse.append(norm)
            outs.append(torch.stack(row_out))
            lses.append(torch.stack(row_lse))
        q0, k0 = q0 + sq, k0 + sk
    return torch.stack(outs), torch.stack(lses, 1)


def _packed(q_lens, k_lens, heads=(4, 2), head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((sum(q_lens), heads[0]), (sum(k_lens), heads[1]), (sum(k_lens), heads[1]))
    return [torch.randn(t, h, head_dim, generator=gen, dtype=torch.float64, requires_grad=True) for t, h in shapes]


def _assert_same(got, want, inputs, atol=1e-11):
    """Outputs and every input gradient of ``sum(out * weights)`` agree."""
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    grads = torch.autograd.grad((got * weights).sum(), inputs, retain_graph=True)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)


Q_LENS, K_LENS = (5, 4, 3), (9, 4, 7)  # straddling, square, straddling segments
FEATURES = {
    "causal": {"causal": True},
    "causal_window": {"causal": True, "window_size": (3, 0)},
    "local_window": {"window_size": (2, 1)},
    "softcap": {"causal": True, "softcap": 2.5},
}


def _expected(feature):
    options = FEATURES[feature]
    left, right = options.get("window_size", (-1, -1))
    return {"left": left, "right": 0 if options.get("causal") else right, "softcap": options.get("softcap", 0.0)}


@pytest.mark.parametrize("library", ["flash_attn", "flash_attn_interface"])
@pytest.mark.parametrize("feature", FEATURES)
def test_flash_stand_ins_match_the_dense_reference(library, feature):
    q, k, v = _packed(Q_LENS, K_LENS)
    with fake_kernels():
        fn = importlib.import_module(library)
        cu_q = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
        cu_k = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
        out, lse, *_ = fn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 5, 9, softmax_scale=0.4, return_attn_probs=True, **FEATURES[feature]
        )
        fixed, fixed_lse, *_ = fn.flash_attn_func(
            q[None, :5], k[None, :9], v[None, :9], softmax_scale=0.4, return_attn_probs=True, **FEATURES[feature]
        )
    want, want_lse = _dense_reference(q, k, v, Q_LENS, K_LENS, scale=0.4, **_expected(feature))
    _assert_same(out, want, (q, k, v))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-11)
    _assert_same(fixed[0], want[:5], (q, k, v))
    torch.testing.assert_close(fixed_lse[0], want_lse[:, :5], rtol=0, atol=1e-11)


def test_the_log_sum_exp_carries_no_gradient_as_in_the_real_kernels():
    """FlashAttn*Func.backward(ctx, dout, *args) and torch's varlen _backward drop the LSE's gradient."""
    q, k, v = _packed(Q_LENS, K_LENS)
    cu_q = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
    with fake_kernels():
        import flash_attn

        out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, causal=True, return_attn_probs=True)
    assert lse.requires_grad
    grads = torch.autograd.grad(lse.sum() + 0 * out.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.parametrize("window", [(-1, 0), (3, 0)])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_torch_varlen_attn_runs_for_real_over_cpu_flash_ops(window, heads):
    """torch's own varlen_attn (argument checks, is_causal rule, autograd) over the CPU aten stand-in."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    q, k, v = _packed(Q_LENS, K_LENS, heads=heads)
    cu_q = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
    with fake_kernels():
        out, lse = varlen_attn(
            q, k, v, cu_q, cu_k, 5, 9, scale=0.4, window_size=window, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
    want, want_lse = _dense_reference(q, k, v, Q_LENS, K_LENS, scale=0.4, left=window[0], right=0)
    _assert_same(out, want, (q, k, v))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-11)  # [Hq, Tq], as torch's fake op declares


def _te_attention(attention_type, q_lens, k_lens, heads=(4, 2), learnable_sink=None, **module_options):
    """The TE stand-in over fresh float64 segments -> ``(module, out [Tq, Hq, 8], (q, k, v))``."""
    from transformer_engine.pytorch import DotProductAttention

    q, k, v = _packed(q_lens, k_lens, heads=heads)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    module = DotProductAttention(
        heads[0],
        8,
        num_gqa_groups=heads[1],
        qkv_format="thd",
        attn_mask_type="padding_causal_bottom_right",
        attention_type=attention_type,
        softmax_scale=0.4,
        **module_options,
    )
    if learnable_sink is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(learnable_sink)
    out = module(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max(q_lens), max_seqlen_kv=max(k_lens))
    return module, out.view(out.shape[0], heads[0], 8), (q, k, v)


@pytest.mark.parametrize(
    ("options", "reference"),
    [
        ({}, {}),
        ({"window_size": (3, 0)}, {"left": 3}),
        ({"softmax_type": "off-by-one"}, {"sink": torch.zeros(4)}),
        ({"softmax_type": "learnable"}, {"sink": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)}),
    ],
)
def test_te_stand_in_with_cross_attention_matches_the_dense_reference(options, reference):
    learnable = reference.get("sink") if options.get("softmax_type") == "learnable" else None
    with fake_kernels():
        module, out, qkv = _te_attention("cross", Q_LENS, K_LENS, learnable_sink=learnable, **options)
    if learnable is not None:  # the sink is a parameter of the module: its gradient is the reference's too
        sink = learnable.clone().requires_grad_()
        with_sink, _ = _dense_reference(*(t.detach() for t in qkv), Q_LENS, K_LENS, scale=0.4, sink=sink)
        (want_grad,) = torch.autograd.grad(with_sink.sum(), sink)
        (got_grad,) = torch.autograd.grad(out.sum(), module.softmax_offset, retain_graph=True)
        torch.testing.assert_close(got_grad, want_grad.float())  # TE's softmax_offset is float32
    want, _ = _dense_reference(*qkv, Q_LENS, K_LENS, scale=0.4, **reference)
    _assert_same(out, want, qkv)


def test_te_stand_in_reproduces_the_unfused_self_attention_masks():
    """attention_type='self' (TE's default): keys masked with the query lengths, top-left within them."""
    with fake_kernels():
        with pytest.raises(RuntimeError, match="must match the size"):  # max_k > max_q: a broadcast error
            _te_attention("self", Q_LENS, K_LENS)
        # max_k == max_q: the straddling segment (4 queries, 9 keys) silently attends its first 4 keys top-left
        _, out, (q, k, v) = _te_attention("self", (4, 9), (9, 9))
    top_left, _ = _dense_reference(q, k[:4], v[:4], (4,), (4,), scale=0.4)
    torch.testing.assert_close(out[:4], top_left, rtol=0, atol=1e-11)
    right, _ = _dense_reference(q, k, v, (4, 9), (9, 9), scale=0.4)
    assert not torch.allclose(out[:4], right[:4])


# ----------------------------------------------------------------------------- the kernels through the stand-ins


def _group(q_lens, k_lens, heads=(4, 2), head_dim=8, seed=0):
    """A group's metadata (two padding rows) and ``q [1, Hq, L, D]``, ``k/v [1, Hkv, K, D]`` in float64."""
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu")
    gen = torch.Generator().manual_seed(seed)
    shapes = ((heads[0], meta.local_len), (heads[1], meta.kv_len), (heads[1], meta.kv_len))
    q, k, v = (
        torch.randn(1, h, n, head_dim, generator=gen, dtype=torch.float64, requires_grad=True) for h, n in shapes
    )
    return meta, q, k, v


@pytest.mark.parametrize("kernel", ["flash", "fa3"])
def test_flash_kernels_attend_segments_with_earlier_keys_outside_varlen(kernel):
    """Upstream's boundary guard: no varlen launch over a segment with k > q (straddles first and inside)."""
    meta, q, k, v = _group((5, 7, 3, 2, 6), (9, 7, 8, 2, 6))
    with fake_kernels():
        import fake_varlen_core

        fake_varlen_core.CALLS.clear()
        out = kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.0)
        calls = [(c["fn"].split(".")[-1], c["q_lens"], c["k_lens"]) for c in fake_varlen_core.CALLS]
    assert calls == [
        ("flash_attn_func", [5], [9]),
        ("flash_attn_varlen_func", [7], [7]),
        ("flash_attn_func", [3], [8]),
        ("flash_attn_varlen_func", [2, 6], [2, 6]),
    ]
    _assert_same(out, kernels.blockdiag_attention("sdpa_varlen", q, k, v, meta, None, 0.0), (q, k, v))


def test_a_group_without_earlier_keys_is_one_varlen_call():
    meta, q, k, v = _group((4, 5), (4, 5))
    with fake_kernels():
        import fake_varlen_core

        fake_varlen_core.CALLS.clear()
        kernels.blockdiag_attention("flash", q, k, v, meta, None, 0.0)
        assert [c["fn"] for c in fake_varlen_core.CALLS] == ["flash_attn_varlen_func"]


def test_fa3_accepts_the_older_out_and_lse_return(monkeypatch):
    """FA3 releases before 2025-07-11 returned (out, softmax_lse) from every call."""
    meta, q, k, v = _group((5, 3), (9, 3))
    with fake_kernels():
        import flash_attn_interface

        for name in ("flash_attn_func", "flash_attn_varlen_func"):
            real = getattr(flash_attn_interface, name)
            monkeypatch.setattr(
                flash_attn_interface, name, lambda *a, _real=real, **kw: _real(*a, **kw, return_attn_probs=True)
            )
        out = kernels.blockdiag_attention("fa3", q, k, v, meta, None, 0.0)
    _assert_same(out, kernels.blockdiag_attention("sdpa_varlen", q, k, v, meta, None, 0.0), (q, k, v))


@pytest.mark.parametrize("kernel", ["flash", "te"])
def test_kernels_with_dropout_pass_it_to_the_library(kernel):
    meta, q, k, v = _group((5, 3), (9, 3))
    with fake_kernels():
        import fake_varlen_core

        fake_varlen_core.CALLS.clear()
        torch.manual_seed(0)
        out = kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.5)
        if kernel == "te":
            assert gpu_kernels._TE_MODULES and all(
                m.attention_dropout.p == 0.5 for m in gpu_kernels._TE_MODULES.values()
            )
        else:
            assert {c["dropout_p"] for c in fake_varlen_core.CALLS} == {0.5}
    plain = kernels.blockdiag_attention("sdpa_varlen", q, k, v, meta, None, 0.0)
    assert torch.isfinite(out).all() and not torch.allclose(out, plain)


def test_te_module_is_built_for_cross_attention():
    meta, q, k, v = _group((5, 3), (9, 3))
    with fake_kernels():
        kernels.blockdiag_attention("te", q, k, v, meta, None, 0.0)
        (module,) = gpu_kernels._TE_MODULES.values()
        assert (module.attention_type, module.attn_mask_type) == ("cross", "padding_causal_bottom_right")


# ----------------------------------------------------------------------------- availability: real imports


@contextlib.contextmanager
def _installed(tmp_path: Path, files: dict[str, str]):
    """Packages written under ``tmp_path`` shadow any installed ones while active; caches are reset around."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    tops = {name.split("/")[0].removesuffix(".py") for name in files}
    ours = lambda: [m for m in sys.modules if m.split(".")[0] in tops]  # noqa: E731
    saved = {m: sys.modules.pop(m) for m in ours()}
    sys.path.insert(0, str(tmp_path))
    gpu_kernels.reset_caches()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        for m in ours():
            del sys.modules[m]
        sys.modules.update(saved)
        gpu_kernels.reset_caches()


def _libraries(device: str = "cpu") -> gpu_libraries.GpuLibraries:
    return gpu_libraries.probe_gpu_libraries(device)


def _flash_reason(call: KernelCall | None = None) -> str | None:
    libs = _libraries()
    return gpu_libraries.flash_problem(libs.flash, libs.device, call or KernelCall(torch.bfloat16, 128))


_GOOD_FLASH = "__version__ = '{}'\ndef flash_attn_varlen_func(*a, **k): pass\ndef flash_attn_func(*a, **k): pass\n"
BROKEN_FLASH = {
    "fa4_only_namespace": ({"flash_attn/cute/__init__.py": ""}, "FlashAttention-4 alone installs flash_attn.cute"),
    "abi_mismatch": (
        {"flash_attn/__init__.py": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')"},
        "importing `flash_attn` failed: ImportError: flash_attn_2_cuda.so: undefined symbol",
    ),
    "missing_library": (
        {"flash_attn/__init__.py": "raise OSError('libcudart.so.12: cannot open shared object file')"},
        "importing `flash_attn` failed: OSError",
    ),
    "runtime_error": ({"flash_attn/__init__.py": "raise RuntimeError('CUDA driver too old')"}, "RuntimeError"),
    "version_2_0": ({"flash_attn/__init__.py": _GOOD_FLASH.format("2.0.9")}, "flash-attn 2.0.9 is too old"),
    "version_2_6_1": ({"flash_attn/__init__.py": _GOOD_FLASH.format("2.6.1")}, "soft-cap backward without the tanh"),
}


@pytest.mark.parametrize("case", BROKEN_FLASH)
def test_flash_is_unavailable_when_its_import_or_version_fails(tmp_path, case):
    files, needle = BROKEN_FLASH[case]
    with _installed(tmp_path, files):
        reason = _flash_reason()
    assert reason is not None and needle in reason


@pytest.mark.parametrize("version", ["2.6.2", "2.8.3.post1"])
def test_a_working_flash_install_is_available(tmp_path, version):
    with _installed(tmp_path, {"flash_attn/__init__.py": _GOOD_FLASH.format(version)}):
        assert _flash_reason() is None


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        (
            {"transformer_engine/__init__.py": "raise RuntimeError('libtransformer_engine.so not found')"},
            "RuntimeError",
        ),
        ({"transformer_engine/__init__.py": "raise OSError('libcudnn.so.9: cannot open')"}, "OSError"),
        (
            {"transformer_engine/__init__.py": "__version__ = '1.8.0'", "transformer_engine/pytorch/__init__.py": ""},
            "needs TransformerEngine >= 1.9",
        ),
    ],
)
def test_te_is_unavailable_when_its_import_or_version_fails(tmp_path, files, needle):
    with _installed(tmp_path, files):
        libs = _libraries()
        reason = gpu_libraries.te_problem(libs.te, libs.device, KernelCall(torch.bfloat16, 128))
    assert reason is not None and needle in reason


def test_fa3_without_a_varlen_function_is_unavailable(tmp_path):
    with _installed(tmp_path, {"flash_attn_interface.py": "def flash_attn_func(*a, **k): pass\n"}):
        libs = _libraries()
        reason = gpu_libraries.fa3_problem(libs.fa3, libs.device, KernelCall(torch.bfloat16, 128))
    assert reason is not None and "no flash_attn_varlen_func" in reason


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend a CUDA device (compute capability, shared memory); the probe reads it through one function."""

    def pretend(capability, smem_optin=227 * 1024):
        facts = gpu_libraries.DeviceFacts(capability, smem_optin, f"sm{capability[0]}{capability[1]}")
        monkeypatch.setattr(gpu_libraries, "device_facts", lambda device: facts)
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)

    return pretend


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _kernel_logs():
    handler = _Records()
    logger = logging.getLogger(kernels.__name__.rpartition(".")[0])  # the package: kernels and gpu_kernels
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    reset_log_once()
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


@pytest.mark.parametrize("case", ["fa4_only_namespace", "abi_mismatch", "missing_library", "version_2_0"])
def test_auto_falls_back_past_a_broken_flash_and_logs_why(tmp_path, on_gpu, case):
    """find_spec found these; every rank then raised at its first call instead of falling back."""
    files, needle = BROKEN_FLASH[case]
    on_gpu((8, 0))  # an A100: fa3 is skipped for the GPU, te is not installed
    no_te = {"transformer_engine/__init__.py": "raise ImportError('no TE here')"}
    with _installed(tmp_path, {**files, **no_te}), _kernel_logs() as logs:
        picked = kernels.select_kernel("auto", torch.bfloat16, torch.device("cuda"), head_dim=128)
        kernels.select_kernel("auto", torch.bfloat16, torch.device("cuda"), head_dim=128)
    assert picked == "torch_varlen"
    assert len(logs) == 1 and "-> torch_varlen" in logs[0] and needle in logs[0]
    assert "fa3: fa3 needs FlashAttention-3" in logs[0] and "te: te needs TransformerEngine" in logs[0]


# ----------------------------------------------------------------------------- availability: device, head dim, dropout

_DEVICES = {
    "T4": gpu_libraries.DeviceFacts((7, 5), 64 << 10),
    "A100": gpu_libraries.DeviceFacts((8, 0), 163 << 10),
    "A10": gpu_libraries.DeviceFacts((8, 6), 99 << 10),
    "H100": gpu_libraries.DeviceFacts((9, 0), 227 << 10),
    "B200": gpu_libraries.DeviceFacts((10, 0), 227 << 10),
}


def _flash(version, device, head_dim=128, dropout_p=0.0):
    flash = gpu_libraries.FlashFacts(None, version)
    return gpu_libraries.flash_problem(
        flash, _DEVICES[device], KernelCall(torch.bfloat16, head_dim, dropout_p=dropout_p)
    )


def _fa3(device, head_dim=128):
    fa3 = gpu_libraries.Fa3Facts(None, frozenset({"softcap"}))
    return gpu_libraries.fa3_problem(fa3, _DEVICES[device], KernelCall(torch.bfloat16, head_dim))


def _limits(limits, head_dim, dropout_p=0.0):
    return limits(KernelCall(torch.bfloat16, head_dim, dropout_p=dropout_p))


@pytest.mark.parametrize(
    ("check", "needle"),
    [
        (lambda: _flash((2, 8, 3), "T4"), "needs an Ampere or newer GPU"),
        (lambda: _flash((2, 7, 2), "B200"), "predates Blackwell"),
        (lambda: _flash((2, 8, 3), "A10", 256, 0.1), "no kernel below 144 KB"),
        (lambda: _limits(gpu_libraries.flash_limits, 288), "head dims up to 256, got 288"),
        (lambda: _limits(gpu_libraries.fa3_limits, 96, 0.1), "fa3 has no dropout"),
        (lambda: _limits(gpu_libraries.fa3_limits, 100), "multiple of 8 and at most 256, got 100"),
        (lambda: _fa3("A100"), "Hopper"),
        (lambda: _limits(gpu_libraries.torch_varlen_limits, 128, 0.1), "torch_varlen has no dropout"),
        (lambda: _limits(gpu_libraries.torch_varlen_limits, 512), "head dims up to 256, got 512"),
        (lambda: _limits(gpu_libraries.torch_varlen_limits, 12), "multiple of 8"),
    ],
)
def test_library_limits_name_the_problem(check, needle):
    reason = check()
    assert reason is not None and needle in reason


@pytest.mark.parametrize(
    "check",
    [
        lambda: _flash((2, 8, 3), "A100", 256, 0.1),  # A100 has the shared memory
        lambda: _flash((2, 8, 3), "A10", 256),  # no dropout: a kernel
        lambda: _flash((2, 7, 3), "B200"),
        lambda: _fa3("H100"),
        lambda: _limits(gpu_libraries.fa3_limits, 128),
    ],
)
def test_supported_setups_pass(check):
    assert check() is None


def _te_install(version: str, cudnn: tuple[int, int, int]) -> dict[str, str]:
    """A TransformerEngine whose runtime facts are those of ``version`` without flash-attn, on ``cudnn``."""
    attention = "transformer_engine/pytorch/attention/dot_product_attention"
    return {
        "transformer_engine/__init__.py": f"__version__ = {version!r}\n",
        "transformer_engine/pytorch/__init__.py": "",
        "transformer_engine/pytorch/utils.py": f"def get_cudnn_version():\n    return {cudnn!r}\n",
        "transformer_engine/pytorch/attention/__init__.py": "",
        f"{attention}/__init__.py": "",
        f"{attention}/utils.py": "class FlashAttentionUtils:\n    is_installed = False\n",
    }


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_te_without_a_backend_is_refused_and_unfused_only_te_is_skipped_by_auto(
    tmp_path, monkeypatch, on_gpu, dropout_p
):
    """An A100 without flash-attn. TE 2.10: 'No dot product attention backend is available'; 2.12: unfused only."""
    on_gpu((8, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)  # no torch_varlen
    call = {"dtype": torch.bfloat16, "device": torch.device("cuda"), "head_dim": 128, "dropout_p": dropout_p}
    refused = pytest.raises(kernels.KernelUnavailableError, match=r"2\.10\.0 has no backend for THD bottom-right")
    with _installed(tmp_path / "te210", _te_install("2.10.0", (9, 8, 0))), refused:
        kernels.select_kernel("te", **call)
    with _installed(tmp_path / "te212", _te_install("2.12.0", (9, 8, 0))), _kernel_logs() as logs:
        assert kernels.select_kernel("auto", **call) == "sdpa_varlen"
        assert kernels.select_kernel("te", **call) == "te"
    assert "te: TransformerEngine would use its unfused backend" in logs[0]
    assert "attn_backend=te: TransformerEngine would use its unfused backend" in logs[1]


# ----------------------------------------------------------------------------- selection


@pytest.mark.parametrize("name", ["flash", "fa3", "te", "torch_varlen"])
def test_an_explicit_kernel_that_cannot_run_raises_naming_reason_and_fix(name):
    with pytest.raises(kernels.KernelUnavailableError) as raised:
        kernels.select_kernel(name, torch.float32, torch.device("cpu"))
    assert isinstance(raised.value, ValueError)
    message = str(raised.value)
    assert f"attn_backend={name!r} cannot run here: {name} needs device cuda, got cpu" in message
    assert "use attn_backend='auto' or 'sdpa_varlen'" in message and "never replaced" in message


def test_auto_on_cpu_is_sdpa_varlen_and_logs_the_skipped_kernels_once():
    with _kernel_logs() as logs:
        for _ in range(3):
            assert kernels.select_kernel("auto", torch.float32, torch.device("cpu"), head_dim=64) == "sdpa_varlen"
    assert len(logs) == 1
    assert all(f"{name}: {name} needs device cuda" in logs[0] for name in ("fa3", "flash", "te", "torch_varlen"))


def test_auto_order_is_documented_and_complete():
    assert kernels.AUTO_PREFERENCE == ("fa3", "flash", "te", "torch_varlen", "sdpa_varlen")
    assert set(kernels.AUTO_PREFERENCE) | {"dense"} == set(kernels.KERNELS) == set(choices("attn_backend")) - {"auto"}


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [("fa3", "fa3"), ("flash_attn_3", "fa3"), ("flash-attn-3", "fa3"), ("FA3", "fa3"),
     ("torch_varlen", "torch_varlen"), ("varlen_attn", "torch_varlen"), ("flash", "flash"), ("te", "te")],
)  # fmt: skip
def test_every_kernel_is_configurable_on_any_machine(spelling, canonical):
    """Availability is decided when a step runs; configuring and building a batch never checks it."""
    configure_cp_varlen(attn_backend=spelling)
    assert state.cp_varlen_runtime_config()["attn_backend"] == canonical
    configure_cp_varlen()
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long)}
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, attn_backend=spelling)
    with ctx() as st:
        assert st.options.attn_backend == canonical


# ----------------------------------------------------------------------------- attention variants: nothing is silent

VARIANTS = {
    "window": (AttentionVariant(window=4096, source="MistralForCausalLM layer 3"), "sliding_window=4096"),
    "softcap": (AttentionVariant(softcap=50.0, source="Gemma2ForCausalLM layer 0"), "softcap=50.0"),
    "sinks": (AttentionVariant(sinks=torch.zeros(4), source="GptOssForCausalLM layer 1"), "s_aux (attention sinks)"),
}
# What each kernel computes with the stand-ins' libraries (flash-attn 2.8.3, FA3 main, TE 2.20, torch 2.13).
COMPUTES = {
    "flash": {"window", "softcap", "sinks"},
    "fa3": {"window", "softcap", "sinks"},
    "te": {"window"},
    "torch_varlen": {"window"},
}


def _escaped(text: str) -> str:
    return text.replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("kernel", ["fa3", "flash", "te", "torch_varlen"])
@pytest.mark.parametrize("kind", VARIANTS)
def test_every_gpu_kernel_computes_a_feature_or_refuses_it_by_name(kernel, kind):
    """A GPU kernel either computes a feature or refuses it naming feature and source: never a silent plain call."""
    variant, name = VARIANTS[kind]
    with fake_kernels():
        spec = kernels.KERNELS[kernel]
        assert spec.variant_problem is not None
        problem = spec.variant_problem(KernelCall(torch.bfloat16, variant=variant), _libraries())
        assert (problem is None) == (kind in COMPUTES[kernel])
        if problem is not None:
            assert f"{name} ({variant.source}) is not supported by attn_backend={kernel}: " in problem
            reason = kernels.kernel_unavailable_reason(kernel, torch.bfloat16, torch.device("cuda"), variant=variant)
            assert reason == problem  # the variant is checked first: the reason names the feature
            with pytest.raises(kernels.KernelUnavailableError, match=_escaped(name)):
                kernels.select_kernel(kernel, torch.bfloat16, torch.device("cuda"), variant=variant)


@pytest.mark.parametrize("kernel", ["fa3", "flash", "te", "torch_varlen"])
def test_a_direct_kernel_call_with_a_refused_feature_raises(kernel):
    """Even called around selection, a kernel never computes plain attention for a feature it cannot express."""
    for kind in set(VARIANTS) - COMPUTES[kernel]:
        variant, name = VARIANTS[kind]
        meta = kernels.build_varlen_meta((5, 3), (9, 3), 10, "cpu", window=variant.window)
        q = torch.randn(1, 4, 10, 8, dtype=torch.float64)
        k = v = torch.randn(1, 2, 12, 8, dtype=torch.float64)
        with fake_kernels(), pytest.raises(ValueError, match=_escaped(name) + " .* is not supported"):
            kernels.KERNELS[kernel].fn(q, k, v, meta, None, 0.0, variant)


def test_the_first_refused_feature_is_named_with_its_source():
    variant = AttentionVariant(window=8, softcap=30.0, source="Gemma2ForCausalLM layer 2")
    problem = gpu_kernels.variant_problem("te", variant, {"softcap": "no soft-cap in TE"})
    assert problem == (
        "softcap=30.0 (Gemma2ForCausalLM layer 2) is not supported by attn_backend=te: no soft-cap in TE; "
        "use attn_backend='auto' (it picks a kernel that computes it) or 'sdpa_varlen'"
    )
    assert gpu_kernels.variant_problem("te", variant, {}) is None


def _gaps_fa3(*parameters: str, disabled: str | None = None) -> set[str]:
    flags = None if disabled is None else frozenset({disabled})
    return set(gpu_libraries.fa3_gaps(gpu_libraries.Fa3Facts(None, frozenset(parameters), disabled=flags)))


def _gaps_torch(*parameters: str) -> set[str]:
    return set(gpu_libraries.torch_varlen_gaps(gpu_libraries.TorchVarlenFacts(None, frozenset(parameters))))


@pytest.mark.parametrize(
    ("gaps", "want"),
    [
        (lambda: set(gpu_libraries.flash_gaps(gpu_libraries.FlashFacts(None, (2, 8, 3)))), {"sinks"}),  # no pair
        (lambda: _gaps_fa3("q", "causal"), {"window", "softcap", "sinks"}),
        (lambda: _gaps_fa3("window_size"), {"softcap", "sinks"}),  # 2024-08..2025-01
        (lambda: _gaps_fa3("window_size", "softcap"), {"sinks"}),
        (lambda: _gaps_fa3("window_size", "softcap", disabled="LOCAL"), {"window", "sinks"}),
        (lambda: _gaps_fa3("window_size", "softcap", disabled="SOFTCAP"), {"softcap", "sinks"}),
        (lambda: set(gpu_libraries.te_gaps(gpu_libraries.TEFacts(None, (1, 13)))), {"window", "softcap", "sinks"}),
        (lambda: set(gpu_libraries.te_gaps(gpu_libraries.TEFacts(None, (2, 0)))), {"softcap", "sinks"}),
        (lambda: _gaps_torch(), {"window", "softcap", "sinks"}),
        (lambda: _gaps_torch("window_size"), {"softcap", "sinks"}),
    ],
)
def test_features_need_the_release_or_build_that_has_them(gaps, want):
    assert gaps() == want


def test_flash_refuses_softcap_with_dropout_like_flash_attn():
    """flash_api.cpp: "Softcapping does not support dropout for now"; said before the call, naming the source."""
    variant = AttentionVariant(softcap=30.0, source="Gemma2ForCausalLM layer 0")
    meta, q, k, v = _group((5, 3), (9, 3))
    with fake_kernels():
        with pytest.raises(ValueError, match=r"softcap=30.0 \(Gemma2ForCausalLM layer 0\) with dropout_p"):
            kernels.blockdiag_attention("flash", q, k, v, meta, None, 0.1, variant)
        reason = kernels.kernel_unavailable_reason("flash", torch.float16, "cuda", dropout_p=0.1, variant=variant)
        assert reason is not None and "soft-capping has no dropout" in reason


# ----------------------------------------------------------------------------- attention variants: computed exactly


# Kernels x the features they compute: windows narrower than a segment, wider than some,
# one key (W=1), and soft-caps alone and with a window.
VARIANT_CASES = [
    (kernel, window, softcap)
    for kernel in ("flash", "fa3", "te", "torch_varlen")
    for window, softcap in ((1, None), (3, None), (6, None), (50, None), (None, 2.0), (4, 1.5))
    if softcap is None or "softcap" in COMPUTES[kernel]
]


@pytest.mark.parametrize(("kernel", "window", "softcap"), VARIANT_CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_gpu_kernels_compute_windows_and_softcaps_exactly(kernel, window, softcap, heads):
    """Forward and every gradient against the definition, with straddling segments first and inside (GQA too)."""
    q_lens, k_lens = (5, 4, 3, 6), (9, 4, 7, 6)  # straddling, square, straddling, square
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=window)
    gen = torch.Generator().manual_seed(1)
    shapes = ((heads[0], meta.local_len), (heads[1], meta.kv_len), (heads[1], meta.kv_len))
    q, k, v = (torch.randn(1, h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h, n in shapes)
    variant = AttentionVariant(window=window, softcap=softcap, source="test layer")
    with fake_kernels():
        assert kernels.kernel_unavailable_reason(kernel, torch.float64, torch.device("cpu"), variant=variant) is None
        got = kernels.blockdiag_attention(kernel, q, k, v, meta, 0.4, 0.0, variant)
    want = segments_reference(q, k, v, meta, scale=0.4, window=window, softcap=softcap)
    _assert_same(got, want, (q, k, v))
    if window is not None and window < 9:  # the window really changed something (not a no-op)
        plain = segments_reference(q, k, v, meta, scale=0.4, softcap=softcap)
        assert not torch.allclose(want, plain)


# ----------------------------------------------------------------------------- sinks on flash-attn 2's private pair

# flash_attn/flash_attn_interface.py, parameter for parameter with defaults: v2.6.2 (lines 48-200; v2.6.3 the same)
# and v2.8.3 (lines 76-400; v2.7.0 to v2.8.2 the same up to zero_tensors, added in v2.7.4).
FA2_LSE = {
    "2.6.3": {
        "_flash_attn_forward": "q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
        "return_softmax",
        "_flash_attn_varlen_forward": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, "
        "softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, "
        "block_table=None, leftpad_k=None, seqused_k=None",
        "_flash_attn_backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
        "window_size, softcap, alibi_slopes, deterministic, rng_state=None",
        "_flash_attn_varlen_backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, "
        "max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
        "deterministic, rng_state=None",
    },
    "2.8.3": {
        "_flash_attn_forward": "q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, "
        "softcap, alibi_slopes, return_softmax",
        "_flash_attn_varlen_forward": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, "
        "softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, "
        "return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False",
        "_flash_attn_backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
        "window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None",
        "_flash_attn_varlen_backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, "
        "max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, "
        "softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False",
    },
}


@pytest.mark.parametrize("release", sorted(FA2_LSE))
def test_flash_private_pair_stand_ins_have_the_real_signatures(release):
    from tests.fakes.machine import Machine

    with fake_kernels(machine=Machine(flash=release)):
        module = importlib.import_module("flash_attn.flash_attn_interface")
        for name, want in FA2_LSE[release].items():
            assert str(inspect.signature(getattr(module, name)))[1:-1] == want, name
        assert _libraries().flash.lse is not None and _libraries().flash.lse.split_window == (release >= "2.7")


SINK_CASES = [(None, None), (None, 1.5), (3, None), (6, 2.0), (1, None)]


@pytest.mark.parametrize("release", sorted(FA2_LSE))
@pytest.mark.parametrize(("window", "softcap"), SINK_CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_flash_computes_sinks_exactly_through_its_private_pair(release, window, softcap, heads):
    """Sinks on flash: forward, dq/dk/dv and the sinks' gradient equal the explicit-score ``dense`` kernel, with
    straddling segments (fixed-length calls) first and inside, on both eras of the private pair."""
    from tests.fakes.machine import Machine

    q_lens, k_lens = (5, 4, 3, 6), (9, 4, 7, 6)
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=window)
    gen = torch.Generator().manual_seed(3)
    shapes = ((heads[0], meta.local_len), (heads[1], meta.kv_len), (heads[1], meta.kv_len))
    q, k, v = (torch.randn(1, h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h, n in shapes)
    sinks = torch.linspace(-1.0, 1.5, heads[0], dtype=torch.float64, requires_grad=True)
    variant = AttentionVariant(window=window, softcap=softcap, sinks=sinks, source="test layer")
    with fake_kernels(machine=Machine(flash=release)):
        assert kernels.kernel_unavailable_reason("flash", torch.float64, torch.device("cpu"), variant=variant) is None
        got = kernels.blockdiag_attention("flash", q, k, v, meta, 0.4, 0.0, variant)
    want = kernels.blockdiag_attention("dense", q, k, v, meta, 0.4, 0.0, variant)
    _assert_same(got, want, (q, k, v, sinks))


# ----------------------------------------------------------------------------- sinks on FA3's private pair

# hopper/flash_attn_interface.py, parameter for parameter with defaults, at each stand-in era's commit
# (7b4e68e0, 7a802796, 909eb7ce = v2.8.3, 0251105a): 2024-08's pair is fixed-length only (not read: refused).
FA3_LSE = {
    "2024-08": (
        "q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None, descale_v=None",
        "dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size, deterministic=False",
    ),
    "2025-01": (
        "q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, "
        "max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, q_descale, "
        "k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, "
        "rotary_interleaved=True, num_splits=1, pack_gqa=None, sm_margin=0",
        "dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, "
        "max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, "
        "deterministic=False, sm_margin=0",
    ),
    "2025-04": (
        "q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, "
        "max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, "
        "q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1), attention_chunk=0, "
        "softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0",
        "dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, "
        "max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0, deterministic=False, "
        "sm_margin=0",
    ),
    "main": (
        "q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None, "
        "cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, "
        "page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, "
        "q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size_left=-1, "
        "window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, "
        "num_splits=1, pack_gqa=None, sm_margin=0",
        "dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None, "
        "max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False, "
        "window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0",
    ),
}
FA3_LSE["2.8.3"] = FA3_LSE["2025-04"]
FA3_SINK_ERAS = ("2025-01", "2025-04", "2.8.3", "main")  # a pair read; 2025-01's public functions are refused


def _unannotated(fn) -> str:
    fn = getattr(fn, "_init_fn", fn)  # a custom op (main) keeps the decorated function
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]
    return str(inspect.Signature(parameters))[1:-1]


@pytest.mark.parametrize("era", sorted(FA3_LSE))
def test_fa3_private_pair_stand_ins_have_the_real_signatures(era):
    from tests.fakes.machine import Machine

    with fake_kernels(machine=Machine(fa3=era)):
        module = importlib.import_module("flash_attn_interface")
        got = (_unannotated(module._flash_attn_forward), _unannotated(module._flash_attn_backward))
        assert got == FA3_LSE[era]
        facts = _libraries().fa3
        assert (facts.lse is not None) == (era in FA3_SINK_ERAS), facts.lse_problem
        if facts.lse is not None:
            assert facts.lse.forward_call.split_window == facts.lse.backward_call.split_window == (era == "main")
            assert facts.lse.backward_call.causal == ("is_causal" if era == "main" else "causal")


@pytest.mark.parametrize("era", FA3_SINK_ERAS[1:])
@pytest.mark.parametrize(("window", "softcap"), SINK_CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_fa3_computes_sinks_exactly_through_its_private_pair(era, window, softcap, heads):
    """Sinks on fa3: forward, dq/dk/dv and the sinks' gradient equal the explicit-score ``dense`` kernel, with
    straddling segments (fixed-length calls, ``lse [B, Hq, Sq]``) first and inside, on every era's pair."""
    from tests.fakes.machine import Machine

    q_lens, k_lens = (5, 4, 3, 6), (9, 4, 7, 6)
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=window)
    gen = torch.Generator().manual_seed(5)
    shapes = ((heads[0], meta.local_len), (heads[1], meta.kv_len), (heads[1], meta.kv_len))
    q, k, v = (torch.randn(1, h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h, n in shapes)
    sinks = torch.linspace(-1.0, 1.5, heads[0], dtype=torch.float64, requires_grad=True)
    variant = AttentionVariant(window=window, softcap=softcap, sinks=sinks, source="test layer")
    with fake_kernels(machine=Machine(fa3=era)):
        import fake_varlen_core

        assert kernels.kernel_unavailable_reason("fa3", torch.float64, torch.device("cpu"), variant=variant) is None
        fake_varlen_core.CALLS.clear()
        got = kernels.blockdiag_attention("fa3", q, k, v, meta, 0.4, 0.0, variant)
        torch.autograd.grad(got.sum(), q, retain_graph=True)  # the stand-in records its backward
        calls = {c["fn"] for c in fake_varlen_core.CALLS}
    want = kernels.blockdiag_attention("dense", q, k, v, meta, 0.4, 0.0, variant)
    _assert_same(got, want, (q, k, v, sinks))
    assert {"fa3._flash_attn_forward", "fa3._flash_attn_backward"} <= calls


def _pair_module(forward, backward):
    import types

    module = types.ModuleType("flash_attn_interface")
    module._flash_attn_forward, module._flash_attn_backward = forward, backward
    return module


def _main_pair():
    from tests.fakes.machine import Machine

    with fake_kernels(machine=Machine(fa3="main")):
        module = importlib.import_module("flash_attn_interface")
        return module._flash_attn_forward._init_fn, module._flash_attn_backward._init_fn


def _with_parameters(fn, change):
    """``fn`` with its signature edited by ``change(list of parameters)`` (what the probe reads)."""

    def edited(*args, **kwargs):
        return fn(*args, **kwargs)

    parameters = list(inspect.signature(fn).parameters.values())
    edited.__signature__ = inspect.Signature(change(parameters))
    return edited


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # a parameter no revision read has (hopper/ has no sink input; a future one would mean a new contract)
        (lambda ps: [*ps, inspect.Parameter("learnable_sink", inspect.Parameter.KEYWORD_ONLY, default=None)],
         "_flash_attn_forward takes learnable_sink"),
        (lambda ps: [p for p in ps if p.name != "softcap"], "_flash_attn_forward lacks softcap"),
        (lambda ps: [p for p in ps if not p.name.startswith("window_size")],
         "_flash_attn_forward lacks window_size"),
        (lambda ps: [p.replace(kind=p.KEYWORD_ONLY, default=p.empty if p.name == "num_splits" else p.default)
                     for p in ps],
         "_flash_attn_forward requires num_splits"),
    ],
)  # fmt: skip
def test_fa3_sinks_refuse_a_private_pair_whose_signature_was_not_read(change, named):
    """Every parameter of FA3's private pair is one a read revision has; anything else refuses sinks by name."""
    forward, backward = _main_pair()
    lse, problem = gpu_libraries._probe_fa3_lse(_pair_module(_with_parameters(forward, change), backward))
    assert lse is None and named in problem and "not one this kernel has read" in problem
    facts = gpu_libraries.Fa3Facts(None, frozenset({"window_size", "softcap"}), lse=lse, lse_problem=problem)
    gaps = gpu_libraries.fa3_gaps(facts)
    assert set(gaps) == {"sinks"} and named in gaps["sinks"]
    assert gpu_libraries._probe_fa3_lse(_pair_module(forward, backward))[0] is not None  # unedited: read


def test_fa3_sinks_refuse_the_2024_pair_by_name():
    """2024-08's private pair is fixed-length only (a separate varlen pair): not read, so sinks are refused."""
    from tests.fakes.machine import Machine

    variant = AttentionVariant(sinks=torch.zeros(4), source="GptOssForCausalLM layer 1")
    with fake_kernels(machine=Machine(fa3="2024-08")):
        reason = kernels.kernel_unavailable_reason("fa3", torch.bfloat16, torch.device("cuda"), variant=variant)
    assert reason is not None and reason.startswith(
        "s_aux (attention sinks) (GptOssForCausalLM layer 1) is not supported by attn_backend=fa3: attention sinks "
        "need FlashAttention-3's private forward/backward pair: this FlashAttention-3 build's private pair is not "
        "one this kernel has read (its _flash_attn_forward lacks cu_seqlens_q"
    )


@pytest.mark.parametrize(
    "returned",
    [lambda result: result[0], lambda result: (result[0], result[1].t())],  # no lse; an lse [n, Hq]
)
def test_fa3_sinks_refuse_a_forward_that_returns_no_lse(returned):
    """A build whose private forward returns something else than ``(out, softmax_lse [Hq, n], ...)`` raises."""
    forward, backward = _main_pair()

    def other(**arguments):
        return returned(forward(**arguments))

    other.__signature__ = inspect.signature(forward)
    lse, _ = gpu_libraries._probe_fa3_lse(_pair_module(other, backward))
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    seqlens = (torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32), 6, 6)
    with fake_kernels(), pytest.raises(RuntimeError, match=r"did not return \(out, softmax_lse"):
        lse.forward(q, q, q, seqlens, 0.3, (-1, 0), 0.0)


def test_flash_refuses_sinks_with_dropout_or_an_unpadded_head_dim():
    variant = AttentionVariant(sinks=torch.zeros(4), source="GptOssForCausalLM layer 1")
    with fake_kernels():
        for call in (
            KernelCall(torch.bfloat16, 64, dropout_p=0.1, variant=variant),
            KernelCall(torch.bfloat16, 20, variant=variant),
        ):
            problem = gpu_kernels.flash_variant_problem(call, _libraries())
            assert problem is not None and "s_aux (attention sinks) (GptOssForCausalLM layer 1)" in problem
