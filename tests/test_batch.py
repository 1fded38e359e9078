"""The batch builder: document-id sources, padding and sharding, the step context, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    configure_cp_varlen,
    current_blockdiag_cp_state,
    make_cp_blockdiag_batch_and_ctx,
)
from tests.cases import cp_mesh
from tests.reference import blockdiag_allowed, doc_ids_from_lengths


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
        return st.doc_ids[0].tolist()


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
        assert current_blockdiag_cp_state() is st


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
        assert current_blockdiag_cp_state() is outer
    assert current_blockdiag_cp_state() is None


def test_arguments_override_configured_knobs_in_the_snapshot():
    configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row([4], 4), kv_exchange="all_gather")
    with ctx() as st:
        assert (st.attn_backend, st.kv_exchange) == ("dense", "allgather")


def _with(batch, **changes):
    out = dict(batch)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_GOOD = _row([3, 5], 8)


@pytest.mark.parametrize(
    ("batch", "kwargs", "needle"),
    [
        (_with(_GOOD, input_ids=torch.ones(2, 8, dtype=torch.long)), {}, "local batch size 1"),
        (_with(_GOOD, inputs_embeds=torch.ones(1, 8, 4)), {}, "exactly one of 'input_ids' or 'inputs_embeds'"),
        (_with(_GOOD, input_ids=None), {}, "exactly one of 'input_ids' or 'inputs_embeds'"),
        (_with(_GOOD, _packed_seq_ids=torch.tensor([[1, 1, 0, 2, 2, 2, 2, 2]])), {}, "padding must be a tail"),
        (_with(_GOOD, _packed_seq_ids=torch.tensor([[1, 1, 2, 2, 1, 1, 3, 3]])), {}, "document id 1 reappears"),
        (_with(_GOOD, _packed_seq_ids=torch.ones(1, 7, dtype=torch.long)), {}, "_packed_seq_ids: document ids must be"),
        (_with(_GOOD, _packed_seq_ids=torch.ones(1, 8)), {}, "integer or bool"),
        (_with(_GOOD, _packed_seq_ids=-torch.ones(1, 8, dtype=torch.long)), {}, "negative ids"),
        (_with(_GOOD, labels=torch.ones(1, 9, dtype=torch.long)), {}, "labels: expected batch 1 and sequence length 8"),
        (_with(_GOOD, position_ids=torch.ones(2, 1, 8, dtype=torch.long)), {}, "mRoPE [3, B, S]"),
        (_GOOD, {"attn_backend": "ring"}, "Unknown attn_backend 'ring'"),
        (_GOOD, {"kv_exchange": "ring"}, "Unknown kv_exchange 'ring'"),
        (_GOOD, {"loss_mask": torch.ones(1, 5)}, "loss_mask: expected batch 1 and sequence length 8"),
        (
            _with(_GOOD, _packed_seq_ids=None, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)),
            {},
            "not block-diagonal causal",
        ),
    ],
)
def test_bad_batches_raise_a_clear_error_and_leave_no_state(batch, kwargs, needle):
    with pytest.raises(ValueError) as err:
        make_cp_blockdiag_batch_and_ctx(None, None, batch, **kwargs)
    assert needle in str(err.value)
    assert current_blockdiag_cp_state() is None


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


class _MismatchedMesh:
    """A 1-D mesh of size 1 whose process group is the whole (2-rank) world."""

    ndim = 1

    def size(self):
        return 1

    def get_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def get_local_rank(self):
        return 0


def _mismatched_mesh_error():
    try:
        make_cp_blockdiag_batch_and_ctx(_MismatchedMesh(), None, _row([4], 4))
    except RuntimeError as exc:
        return str(exc)
    return None


def _two_d_mesh_error():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    try:
        make_cp_blockdiag_batch_and_ctx(mesh, None, _row([4], 4))
    except ValueError as exc:
        return str(exc)
    return None


def test_cp_group_size_must_match_the_mesh(pools):
    messages = pools.get(2).run_ok(_mismatched_mesh_error) + pools.get(2).run_ok(_two_d_mesh_error)
    assert all("group has 2 ranks but the mesh has 1" in m for m in messages[:2])
    assert all("1-D CP sub-mesh" in m for m in messages[2:])
