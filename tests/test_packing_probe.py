"""The packing-isolation probe: it passes every exact class, and catches every refused one without the name list.

The probe (:mod:`nemo_automodel.components.models.packing_probe`) runs on the real CP group
(cp=2 here, gloo) with the classes of the model table; for the refused ones the
load-time name list (:func:`~nemo_automodel.components.models.packing_guard.packing_blockers`)
is switched off, so the verdict comes from the measurement alone.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from nemo_automodel.components.models import cp_attention, packing_probe
from nemo_automodel.components.models.packing_probe import PackingLeakError, verify_packing_isolation
from tests.families import DOC_LENGTHS, FAMILIES, TABLE, build_model

_EXACT = [*FAMILIES, *(n for n, e in TABLE.items() if not e.refused)]
_REFUSED = [n for n, e in TABLE.items() if e.refused]
# Classes transformers cannot build (Falcon) or run (MPT) on "cp_blockdiag" run on their own attention code, as
# model.attention=eager would (cp=1 only in the recipe; here at cp=2 the API's probe sees each shard alone).
_OWN_ATTENTION = {name: ("eager", "eager") for name in ("falcon", "falcon_alibi", "mpt")}
_ROW = sum(DOC_LENGTHS)  # llama4_text_chunked is exact on rows shorter than its floor_scale (64)


def _model(name: str) -> tuple[torch.nn.Module, str]:
    cp_attention.register_cp_attention()
    impl, route = _OWN_ATTENTION.get(name, (cp_attention.CP_ATTN_IMPLEMENTATION, "hf_interface"))
    return build_model(name, impl).float(), route


def probe_each(names: list[str], name_list: bool = True, seq_len: int | None = None) -> dict[str, Any]:
    """Pool worker: ``verify_packing_isolation`` of each class on the whole pool as one CP group.

    Returns ``{name: (passed, message, leak, calls)}``; ``name_list=False`` switches the load-time name list off
    (the refusal's cause then comes from the measurement alone).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    original = packing_probe.packing_blockers
    if not name_list:
        packing_probe.packing_blockers = lambda *args, **kwargs: []
    try:
        out = {}
        for name in names:
            model, route = _model(name)
            scope = functools.partial(cp_attention.attention_scope, route) if route == "patch_sdpa" else None
            try:
                report = verify_packing_isolation(model, mesh, route=route, attention_scope=scope, seq_len=seq_len)
                out[name] = (True, "", report.leak, report.attention_calls)
            except PackingLeakError as exc:
                out[name] = (False, str(exc), None, None)
        return out
    finally:
        packing_probe.packing_blockers = original


def test_probe_passes_every_exact_class_at_cp2(pools):
    results = pools.get(2).run_ok(probe_each, _EXACT, seq_len=_ROW, timeout=600)
    for name in _EXACT:
        verdicts = {r[name][:2] for r in results}
        assert verdicts == {(True, "")}, f"{name} falsely refused: {verdicts}"
        assert all(r[name][3] > 0 for r in results), f"{name}: no CP attention call"


def test_probe_catches_every_refused_class_without_the_name_list(pools):
    results = pools.get(2).run_ok(probe_each, _REFUSED, name_list=False, timeout=600)
    for name in _REFUSED:
        messages = {r[name][1] for r in results}
        assert len(messages) == 1 and all(not r[name][0] for r in results), f"{name} not refused on every rank"
        message = messages.pop()
        assert "leaks between packed documents" in message and "model.verify_packing=false" in message, message
        assert "ForCausalLM" in message, message


def test_refusal_names_the_cause_from_the_name_list_or_the_call_count():
    bloom, _ = _model("bloom")
    with pytest.raises(PackingLeakError, match=r"BloomForCausalLM leaks .*never reached the CP attention function"):
        verify_packing_isolation(bloom)
    lfm2, _ = _model("lfm2")
    with pytest.raises(PackingLeakError, match=r"Lfm2ForCausalLM leaks .*convolution Conv1d"):
        verify_packing_isolation(lfm2)


def test_temperature_leaks_on_rows_of_floor_scale_tokens_and_chunks_do_not():
    """llama4_text_chunked (chunk 4, floor_scale 64): exact on 44-token rows, not on the default 96."""
    model, _ = _model("llama4_text_chunked")
    verify_packing_isolation(model, seq_len=_ROW)
    with pytest.raises(PackingLeakError, match=r"Llama4ForCausalLM leaks .*row-position scaling") as info:
        verify_packing_isolation(model)
    assert "chunked attention" not in str(info.value)


def test_probe_leaves_the_model_as_it_found_it():
    """Training mode, requires_grad flags, dtype (a bf16 model goes to float32 and back, exactly) and no gradients."""
    model, _ = _model("llama")
    model = model.to(torch.bfloat16).train()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    verify_packing_isolation(model)
    assert model.training and not frozen.requires_grad
    assert model.config._attn_implementation == cp_attention.CP_ATTN_IMPLEMENTATION
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.grad is None and torch.equal(p, before[n]), n
