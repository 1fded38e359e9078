"""The batch builder: document-id sources, padding and sharding, and the step context.

Rejected batches and meshes are rows of docs/bad_inputs.md (tests/faults/test_bad_input_catalogue.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    BlockdiagCpModelState,
    compat,
    configure_cp_varlen,
    current_blockdiag_cp_state,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.testing.cases import cp_mesh
from nemo_automodel.testing.reference import blockdiag_allowed, doc_ids_from_lengths


def _row(lengths: list[int], total: int) -> dict[str, torch.Tensor]:
    ids = doc_ids_from_lengths(lengths, total)
    return {
        "input_ids": torch.arange(1, total + 1)[None],
        "labels": torch.arange(total)[None],
        "position_ids": torch.arange(total)[None],
        "_packed_seq_ids": ids,
    }


def _doc_ids_seen_by_state(batch) -> list[int]:
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with ctx() as st:
        return compat.row_doc_ids(st)[0].tolist()


def test_document_ids_from_each_source_agree():
    lengths, total = [3, 4, 2], 10
    want = doc_ids_from_lengths(lengths, total)[0].tolist()
    allowed = blockdiag_allowed(doc_ids_from_lengths(lengths, total))[None, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    base = {"input_ids": torch.ones(1, total, dtype=torch.long)}
    assert _doc_ids_seen_by_state({**base, "_packed_seq_ids": doc_ids_from_lengths(lengths, total)}) == want
    assert _doc_ids_seen_by_state({**base, "attention_mask": allowed}) == want
    assert _doc_ids_seen_by_state({**base, "attention_mask": additive}) == want
    assert _doc_ids_seen_by_state({**base, "attention_mask": doc_ids_from_lengths(lengths, total)}) == want
    assert _doc_ids_seen_by_state({**base, "attention_mask": torch.tensor([[1] * 9 + [0]])}) == [1] * 9 + [0]
    assert _doc_ids_seen_by_state(base) == [1] * total


def test_padding_fills_and_layout_at_cp1():
    batch = _row([3, 2], 7)
    batch["position_ids"] = torch.arange(7).expand(3, 1, 7).clone()  # mRoPE [3, B, S]
    ctx, out, layout = make_cp_blockdiag_batch_and_ctx(
        None, None, batch, loss_mask=torch.ones(1, 7), padding_token_id=99
    )
    assert (layout.original_seq_len, layout.padded_seq_len, layout.local_len) == (7, 8, 8)
    assert out["input_ids"][0, -1] == 99 and out["labels"][0, -1] == -100
    assert out["_packed_seq_ids"][0, -1] == 0 and out["loss_mask"][0, -1] == 0
    assert out["padding_mask"][0].tolist() == [False] * 5 + [True] * 3
    assert out["position_ids"].shape == (3, 1, 8)
    assert "attention_mask" not in out
    with ctx() as st:
        assert st.packed_cu_seqlens_cpu.tolist() == [0, 3, 5, 8]
        assert current_blockdiag_cp_state() is st.model_view


def test_caller_batch_is_not_modified():
    batch = _row([3, 5], 8)
    batch["attention_mask"] = torch.ones(1, 8)
    before = copy.deepcopy(batch)
    make_cp_blockdiag_batch_and_ctx(None, None, batch)
    assert batch.keys() == before.keys() and all(torch.equal(batch[k], before[k]) for k in batch)


def test_context_restores_previous_state_even_on_exception():
    outer_ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row([4], 4))
    inner_ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row([2, 2], 4))
    with outer_ctx() as outer:
        with pytest.raises(RuntimeError), inner_ctx():
            raise RuntimeError("boom")
        assert current_blockdiag_cp_state() is outer.model_view
    assert current_blockdiag_cp_state() is None


def test_arguments_override_configured_knobs_in_the_snapshot():
    configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row([4], 4), kv_exchange="all_gather")
    with ctx() as st:
        assert (st.options.attn_backend, st.options.kv_exchange) == ("dense", "allgather")


def _shard_rows(lengths, total):
    _, out, layout = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, _row(lengths, total))
    return out, layout


def test_rows_are_padded_and_sharded_contiguously_over_ranks(pools):
    results = pools.get(2).run_ok(_shard_rows, [5, 4], 9)
    merged = {k: torch.cat([r[0][k] for r in results], dim=1) for k in ("input_ids", "labels", "_packed_seq_ids")}
    assert merged["input_ids"][0].tolist() == list(range(1, 10)) + [0, 0, 0]
    assert merged["labels"][0].tolist() == list(range(9)) + [-100] * 3
    assert merged["_packed_seq_ids"][0].tolist() == [1] * 5 + [2] * 4 + [0] * 3
    assert [r[1].row_offset for r in results] == [0, 6]


def _shard_primary_views(layout: str):
    """``shard_primary=False``: the whole embeddings, sharded by the model from the view's positions."""
    row = _row([7, 3, 9, 2], 21)
    embeds = torch.randn(1, 21, 4, generator=torch.Generator().manual_seed(0))
    row = {**{k: v for k, v in row.items() if k != "input_ids"}, "inputs_embeds": embeds}
    _, sharded, _ = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, row, layout=layout)
    ctx, whole, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, row, layout=layout, shard_primary=False)
    with ctx():
        view = current_blockdiag_cp_state()
        padded = torch.nn.functional.pad(whole["inputs_embeds"], (0, 0, 0, view.padded_seq_len - 21))
        mine = padded.index_select(1, view.positions)
    return (
        whole["inputs_embeds"] is embeds,
        torch.equal(mine, sharded["inputs_embeds"]),
        torch.equal(whole["labels"], sharded["labels"]),
        view.layout == shard.layout,
    )


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_shard_primary_false_leaves_the_inputs_whole_and_the_view_says_which_rows_are_mine(pools, layout):
    for untouched, same_rows, labels_sharded, same_layout in pools.get(2).run_ok(_shard_primary_views, layout):
        assert untouched and same_rows and labels_sharded and same_layout


def test_the_model_view_is_frozen_and_upstream_compatible():
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row([3, 5], 8))
    with ctx() as st:
        view = current_blockdiag_cp_state()
        assert isinstance(view, BlockdiagCpModelState) and view.group is None
        assert view.packed_cu_seqlens_cpu.tolist() == [0, 3, 8] and view.packed_cu_seqlens.tolist() == [0, 3, 8]
        assert (view.cp_rank, view.cp_size, view.local_len, view.padded_seq_len) == (0, 1, 8, 8)
        with pytest.raises(dataclasses.FrozenInstanceError):
            view.local_len = 4
        assert view is st.model_view
