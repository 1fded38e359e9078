"""Tiny configs of real transformers model families, with the attention features each one exercises.

Every config is small enough for float64 CPU tests (hidden 32, 2 layers, 4 query /
2 K/V heads, vocabulary 64) and small-windowed (3 to 5 keys), so that a window
bites on documents of 8 to 20 tokens. Families that mix windowed and full layers
do so here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 64
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "use_cache": False,
    "attention_dropout": 0.0,
}


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON)


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=4)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    # layer 0 full (below max_window_layers), layer 1 windowed
    return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=3, max_window_layers=1)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=8)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_COMMON,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,  # small, so the cap changes the scores of a tiny random model
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=8,
    )


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON,
        head_dim=8,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_COMMON,
        head_dim=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
    )


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**_COMMON, sliding_window=5, pad_token_id=0)


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    # MLA: q/k head dim 8 + 4 (nope + rope), value head dim 6
    # MLA expands its latent to one K/V head per query head (as the real config: kv heads == heads)
    return DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": _COMMON["num_attention_heads"]},
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        first_k_dense_replace=2,  # dense MLPs: attention is what is under test
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=16,
    )


@dataclass(frozen=True)
class Family:
    """One model family: its tiny config and what its attention does beyond plain causal.

    Attributes:
        name: Short name used in test ids.
        make_config: Builds the tiny ``PretrainedConfig``.
        features: Human summary of the attention features (README table).
        variant_layers: Layer indices whose attention is not plain causal (the can-fail check
            needs at least one).
    """

    name: str
    make_config: Callable[[], Any]
    features: str
    variant_layers: tuple[int, ...]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", _llama, "causal, GQA", ()),
        Family("mistral", _mistral, "sliding window (every layer)", (0, 1)),
        Family("qwen2", _qwen2, "sliding window on layers >= max_window_layers", (1,)),
        Family("qwen3", _qwen3, "causal, GQA, q/k norm", ()),
        Family("gemma2", _gemma2, "soft-cap + sliding/full layers", (0, 1)),
        Family("gemma3", _gemma3, "sliding/full layers", (0,)),
        Family("gpt_oss", _gpt_oss, "sinks + sliding/full layers, MoE", (0, 1)),
        Family("phi3", _phi3, "sliding window (every layer)", (0, 1)),
        Family("deepseek_v3", _deepseek_v3, "MLA (value head dim != q/k head dim)", ()),
    )
}


def _perturb_sinks(model: torch.nn.Module) -> None:
    """gpt-oss initializes sinks to a constant; make them differ per head so a wrong head mapping shows."""
    gen = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))


def _config(name: str, **kwargs: Any) -> Any:
    """``transformers.<name>Config`` with the common tiny shape, overridden by ``kwargs``."""
    import transformers

    return getattr(transformers, f"{name}Config")(**{**_COMMON, **kwargs})


# Mamba-style mixers: 4 heads of 8 (or 16), state 4, conv 4, scan chunks of 8 (all cross the 44-token row's documents).
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 4, "mamba_chunk_size": 8}
_MAMBA2 |= {"mamba_d_conv": 4, "mamba_expand": 2}
_MOE = {"num_experts_per_tok": 1, "moe_intermediate_size": 16}
# Llama 4 text with chunks that bite on the 44-token row (chunk 4); its NoPE temperature bites too (floor_scale 4)
# or not (floor_scale 64)...
_LLAMA4 = {"head_dim": 8, "num_local_experts": 1, "num_experts_per_tok": 1, "intermediate_size_mlp": 64}
_LLAMA4 |= {
    "no_rope_layers": [1, 0],
    "interleave_moe_layer_step": 2,
    "attn_temperature_tuning": True,
    "attn_scale": 0.5,
}


@dataclass(frozen=True)
class TableEntry:
    """One transformers causal-LM class of the model table: exact under packing + CP, or refused by name.

    Attributes:
        name: Short name used in test ids.
        make_config: Builds the tiny config.
        refused: The blocker kinds the load-time check must name (empty: the class is exact).
        reason: Why, as the docs table says it.
    """

    name: str
    make_config: Callable[[], Any]
    refused: tuple[str, ...]
    reason: str


TABLE: dict[str, TableEntry] = {
    e.name: e
    for e in (
        # top-2 of 3 experts: with top-1 the renormalized routing weight is 1 and the router gets no gradient
        TableEntry("mixtral", lambda: _config("Mixtral", num_local_experts=3, num_experts_per_tok=2), (), "MoE"),
        TableEntry("starcoder2", lambda: _config("Starcoder2", sliding_window=4), (), "sliding window, biases"),
        TableEntry(
            "cohere2",
            lambda: _config(
                "Cohere2", head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
            ),
            (),
            "sliding/full layers, parallel block",
        ),
        TableEntry(
            "olmo3",
            lambda: _config("Olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
            (),
            "sliding/full layers, q/k norm",
        ),
        TableEntry("qwen3_moe", lambda: _config("Qwen3Moe", head_dim=8, num_experts=2, **_MOE), (), "MoE, q/k norm"),
        TableEntry(
            "granite",
            lambda: _config("Granite", attention_multiplier=0.2, embedding_multiplier=2.0, logits_scaling=2.0),
            (),
            "attention multiplier (scaling)",
        ),
        TableEntry("glm4", lambda: _config("Glm4", head_dim=8, pad_token_id=0), (), "partial rotary, extra norms"),
        TableEntry("gpt_neox", lambda: _config("GPTNeoX", rotary_pct=0.5), (), "fused QKV, partial rotary"),
        TableEntry("phi", lambda: _config("Phi", partial_rotary_factor=0.5), (), "partial rotary, parallel block"),
        TableEntry("smollm3", lambda: _config("SmolLM3", no_rope_layers=[1, 0], pad_token_id=0), (), "NoPE layers"),
        TableEntry("olmo2", lambda: _config("Olmo2"), (), "q/k norm"),
        TableEntry("stablelm", lambda: _config("StableLm", partial_rotary_factor=0.5), (), "partial rotary"),
        TableEntry(
            "llama4_text",
            lambda: _config("Llama4Text", **_LLAMA4, attention_chunk_size=4, floor_scale=4),
            ("row-position scaling",),
            "the NoPE temperature bites on rows of floor_scale tokens or more",
        ),
        TableEntry(
            "llama4_text_chunked",
            lambda: _config("Llama4Text", **_LLAMA4, attention_chunk_size=4, floor_scale=64),
            (),
            "chunked/full layers (chunks of 4, shorter than the documents), NoPE temperature: exact on rows "
            "< floor_scale",
        ),
        TableEntry(
            "jamba",
            lambda: _config(
                "Jamba",
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=2,
                num_experts_per_tok=1,
                mamba_d_state=4,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=4,
            ),
            ("state-space", "convolution"),
            "Mamba layers",
        ),
        TableEntry(
            "bamba", lambda: _config("Bamba", attn_layer_indices=[1], **_MAMBA2), ("state-space",), "Mamba2 layers"
        ),
        TableEntry(
            "zamba2",
            lambda: _config(
                "Zamba2",
                layers_block_type=["mamba", "hybrid"],
                mamba_d_state=4,
                mamba_headdim=8,
                n_mamba_heads=8,
                mamba_ngroups=1,
                attention_head_dim=8,
                num_mem_blocks=1,
                chunk_size=8,
            ),
            ("state-space",),
            "Mamba2 layers (shared attention blocks)",
        ),
        TableEntry(
            "falcon_h1",
            lambda: _config(
                "FalconH1",
                head_dim=8,
                mamba_d_ssm=32,
                mamba_n_heads=4,
                mamba_d_head=8,
                mamba_n_groups=1,
                mamba_d_state=4,
                mamba_chunk_size=8,
                mamba_d_conv=4,
            ),
            ("state-space",),
            "Mamba2 mixer in parallel with attention in every layer",
        ),
        TableEntry(
            "lfm2",
            lambda: _config("Lfm2", layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=64),
            ("convolution",),
            "short convolutions along the sequence",
        ),
        TableEntry(
            "qwen3_next",
            lambda: _config(
                "Qwen3Next",
                layer_types=["linear_attention", "full_attention"],
                head_dim=8,
                linear_num_value_heads=2,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=3,
                num_experts=2,
                shared_expert_intermediate_size=16,
                **_MOE,
            ),
            ("state-space",),
            "gated DeltaNet (linear attention) layers",
        ),
        TableEntry(
            "minimax",
            lambda: _config(
                "MiniMax",
                layer_types=["linear_attention", "full_attention"],
                head_dim=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                block_size=4,
            ),
            ("bypasses attention interface",),
            "lightning (linear) attention layers",
        ),
        TableEntry(
            "granitemoehybrid",
            lambda: _config(
                "GraniteMoeHybrid",
                layer_types=["mamba", "attention"],
                num_local_experts=2,
                num_experts_per_tok=1,
                **_MAMBA2,
            ),
            ("state-space",),
            "Mamba2 layers",
        ),
        TableEntry(
            "recurrent_gemma",
            lambda: _recurrent_gemma(),
            ("convolution",),
            "RG-LRU recurrence and its convolution",
        ),
        TableEntry(
            "bloom",
            lambda: _bloom(),
            ("alibi",),
            "ALiBi in its own attention code (never calls the attention interface)",
        ),
        TableEntry("mpt", lambda: _mpt(), ("alibi",), "ALiBi in its own attention code"),
        TableEntry("falcon_alibi", lambda: _falcon(alibi=True), ("alibi",), "ALiBi in its own attention code"),
        TableEntry("falcon", lambda: _falcon(alibi=False), ("bypasses attention interface",), "its own attention code"),
    )
}


def _recurrent_gemma() -> Any:
    from transformers import RecurrentGemmaConfig

    shape = {k: v for k, v in _COMMON.items() if k not in ("max_position_embeddings", "tie_word_embeddings")}
    return RecurrentGemmaConfig(
        **shape,
        lru_width=32,
        attention_window_size=8,
        block_types=["recurrent", "attention"],
        conv1d_width=3,
        head_dim=8,
    )


def _bloom() -> Any:
    from transformers import BloomConfig

    return BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False)


def _mpt() -> Any:
    from transformers import MptConfig

    return MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=128, use_cache=False)


def _falcon(alibi: bool) -> Any:
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=alibi, use_cache=False
    )


def make_config(name: str) -> Any:
    """The tiny config of a family (:data:`FAMILIES`) or a model-table class (:data:`TABLE`)."""
    return FAMILIES[name].make_config() if name in FAMILIES else TABLE[name].make_config()


def build_model(name: str, attn_implementation: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny causal LM in float64, eval mode, seeded weights (same seed -> same weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(name)
    # eager experts: the grouped-mm MoE kernels have no float64
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, attn_implementation=attn_implementation, experts_implementation="eager"
    )
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it: named in CP errors
    _perturb_sinks(model)
    return model.eval()


# A packed row of five documents (44 tokens): at cp=2 and cp=3 documents straddle ranks, and the
# 14-token one spans more than a window, so windows cut keys that live on another rank.
DOC_LENGTHS = (9, 14, 3, 12, 6)
# (layout, kv_exchange) pairs every family runs
EXCHANGES = (("contiguous", "halo"), ("contiguous", "a2a"), ("balanced", "a2a"), ("auto", "auto"))


def packed_row(lengths: tuple[int, ...] = DOC_LENGTHS, seed: int = 0) -> dict[str, torch.Tensor]:
    """One packed row: token ids, per-document positions and 1-based document ids, ``[1, S]`` each."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return {
        "input_ids": torch.randint(0, VOCAB, (1, total), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "_packed_seq_ids": torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None],
    }


def output_grad(total: int, seed: int = 1) -> torch.Tensor:
    """A fixed random cotangent ``[total, VOCAB]`` for the logits (a loss that weighs every logit)."""
    return torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def reference_run(name: str, lengths: tuple[int, ...] = DOC_LENGTHS) -> dict[str, Any]:
    """The independent expectation: each document alone through the eager model (no packing, no CP).

    Returns ``{"logits": [S, V], "grads": {param: grad}}`` for the loss ``sum(logits * output_grad)``.
    """
    model = build_model(name, "eager")
    row = packed_row(lengths)
    gout = output_grad(sum(lengths))
    logits, start = [], 0
    for n in lengths:
        ids = row["input_ids"][:, start : start + n]
        out = model(input_ids=ids, position_ids=torch.arange(n)[None]).logits[0]
        (out * gout[start : start + n]).sum().backward()
        logits.append(out.detach())
        start += n
    grads = {p: t.grad.clone() for p, t in model.named_parameters() if t.grad is not None}
    return {"logits": torch.cat(logits), "grads": grads}


def cp_run(
    name: str, cases: tuple[tuple[str, str], ...], drop_variants: bool = False, attn_backend: str = "auto"
) -> list[dict[str, Any]]:
    """Pool worker: the packed row through the family's model under CP over the whole pool, per case.

    Every rank returns, per ``(layout, kv_exchange)`` case, its local logits, their original
    positions, its share of every parameter gradient (the ranks' shares sum to the gradient) and
    the exchange path taken. ``drop_variants`` emulates the old bug (window, soft-cap and sinks
    thrown away) so a test can show the comparison fails then.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_automodel.components.distributed.blockdiag_cp import exchange_stats, make_cp_blockdiag_batch_and_ctx
    from nemo_automodel.components.models import cp_attention

    cp_attention.register_cp_attention()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    model = build_model(name, cp_attention.CP_ATTN_IMPLEMENTATION)
    row = packed_row()
    gout_full = output_grad(row["input_ids"].shape[1])
    original = cp_attention.attention_variant
    if drop_variants:
        cp_attention.attention_variant = lambda module, kwargs: original(module, {})
    try:
        results = []
        for layout, kv_exchange in cases:
            model.zero_grad(set_to_none=True)
            ctx, local, shard = make_cp_blockdiag_batch_and_ctx(
                mesh, None, dict(row), attn_backend=attn_backend, kv_exchange=kv_exchange, layout=layout
            )
            positions = shard.positions
            real = positions < gout_full.shape[0]  # padding rows carry no loss
            gout = torch.zeros(positions.numel(), VOCAB, dtype=torch.float64)
            gout[real] = gout_full[positions[real]]
            with ctx():
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0]
                (logits * gout).sum().backward()
            results.append(
                {
                    "logits": logits.detach(),
                    "positions": positions.clone(),
                    "grads": {p: t.grad.clone() for p, t in model.named_parameters() if t.grad is not None},
                    "path": exchange_stats()["path"],
                }
            )
        return results
    finally:
        cp_attention.attention_variant = original
