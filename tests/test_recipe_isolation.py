"""Through the real model: a token influences later logits of its own document and nothing else."""

from __future__ import annotations

import pytest
import torch

from tests.recipe_helpers import packed_logits

# Four documents in one 96-token row (the second one crosses the cp=2 shard boundary at 48).
DOC_LENGTHS = (20, 40, 9, 27)
PERTURBED_DOC = 1  # 0-based
PERTURBED_OFFSET = 10  # within that document


def _row(lengths: tuple[int, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=gen)
    seq_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions, "_packed_seq_ids": seq_ids, "labels": ids.clone()}


def _spans(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


@pytest.mark.parametrize(("world", "kv_exchange"), [(1, "halo"), (2, "halo"), (2, "allgather"), (2, "a2a")])
@pytest.mark.parametrize("route", ["hf_interface", "patch_sdpa"])
def test_perturbing_one_token_changes_only_its_own_document_after_it(pools, world, kv_exchange, route):
    row = _row(DOC_LENGTHS)
    start, end = _spans(DOC_LENGTHS)[PERTURBED_DOC]
    changed = {k: v.clone() for k, v in row.items()}
    changed["input_ids"][0, start + PERTURBED_OFFSET] = (row["input_ids"][0, start + PERTURBED_OFFSET] + 1) % 256
    base, perturbed = pools.get(world).run_ok(packed_logits, route, [row, changed], kv_exchange, timeout=120)[0]

    diff = (base - perturbed).abs().amax(dim=-1)  # [S]
    for doc, (s, e) in enumerate(_spans(DOC_LENGTHS)):
        if doc != PERTURBED_DOC:
            assert diff[s:e].max() == 0, f"document {doc} changed by a token of document {PERTURBED_DOC}"
    assert diff[start : start + PERTURBED_OFFSET].max() == 0, "a token changed logits before it (not causal)"
    later = diff[start + PERTURBED_OFFSET : end]
    assert (later > 1e-4).all(), f"the token did not reach every later position of its document: {later}"
