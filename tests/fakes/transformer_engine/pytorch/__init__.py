"""Stand-in for ``transformer_engine.pytorch.DotProductAttention``, release ``machine.ACTIVE.te``.

It runs the THD call our ``te`` kernel makes (and the ``bshd``/``causal_bottom_right``
call of its boundary guard) as the real one does, release by release:

1. Construction (dot_product_attention.py ``__init__``): ``kv_channels`` is an int or, from
   1.10, a ``(k, v)`` pair; before 1.12 flash-attn must be installed (pytorch/attention.py
   reads its version at import) and within TE's range (asserted in ``FlashAttention.__init__``).
2. Forward: keys/values must have the module's head dims (asserted), then the backend is
   chosen as ``get_attention_backend`` (utils.py) and ``nvte_get_fused_attn_backend``
   (common/fused_attn/fused_attn.cpp) choose it for these calls (:func:`_fused_serves`,
   :func:`_flash_serves`); none -> ``ValueError("No dot product attention backend ...")``.
3. The chosen backend computes: flash-attn 2 and FA3 through their stand-ins (so their own
   device checks and call records apply), cuDNN exactly, the unfused backend step by step
   (below). Each call is recorded with the backend it used.

The unfused backend is the one whose masks depend on ``attention_type`` (TE main,
``attention/dot_product_attention``):

1. ``backends.py`` ``UnfusedDotProductAttention._forward``: THD -> padded ``[b, max_s, h, d]``
   with ``cu_seqlens_q``/``max_seqlen_q`` for queries and ``cu_seqlens_kv``/``max_seqlen_kv`` for keys.
2. ``utils.py`` ``get_padding_mask``: ``attention_type="self"`` returns the query padding mask
   only; ``"cross"`` returns ``(query mask, key mask)``.
3. ``utils.py`` ``get_full_mask``: ``self`` broadcasts the query mask over keys
   (``[b, 1, max_q, max_q]``), so keys are masked with the *query* lengths; the
   bottom-right shift uses ``actual_seqlens_kv - actual_seqlens_q`` counted from that
   mask (0 under ``self``). ``max_kv > max_q`` under ``self`` is a broadcast error.
4. Scores ``scale * Q K^T``; sink column for ``softmax_type != "vanilla"``;
   ``masked_fill(mask, -10000.0)`` (``utils.attention_mask_func``), softmax, padded
   probabilities zeroed, sink column dropped, dropout, ``P V``, back to THD ``[t, h * d]``.

Without a pretend device (``machine.ACTIVE.device is None``) every call takes the unfused
path, as before any backend model existed. Signatures are main's (dot_product_attention.py
``__init__`` line 670, ``forward`` line 1380), every parameter with its default; 2.10 has the
same parameters minus ``bottom_right_diagonal``/``name`` and the forward's
``bf16_backward``/``score_mod*``/``qkv_layer`` group. Only the parameters our kernels
and their windows/sinks use are implemented; anything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os

import machine
import torch
from fake_varlen_core import attend, check_dtypes, record
from packaging.version import Version

from transformer_engine.pytorch import flash_view

TE = flash_view.TE
if TE < (1, 12) and machine.ACTIVE.flash is None:  # pytorch/attention.py: get_pkg_version("flash-attn") at import
    raise importlib.metadata.PackageNotFoundError("flash-attn")

_MASK_TYPES = {"thd": {"padding", "padding_causal", "padding_causal_bottom_right"}, "bshd": {"causal_bottom_right"}}
NO_BACKEND = (
    "No dot product attention backend is available for the provided inputs. Please run with NVTE_DEBUG=1 "
    "NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all backends."
)


def _padded(x: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """THD ``[t, h, d]`` -> ``[b, max_len, h, d]``, zeros past each sequence (ConvertTHDtoBSHD)."""
    starts, lens = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
    out = x.new_zeros(len(lens), max_len, *x.shape[1:])
    for i, (s, n) in enumerate(zip(starts, lens)):
        out[i, :n] = x[s : s + n]
    return out


def _unpadded(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[b, max_len, ...]`` -> THD ``[t, ...]`` (ConvertBSHDtoTHD)."""
    lens = (cu[1:] - cu[:-1]).tolist()
    return torch.cat([x[i, :n] for i, n in enumerate(lens)])


def _padding_mask(cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[b, 1, 1, max_len]``, True at padding (utils.get_padding_mask)."""
    lens = cu[1:] - cu[:-1]
    return (torch.arange(max_len)[None, :] >= lens[:, None]).view(-1, 1, 1, max_len)


def _full_mask(max_q, max_kv, mask_type, attention_mask, window_size, attention_type):
    """utils.get_full_mask for the padding mask types (True = masked)."""
    if "causal" in mask_type:
        window_size = (window_size[0], 0)
    window = (max_kv if window_size[0] == -1 else window_size[0], max_q if window_size[1] == -1 else window_size[1])
    if attention_type == "self":
        attention_mask = torch.logical_or(attention_mask.squeeze(1).unsqueeze(3), attention_mask)
    else:
        attention_mask = torch.logical_or(attention_mask[0].squeeze(1).unsqueeze(3), attention_mask[1])
    kept = attention_mask.logical_not()
    actual_q, actual_kv = kept[:, 0, :, 0].sum(dim=1), kept[:, 0, 0, :].sum(dim=1)
    diff = (torch.arange(max_q).view(1, 1, max_q, 1) - torch.arange(max_kv).view(1, 1, 1, max_kv)).expand(
        attention_mask.shape[0], 1, max_q, max_kv
    )
    if mask_type == "padding_causal":  # top-left
        shift = torch.zeros_like(actual_q)
    else:  # padding_causal_bottom_right, and padding with the default bottom-right alignment
        shift = actual_kv - actual_q
    swa_left = diff + (shift - window[0]).view(-1, 1, 1, 1)
    swa_right = diff + (shift + window[1]).view(-1, 1, 1, 1)
    swa_mask = torch.logical_not((swa_left <= 0) & ~(swa_right < 0))
    return torch.logical_or(swa_mask, attention_mask)


# ----------------------------------------------------------------------------- backend choice, as TE makes it


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def _cudnn() -> int:
    major, minor, patch = machine.ACTIVE.cudnn
    return major * 10000 + minor * 100 + patch


def _flash_serves(cc, d, dv, max_q, max_kv, left) -> bool:
    """get_attention_backend's flash-attn 2 filters for these calls."""
    if not (_env_on("NVTE_FLASH_ATTN") and flash_view.IN_RANGE and cc >= (8, 0)):
        return False
    flash = Version(flash_view.FLASH)
    if cc >= (10, 0) and flash < Version("2.7.3"):  # version_required_blackwell
        return False
    if d != dv and TE < (2, 18):  # "Disabling FlashAttention 2 as it does not support MLA."
        return False
    width = max(d, dv)  # fa2_padded_head_dim (2.18); d otherwise
    wide_ok = ((8, 0), (9, 0), (10, 0), (12, 0)) if TE >= (2, 2) else ((8, 0), (9, 0))
    if width % 8 or width > 256 or (width > 192 and cc not in wide_ok):
        return False
    if left >= 0 and flash < Version("2.3"):  # sliding window needs 2.3
        return False
    return not (max_q != max_kv and flash < Version("2.1"))  # bottom-right diagonal since 2.1


def _fa3_serves(cc, d, dv, dropout) -> bool:
    """TE's FA3 filters, as the project models them (sm90, no dropout, equal head dims up to 128)."""
    return (
        _env_on("NVTE_FLASH_ATTN") and flash_view.FA3 and cc == (9, 0) and dropout == 0 and d == dv
        and d % 8 == 0 and d <= 128
    )  # fmt: skip


def _fused_serves(cc, d, dv, max_q, max_kv, qkv_format, left, dropout, same_heads) -> bool:
    """nvte_get_fused_attn_backend's F16 clauses for these calls (training, no bias, vanilla softmax)."""
    if not _env_on("NVTE_FUSED_ATTN"):
        return False
    sm, cv = cc[0] * 10 + cc[1], _cudnn()
    deterministic = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
    arch = (cv >= 8903 and 80 <= sm < 100) or (cv >= 90700 and sm >= 100) if TE >= (2, 5) else cv >= 8903 and sm >= 80
    if TE >= (2, 5):
        heads = (
            d % 8 == 0
            and dv % 8 == 0
            and (
                (d <= 128 and dv <= 128)
                or (d <= 256 and dv <= 256 and sm == 90 and cv >= 90500)
                or (d == 192 and dv == 128 and sm >= 100 and cv >= 91100)
                or (TE >= (2, 18) and d == dv == 256 and 100 <= sm < 110 and cv >= 92500 and dropout == 0)
            )
        )
        mla_bug = (
            sm == 90
            and d >= 128
            and dv >= 128
            and (d, dv) != (192, 128)
            and d != dv
            and (
                (TE[:2] == (2, 6) and cv // 100 in (911, 912))
                or (TE[:2] == (2, 7) and cv // 100 in (911, 912, 913))
                or (TE >= (2, 8) and cv >= 91100)
            )
        )
        heads = heads and not mla_bug
    else:
        heads = ((d <= 128 and dv <= 128) or (sm >= 90 and cv >= 90000 and d <= 256 and dv <= 256)) and (
            d % 8 == 0 and dv % 8 == 0
        )
        heads = heads and not (TE >= (2, 0) and sm >= 100 and (d > 128 or dv > 128))
    if qkv_format == "thd":
        fmt = sm >= 90 and ((cv >= 90100 and same_heads) or cv >= 90600)
        mask = TE >= (2, 0) and (
            (cv >= 90600 and max_q % 64 == 0 and max_kv % 64 == 0 and max_q <= max_kv and dropout == 0)
            or (TE >= (2, 2) and cv >= 90700 and max_q <= max_kv)
        )
    else:  # bshd + causal_bottom_right
        fmt = True
        mask = (cv >= 90300 and max_q % 64 == 0 and max_kv % 64 == 0 and max_q <= max_kv and dropout == 0) or (
            TE >= (2, 2) and cv >= 90700 and max_q <= max_kv
        )
    window = left == -1 or (cv >= 90600 and (sm < 100 or cv > 90700) and max_q <= max_kv and dropout == 0)
    broken = (TE >= (2, 6) and cv in (91000, 91001)) or (TE >= (2, 10) and cv == 91400 and left != -1 and max_kv > 1024)
    blackwell_determinism = TE < (2, 12) or sm < 100 or not deterministic or (cv >= 91801 and dropout == 0)
    sm120 = not (TE >= (2, 14) and sm == 120 and cv < 91801)
    return arch and heads and fmt and mask and window and not broken and blackwell_determinism and sm120


def _select_backend(cc, d, dv, max_q, max_kv, qkv_format, left, dropout, same_heads) -> str | None:
    flash = _flash_serves(cc, d, dv, max_q, max_kv, left)
    fa3 = _fa3_serves(cc, d, dv, dropout)
    fused = _fused_serves(cc, d, dv, max_q, max_kv, qkv_format, left, dropout, same_heads)
    unfused = _env_on("NVTE_UNFUSED_ATTN") and (qkv_format != "thd" or TE >= (2, 11))
    if (flash or fa3) and fused and cc >= (9, 0):  # "Select FusedAttention for performance"
        flash = fa3 = False
    return next(
        (name for name, ok in (("fa3", fa3), ("flash", flash), ("fused", fused), ("unfused", unfused)) if ok), None
    )


def _fa2_padded(q, k, v):
    """TE >= 2.18 runs flash-attn 2 with q/k/v zero-padded to ``max(head_dim_qk, head_dim_v)`` (then slices)."""
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1]))  # noqa: E731
    return pad(q), pad(k), pad(v)


# ----------------------------------------------------------------------------- the module


class DotProductAttention(torch.nn.Module):
    """THD (and guard-call BSHD) attention; see the module docstring."""

    def __init__(
        self,
        num_attention_heads,
        kv_channels,
        num_gqa_groups=None,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal",
        window_size=None,
        bottom_right_diagonal=None,
        sequence_parallel=False,
        tp_size=1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number=None,
        attention_type="self",
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type="p2p",
        softmax_scale=None,
        softmax_type="vanilla",
        return_max_logit=False,
        name=None,
    ):
        super().__init__()
        attn_mask_type = attn_mask_type.replace(",", "_")
        if attn_mask_type == "causal_padding":
            attn_mask_type = "padding_causal"
        assert attention_type in ("self", "cross"), f"attention_type {attention_type} not supported"
        assert softmax_type in ("vanilla", "off-by-one", "learnable"), f"softmax_type {softmax_type} not supported"
        if attn_mask_type not in _MASK_TYPES.get(qkv_format, ()):
            raise NotImplementedError(
                "the stand-in implements thd with padding masks and bshd with causal_bottom_right"
            )
        if sequence_parallel or tp_size != 1 or cp_group is not None or return_max_logit or bottom_right_diagonal:
            raise NotImplementedError("the stand-in implements no parallelism, max logit or diagonal override")
        if not isinstance(kv_channels, int) and TE < (1, 10):  # 1.9: hidden_size_per_attention_head = kv_channels
            raise TypeError("can't multiply sequence by non-int of type 'int'")
        if TE < (1, 12) and not flash_view.IN_RANGE:  # FlashAttention.__init__ asserts the version range
            raise AssertionError(f"FlashAttention maximum version {flash_view.MAX} is supported.")
        self.num_attention_heads = num_attention_heads
        self.head_dim_k = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.head_dim_v = kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.attention_type = attention_type
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim_k) if softmax_scale is None else softmax_scale
        self.attention_dropout = torch.nn.Dropout(attention_dropout)
        self.softmax_type = softmax_type
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(num_attention_heads)
        else:  # TE allocates it uninitialized (torch.empty); zeros keep the stand-in deterministic
            self.softmax_offset = torch.nn.Parameter(torch.zeros(num_attention_heads))

    def forward(
        self,
        query_layer=None,
        key_layer=None,
        value_layer=None,
        attention_mask=None,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
        attn_mask_type=None,
        window_size=None,
        bottom_right_diagonal=None,
        checkpoint_core_attention=False,
        core_attention_bias_type="no_bias",
        core_attention_bias=None,
        alibi_slopes=None,
        fast_zero_fill=True,
        inference_params=None,
        pad_between_seqs=None,
        fp8_output=False,
        bf16_backward=False,
        num_splits=1,
        score_mod=None,
        score_mod_bprop=None,
        score_mod_tensors=None,
        score_mod_bprop_tensors=None,
        qkv_layer=None,
        kv_layer=None,
        qkv_interleave_dim=-3,
    ):
        """THD ``[t_q, Hq, D]``, ``[t_kv, Hkv, D|Dv]`` -> ``[t_q, Hq * Dv]``; BSHD ``[1, s, ...]`` likewise."""
        fmt = qkv_format or self.qkv_format
        if attention_mask is not None or qkv_layer is not None or fmt != self.qkv_format:
            raise NotImplementedError("the stand-in implements separate q/k/v in the module's format, no mask")
        if core_attention_bias_type != "no_bias" or alibi_slopes is not None or score_mod is not None:
            raise NotImplementedError("the stand-in implements no bias, ALiBi or score_mod")
        mask_type = attn_mask_type or self.attn_mask_type
        window = window_size if window_size is not None else self.window_size
        if window is None:
            window = (-1, 0) if "causal" in mask_type else (-1, -1)
        q, k, v = query_layer, key_layer, value_layer
        check_dtypes(q, k, v)
        head_dim_qk, head_dim_v = q.shape[-1], v.shape[-1]
        assert q.shape[-1] == k.shape[-1], "Queries and keys must have the same head dimension!"
        assert head_dim_qk == self.head_dim_k, f"Keys have head_dim = {head_dim_qk}, but expected {self.head_dim_k}!"
        assert head_dim_v == self.head_dim_v, f"Values have head_dim = {head_dim_v}, but expected {self.head_dim_v}!"
        assert k.shape[-2] == self.num_gqa_groups, f"Keys and values must have num_gqa_group = {self.num_gqa_groups}"
        if fmt == "bshd":
            return self._bshd(q, k, v, mask_type, window)
        return self._thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask_type, window)

    def _thd(self, q, k, v, cu_q, cu_kv, max_q, max_kv, mask_type, window):
        # DotProductAttention.forward's THD checks
        assert all(len(x.shape) == 3 for x in (q, k, v)), "Queries, keys and values must be 3D tensors"
        assert "padding" in mask_type, "Attention mask type must be padding or padding_causal for qkv_format=thd!"
        assert cu_q is not None and cu_kv is not None
        assert cu_q.shape == cu_kv.shape and len(cu_q.shape) == 1
        assert cu_q.dtype == torch.int32 and cu_kv.dtype == torch.int32
        lens = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_kv[1:] - cu_kv[:-1]).tolist()
        if max_q is None:  # dot_product_attention.py: rounded up to a multiple of 64
            max_q = (max(lens[0]) + 63) // 64 * 64
        if max_kv is None:
            max_kv = (max(lens[1]) + 63) // 64 * 64
        backend = self._backend(q, k, v, max_q, max_kv, "thd", window)
        segments = [(0, a, 0, b) for a, b in zip(*lens)]
        record(
            "te.DotProductAttention", segments, backend=backend, attention_type=self.attention_type, mask_type=mask_type
        )
        if backend == "unfused":
            return self._unfused(q, k, v, cu_q, cu_kv, max_q, max_kv, mask_type, window)
        seqlens = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_kv, "max_seqlen_q": max_q, "max_seqlen_k": max_kv}
        if backend == "flash":
            q, k, v = _fa2_padded(q, k, v)  # 2.18: fa2_padded_head_dim = max(head_dim_qk, head_dim_v)
            flash_attn = importlib.import_module("flash_attn")
            out = flash_attn.flash_attn_varlen_func(q, k, v, **seqlens, **self._flash_options(window))
            out = out[..., : self.head_dim_v]
        elif backend == "fa3":
            options = {key: value for key, value in self._flash_options(window).items() if key != "dropout_p"}
            out = importlib.import_module("flash_attn_interface").flash_attn_varlen_func(q, k, v, **seqlens, **options)
            out = out[0] if isinstance(out, tuple) else out
        else:
            out = self._fused(q, k, v, cu_q, cu_kv, window)
        return out.flatten(1)

    def _bshd(self, q, k, v, mask_type, window):
        assert q.shape[0] == 1, "the stand-in implements batch 1 for the guard's bshd call"
        backend = self._backend(q[0], k[0], v[0], q.shape[1], k.shape[1], "bshd", window)
        record("te.DotProductAttention[bshd]", [(0, q.shape[1], 0, k.shape[1])], backend=backend, mask_type=mask_type)
        if backend == "flash":
            flash_attn = importlib.import_module("flash_attn")
            out = flash_attn.flash_attn_func(*_fa2_padded(q, k, v), **self._flash_options(window))[
                ..., : self.head_dim_v
            ]
        elif backend == "fa3":
            options = {key: value for key, value in self._flash_options(window).items() if key != "dropout_p"}
            out = importlib.import_module("flash_attn_interface").flash_attn_func(q, k, v, **options)
            out = out[0] if isinstance(out, tuple) else out
        else:  # cuDNN and the unfused backend compute the same bottom-right causal window here
            cu_q = torch.tensor([0, q.shape[1]], dtype=torch.int32)
            cu_kv = torch.tensor([0, k.shape[1]], dtype=torch.int32)
            out = self._fused(q[0], k[0], v[0], cu_q, cu_kv, window)[None]
        return out.flatten(2)

    def _backend(self, q, k, v, max_q, max_kv, fmt, window):
        capability = machine.capability()
        if capability is None:  # no pretend device: the unfused path, as TE runs it on any GPU from 2.11
            return "unfused" if fmt == "thd" else "fused"
        backend = _select_backend(
            capability, q.shape[-1], v.shape[-1], max_q, max_kv, fmt, window[0], self.attention_dropout.p,
            q.shape[-2] == k.shape[-2],
        )  # fmt: skip
        if backend is None:
            raise ValueError(NO_BACKEND)
        if backend == "fused" and _cudnn() in (91000, 91001):
            raise RuntimeError("cuDNN 9.10.0/9.10.1: known bugs with SDPA F16 (TE >= 2.6 excludes them)")
        if backend == "fused" and capability == (12, 0) and _cudnn() < 91801:
            raise RuntimeError("cuDNN Error: sm120 is not supported before cuDNN 9.18.1")
        return backend

    def _flash_options(self, window):
        return {
            "dropout_p": self.attention_dropout.p if self.training else 0.0,
            "softmax_scale": self.softmax_scale,
            "causal": True,
            "window_size": (window[0], 0),
        }

    def _fused(self, q, k, v, cu_q, cu_kv, window):
        if self.softmax_offset is not None:
            raise NotImplementedError("the stand-in runs sinks on the unfused path only")
        segments = [(a, b, c, d) for (a, b), (c, d) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                                            zip(cu_kv[:-1].tolist(), cu_kv[1:].tolist()))]  # fmt: skip
        dropout = self.attention_dropout.p if self.training else 0.0
        out, _ = attend(q, k, v, segments, scale=self.softmax_scale, left=window[0], right=0, dropout_p=dropout)
        return out

    def _unfused(self, q, k, v, cu_q, cu_kv, max_q, max_kv, mask_type, window):
        qb, kb, vb = _padded(q, cu_q, max_q), _padded(k, cu_kv, max_kv), _padded(v, cu_kv, max_kv)
        if self.attention_type == "self":
            mask = _padding_mask(cu_q, max_q)
        else:
            mask = (_padding_mask(cu_q, max_q), _padding_mask(cu_kv, max_kv))
        mask = _full_mask(max_q, max_kv, mask_type, mask, window, self.attention_type)
        rep = q.shape[1] // k.shape[1]
        kb, vb = kb.repeat_interleave(rep, dim=2), vb.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", qb, kb) * self.softmax_scale  # [b, h, max_q, max_kv]
        if self.softmax_offset is not None:  # the sink: one more logit per head, never masked
            sink = self.softmax_offset.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            scores = torch.cat((scores, sink), dim=-1)
            mask = torch.nn.functional.pad(mask, (0, 1), value=False)
        probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1).masked_fill(mask, 0.0)
        if self.softmax_offset is not None:
            probs = probs[..., :-1]
        probs = self.attention_dropout(probs)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vb)
        return _unpadded(out, cu_q).flatten(1)
