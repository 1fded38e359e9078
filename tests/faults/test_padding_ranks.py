"""A rank holding only padding, first, middle or last in the group: exact outputs and gradients, every exchange.

The contiguous layout pads only the tail, so only trailing ranks can be empty. Any
valid tiling is legal for the runtime, so the other positions come from a
placement that leaves the chosen rank empty (``layout.balanced_pieces`` patched in
the workers; the batch builder then permutes every field accordingly). The
contiguous layout's own trailing padding rank is the ``pad_rank`` layout of
``tests/test_parity_distributed.py`` (every exchange, cp 2-4).
"""

from __future__ import annotations

import itertools
from typing import Any

from nemo_automodel.components.distributed.blockdiag_cp import layout as layout_module
from nemo_automodel.testing.cases import LOCAL, Case, attend_one, compare, cp_mesh
from nemo_automodel.testing.reference import doc_ids_from_lengths

EXCHANGES = ("allgather", "halo", "a2a", "auto")
CP = 3


def pieces_leaving_empty(empty: int) -> Any:
    """A ``balanced_pieces`` replacement: the real tokens contiguously over every rank but ``empty``."""

    def placement(runs: layout_module.DocRuns, cp: int, local_len: int) -> layout_module.Pieces:
        filled = list(layout_module.contiguous_pieces(runs, cp - 1, local_len))
        assert all(filled), "the test layouts fill every other rank"
        return tuple([*filled[:empty], (), *filled[empty:]])

    return placement


def _attend_with_empty_rank(cases: list[tuple[Case, int]]) -> list[dict[str, Any]]:
    """Pool worker: each case with its ``empty`` rank left without tokens; outputs and gradients per case."""
    mesh, real = cp_mesh(), layout_module.balanced_pieces
    out = []
    for case, empty in cases:
        layout_module.balanced_pieces = pieces_leaving_empty(empty)
        try:
            out.append(attend_one(mesh, case))
        finally:
            layout_module.balanced_pieces = real
    return out


def _cases() -> list[tuple[Case, int]]:
    """Every empty position x exchange x kernel, on rows whose documents cross the other ranks' boundaries."""
    real = (CP - 1) * LOCAL - 3  # fits the other ranks, minus a padding tail
    ids = doc_ids_from_lengths([LOCAL + 5, 4, real - LOCAL - 9], CP * LOCAL)
    return [
        (Case(ids, backend, exchange, (4, 2), seed=i, layout="balanced"), empty)
        for i, (empty, exchange, backend) in enumerate(
            itertools.product(range(CP), EXCHANGES, ("sdpa_varlen", "dense"))
        )
    ]


def test_an_empty_rank_anywhere_gives_exact_outputs_and_gradients(pools):
    cases = _cases()
    results = pools.get(CP).run_ok(_attend_with_empty_rank, cases, timeout=180)
    problems = []
    for i, (case, empty) in enumerate(cases):
        per_rank = [r[i] for r in results]
        n_real = int((case.doc_ids > 0).sum())
        assert all(p >= n_real for p in per_rank[empty]["positions"].tolist()), f"rank {empty} holds real tokens"
        problems += [f"empty rank {empty}: {p}" for p in compare(case, per_rank, CP)]
    assert not problems, "\n".join(problems)
