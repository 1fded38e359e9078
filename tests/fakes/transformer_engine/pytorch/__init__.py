"""Stand-in for ``transformer_engine.pytorch.DotProductAttention`` in THD format."""

from __future__ import annotations

import torch
from fake_varlen_core import varlen_attention

_MASKS = {"padding_causal_bottom_right": True, "padding_causal": False}


class DotProductAttention(torch.nn.Module):
    def __init__(
        self,
        num_attention_heads,
        kv_channels,
        num_gqa_groups=None,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal",
        softmax_scale=None,
        **kwargs,
    ):
        super().__init__()
        if qkv_format != "thd":
            raise ValueError("the stand-in implements qkv_format='thd' only")
        if attn_mask_type not in _MASKS:
            raise ValueError(f"the stand-in implements {sorted(_MASKS)}, got {attn_mask_type!r}")
        if attention_dropout:
            raise ValueError("the stand-in has no dropout")
        self.heads, self.head_dim = num_attention_heads, kv_channels
        self.gqa_groups = num_gqa_groups or num_attention_heads
        self.mask_type, self.scale = attn_mask_type, softmax_scale

    def forward(
        self,
        query_layer,
        key_layer,
        value_layer,
        attention_mask=None,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
        **kwargs,
    ):
        if query_layer.shape[1:] != (self.heads, self.head_dim) or key_layer.shape[1] != self.gqa_groups:
            raise ValueError("tensor heads/dims do not match the module configuration")
        out = varlen_attention(
            query_layer,
            key_layer,
            value_layer,
            cu_seqlens_q,
            cu_seqlens_kv,
            max_seqlen_q,
            max_seqlen_kv,
            self.scale,
            bottom_right=_MASKS[self.mask_type],
        )
        return out.reshape(out.shape[0], -1)  # TE returns [tokens, heads * dim]
