"""Records (one JSON object / table row each) to token documents with per-token loss targets.

Three formats, chosen by ``data.source``:

- ``text`` (alias ``jsonl``): ``{text_field: str}``; every token is a target;
- ``instruction``: ``{prompt_field: str, completion_field: str}``, tokenized one after the
  other; with answer-only loss only the completion is a target;
- ``chat``: ``{messages_field: [{"role", "content"}, ...]}`` rendered with the tokenizer's chat
  template; with answer-only loss each assistant turn's content and the end-of-turn text that
  closes it are targets; system/user turns and role headers are not.

A *target* is a token that some label predicts: ``labels[i] = ids[i + 1]`` when token
``i + 1`` is a target (and of the same document), else ``-100``.

The assistant spans are found by rendering prefixes of the conversation, so they do not need
``{% generation %}`` markers in the template: for assistant turn ``k``, the text from the end of
``render(messages[:k], add_generation_prompt=True)`` to the end of ``render(messages[:k + 1])``
(trailing whitespace excluded) is the answer. The rendering is tokenized segment by segment at
those boundaries, exactly as a prompt and a generated answer are at inference time.

EOS: with ``data.add_eos`` every document ends with the tokenizer's EOS, unless its rendering
already does. The appended EOS is a target when the token before it is one (an instruction's
completion, a conversation that ends with an assistant turn), so the model learns to stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_automodel.components.config.schema import DataConfig

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Document:
    """One document's token ids ``[n]`` and per-token targets ``[n]`` (``None``: every token is a target).

    ``answer_ends`` are the token offsets just after each answer span (chat and instruction):
    the only places a too-long conversation may be cut without half-labelling a turn.
    """

    ids: list[int]
    targets: list[bool] | None = None
    answer_ends: tuple[int, ...] = ()

    @property
    def loss_tokens(self) -> int:
        """Labels this document yields once packed (its first token is no target: nothing predicts it)."""
        if self.targets is None:
            return max(len(self.ids) - 1, 0)
        return sum(self.targets[1:])


@dataclass
class FormatStats:
    """What conversion did to the records, for the log (``data: ...``)."""

    records: int = 0
    too_large: int = 0
    too_large_rows: list[str] = field(default_factory=list)
    empty_answers: int = 0
    empty_answer_rows: list[str] = field(default_factory=list)
    empty: int = 0
    cut: int = 0
    dropped: int = 0
    dropped_rows: list[str] = field(default_factory=list)

    def summary(self, cfg: DataConfig) -> str:
        parts = [f"{self.records} records"]
        if self.too_large:
            parts.append(
                f"{self.too_large} larger than data.max_record_bytes={cfg.max_record_bytes} (dropped, e.g. "
                f"{', '.join(self.too_large_rows[:3])})"
            )
        if self.empty:
            parts.append(f"{self.empty} empty (skipped)")
        if self.empty_answers:
            parts.append(
                f"{self.empty_answers} empty assistant answers (trained as an immediate end of turn, e.g. "
                f"{', '.join(self.empty_answer_rows[:3])})"
            )
        if self.cut or self.dropped:
            parts.append(
                f"{self.cut + self.dropped} longer than data.seq_len={cfg.seq_len}: {self.cut} cut to their leading "
                f"turns, {self.dropped} dropped (no whole assistant turn fits)"
                + (f", e.g. {', '.join(self.dropped_rows[:3])}" if self.dropped_rows else "")
            )
        return "; ".join(parts)


def answer_only(cfg: DataConfig) -> bool:
    """Whether only answers carry loss: ``data.loss_on=answer``, or ``auto`` with chat/instruction data."""
    if cfg.loss_on == "auto":
        return cfg.source in ("chat", "instruction")
    return cfg.loss_on == "answer"


def check_record(cfg: DataConfig, record: Any) -> None:
    """Raise a ``ValueError`` (no file context) when ``record`` is not a row of ``cfg.source``'s format."""
    if not isinstance(record, dict):
        raise ValueError(f"is not a JSON object (got {type(record).__name__})")
    if cfg.source == "chat":
        _check_messages(record.get(cfg.messages_field), cfg)
    elif cfg.source == "instruction":
        for name in (cfg.prompt_field, cfg.completion_field):
            if not isinstance(record.get(name), str):
                raise ValueError(
                    f"has no string field {name!r}; data=instruction expects {{{cfg.prompt_field!r}: ..., "
                    f"{cfg.completion_field!r}: ...}} per row (names: data.prompt_field / data.completion_field); "
                    f"a row of another format means the file mixes formats"
                )
        if not record[cfg.completion_field].strip():
            raise ValueError(
                f"has an empty {cfg.completion_field!r}: the completion is what the model learns; "
                "fill it in or remove the row"
            )
    elif not isinstance(record.get(cfg.text_field), str):
        raise ValueError(
            f"has no string field {cfg.text_field!r}; each row must be an object like {{{cfg.text_field!r}: ...}} "
            "(or set data.text_field)"
        )


def _check_messages(messages: Any, cfg: DataConfig) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"has no non-empty list {cfg.messages_field!r}; data=chat expects {{{cfg.messages_field!r}: "
            "[{'role': ..., 'content': ...}, ...]} per row (or set data.messages_field); a row of another format "
            "means the file mixes formats"
        )
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has role {role!r}; valid roles: {', '.join(CHAT_ROLES)} "
                "(each message is {'role': ..., 'content': '...'})"
            )
        content = message.get("content")
        if role == "assistant" and content is None and _tool_calls(message, i):
            continue  # an OpenAI-style tool-call turn: rendered if the template can (see _chat_segments)
        if not isinstance(content, str):
            raise ValueError(
                f"message {i} ({role}) has no string 'content'"
                + (" (content may be null only with a non-empty 'tool_calls' list)" if role == "assistant" else "")
            )
    if answer_only(cfg) and not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            "has no assistant message: with answer-only loss nothing in it would be learned; "
            "remove it, or set data.loss_on=all"
        )


def _tool_calls(message: dict[str, Any], index: int) -> list[Any]:
    """The message's ``tool_calls`` (``[]``: none), each ``{"function": {"name": str, ...}, ...}``."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls
    ):
        raise ValueError(
            f"message {index} has malformed 'tool_calls'; expected OpenAI-style "
            "[{'type': 'function', 'function': {'name': ..., 'arguments': ...}}, ...]"
        )
    return calls


def empty_answers(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the assistant messages with nothing to learn: blank content and no tool calls."""
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and not (m.get("content") or "").strip() and not m.get("tool_calls")
    ]


def _chat_segments(messages: list[dict[str, Any]], tokenizer: Any) -> list[tuple[str, bool]]:
    """The full rendering cut into ``(text, is_answer)`` segments by rendering prefixes (module docstring).

    The prefixes are rendered together when the tokenizer can (``render_chat_prefixes``: the same strings, the
    messages prepared once); otherwise, or when that fails, one by one with ``render_chat``, in the order below,
    so an error is the one ``render_chat`` raises.
    """
    answers = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    prefixes = [(len(messages), False)] + [p for k in answers for p in ((k, True), (k + 1, False))]
    rendered = tokenizer.render_chat_prefixes(messages, prefixes) or {}  # {}: each rendered below, in order

    def render(chat: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            return tokenizer.render_chat(chat, add_generation_prompt=generation_prompt)
        except ValueError:
            raise
        except Exception as exc:  # jinja errors of the template itself (e.g. roles must alternate)
            raise ValueError(f"the chat template cannot render it: {type(exc).__name__}: {exc}") from None

    def render_prefix(n: int, generation_prompt: bool) -> str:
        known = rendered.get((n, generation_prompt))
        return render(messages[:n], generation_prompt) if known is None else known

    full = render_prefix(len(messages), False)
    segments: list[tuple[str, bool]] = []
    done = 0
    for k in answers:
        message = messages[k]
        before, after = render_prefix(k, True), render_prefix(k + 1, False)
        if message.get("tool_calls"):
            plain = {key: value for key, value in message.items() if key != "tool_calls"}
            if render([*messages[:k], plain], False) == after:  # the template ignores tool_calls
                raise ValueError(
                    f"message {k} (assistant) has tool calls, but the chat template of {tokenizer.name} does not "
                    "render them (the turn renders the same without its 'tool_calls'); use a tokenizer whose chat "
                    "template supports tool calls, or remove the tool-call turns"
                )
        if not (full.startswith(after) and after.startswith(before) and len(before) >= done):
            raise ValueError(
                f"the chat template renders turn {k} differently once later turns follow, so its answer span "
                "cannot be found; set data.loss_on=all, or use a template that renders conversations "
                "incrementally"
            )
        end = max(len(before), len(after.rstrip()))
        segments += [(full[done : len(before)], False), (full[len(before) : end], True)]
        done = end
    if full[done:].strip():
        segments.append((full[done:], False))
    return [(text, answer) for text, answer in segments if text]


def _segments(cfg: DataConfig, record: dict[str, Any], tokenizer: Any) -> list[tuple[str, bool]]:
    """A checked record's text as ``(text, is_answer)`` segments, each tokenized on its own."""
    if cfg.source == "chat":
        return _chat_segments(record[cfg.messages_field], tokenizer)
    if cfg.source == "instruction":
        return [(record[cfg.prompt_field], False), (record[cfg.completion_field], True)]
    return [(record[cfg.text_field], True)]


def _document(cfg: DataConfig, segments: list[tuple[str, bool]], tokens: list[list[int]]) -> Document:
    """The document of ``segments`` given each one's token ids ``tokens`` (text: every token a target)."""
    if cfg.source not in ("chat", "instruction"):
        return Document(tokens[0])
    all_targets = not answer_only(cfg)
    ids: list[int] = []
    targets: list[bool] = []
    ends: list[int] = []
    for (_, answer), segment in zip(segments, tokens, strict=True):
        ids += segment
        targets += [answer or all_targets] * len(segment)
        if answer:
            ends.append(len(ids))
    return Document(ids, targets, tuple(ends))


def records_to_documents(cfg: DataConfig, records: list[dict[str, Any]], tokenizer: Any) -> list[Document | ValueError]:
    """Checked records as documents (before EOS and any length policy), in order.

    The segments of all ``records`` are tokenized in one ``tokenizer.encode_batch`` call (the same ids as one
    ``encode`` per segment, with one call's overhead). A record that cannot be converted gets the ``ValueError``
    it raises in its place, for the caller to raise in record order.
    """
    segmented: list[list[tuple[str, bool]] | ValueError] = []
    for record in records:
        try:
            segmented.append(_segments(cfg, record, tokenizer))
        except ValueError as exc:
            segmented.append(exc)
    texts = [text for segments in segmented if not isinstance(segments, ValueError) for text, _ in segments]
    tokens = iter(tokenizer.encode_batch(texts))
    return [
        segments if isinstance(segments, ValueError) else _document(cfg, segments, [next(tokens) for _ in segments])
        for segments in segmented
    ]


def record_to_document(cfg: DataConfig, record: dict[str, Any], tokenizer: Any) -> Document:
    """One checked record as a document (before EOS and before any length policy)."""
    doc = records_to_documents(cfg, [record], tokenizer)[0]
    if isinstance(doc, ValueError):
        raise doc
    return doc


def with_eos(doc: Document, eos_id: int | None) -> Document:
    """``doc`` ending with ``eos_id`` (added unless it already ends with it); see the module docstring."""
    if eos_id is None or (doc.ids and doc.ids[-1] == eos_id):
        return doc
    targets = None if doc.targets is None else doc.targets + [bool(doc.targets and doc.targets[-1])]
    return Document(doc.ids + [eos_id], targets, doc.answer_ends)


def fit_conversation(doc: Document, seq_len: int, eos_id: int | None) -> Document | None:
    """A chat/instruction document of at most ``seq_len`` tokens with EOS, or ``None`` when none fits.

    Too long: the leading turns are kept, up to the end of the last assistant turn that
    fits with its EOS; an answer is never cut in half.
    """
    full = with_eos(doc, eos_id)
    if len(full.ids) <= seq_len:
        return full
    extra = 0 if eos_id is None else 1
    fitting = [end for end in doc.answer_ends if end + extra <= seq_len]
    if not fitting:
        return None
    end = fitting[-1]
    cut = Document(doc.ids[:end], None if doc.targets is None else doc.targets[:end], tuple(fitting))
    return with_eos(cut, eos_id)
