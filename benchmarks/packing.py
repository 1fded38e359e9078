"""Packing time: this project's O(n log n) first fit vs NeMo's scanning first fit, same bins.

    python benchmarks/packing.py                 # 10k/20k/40k documents vs NeMo, then 1M with ours only (first fit,
                                                 # then pack_documents end to end: wall, CPU, peak RSS)
    python benchmarks/packing.py --sizes 20000 --big 0
    python benchmarks/packing.py --fill 100000      # the row fill: vectorized vs the per-document loop

Documents are short conversations (lengths 20-300 tokens, seed 0) packed into 2048-token rows with
``first_fit_shuffle`` (the default) and ``first_fit_decreasing``. Prints seconds per size and packer, the
ratio NeMo / ours, and checks that both give the same bins. ``--fill N`` times, for N such documents with
answer-only targets, the tensor fill of the packed rows: the per-document loop it replaced (``testing/reference.py``)
against ``fill_rows`` over the flat document arrays the pipeline holds, with the ratio and a comparison value for
value (ours are stored as int32).
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import numpy as np
import torch

from nemo_automodel.components.datasets.documents import DocumentTable
from nemo_automodel.components.datasets.formats import Document
from nemo_automodel.components.datasets.packing import (
    assign_to_rows,
    fill_rows,
    first_fit,
    pack_documents,
    pack_order,
)
from nemo_automodel.testing.reference import fill_rows_reference


def _nemo_first_fit():  # the baseline (imported here only: importing NeMo takes seconds)
    from nemo.utils import logging as nemo_logging
    from nemo.utils.sequence_packing_utils import first_fit as nemo_first_fit

    nemo_logging.captureWarnings(False)
    return nemo_first_fit


def _fill(n: int, seq_len: int) -> None:
    rng = random.Random(0)
    docs = []
    for _ in range(n):
        length = rng.randint(20, 300)
        docs.append(Document([rng.randrange(32000) for _ in range(length)], [i >= length // 2 for i in range(length)]))
    rows = assign_to_rows([len(d.ids) for d in docs], seq_len, "first_fit_shuffle", 1234)
    began = time.perf_counter()
    loop = fill_rows_reference(docs, rows, seq_len, 0)
    loop_s = time.perf_counter() - began
    table = DocumentTable.from_documents(docs)  # what the pipeline holds (flat arrays), built before the clock
    began = time.perf_counter()
    ours = fill_rows(table, rows, seq_len, 0)
    ours_s = time.perf_counter() - began
    fields = (ours.input_ids, ours.labels, ours.position_ids, ours.seq_ids)
    same = all(torch.equal(a, b.long()) for a, b in zip(loop, fields))
    print(f"{'docs':>9} {'rows':>7} {'loop s':>8} {'ours s':>8} {'ratio':>7} same")
    print(f"{n:>9} {len(rows):>7} {loop_s:>8.2f} {ours_s:>8.3f} {loop_s / ours_s:>6.0f}x {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 20_000, 40_000])
    parser.add_argument("--big", type=int, default=1_000_000, help="documents packed by ours alone (0: skip)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--fill", type=int, default=0, help="time only the row fill for this many documents")
    args = parser.parse_args()
    if args.fill:
        _fill(args.fill, args.seq_len)
        return
    nemo = _nemo_first_fit()
    rng = random.Random(0)
    print(f"{'docs':>9} {'algorithm':<22} {'nemo s':>8} {'ours s':>8} {'ratio':>7} same")
    for n in args.sizes:
        lengths = [rng.randint(20, 300) for _ in range(n)]
        for algorithm in ("first_fit_shuffle", "first_fit_decreasing"):
            order = pack_order(lengths, algorithm, seed=1234)
            began = time.perf_counter()
            theirs = nemo(order, args.seq_len)
            nemo_s = time.perf_counter() - began
            began = time.perf_counter()
            ours = first_fit(order, args.seq_len)
            ours_s = time.perf_counter() - began
            print(f"{n:>9} {algorithm:<22} {nemo_s:>8.2f} {ours_s:>8.3f} {nemo_s / ours_s:>6.0f}x {ours == theirs}")
    if args.big:
        lengths = [rng.randint(20, 300) for _ in range(args.big)]
        for algorithm in ("first_fit_shuffle", "first_fit_decreasing"):
            began = time.perf_counter()
            bins = first_fit(pack_order(lengths, algorithm, seed=1234), args.seq_len)
            print(f"{args.big:>9} {algorithm:<22} {'-':>8} {time.perf_counter() - began:>8.2f}  ({len(bins)} rows)")
        _pack_all(lengths, args.seq_len)


def _pack_all(lengths: list[int], seq_len: int) -> None:
    """``pack_documents`` end to end (fit, first fit, fill) on a table of documents of ``lengths``, as the recipe
    holds them; wall and CPU seconds, and the peak RSS of the process."""
    gen = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    table = DocumentTable(
        gen.integers(0, 32000, int(offsets[-1]), dtype=np.int32), gen.random(int(offsets[-1])) < 0.5, offsets
    )
    began, cpu = time.perf_counter(), time.process_time()
    rows = pack_documents(table, seq_len, "first_fit_shuffle", pad_id=0, seed=1234)
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"pack_documents, {len(lengths)} documents ({int(offsets[-1])} tokens) -> {len(rows)} rows of {seq_len}: "
        f"{wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS {peak:.2f} GiB (table {table.ids.nbytes * 5 / 4 / 2**30:.2f} "
        f"GiB, rows {4 * rows.input_ids.nbytes / 2**30:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
