"""End-to-end data preparation of N short conversations: what the recipe's rank 0 does before training.

    python benchmarks/data_prep.py --conversations 100000
    python benchmarks/data_prep.py --conversations 1000 --record-mib 16 [--record-source text]  # one big record
    /usr/bin/time -v python benchmarks/data_prep.py --conversations 1000000   # + the process's peak RSS

Writes N seeded chat-demo conversations (seeds 0, 1, ... per 10k; 1-3 question/answer exchanges, a system turn or not:
``chat_demo.conversations``) as one JSON Lines file in a temporary directory, then calls the recipe's own
entry, ``loader.load_data`` (rank 0, empty cache: read, render, tokenize, hold out 5%, pack, write the cache
entry), with the demo's byte-level BPE tokenizer and ``data=chat_demo``'s settings (``seq_len`` 512 unless
``--seq-len``).
Prints each phase's wall and CPU seconds (CPU: what a shared machine's load does not inflate) and the
process's peak RSS when it ended (``ru_maxrss``), the tokens held and the cache entry's size. Phases are timed
by wrapping the functions the recipe calls (no other change).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets import cache, chat_demo, loader, packing
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer, HFTokenizer

_CHUNK = 10_000  # conversations generated at a time
PHASES: list[tuple[str, float, float, float]] = []  # (phase, wall s, CPU s, peak RSS in GiB when it ended)


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _timed(module: Any, name: str, phase: str) -> None:
    """Replace ``module.name`` by a wrapper that records ``phase``'s time and the peak RSS after it."""
    inner: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began, cpu = time.perf_counter(), time.process_time()
        result = inner(*args, **kwargs)
        PHASES.append((phase, time.perf_counter() - began, time.process_time() - cpu, _peak_gib()))
        return result

    setattr(module, name, wrapper)


class _Store:
    """The c10d store of a one-rank job (rank 0 posts the outcome)."""

    def set(self, key: str, value: str) -> None:
        pass


def _one_record(count: int, mib: float, source: str) -> None:
    """Peak RSS of preparing ``count`` short records plus one of ``mib`` MiB: what one big record costs.

    ``chat``: the demo's conversations and BPE tokenizer, the big one an answer of repeated demo sentences
    (dropped: longer than ``seq_len``, after it was rendered and tokenized). ``text``: ``{"text": ...}`` records
    and the byte tokenizer (one token per byte: the most tokens a byte can make), the big one split into rows.
    """
    sentence = "The capital of France is Paris. The opposite of hot is cold. 3 plus 4 is 7. "
    big = (sentence * (int(mib * 2**20) // len(sentence) + 1))[: int(mib * 2**20)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        chats = chat_demo.conversations(count, seed=0)
        with path.open("w") as f:
            for chat in chats:
                text = " ".join(m["content"] for m in chat["messages"])
                f.write(json.dumps(chat if source == "chat" else {"text": text}) + "\n")
            if big:
                long = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": big}]
                f.write(json.dumps({"messages": long} if source == "chat" else {"text": big}) + "\n")
        cfg = DataConfig(source=source, path=str(path), seq_len=512, cache_dir=str(Path(tmp) / "cache"))
        tokenizer = (
            HFTokenizer.load(str(chat_demo.ASSETS / chat_demo.TOKENIZER_DIR)) if source == "chat" else ByteTokenizer()
        )
        before = _peak_gib()
        data = loader.load_data(cfg, tokenizer, is_main=True, store=_Store())
        print(
            f"{source}: one record of {mib:g} MiB: peak RSS {before:.3f} GiB before load_data, {_peak_gib():.3f} GiB "
            f"after ({len(data.train)} rows; {data.summary})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--keep", type=Path, default=None, help="write the data and cache here (default: a temp dir)")
    parser.add_argument(
        "--record-mib",
        type=float,
        default=None,
        help="instead: the conversations plus one record of this many MiB (0: none, the baseline); prints peak RSS",
    )
    parser.add_argument("--record-source", choices=("chat", "text"), default="chat")
    args = parser.parse_args()
    if args.record_mib is not None:
        _one_record(args.conversations, args.record_mib, args.record_source)
        return
    _timed(loader, "to_documents", "read + render + tokenize")
    _timed(loader, "_hold_out", "hold out 5%")
    _timed(packing, "assign_to_rows", "  pack: first fit")
    _timed(packing, "fill_rows", "  pack: fill rows")
    _timed(loader, "_pack", "pack (fit + first fit + fill)")
    _timed(cache, "_save", "write the cache entry")
    with tempfile.TemporaryDirectory(dir=args.keep) as tmp:
        began = time.perf_counter()
        path = Path(tmp) / "chats.jsonl"
        with path.open("w") as f:
            for seed, first in enumerate(range(0, args.conversations, _CHUNK)):  # in chunks: the list is ~1 KB each
                for chat in chat_demo.conversations(min(_CHUNK, args.conversations - first), seed=seed):
                    f.write(json.dumps(chat) + "\n")
        print(
            f"wrote {args.conversations} conversations ({path.stat().st_size / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - began:.1f} s (not counted); peak RSS so far {_peak_gib():.2f} GiB"
        )
        cfg = DataConfig(
            source="chat", path=str(path), validation="0.05", seq_len=args.seq_len, cache_dir=str(Path(tmp) / "cache")
        )
        tokenizer = HFTokenizer.load(str(chat_demo.ASSETS / chat_demo.TOKENIZER_DIR))
        began, cpu = time.perf_counter(), time.process_time()
        data = loader.load_data(cfg, tokenizer, is_main=True, store=_Store())
        total, total_cpu = time.perf_counter() - began, time.process_time() - cpu
        entry = next((Path(tmp) / "cache").glob("*/packed.pt"))
        tokens = int((data.train.seq_ids > 0).sum()) + int((data.validation.seq_ids > 0).sum())
        print(f"\n{'phase':<32} {'wall s':>8} {'CPU s':>8} {'peak RSS GiB':>13}")
        for phase, seconds, cpu_s, peak in PHASES:
            print(f"{phase:<32} {seconds:>8.1f} {cpu_s:>8.1f} {peak:>13.2f}")
        print(f"{'load_data end to end':<32} {total:>8.1f} {total_cpu:>8.1f} {_peak_gib():>13.2f}")
        print(f"\n{data.summary}")
        print(
            f"{len(data.train)} + {len(data.validation)} rows of {args.seq_len}, {tokens} tokens; cache entry "
            f"{entry.stat().st_size / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
