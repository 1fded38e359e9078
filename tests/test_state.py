"""The seed's process default, the thread-shared step slot and the fire counter."""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    cp_blockdiag_sdpa,
    make_cp_blockdiag_batch_and_ctx,
    state,
)


def test_configure_validates_before_changing_anything():
    state.configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    with pytest.raises(ValueError):
        state.configure_cp_varlen(attn_backend="sdpa", kv_exchange="bogus")
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "dense",
        "kv_exchange": "a2a",
        "layout": "contiguous",
        "overlap": True,
        "check_finite": False,
        "consensus": "step",
    }
    state.configure_cp_varlen(attn_backend="flash_attn", kv_exchange="needed_only", layout="zigzag", overlap=False)
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "flash",
        "kv_exchange": "halo",
        "layout": "balanced",
        "overlap": False,
        "check_finite": False,
        "consensus": "step",
    }
    state.configure_cp_varlen()
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "auto",
        "kv_exchange": "halo",
        "layout": "contiguous",
        "overlap": True,
        "check_finite": False,
        "consensus": "step",
    }


def test_step_slot_is_visible_from_other_threads_and_restores_nested_values():
    slot = state.ThreadSharedSlot()
    outer = slot.set("outer")
    inner = slot.set("inner")
    seen = []
    worker = threading.Thread(target=lambda: seen.append(slot.get()))  # e.g. autograd's recompute thread
    worker.start()
    worker.join()
    assert seen == ["inner"]
    slot.reset(inner)
    assert slot.get() == "outer"
    slot.reset(outer)
    assert slot.get() is None


def test_fire_count_spans_steps_until_reset_and_lives_on_the_step():
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 8, dtype=torch.long)})
    q = torch.randn(1, 2, 8, 4)
    state.reset_cp_attn_fire_count()
    with ctx() as st:
        for _ in range(3):
            cp_blockdiag_sdpa(q, q, q)
        assert state.cp_attn_fire_count() == 3 and st.stats.calls == 3
    with ctx():
        cp_blockdiag_sdpa(q, q, q)
        assert state.cp_attn_fire_count() == 4
        state.reset_cp_attn_fire_count()
        assert state.cp_attn_fire_count() == 0
        cp_blockdiag_sdpa(q, q, q)
    assert state.cp_attn_fire_count() == 1 and st.stats.calls == 5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"overlap": "yes"}, "overlap: expected True or False, got 'yes'"),
        ({"check_finite": 1}, "check_finite: expected True or False, got 1"),
        ({"consensus": "often"}, "Unknown consensus 'often'"),
        ({"kv_exchange": "ring"}, "Unknown kv_exchange 'ring'"),
        ({"attn_shape": (8, 4, 64)}, "attn_shape: expected blockdiag_cp.cost.Shape"),
    ],
)
def test_options_validate_every_field(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        state.CPOptions(**changes)


def test_options_are_frozen_and_canonical():
    options = state.CPOptions(attn_backend="flash_attn", kv_exchange="needed_only", layout="zigzag", consensus="call")
    assert (options.attn_backend, options.kv_exchange, options.layout, options.consensus) == (
        "flash",
        "halo",
        "balanced",
        "call",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.layout = "contiguous"
    assert options.replace(layout="contiguous").layout == "contiguous" and options.layout == "balanced"
