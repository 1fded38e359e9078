"""Real transformers model families under block-diagonal CP: windows, soft-caps, sinks and MLA are never silent.

For each family a tiny float64 model runs one packed row of five documents under CP
(cp=2 and cp=3, real gloo ranks) through ``attn_implementation="cp_blockdiag"``; its
logits and parameter gradients must equal the independent reference: every document
alone through the same weights with transformers' ``eager`` attention (no packing, no
CP). The reference's softmax runs in float32 (transformers' eager upcasts to it), which
bounds the agreement at ~1e-7 relative; dropping the variants changes results by
0.3 and more (:func:`test_dropping_the_variant_fails_the_comparison`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from nemo_automodel.components.models import cp_attention
from nemo_automodel.components.models.attention_features import attention_features, check_attention_route
from tests.families import EXCHANGES, FAMILIES, VOCAB, build_model, cp_run, packed_row, reference_run

REL_TOL = 1e-5  # relative to the largest reference value of each tensor

CASE_GROUPS: dict[str, tuple[tuple[str, str], ...]] = {
    "explicit": tuple(c for c in EXCHANGES if c != ("auto", "auto")),
    "auto": (("auto", "auto"),),
}


@functools.cache
def _reference(name: str) -> dict[str, Any]:
    return reference_run(name)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def _full_logits(ranks: list[dict[str, Any]], total: int) -> torch.Tensor:
    """The ranks' local logits back in original token order (padding rows dropped)."""
    positions = torch.cat([r["positions"] for r in ranks])
    logits = torch.cat([r["logits"] for r in ranks])
    real = positions < total
    out = torch.full((total, VOCAB), float("nan"), dtype=logits.dtype)
    out[positions[real]] = logits[real]
    return out


def _problems(name: str, results: list[list[dict[str, Any]]], cases: tuple[tuple[str, str], ...]) -> dict[str, list]:
    """Per check (``logits``, ``grads``): the cases whose CP results differ from the reference."""
    ref = _reference(name)
    total = ref["logits"].shape[0]
    found: dict[str, list] = {"logits": [], "grads": []}
    for i, case in enumerate(cases):
        ranks = [r[i] for r in results]
        err = _rel_err(_full_logits(ranks, total), ref["logits"])
        if not err <= REL_TOL:
            found["logits"].append((case, f"logits rel err {err:.3g}"))
        for param, want in ref["grads"].items():
            shares = [r["grads"][param] for r in ranks if param in r["grads"]]
            if not shares:
                found["grads"].append((case, f"{param}: no gradient"))
                continue
            err = _rel_err(sum(shares), want)
            if not err <= REL_TOL:
                found["grads"].append((case, f"{param}: rel err {err:.3g}"))
    return found


def _params() -> list[Any]:
    return [
        pytest.param(name, cp, group, id=f"{name}-cp{cp}-{group}")
        for name in FAMILIES
        for cp in (2, 3)
        for group in CASE_GROUPS
    ]


@pytest.mark.parametrize(("name", "cp", "group"), _params())
def test_family_logits_and_grads_match_unpacked_eager(pools, name, cp, group):
    cases = CASE_GROUPS[group]
    results = pools.get(cp).run_ok(cp_run, name, cases, timeout=180)
    problems = _problems(name, results, cases)
    assert not problems["logits"], "\n".join(map(str, problems["logits"]))
    paths = [{r[i]["path"] for r in results} for i in range(len(cases))]
    for (_, kv_exchange), got in zip(cases, paths):
        assert len(got) == 1 and (kv_exchange == "auto" or got == {kv_exchange}), (kv_exchange, got)
    assert not problems["grads"], "\n".join(map(str, problems["grads"]))


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_dense_kernel_honours_variants(pools, name):
    """The explicit-mask CPU kernel, besides the default (auto: sdpa_varlen), on window + soft-cap + sinks."""
    cases = (("contiguous", "a2a"),)
    results = pools.get(2).run_ok(cp_run, name, cases, attn_backend="dense", timeout=180)
    problems = _problems(name, results, cases)
    assert not problems["logits"], "\n".join(map(str, problems["logits"]))


def test_gpt_oss_sinks_get_their_gradient_under_cp(pools):
    """The sink logits are a parameter: each rank's share of their gradient adds up to the reference's."""
    cases = CASE_GROUPS["explicit"][:1]
    results = pools.get(2).run_ok(cp_run, "gpt_oss", cases, timeout=180)
    problems = _problems("gpt_oss", results, cases)
    assert not problems["grads"], "\n".join(map(str, problems["grads"]))


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.variant_layers])
def test_dropping_the_variant_fails_the_comparison(pools, name):
    """The old ``del kwargs`` behaviour (window, soft-cap, sinks thrown away) must not pass these tests."""
    cases = CASE_GROUPS["explicit"][:1]
    results = pools.get(2).run_ok(cp_run, name, cases, drop_variants=True, timeout=180)
    problems = _problems(name, results, cases)
    assert problems["logits"], f"{name}: results without its attention variant still match the reference"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_outside_a_step_cp_attention_is_exactly_eager(name):
    """Eval and generation run outside a CP step: variants are computed exactly there, not refused."""
    cp_attention.register_cp_attention()
    row = packed_row((13,))
    with torch.no_grad():
        want = build_model(name, "eager")(input_ids=row["input_ids"]).logits
        got = build_model(name, cp_attention.CP_ATTN_IMPLEMENTATION)(input_ids=row["input_ids"]).logits
    assert _rel_err(got, want) <= REL_TOL


@pytest.mark.parametrize("name", ["mistral", "llama"])
@pytest.mark.parametrize("new_tokens", [1, 4])
def test_outside_a_step_with_a_kv_cache_queries_align_to_the_last_keys(name, new_tokens):
    """Generation: new queries over cached keys (decode, chunked prefill) see their causal window, as eager does.

    Stock SDPA's ``is_causal`` would align several new queries to the *first* keys (top-left).
    """
    cp_attention.register_cp_attention()
    ids = packed_row((12,))["input_ids"]
    logits = {}
    for impl in ("eager", cp_attention.CP_ATTN_IMPLEMENTATION):
        model = build_model(name, impl)
        with torch.no_grad():
            out = model(input_ids=ids[:, :-new_tokens], use_cache=True)
            cache = out.past_key_values
            logits[impl] = model(input_ids=ids[:, -new_tokens:], past_key_values=cache, use_cache=True).logits
    assert _rel_err(logits[cp_attention.CP_ATTN_IMPLEMENTATION], logits["eager"]) <= REL_TOL


class _Layer(torch.nn.Module):
    """A stand-in attention module: the class name and layer errors must name."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 3
        self.config = type("Config", (), {"architectures": ["MistralForCausalLM"]})()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"attention_chunk_size": 8}, "attention_chunk_size=8"),
        ({"is_causal": False}, "is_causal=False"),
        ({"output_attentions": True}, "output_attentions=True"),
        ({"cu_seq_lens_q": torch.zeros(2)}, "cu_seq_lens_q (a tensor)"),
    ],
)
def test_unknown_or_unhonourable_keyword_raises_naming_it_and_the_layer(kwargs, named):
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"MistralForCausalLM layer 3") as info:
        cp_attention.cp_blockdiag_attention(_Layer(), q, q, q, None, **kwargs)
    assert named in str(info.value)


def test_known_harmless_keywords_are_accepted():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    harmless = {"position_ids": torch.arange(4)[None], "use_cache": False, "output_router_logits": False}
    out, _ = cp_attention.cp_blockdiag_attention(_Layer(), q, q, q, None, is_causal=True, **harmless)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want)


# What each tiny config implies, by the families' own rules (see attention_features).
_EXPECTED_FEATURES = {
    "llama": [],
    "mistral": ["sliding_window=4 (layers 0-1)"],
    "qwen2": ["sliding_window=3 (layers 1)"],
    "qwen3": [],
    "gemma2": ["sliding_window=4 (layers 0)", "softcap=2.0 (attn_logit_softcapping)"],
    "gemma3": ["sliding_window=5 (layers 0)"],
    "gpt_oss": ["sliding_window=3 (layers 0)", "s_aux (attention sinks)"],
    "phi3": ["sliding_window=5 (layers 0-1)"],
    "deepseek_v3": [],
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_attention_features_follow_each_family_config(name):
    assert attention_features(FAMILIES[name].make_config()).names() == _EXPECTED_FEATURES[name]


def test_qwen_window_needs_use_sliding_window():
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=4, sliding_window=8, max_window_layers=2, use_sliding_window=False)
    assert attention_features(config).names() == []
    config = Qwen2Config(num_hidden_layers=4, sliding_window=8, max_window_layers=2, use_sliding_window=True)
    assert attention_features(config).windows == {2: 8, 3: 8}


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.variant_layers])
def test_patch_sdpa_refuses_every_family_with_variants(name):
    config = FAMILIES[name].make_config()
    with pytest.raises(ValueError, match=r"model\.attention=patch_sdpa cannot honour") as info:
        check_attention_route(config, "patch_sdpa")
    for feature in _EXPECTED_FEATURES[name]:
        assert feature in str(info.value)
    check_attention_route(config, "hf_interface")  # the route that passes them on is accepted
