"""Knob normalization, runtime configuration, the thread-shared step slot and the fire counter."""

from __future__ import annotations

import threading

import pytest

from nemo_automodel.components.distributed.blockdiag_cp import state


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("flash", "flash"),
        ("FLASH_ATTN", "flash"),
        ("fa2", "flash"),
        ("flash-attention-2", "flash"),
        ("te", "te"),
        ("transformer_engine", "te"),
        ("dense", "dense"),
        ("sdpa", "dense"),
        ("sdpa_varlen", "sdpa_varlen"),
        ("varlen", "sdpa_varlen"),
        ("auto", "auto"),
        (None, "auto"),
        ("", "auto"),
        ("default", "auto"),
        ("  Default ", "auto"),
    ],
)
def test_attn_backend_synonyms_map_to_canonical(raw, canonical):
    assert state.normalize_attn_backend(raw) == canonical


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("allgather", "allgather"),
        ("all_gather", "allgather"),
        ("ALL-GATHER", "allgather"),
        ("halo", "halo"),
        ("neighbor", "halo"),
        ("needed_only", "halo"),
        ("a2a", "a2a"),
        ("all_to_all", "a2a"),
        ("a2av", "a2a"),
        (None, "halo"),
        ("", "halo"),
        ("default", "halo"),
    ],
)
def test_kv_exchange_synonyms_map_to_canonical(raw, canonical):
    assert state.normalize_kv_exchange(raw) == canonical


@pytest.mark.parametrize(
    ("fn", "field", "valid"),
    [
        (state.normalize_attn_backend, "attn_backend", state.ATTN_BACKEND_VALUES),
        (state.normalize_kv_exchange, "kv_exchange", state.KV_EXCHANGE_VALUES),
    ],
)
def test_unknown_knob_value_names_field_and_valid_values(fn, field, valid):
    with pytest.raises(ValueError) as err:
        fn("ring")
    message = str(err.value)
    assert field in message and "'ring'" in message
    assert all(v in message for v in valid)


def test_configure_validates_before_changing_anything():
    state.configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    with pytest.raises(ValueError):
        state.configure_cp_varlen(attn_backend="sdpa", kv_exchange="bogus")
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "dense",
        "kv_exchange": "a2a",
        "layout": "contiguous",
        "overlap": True,
        "check_finite": True,
    }
    state.configure_cp_varlen(attn_backend="fa2", kv_exchange="neighbor", layout="zigzag", overlap=False)
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "flash",
        "kv_exchange": "halo",
        "layout": "balanced",
        "overlap": False,
        "check_finite": True,
    }
    state.configure_cp_varlen()
    assert state.cp_varlen_runtime_config() == {
        "attn_backend": "auto",
        "kv_exchange": "halo",
        "layout": "contiguous",
        "overlap": True,
        "check_finite": True,
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


def test_fire_counter_counts_and_resets():
    state.reset_cp_attn_fire_count()
    for _ in range(3):
        state.record_cp_attn_call()
    assert state.cp_attn_fire_count() == 3
    state.reset_cp_attn_fire_count()
    assert state.cp_attn_fire_count() == 0
