"""Tokenizers: a built-in byte-level one, or a HF tokenizer loaded from a local directory.

With ``tokenizer.name_or_path`` unset, a ``model.pretrained_path`` that holds a
tokenizer supplies it (the model's own vocabulary); otherwise the byte-level
tokenizer is used, with a warning when a pretrained model is trained on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nemo_automodel.components.config.schema import TokenizerConfig

logger = logging.getLogger("nemo_automodel.finetune")

# Files any of which marks a directory as holding a HF tokenizer (save_pretrained output).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TextTokenizer(Protocol):
    """What the recipe needs from a tokenizer."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (special-token *text* is still recognised)."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(text) for text in texts]``, exactly, in fewer calls."""
        ...

    def fingerprint(self) -> str:
        """A digest of everything that decides token ids (for the tokenized-data cache key)."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, no chat template.

    Byte 0 (NUL) is both the padding id and the end-of-document (EOS) id: padded
    positions never carry a label, and NUL does not occur in ordinary text.
    """

    name: str = "bytes"
    vocab_size: int = 256
    pad_id: int = 0
    eos_id: int | None = 0
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def fingerprint(self) -> str:
        return "bytes-v1"

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        raise ValueError(_no_template(self.name))

    def render_chat_prefixes(
        self, messages: list[dict[str, Any]], prefixes: list[tuple[int, bool]]
    ) -> dict[tuple[int, bool], str] | None:
        """``None``: no template (``render_chat`` raises the error)."""
        return None


# transformers releases whose private chat-template helpers (``_compile_jinja_template``,
# ``_normalize_chat_messages``, ``_plain_template_data``, ``_alias_reasoning_fields``) were read, and which
# ``tests/test_data_render.py`` checks against ``apply_chat_template``: any other release takes the public path
_FAST_RENDER_CHECKED = ("5.24.",)


@dataclass(frozen=True)
class HFTokenizer:
    """A ``transformers`` tokenizer from a local directory (never the hub)."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int | None
    _tokenizer: Any

    @classmethod
    def load(cls, path: str) -> HFTokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        return cls(path, len(tok), 0 if pad is None else int(pad), None if eos is None else int(eos), tok)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tokenizer, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call (a fast tokenizer's ``encode`` is a batch of one, same path)."""
        if not texts or not getattr(self._tokenizer, "is_fast", False):
            return [self.encode(text) for text in texts]
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """``messages`` rendered by the tokenizer's chat template, as text."""
        if not self.chat_template:
            raise ValueError(_no_template(self.name))
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render_chat_prefixes(
        self, messages: list[dict[str, Any]], prefixes: list[tuple[int, bool]]
    ) -> dict[tuple[int, bool], str] | None:
        """``{(n, g): render_chat(messages[:n], add_generation_prompt=g)}`` for each prefix, or ``None``.

        The same strings as :meth:`render_chat`, at a fraction of its cost: ``apply_chat_template`` copies and
        normalises every message of every prefix it is given (most of its time), so a conversation's prefixes
        cost O(turns^2) copies; here the messages are prepared once, by ``transformers``' own functions, and
        each prefix is a slice of them rendered by ``transformers``' own compiled template with the variables
        ``apply_chat_template`` passes (its special tokens; no tools, no documents). Those helpers are private,
        so their absence or any error (a template error, an empty prefix) returns ``None``: the caller then
        renders with :meth:`render_chat`, which raises the error it would have raised.
        """
        if not self.chat_template or any(n < 1 for n, _ in prefixes):
            return None  # apply_chat_template refuses an empty conversation: let it say so
        try:
            import transformers
            from transformers import PreTrainedTokenizerBase
            from transformers.utils import chat_template_utils as ctu

            if not transformers.__version__.startswith(_FAST_RENDER_CHECKED):
                return None  # private helpers read for these releases only: elsewhere the public path renders
            if type(self._tokenizer).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template:
                return None  # a tokenizer class with its own rendering: only it knows what it does

            template = ctu._compile_jinja_template(self._tokenizer.get_chat_template())  # cached by its text
            chat = ctu._alias_reasoning_fields(
                ctu._plain_template_data(ctu._normalize_chat_messages(messages))
            )  # per message, so a prefix of it is the prepared prefix
            variables = ctu._plain_template_data(dict(self._tokenizer.special_tokens_map))
            return {
                (n, generation): template.render(
                    messages=chat[:n], tools=None, documents=None, add_generation_prompt=generation, **variables
                )
                for n, generation in prefixes
            }
        except Exception:  # any failure: the public path renders (or raises) instead
            return None

    def fingerprint(self) -> str:
        tok = self._tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        parts = {
            "class": type(tok).__name__,
            "vocab": backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
            "special": tok.special_tokens_map,
            "template": self.chat_template,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def save_pretrained(self, directory: str | Path) -> None:
        self._tokenizer.save_pretrained(str(directory))

    def describe(self) -> str:
        eos = "none"
        if self.eos_id is not None:
            eos = f"{self._tokenizer.convert_ids_to_tokens(self.eos_id)!r} = {self.eos_id}"
        kind = type(self._tokenizer).__name__
        template = "yes" if self.chat_template else "no"
        return f"{self.name} ({kind}, {self.vocab_size} tokens, eos {eos}, chat template {template})"


def _no_template(name: str) -> str:
    return (
        f"data=chat: the tokenizer {name} has no chat template; use a tokenizer whose tokenizer_config.json has a "
        "'chat_template' (tokenizer.name_or_path=<dir>), or use data=instruction / data=jsonl"
    )


def holds_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` has the files of a saved HF tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def build_tokenizer(cfg: TokenizerConfig, pretrained_path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The configured tokenizer, else the pretrained model's own, else bytes; logged by name.

    Paths are checked before any process starts (:mod:`nemo_automodel.recipes.checks`).
    """
    if cfg.name_or_path is not None:
        tokenizer = HFTokenizer.load(cfg.name_or_path)
        logger.info("tokenizer: %s", tokenizer.describe())
        return tokenizer
    if pretrained_path is not None and holds_tokenizer(pretrained_path):
        tokenizer = HFTokenizer.load(pretrained_path)
        logger.info("tokenizer: %s (the model's own: model.pretrained_path)", tokenizer.describe())
        return tokenizer
    if pretrained_path is not None:
        logger.warning(
            "model.pretrained_path=%s holds no tokenizer: training on the built-in byte tokenizer (256 ids); "
            "pass tokenizer.name_or_path=<dir> if the model was trained with another one",
            pretrained_path,
        )
    else:
        logger.info("tokenizer: bytes (built in: 256 ids, EOS and padding = byte 0)")
    return ByteTokenizer()
