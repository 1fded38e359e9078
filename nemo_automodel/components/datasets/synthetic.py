"""A deterministic synthetic corpus with learnable structure and long-tailed document lengths.

Each document is one of two kinds of ASCII text, so a byte-level model can learn it
within a few hundred CPU steps and the loss falls visibly:

- a *repeated pattern*: a random 2-6 letter word repeated (``"kqz kqz kqz ..."``):
  after its first occurrence every byte is predictable by attending earlier in the
  same document (exactly what block-diagonal attention must preserve);
- an *arithmetic progression*: ``"+7: 12 19 26 33 ..."``: the header states the step.

Lengths follow ``min * (max / min) ** (u ** 2)`` with ``u ~ U(0, 1)``: most documents are
short (median ~ ``sqrt(sqrt(max / min)) * min``), a tail of ~5% is longer than a 256-token
CP shard, and a few are longer than a packed row.
"""

from __future__ import annotations

import string

import numpy as np

from nemo_automodel.components.config.schema import DataConfig


def _document_lengths(rng: np.random.Generator, count: int, min_len: int, max_len: int) -> np.ndarray:
    u = rng.random(count)
    return np.floor(min_len * (max_len / min_len) ** (u**2)).astype(np.int64).clip(min_len, max_len)


def _repeated_pattern(rng: np.random.Generator, length: int) -> str:
    word = "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(2, 7))))
    return ((word + " ") * (length // (len(word) + 1) + 1))[:length]


def _progression(rng: np.random.Generator, length: int) -> str:
    step, value = int(rng.integers(1, 10)), int(rng.integers(0, 100))
    parts = [f"+{step}:"]
    while sum(len(p) + 1 for p in parts) < length:
        parts.append(str(value))
        value += step
    return " ".join(parts)[:length]


def synthetic_documents(cfg: DataConfig) -> list[str]:
    """``cfg.num_documents`` texts, identical for identical ``cfg.seed`` (independent of any global RNG)."""
    rng = np.random.default_rng(cfg.seed)
    lengths = _document_lengths(rng, cfg.num_documents, cfg.min_doc_len, cfg.max_doc_len)
    makers = (_repeated_pattern, _progression)
    return [makers[int(rng.integers(0, len(makers)))](rng, int(n)) for n in lengths]
