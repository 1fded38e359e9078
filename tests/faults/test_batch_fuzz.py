"""Fuzzing the batch builder: any batch gives a correct shard or a clear error naming a field, and no leftover state.

Batches are drawn with hypothesis: shapes, dtypes, document-id patterns and sources
(``_packed_seq_ids``, 2-D and 4-D ``attention_mask``), extra fields, knob values,
including non-tensors and wrong ranks. Without a mesh each example runs here; on
a real 2-rank mesh a list of drawn examples runs on every rank of a pool.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_automodel.components.distributed.blockdiag_cp import (
    current_blockdiag_cp_state,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.components.distributed.blockdiag_cp.batch import SEQ_FIELDS
from nemo_automodel.testing.cases import cp_mesh
from nemo_automodel.testing.reference import blockdiag_allowed, doc_ids_from_lengths

# Words a clear error names: the batch's fields, the knobs, the mesh.
FIELD_WORDS = (*SEQ_FIELDS, "attention_mask", "batch", "attn_backend", "kv_exchange", "layout", "cp_mesh")
# Valid spellings (and the defaults) of each knob; one value in ten is a bad one.
KNOB_VALUES = {
    "attn_backend": (None, "auto", "sdpa_varlen", "dense", "flash", "te", "fa3", "torch_varlen"),
    "kv_exchange": (None, "auto", "halo", "a2a", "allgather", "all_to_all"),
    "layout": (None, "auto", "contiguous", "balanced", "zigzag"),
}


@st.composite
def _doc_ids(draw: Any, seq_len: int) -> torch.Tensor:
    """``[1, S]`` ids: valid packings (with a padding tail) or arbitrary small integers."""
    if draw(st.booleans()) and seq_len:
        lengths, used = [], 0
        real = draw(st.integers(1, seq_len))
        while used < real:
            lengths.append(draw(st.integers(1, real - used)))
            used += lengths[-1]
        return doc_ids_from_lengths(lengths, seq_len)
    return torch.tensor([draw(st.lists(st.integers(-1, 4), min_size=seq_len, max_size=seq_len))])


def _tensor_like(draw: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A tensor of ``shape``/``dtype``, or (sometimes) a mangled one: other shape, other dtype, a list, ``None``."""
    kind = draw(st.sampled_from(["ok"] * 20 + ["shape", "dtype", "list", "none", "scalar"]))
    if kind == "shape":
        return torch.zeros(*[n + draw(st.integers(-1, 1)) if n else n for n in shape]).clamp(min=0).long()
    if kind == "dtype":
        return torch.zeros(shape, dtype=draw(st.sampled_from([torch.float32, torch.bool, torch.int32, torch.uint8])))
    if kind == "list":
        return torch.zeros(shape).tolist()
    if kind == "none":
        return None
    if kind == "scalar":
        return torch.tensor(3)
    return torch.zeros(shape, dtype=dtype)


@st.composite
def batches(draw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(batch, keyword arguments)`` for one builder call."""
    b = draw(st.sampled_from([1] * 12 + [0, 2]))
    s = draw(st.integers(0, 40))
    batch: dict[str, Any] = {}
    primary = draw(st.sampled_from(["input_ids"] * 12 + ["inputs_embeds"] * 3 + ["both", "neither"]))
    if primary in ("input_ids", "both"):
        batch["input_ids"] = _tensor_like(draw, (b, s), torch.long)
    if primary in ("inputs_embeds", "both"):
        batch["inputs_embeds"] = _tensor_like(draw, (b, s, 4), torch.float32)
    ids = draw(_doc_ids(s))
    source = draw(st.sampled_from(["seq_ids", "seq_ids", "mask2d", "mask4d", "none"]))
    if source == "seq_ids":
        batch["_packed_seq_ids"] = draw(
            st.sampled_from([ids, ids.int(), ids.bool(), ids.float(), ids[0], ids.tolist()])
        )
    elif source == "mask2d":
        batch["attention_mask"] = draw(st.sampled_from([ids.clamp(min=0), ids.clamp(min=0).bool(), ids[:, 1:]]))
    elif source == "mask4d" and bool((ids >= 0).all()):
        allowed = blockdiag_allowed(ids)[None, None] if s else torch.zeros(1, 1, 0, 0, dtype=torch.bool)
        batch["attention_mask"] = draw(
            st.sampled_from([allowed, allowed.float(), torch.ones_like(allowed), allowed[0]])
        )
    for name, dtype in (("labels", torch.long), ("position_ids", torch.long), ("padding_mask", torch.bool)):
        if draw(st.booleans()):
            batch[name] = _tensor_like(draw, (b, s), dtype)
    if draw(st.booleans()):
        batch["position_ids"] = _tensor_like(draw, (draw(st.sampled_from([3, 2])), b, s), torch.long)
    if draw(st.booleans()):
        batch["extra"] = draw(st.sampled_from([torch.ones(7), "text", None, [1, 2]]))
    kwargs: dict[str, Any] = {"padding_token_id": draw(st.integers(0, 9))}
    if draw(st.booleans()):
        kwargs["loss_mask"] = _tensor_like(draw, (b, s), torch.float32)
    for knob, values in KNOB_VALUES.items():
        if draw(st.booleans()):
            kwargs[knob] = draw(st.sampled_from(values * 9 + ("ring",)))
    return batch, kwargs


def problems_with(mesh: Any, batch: dict[str, Any], kwargs: dict[str, Any]) -> list[str]:
    """What is wrong with the builder's answer to one batch (empty: a correct shard, or a clear error)."""
    try:
        ctx, out, shard = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, **kwargs)
    except (ValueError, RuntimeError) as exc:
        named = any(word in str(exc) for word in FIELD_WORDS)
        leftover = current_blockdiag_cp_state() is not None
        return [f"error names no field: {exc}"] * (not named) + ["state left active after an error"] * leftover
    except Exception as exc:
        return [f"internal error {type(exc).__name__}: {exc}"]
    return _shard_problems(batch, out, shard, ctx)


def _shard_problems(batch: dict[str, Any], out: dict[str, Any], shard: Any, ctx: Any) -> list[str]:
    problems = []
    cp = shard.cp_size
    if shard.padded_seq_len % (2 * cp) or not 0 <= shard.padded_seq_len - shard.original_seq_len < 2 * cp:
        problems.append(f"padded length {shard.padded_seq_len} for {shard.original_seq_len} tokens at cp={cp}")
    for name in SEQ_FIELDS:
        if isinstance(batch.get(name), torch.Tensor) or name == "padding_mask":
            dim = 2 if name == "position_ids" and out[name].dim() == 3 else 1
            if out[name].shape[dim] != shard.local_len:
                problems.append(f"{name}: local shape {tuple(out[name].shape)}, local_len {shard.local_len}")
    if "attention_mask" in out:
        problems.append("attention_mask was passed through")
    if "extra" in batch and out["extra"] is not batch["extra"]:
        problems.append("a non-sequence field was not passed through unchanged")
    with ctx() as state:
        if state.local_len != shard.local_len or current_blockdiag_cp_state() is not state.model_view:
            problems.append("the step context does not hold the built state")
    if current_blockdiag_cp_state() is not None:
        problems.append("state left active after the context")
    return problems


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_any_batch_gives_a_correct_shard_or_a_clear_error(drawn):
    batch, kwargs = drawn
    assert not problems_with(None, batch, kwargs)


def _fuzz_on_mesh(examples: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[list[str]]:
    """Pool worker: :func:`problems_with` for each example on the real CP mesh of the pool."""
    mesh = cp_mesh()
    return [problems_with(mesh, batch, kwargs) for batch, kwargs in examples]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(batches(), min_size=40, max_size=40))
def test_any_batch_on_a_real_two_rank_mesh_gives_a_correct_shard_or_a_clear_error(pools, examples):
    for rank_problems in pools.get(2).run_ok(_fuzz_on_mesh, examples, timeout=120):
        found = [(examples[i], p) for i, p in enumerate(rank_problems) if p]
        assert not found, found[:3]
