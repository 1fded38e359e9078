"""The model table: every transformers causal-LM class is exact under packing + CP, or refused by name at load.

Exact classes run the five-document packed row at cp=2 (contiguous + halo) and cp=3
(balanced + a2a) on real gloo ranks and must match each document alone in transformers'
eager attention (logits and every parameter gradient, float64); refused ones must be
named, with the layer type or module class and the kind of mixing, by the load-time
check (:func:`~nemo_automodel.components.models.packing_guard.check_packable`).
"""

from __future__ import annotations

import pytest
import torch

from nemo_automodel.components.models import cp_attention
from nemo_automodel.components.models.packing_guard import (
    PackingUnsupportedError,
    check_packable,
    check_packable_config,
)
from tests.families import DOC_LENGTHS, FAMILIES, TABLE, build_model, cp_run, make_config, packed_row
from tests.test_model_families import REL_TOL, _problems, _rel_err

_EXACT = [name for name, entry in TABLE.items() if not entry.refused]
_REFUSED = [name for name, entry in TABLE.items() if entry.refused]
ROW = sum(DOC_LENGTHS)  # the packed row every CP test runs: the seq_len the load-time check is given
_CASES = {2: (("contiguous", "halo"),), 3: (("balanced", "a2a"),)}


@pytest.mark.parametrize("name", _REFUSED)
def test_refused_by_name_at_load(name):
    """From the config, before any weight is loaded (Falcon would crash inside transformers on ``cp_blockdiag``)."""
    with pytest.raises(PackingUnsupportedError) as info:
        check_packable_config(make_config(name), seq_len=ROW)
    message = str(info.value)
    assert "ForCausalLM cannot be trained exactly" in message and "model.verify_packing=false" in message
    for kind in TABLE[name].refused:
        assert kind in message, f"{name}: {kind!r} not named in:\n{message}"


@pytest.mark.parametrize("name", [*FAMILIES, *_EXACT])
def test_exact_classes_are_not_refused(name):
    cp_attention.register_cp_attention()
    check_packable_config(make_config(name), seq_len=ROW)
    check_packable(build_model(name, cp_attention.CP_ATTN_IMPLEMENTATION), seq_len=ROW)


def test_chunked_attention_is_accepted_on_hf_interface_and_the_temperature_where_it_does_not_bite():
    model = build_model("llama4_text", "eager")  # attention_chunk_size 4, floor_scale 4
    check_packable(model, seq_len=3)
    with pytest.raises(PackingUnsupportedError) as info:
        check_packable(model, seq_len=40)  # chunks are exact on hf_interface; the temperature's row index bites
    assert "row-position scaling" in str(info.value) and "chunked attention" not in str(info.value)
    check_packable(model, route="patch_sdpa", seq_len=3)
    with pytest.raises(PackingUnsupportedError, match=r"chunked attention .*exact with model\.attention=hf_interface"):
        check_packable(model, route="patch_sdpa", seq_len=5)  # stock SDPA never sees the chunks


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("name", _EXACT)
def test_exact_class_matches_unpacked_eager(pools, name, cp):
    cases = _CASES[cp]
    results = pools.get(cp).run_ok(cp_run, name, cases, timeout=180)
    problems = _problems(name, results, cases)
    assert not problems["logits"], "\n".join(map(str, problems["logits"]))
    assert not problems["grads"], "\n".join(map(str, problems["grads"]))


def test_chunked_layers_outside_a_step_are_exactly_eager_or_refused_over_a_cache():
    """Eval of a 13-token row keeps the chunks of 4; a cached prefix (whose positions attention never sees) raises."""
    cp_attention.register_cp_attention()
    ids = packed_row((13,))["input_ids"]
    with torch.no_grad():
        want = build_model("llama4_text_chunked", "eager")(input_ids=ids).logits
        model = build_model("llama4_text_chunked", cp_attention.CP_ATTN_IMPLEMENTATION)
        assert _rel_err(model(input_ids=ids).logits, want) <= REL_TOL
        cache = model(input_ids=ids[:, :9], use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"Llama4ForCausalLM layer 0\): attention_chunk_size=4 over 3 cached"):
            model(input_ids=ids[:, 9:], past_key_values=cache, use_cache=True)


def test_verify_packing_false_skips_the_refusal_loudly(caplog):
    from nemo_automodel.components.config.schema import ModelConfig
    from nemo_automodel.components.models.causal_lm import check_model_packable

    config = make_config("jamba")
    with pytest.raises(PackingUnsupportedError, match="JambaForCausalLM"):
        check_model_packable(config, ModelConfig(), seq_len=64)
    with caplog.at_level("WARNING"):
        check_model_packable(config, ModelConfig(verify_packing=False), seq_len=64)
    assert "model.verify_packing=false" in caplog.text and "silently wrong" in caplog.text


def test_a_vision_tower_is_not_a_packing_blocker():
    """Gemma 3's SigLIP tower (torch MultiheadAttention, patch convolutions) mixes image patches, not the text row."""
    from transformers import Gemma3Config

    check_packable_config(Gemma3Config())
