"""GPU kernels across library releases, build flags and devices, through stand-ins as strict as each release.

Each test names the library fact it holds us to (docs/design.md, *Kernels*, has
the file and line at each tag). The stand-ins (``tests/fakes``) reproduce what
each release does, refusals and silent failures included; ``machine.Machine``
picks the releases, the GPU, cuDNN and TE's environment.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import gpu_kernels, gpu_libraries, kernels
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant
from nemo_automodel.testing.reference import segments_reference
from tests.cases import fake_kernels
from tests.fakes.machine import A10, A100, B200, H100, L40S, RTX5090, T4, Device, Machine

GPU = ("fa3", "flash", "te", "torch_varlen")
SCALE = 0.4


def _group(q_lens=(5, 4, 3, 6), k_lens=(9, 4, 7, 6), heads=(4, 2), head_dim=8, value_head_dim=None, window=None):
    """Metadata (two padding rows) and float64 ``q [1, Hq, L, D]``, ``k [1, Hkv, K, D]``, ``v [1, Hkv, K, Dv]``."""
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens) + 2, "cpu", window=window)
    gen = torch.Generator().manual_seed(0)
    dims = (head_dim, head_dim, value_head_dim or head_dim)
    sizes = ((heads[0], meta.local_len), (heads[1], meta.kv_len), (heads[1], meta.kv_len))
    q, k, v = (
        torch.randn(1, h, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
        for (h, n), d in zip(sizes, dims)
    )
    return meta, q, k, v


def _errors(got, want, inputs):
    """Max abs difference of the output and of every input gradient of ``sum(out * weights)``."""
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    grads = torch.autograd.grad((got * weights).sum(), inputs, retain_graph=True)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs, retain_graph=True)
    return [(got - want).abs().max().item()] + [(g - w).abs().max().item() for g, w in zip(grads, want_grads)]


def _run(kernel, meta, q, k, v, variant=PLAIN, dropout_p=0.0):
    return kernels.blockdiag_attention(kernel, q, k, v, meta, SCALE, dropout_p, variant)


def _reason(kernel, q, v, variant=PLAIN, dropout_p=0.0):
    return kernels.kernel_unavailable_reason(
        kernel, q.dtype, "cuda", head_dim=q.shape[3], value_head_dim=v.shape[3], dropout_p=dropout_p, variant=variant
    )


def _calls():
    return importlib.import_module("fake_varlen_core").CALLS


# ----------------------------------------------------------------------------- the stand-ins' signatures per release

# hopper/flash_attn_interface.py at each era's commit (git history of Dao-AILab/flash-attention), and
# torch/nn/attention/varlen.py of the torch 2.10.0 and 2.11.0 wheels: parameter for parameter.
FA3_SIGNATURES = {
    "2024-08": (  # 7b4e68e0
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, "
        "window_size=(-1, -1), deterministic=False, seqused_q=None, seqused_k=None",
        "q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False, descale_q=None, "
        "descale_k=None, descale_v=None",
    ),
    "2025-01": (  # 7a802796
        "q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, "
        "causal=False, q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), sink_token_length=0, "
        "softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0",
        "q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None, "
        "window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, "
        "sm_margin=0",
    ),
    "2025-04": (  # 909eb7ce (and v2.8.3)
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None, "
        "softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, "
        "window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, "
        "sm_margin=0",
        "q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, "
        "window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, "
        "sm_margin=0",
    ),
}
TORCH_VARLEN_SIGNATURES = {
    "2.10": "query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None",
    "2.11": "query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)",
}


def _spelled(fn) -> str:
    import inspect

    return str(inspect.signature(fn))[1:-1]


@pytest.mark.parametrize("era", FA3_SIGNATURES)
def test_fa3_stand_in_signatures_are_each_eras(era):
    with fake_kernels(Machine(fa3=era)):
        fa3 = importlib.import_module("flash_attn_interface")
        assert (_spelled(fa3.flash_attn_varlen_func), _spelled(fa3.flash_attn_func)) == FA3_SIGNATURES[era]


@pytest.mark.parametrize("era", TORCH_VARLEN_SIGNATURES)
def test_torch_varlen_stand_in_signatures_are_each_releases(era):
    with fake_kernels(Machine(torch_varlen=era)):
        from torch.nn.attention import varlen

        assert _spelled(varlen.varlen_attn) == TORCH_VARLEN_SIGNATURES[era]


# ----------------------------------------------------------------------------- 1. flash-attn 2.6.0/2.6.1 soft-cap


SOFTCAP = AttentionVariant(softcap=1.5, source="Gemma2ForCausalLM layer 0")


@pytest.mark.parametrize(("release", "right"), [("2.6.1", False), ("2.6.2", True)])
def test_flash_before_2_6_2_computes_softcap_gradients_without_the_tanh(release, right):
    """v2.6.1 flash_bwd_kernel.h has no soft-cap code (backward ships in v2.6.2, #1033): nothing raises."""
    meta, q, k, v = _group()
    with fake_kernels(Machine(flash=release)):
        flash_attn = importlib.import_module("flash_attn")
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q[:, :, : meta.n_real], k, v))
        out = flash_attn.flash_attn_varlen_func(
            qt, kt, vt, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, softmax_scale=SCALE, causal=True, softcap=1.5
        )
    want = segments_reference(q, k, v, meta, scale=SCALE, softcap=1.5)[0, :, : meta.n_real].transpose(0, 1)
    errors = _errors(out, want, (q, k, v))
    assert errors[0] < 1e-12  # the forward is right in both
    assert (max(errors[1:]) < 1e-10) == right


@pytest.mark.parametrize("release", ["2.6.0", "2.6.1"])
def test_flash_before_2_6_2_is_never_selected(release):
    """The floor is 2.6.2 for every call: soft-cap backward, and the split-KV accumulators our guard's call needs."""
    meta, q, k, v = _group()
    with fake_kernels(Machine(device=H100, flash=release, fa3=None, te=None)):
        for variant in (PLAIN, SOFTCAP):
            reason = _reason("flash", q, v, variant)
            assert reason is not None and f"flash-attn {release} is too old" in reason and "2.6.2" in reason
            assert kernels.select_kernel("auto", q.dtype, "cuda", head_dim=8, variant=variant) != "flash"
    with fake_kernels(Machine(device=H100, flash="2.6.2", fa3=None, te=None)):
        assert kernels.select_kernel("auto", q.dtype, "cuda", head_dim=8, variant=SOFTCAP) == "flash"
        errors = _errors(
            _run("flash", meta, q, k, v, SOFTCAP),
            segments_reference(q, k, v, meta, scale=SCALE, softcap=1.5),
            (q, k, v),
        )
        assert max(errors) < 1e-10


# ----------------------------------------------------------------------------- 2. a value head dim of its own (MLA)


MLA = {"head_dim": 16, "value_head_dim": 8}  # small stand-ins of DeepSeek-V3's 192/128


@pytest.mark.parametrize("kernel", ["flash", "torch_varlen"])
def test_flash_and_torch_reject_a_value_head_dim_of_its_own(kernel):
    """flash_api.cpp (flash-attn 2 and torch's copy): CHECK_SHAPE(v, total_k, num_heads_k, head_size)."""
    meta, q, k, v = _group(**MLA)
    with fake_kernels(Machine(device=A100)):
        reason = _reason(kernel, q, v)
        assert reason is not None and "value head dim" in reason
        with pytest.raises(RuntimeError, match="v must have shape"):
            _run(kernel, meta, q, k, v)


def test_auto_with_a_value_head_dim_of_its_own_selects_a_kernel_that_runs_it():
    """DeepSeek-V3-style calls on an A100 with flash-attn, TE main and torch 2.13: te (kv_channels=(D, Dv)) or sdpa."""
    meta, q, k, v = _group(**MLA)
    with fake_kernels(Machine(device=A100, cudnn=(9, 8, 0))):
        picked = kernels.select_kernel("auto", q.dtype, "cuda", head_dim=16, value_head_dim=8)
        assert picked not in ("flash", "torch_varlen", "fa3")
        errors = _errors(_run(picked, meta, q, k, v), segments_reference(q, k, v, meta, scale=SCALE), (q, k, v))
    assert max(errors) < 1e-10


@pytest.mark.parametrize(
    ("machine", "dims", "ok"),
    [
        (Machine(device=H100, fa3="main"), (160, 128), True),  # (128, 192] x (96, 128]
        (Machine(device=H100, fa3="main"), (64, 128), True),  # D <= 64
        (Machine(device=H100, fa3="main"), (128, 64), False),
        (Machine(device=H100, fa3="2025-04"), (160, 128), False),  # no Dv != D backward yet (2025-04-24)
        (Machine(device=H100, fa3="main", fa3_disabled=frozenset({"HDIMDIFF192"})), (160, 128), False),
    ],
)
def test_fa3_takes_some_value_head_dims_on_hopper(machine, dims, ok):
    """hopper/flash_api.cpp: the (D, Dv) pairs, 'Only Hopper supports different V headdim', the backward from 04-24."""
    meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=dims[0], value_head_dim=dims[1])
    with fake_kernels(machine):
        assert (_reason("fa3", q, v) is None) == ok
        if ok:
            errors = _errors(_run("fa3", meta, q, k, v), segments_reference(q, k, v, meta, scale=SCALE), (q, k, v))
            assert max(errors) < 1e-10


@pytest.mark.parametrize(
    ("release", "flash", "ok"), [("1.9.0", "2.5.8", False), ("1.10.0", "2.5.8", True), ("2.20.0.dev0", "2.8.3", True)]
)
def test_te_takes_a_value_head_dim_of_its_own_from_1_10(release, flash, ok):
    """dot_product_attention.py: kv_channels=(D, Dv) from 1.10; the forward asserts head_dim_v == kv_channels[1]."""
    meta, q, k, v = _group(**MLA)
    with fake_kernels(Machine(te=release, flash=flash)):
        reason = _reason("te", q, v)
        assert (reason is None) == ok, reason
        if ok:
            errors = _errors(_run("te", meta, q, k, v), segments_reference(q, k, v, meta, scale=SCALE), (q, k, v))
            assert max(errors) < 1e-10
            (module,) = gpu_kernels._TE_MODULES.values()
            assert (module.head_dim_k, module.head_dim_v) == (16, 8)


def test_the_runtime_selects_with_the_value_head_dim(tmp_path):
    """cp_blockdiag_sdpa passes Dv to selection: auto never picks flash for an MLA call, flash alone raises by name."""
    from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    ids = torch.tensor([[1] * 5 + [2] * 3])
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "_packed_seq_ids": ids}
    q, k = torch.randn(1, 4, 8, 16, dtype=torch.float64), torch.randn(1, 2, 8, 16, dtype=torch.float64)
    v = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    with fake_kernels(Machine(device=A100, te=None)):
        for backend, expect in (("auto", None), ("flash", "value head dim")):
            ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, attn_backend=backend)
            with ctx():
                if expect is None:
                    assert cp_blockdiag_sdpa(q, k, v, enable_gqa=True).shape == (1, 4, 8, 8)
                else:
                    with pytest.raises(kernels.KernelUnavailableError, match=expect):
                        cp_blockdiag_sdpa(q, k, v, enable_gqa=True)


# ----------------------------------------------------------------------------- 3. torch varlen_attn's signature


@pytest.mark.parametrize(("era", "ok"), [("2.10", False), ("2.11", True), ("2.13", True)])
def test_torch_varlen_is_offered_only_where_its_call_works(era, ok):
    """varlen.py: 2.10 has no scale/window_size; 2.11 no enable_gqa (GQA still runs); 2.12+ needs it for Hq != Hkv."""
    meta, q, k, v = _group()
    with fake_kernels(Machine(device=A100, torch_varlen=era)):
        reason = _reason("torch_varlen", q, v)
        assert (reason is None) == ok, reason
        if ok:
            errors = _errors(
                _run("torch_varlen", meta, q, k, v), segments_reference(q, k, v, meta, scale=SCALE), (q, k, v)
            )
            assert max(errors) < 1e-10
        else:
            assert "scale/window_size" in reason
            with pytest.raises(TypeError):
                _run("torch_varlen", meta, q, k, v)


def test_torch_varlen_refuses_head_dims_its_kernel_rejects():
    """torch's flash_api.cpp: TORCH_CHECK(head_size_og % 8 == 0) and varlen_attn pads nothing."""
    meta, q, k, v = _group(head_dim=12)
    with fake_kernels(Machine(device=A100)):
        assert "multiple of 8" in _reason("torch_varlen", q, v)
        with pytest.raises(RuntimeError, match="multiple of 8"):
            _run("torch_varlen", meta, q, k, v)


@pytest.mark.parametrize("device", [B200, RTX5090])
def test_torch_varlen_is_not_offered_where_its_bundled_kernel_does_not_run(device):
    """torch's flash_api.cpp: TORCH_CHECK(is_sm90 || is_sm8x) with is_sm8x = major == 8."""
    meta, q, k, v = _group()
    with fake_kernels(Machine(device=device)):
        assert "sm8x and sm90 only" in _reason("torch_varlen", q, v)
        with pytest.raises(RuntimeError, match="Ampere"):
            _run("torch_varlen", meta, q, k, v)


# ----------------------------------------------------------------------------- 4. the TE backend model


TE_CASES = [
    # (TE, cuDNN, device, flash-attn, dropout, window, backend TE uses or None)
    ("1.13.0", (9, 8, 0), H100, None, 0.0, None, None),  # no cuDNN bottom-right THD before 2.0, no unfused THD
    ("1.13.0", (9, 8, 0), H100, "2.6.3", 0.0, None, "flash"),
    ("2.1.0", (9, 6, 0), H100, None, 0.0, None, "fused"),  # cuDNN 9.6: % 64 (we round max_seqlen) and no dropout
    ("2.1.0", (9, 8, 0), H100, None, 0.1, None, None),  # 2.0-2.1 have no dropout clause
    ("2.2.0", (9, 8, 0), H100, None, 0.1, None, "fused"),  # 2.2 + cuDNN 9.7: dropout
    ("2.2.0", (9, 6, 0), H100, None, 0.1, None, None),
    ("2.5.0", (9, 10, 1), H100, None, 0.0, None, None),  # 9.10.0/9.10.1 known bugs
    ("2.10.0", (9, 8, 0), A100, None, 0.0, None, None),  # sm8x: THD cuDNN needs sm90; unfused THD from 2.11
    ("2.12.0", (9, 8, 0), A100, None, 0.0, None, "unfused"),
    ("2.12.0", (9, 8, 0), A100, "2.8.3", 0.1, None, "flash"),
    ("2.12.0", (9, 8, 0), H100, "2.8.3", 0.0, None, "fused"),  # sm90+: cuDNN preferred over flash-attn
    ("2.14.0", (9, 17, 0), RTX5090, None, 0.0, None, "unfused"),  # sm120 THD needs cuDNN 9.18.1
    ("2.14.0", (9, 18, 1), RTX5090, None, 0.0, None, "fused"),
    ("2.12.0", (9, 8, 0), H100, None, 0.1, 3, "unfused"),  # cuDNN's sliding window has no dropout
    ("2.1.0", (9, 8, 0), A100, "2.8.3", 0.0, None, None),  # TE 2.1 takes flash-attn <= 2.7.4.post1
]


@pytest.mark.parametrize(("release", "cudnn", "device", "flash", "dropout_p", "window", "backend"), TE_CASES)
def test_the_te_backend_model_matches_te_backend_selection(release, cudnn, device, flash, dropout_p, window, backend):
    """utils.py get_attention_backend and fused_attn.cpp nvte_get_fused_attn_backend, as the TE stand-in runs them."""
    meta, q, k, v = _group(head_dim=64, window=window)
    variant = AttentionVariant(window=window)
    machine = Machine(device=device, te=release, cudnn=cudnn, flash=flash, fa3=None)
    with fake_kernels(machine):
        libs = gpu_libraries.probe_gpu_libraries("cuda")
        call = KernelCall(q.dtype, 64, 64, dropout_p, variant)
        assert gpu_libraries.te_plan(libs.te, libs.device, call).backend == backend
        if backend is None:
            assert "has no backend for THD bottom-right" in _reason("te", q, v, variant, dropout_p)
            # TE raises "No dot product attention backend"; before 2.6 it picks cuDNN 9.10.0/9.10.1, which fails
            with pytest.raises((ValueError, RuntimeError), match=r"No dot product attention backend|known bugs"):
                _run("te", meta, q, k, v, variant, dropout_p)
        else:
            _calls().clear()
            out = _run("te", meta, q, k, v, variant, dropout_p)
            assert {c["backend"] for c in _calls() if c["fn"].startswith("te.")} == {backend}
            if dropout_p == 0:
                want = segments_reference(q, k, v, meta, scale=SCALE, window=window)
                assert max(_errors(out, want, (q, k, v))) < 1e-10


TE_FLASH_VIEWS = [  # (TE, flash-attn installed, the flash-attn TE uses)
    ("2.3.0", "2.7.4", (2, 7, 4)),  # FlashAttentionUtils in pytorch/attention/dot_product_attention/utils.py
    ("2.2.0", "2.7.4", (2, 7, 4)),  # ... in pytorch/dot_product_attention/utils.py
    ("2.1.0", "2.7.4", (2, 7, 4)),  # module globals of pytorch/attention.py
    ("2.1.0", "2.8.3", None),  # above TE 2.1's max_version (2.7.4.post1)
    ("1.12.0", "2.6.3", (2, 6, 3)),
]


def test_te_reads_its_flash_attn_view_where_each_release_keeps_it():
    """Where each release keeps it; 1.9-1.11 assert flash-attn's range when building the module."""
    for release, flash, seen in TE_FLASH_VIEWS:
        with fake_kernels(Machine(te=release, flash=flash)):
            te = gpu_libraries.probe_gpu_libraries("cpu").te
            assert (te.flash_version, te.construction_problem) == (seen, None), release
    with fake_kernels(Machine(te="1.11.0", flash="2.8.3")):
        meta, q, k, v = _group()
        assert "asserts flash-attn 2.0.6..2.6.3" in _reason("te", q, v)
        with pytest.raises(AssertionError, match="maximum version"):
            _run("te", meta, q, k, v)


# ----------------------------------------------------------------------------- 5. flash-attn's dropout backward


@pytest.mark.parametrize(
    ("device", "ok"),
    [
        (A100, True),
        (H100, True),
        (A10, False),
        (L40S, False),
        (RTX5090, False),
        (Device((8, 7), 163 * 1024, "Orin"), True),
    ],
)
def test_flash_dropout_backward_for_wide_heads_is_keyed_on_shared_memory(device, ok):
    """run_mha_bwd_hdim256 picks by MaxSharedMemoryPerBlockOptin: below 144 KB no dropout kernel, no gradients."""
    meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=256)
    with fake_kernels(Machine(device=device, flash="2.8.3")):
        reason = _reason("flash", q, v, dropout_p=0.1)
        assert (reason is None) == ok, reason
        torch.manual_seed(0)
        out = _run("flash", meta, q, k, v, dropout_p=0.1)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads) == ok  # the stand-in leaves NaN where the GPU leaves garbage


def test_flash_2_7_2_refuses_the_wide_dropout_backward_off_sm80_sm90():
    """v2.7.2 mha_bwd: TORCH_CHECK(is_sm80 || is_sm90, ...); removed in v2.7.3."""
    meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=256)
    with fake_kernels(Machine(device=Device((8, 7), 163 * 1024, "Orin"), flash="2.7.2")):
        assert "refuses the backward" in _reason("flash", q, v, dropout_p=0.1)
        with pytest.raises(RuntimeError, match="requires A100/A800 or H100/H800"):
            _run("flash", meta, q, k, v, dropout_p=0.1)


# ----------------------------------------------------------------------------- 6. FA3 signatures and build flags


@pytest.mark.parametrize(
    ("machine", "variant", "head_dim", "needle"),
    [
        (Machine(device=H100, fa3="2025-01"), PLAIN, 64, "requires seqused_q, seqused_k"),
        (Machine(device=H100, fa3="2024-08"), PLAIN, 96, "head dims 64/128/256"),
        (Machine(device=H100, fa3="2024-08"), SOFTCAP, 64, "no softcap parameter"),
        (Machine(device=H100, fa3_disabled=frozenset({"BACKWARD"})), PLAIN, 64, "DISABLE_BACKWARD"),
        (Machine(device=H100, fa3_disabled=frozenset({"LOCAL"})), AttentionVariant(window=3), 64, "DISABLE_LOCAL"),
        (Machine(device=H100, fa3_disabled=frozenset({"SOFTCAP"})), SOFTCAP, 64, "DISABLE_SOFTCAP"),
        (Machine(device=H100, fa3_disabled=frozenset({"HDIM256"})), PLAIN, 256, "no kernel for head dim 256"),
        (Machine(device=H100, fa3_disabled=frozenset({"VARLEN"})), PLAIN, 64, "DISABLE_VARLEN"),
        (Machine(device=A100), PLAIN, 64, "Hopper"),
    ],
)
def test_fa3_is_offered_only_where_the_build_runs_the_call(machine, variant, head_dim, needle):
    """hopper/flash_attn_interface.py signatures per era; flash_attn_config build flags; hopper/flash_api.cpp."""
    meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=head_dim, window=variant.window)
    with fake_kernels(machine):
        reason = _reason("fa3", q, v, variant)
        assert reason is not None and needle in reason
        assert kernels.select_kernel("auto", q.dtype, "cuda", head_dim=head_dim, variant=variant) != "fa3"
        if needle != "Hopper":  # the library fails too (off Hopper FA3 runs; refusing it is our choice)
            libs = gpu_libraries.probe_gpu_libraries("cuda")
            functions = gpu_kernels.FlashFunctions(libs.fa3.fixed, libs.fa3.varlen, takes_dropout=False)
            with pytest.raises((RuntimeError, TypeError)):  # around our own checks: the stand-in's error
                out = gpu_kernels._flash_family(q, k, v, meta, SCALE, 0.0, variant, functions)
                torch.autograd.grad(out.sum(), (q, k, v))


@pytest.mark.parametrize("era", ["2025-04", "2.8.3", "main"])
def test_fa3_builds_with_keyword_max_seqlen_run(era):
    meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=64)
    with fake_kernels(Machine(device=H100, fa3=era)):
        assert _reason("fa3", q, v) is None
        errors = _errors(_run("fa3", meta, q, k, v), segments_reference(q, k, v, meta, scale=SCALE), (q, k, v))
    assert max(errors) < 1e-10


# ----------------------------------------------------------------------------- 7. the boundary guard everywhere


@pytest.mark.parametrize(
    ("kernel", "machine", "window"),
    [
        ("flash", Machine(device=A100), None),
        ("fa3", Machine(device=H100), None),
        ("te", Machine(device=A100, te="2.12.0"), None),  # TE runs flash-attn 2 on sm8x
        ("te", Machine(device=A100, te="2.12.0"), 3),
        ("torch_varlen", Machine(device=A100), None),
        ("torch_varlen", Machine(device=A100), 3),
    ],
)
def test_no_varlen_launch_covers_a_segment_with_earlier_keys(kernel, machine, window):
    """Upstream's guard: a segment with k > q never enters a varlen launch, whichever library runs it."""
    meta, q, k, v = _group(q_lens=(5, 7, 3, 2, 6), k_lens=(9, 7, 8, 2, 6), window=window)
    with fake_kernels(machine):
        _calls().clear()
        out = _run(kernel, meta, q, k, v, AttentionVariant(window=window))
        varlen = [c for c in _calls() if c["fn"].endswith(("varlen_func", "_flash_attention_forward"))]
    assert varlen and all(kl == ql for c in varlen for ql, kl in zip(c["q_lens"], c["k_lens"]))
    want = segments_reference(q, k, v, meta, scale=SCALE, window=window)
    assert max(_errors(out, want, (q, k, v))) < 1e-10


def test_te_on_flash_attn_before_2_6_2_is_skipped_by_auto_and_warned_about():
    """TE would call flash-attn 2.5.8's varlen kernel over segments with earlier keys: no fixed-length way around."""
    _, q, _, v = _group()
    machine = Machine(device=A100, te="2.1.0", flash="2.5.8", fa3=None, torch_varlen="2.10")
    with fake_kernels(machine):
        assert _reason("te", q, v) is None
        assert kernels.select_kernel("auto", q.dtype, "cuda", head_dim=8) == "sdpa_varlen"


# ----------------------------------------------------------------------------- auto, across the matrix

MACHINES = {
    "a100-flash262-te212": Machine(device=A100, flash="2.6.2", fa3=None, te="2.12.0"),
    "a100-flash261-te113": Machine(device=A100, flash="2.6.1", fa3=None, te="1.13.0", torch_varlen="2.11"),
    "a10-flash283-te220": Machine(device=A10, flash="2.8.3", fa3=None),
    "l40s-flash272-te20": Machine(device=L40S, flash="2.7.2", fa3=None, te="2.0.0", torch_varlen="2.10"),
    "h100-all-main": Machine(device=H100),
    "h100-fa3-2025-01-te21": Machine(device=H100, fa3="2025-01", te="2.1.0", flash="2.7.4", cudnn=(9, 6, 0)),
    "h100-fa3-nolocal-te22": Machine(device=H100, fa3_disabled=frozenset({"LOCAL", "HDIM256"}), te="2.2.0"),
    "h100-cudnn9101": Machine(device=H100, flash=None, fa3="2024-08", cudnn=(9, 10, 1)),
    "b200-flash272": Machine(device=B200, flash="2.7.2", fa3=None, cudnn=(9, 8, 0)),
    "b200-flash283": Machine(device=B200, flash="2.8.3", fa3=None, cudnn=(9, 11, 0)),
    "rtx5090-cudnn917": Machine(device=RTX5090, flash="2.8.3", fa3=None, cudnn=(9, 17, 0), te="2.14.0"),
    "t4": Machine(device=T4, fa3=None),
}
HEAD_DIMS = {"64": (64, 64), "256": (256, 256), "mla-160/128": (160, 128), "12": (12, 12)}
CALL_VARIANTS = {"plain": PLAIN, "window": AttentionVariant(window=3), "softcap": SOFTCAP}
# Refusals that are choices, not library failures: the stand-in would run the call.
POLICY = (
    "in this project",  # fa3 off Hopper (FlashAttention-3 runs on sm80+ since 2025-02-16)
    "free the split-KV accumulators",  # flash < 2.6.2 (the use-after-free needs memory pressure to show)
    "conservatively",  # TE's FA3 above head dim 128
)


@pytest.mark.parametrize("machine", MACHINES)
def test_auto_never_selects_a_kernel_the_call_defeats(machine):
    """For every (release x device x head dims x variant x dropout): the kernel auto picks runs and is right.

    And every GPU kernel that is offered runs through its stand-in without error and
    with finite gradients (exactly right without dropout); a refused one fails there
    too, unless the refusal is one of the documented choices in POLICY.
    """
    failures = []
    with fake_kernels(MACHINES[machine]):
        for (dims_name, (d, dv)), (variant_name, variant) in itertools.product(
            HEAD_DIMS.items(), CALL_VARIANTS.items()
        ):
            meta, q, k, v = _group(q_lens=(5, 3), k_lens=(9, 3), head_dim=d, value_head_dim=dv, window=variant.window)
            want = _weighted(
                segments_reference(q, k, v, meta, scale=SCALE, window=variant.window, softcap=variant.softcap),
                (q, k, v),
            )
            for dropout in (0.0, 0.1):
                label = f"{machine} D={dims_name} {variant_name} dropout={dropout}"
                picked = kernels.select_kernel(
                    "auto", q.dtype, "cuda", head_dim=d, value_head_dim=dv, dropout_p=dropout, variant=variant
                )
                for kernel in dict.fromkeys((picked, *GPU)):
                    reason = _reason(kernel, q, v, variant, dropout)
                    outcome = _outcome(kernel, meta, q, k, v, variant, dropout, want)
                    if reason is None and outcome != "ok":
                        failures.append(
                            f"{label}: {kernel} offered{' (auto)' if kernel == picked else ''} but {outcome}"
                        )
                    if reason is not None and outcome == "ok" and not any(p in reason for p in POLICY):
                        failures.append(f"{label}: {kernel} refused but its stand-in runs it: {reason}")
    assert not failures, "\n".join(failures)


def _weighted(out, inputs):
    """``out`` and the gradients of ``sum(out * weights)`` with respect to ``inputs``."""
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out.detach(), torch.autograd.grad((out * weights).sum(), inputs)


def _outcome(kernel, meta, q, k, v, variant, dropout, want):
    """``"ok"``, or how the stand-ins defeat the kernel: an exception, non-finite or wrong output/gradients."""
    try:
        torch.manual_seed(0)
        out, grads = _weighted(_run(kernel, meta, q, k, v, variant, dropout), (q, k, v))
    except (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError) as exc:
        return f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    if not all(torch.isfinite(t).all() for t in (out, *grads)):
        return "non-finite output or gradients"
    errors = [(a - b).abs().max().item() for a, b in zip((out, *grads), (want[0], *want[1]))]
    if dropout == 0 and max(errors) > 1e-9:
        return "wrong output or gradients"
    return "ok"
