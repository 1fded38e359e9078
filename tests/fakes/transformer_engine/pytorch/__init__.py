"""Stand-in for ``transformer_engine.pytorch.DotProductAttention`` on THD input, as its unfused backend runs it.

The unfused backend is what TE picks for THD on sm8x without flash-attn, with
cuDNN 9.10.0/9.10.1, or with ``NVTE_FUSED_ATTN=0`` (TE >= 2.11); it is the one
whose masks depend on ``attention_type``, so the stand-in reproduces it step by
step (TE main, ``attention/dot_product_attention``):

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

Signatures are main's (dot_product_attention.py ``__init__`` line 670, ``forward``
line 1380), every parameter with its default; 2.10 has the same parameters minus
``bottom_right_diagonal``/``name`` and the forward's ``bf16_backward``/``score_mod*``/``qkv_layer``
group. Only THD input and the parameters our kernels and their windows/sinks use are implemented;
anything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import math

import torch
from fake_varlen_core import check_dtypes, record

_MASK_TYPES = {"padding", "padding_causal", "padding_causal_bottom_right"}


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


class DotProductAttention(torch.nn.Module):
    """THD attention, TE's unfused backend (see the module docstring)."""

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
        if qkv_format != "thd" or attn_mask_type not in _MASK_TYPES:
            raise NotImplementedError("the stand-in implements qkv_format='thd' with padding mask types only")
        if sequence_parallel or tp_size != 1 or cp_group is not None or return_max_logit or bottom_right_diagonal:
            raise NotImplementedError("the stand-in implements no parallelism, max logit or diagonal override")
        self.num_attention_heads = num_attention_heads
        self.head_dim = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.attention_type = attention_type
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
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
        """``[t_q, Hq, D]``, ``[t_kv, Hkv, D]`` x2 -> ``[t_q, Hq * D]``."""
        if (qkv_format or self.qkv_format) != "thd" or attention_mask is not None or qkv_layer is not None:
            raise NotImplementedError("the stand-in implements separate THD q/k/v without an explicit mask")
        if core_attention_bias_type != "no_bias" or alibi_slopes is not None or score_mod is not None:
            raise NotImplementedError("the stand-in implements no bias, ALiBi or score_mod")
        mask_type = attn_mask_type or self.attn_mask_type
        window = window_size if window_size is not None else self.window_size
        q, k, v = query_layer, key_layer, value_layer
        # DotProductAttention.forward's THD checks
        assert all(len(x.shape) == 3 for x in (q, k, v)), "Queries, keys and values must be 3D tensors"
        assert "padding" in mask_type, "Attention mask type must be padding or padding_causal for qkv_format=thd!"
        assert cu_seqlens_q is not None and cu_seqlens_kv is not None
        assert cu_seqlens_q.shape == cu_seqlens_kv.shape and len(cu_seqlens_q.shape) == 1
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_kv.dtype == torch.int32
        check_dtypes(q, k, v)
        if q.shape[1:] != (self.num_attention_heads, self.head_dim) or k.shape[1] != self.num_gqa_groups:
            raise RuntimeError("query/key heads and head dim differ from the module's configuration")
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist(), (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).tolist()
        if max_seqlen_q is None:
            max_seqlen_q = (max(lens[0]) + 63) // 64 * 64
        if max_seqlen_kv is None:
            max_seqlen_kv = (max(lens[1]) + 63) // 64 * 64
        segments = [(0, a, 0, b) for a, b in zip(*lens)]
        record("te.DotProductAttention", segments, attention_type=self.attention_type, mask_type=mask_type)
        if window is None:
            window = (-1, 0) if "causal" in mask_type else (-1, -1)
        return self._unfused(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask_type, window)

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
