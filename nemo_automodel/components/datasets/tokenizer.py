"""Tokenizers: a built-in byte-level one, or a HF tokenizer loaded from a local directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nemo_automodel.components.config.schema import TokenizerConfig


class TextTokenizer(Protocol):
    """What the recipe needs from a tokenizer."""

    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens: documents are delimited by packing, not by EOS)."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, no special tokens.

    Padding uses id 0 (NUL); padded positions never carry a label, so the id
    only has to be a valid embedding row.
    """

    vocab_size: int = 256
    pad_id: int = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass(frozen=True)
class HFTokenizer:
    """A ``transformers`` tokenizer from a local directory (never the hub)."""

    path: str
    vocab_size: int
    pad_id: int
    _tokenizer: object

    @classmethod
    def load(cls, path: str) -> HFTokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return cls(path, len(tok), 0 if pad is None else int(pad), tok)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def save_pretrained(self, directory: str | Path) -> None:
        self._tokenizer.save_pretrained(str(directory))


def build_tokenizer(cfg: TokenizerConfig) -> ByteTokenizer | HFTokenizer:
    """The configured tokenizer (paths are checked by :mod:`nemo_automodel.components.config.checks`)."""
    if cfg.name_or_path is None:
        return ByteTokenizer()
    return HFTokenizer.load(cfg.name_or_path)
