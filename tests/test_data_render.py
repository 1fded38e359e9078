"""Data preparation's fast paths (all prefixes of a conversation rendered together; the segments of a chunk of
records tokenized in one batched call) give exactly the ids and target masks of one render per prefix and one
``encode`` per segment, and the same errors, on a varied set of conversations, templates and formats."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets import chat_demo, loader
from nemo_automodel.components.datasets.formats import Document, _chat_segments, answer_only, record_to_document
from nemo_automodel.components.datasets.tokenizer import HFTokenizer
from tests.recipe_helpers import save_chat_tokenizer

# Exercises what apply_chat_template prepares: its special-token variables (bos/eos), None-valued keys dropped
# ('name': None is then undefined), reasoning aliases ('reasoning' -> reasoning_content), tool calls, a system
# turn folded into the first turn, and raise_exception (roles must alternate after the system turn).
RICH_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}"
    "{% if loop.first and m['role'] == 'system' %}system: {{ m['content'] }}\n"
    "{% else %}"
    "{% if m['role'] in ['user', 'assistant'] and (m['role'] == 'user') != "
    "((loop.index0 - (1 if messages[0]['role'] == 'system' else 0)) % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>{% if m.name is defined %}({{ m.name }}) {% endif %}"
    "{% if m.reasoning_content is defined %}think: {{ m.reasoning_content }}\n{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['function']['name'] }}: "
    "{{ c['function']['arguments'] }}{% endfor %}"
    "{% elif m.content is defined %}{{ m['content'] }}{% else %}none{% endif %}{{ eos_token }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Renders the last turn differently: answer spans cannot be found (both paths must refuse it alike).
LAST_TURN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if loop.last %}!{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALL = {"type": "function", "function": {"name": "weather", "arguments": "city Paris"}}
USER, ANSWER = {"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."}
VARIED = [
    [USER, ANSWER],
    [{"role": "system", "content": "Answer in one short sentence."}, USER, ANSWER, USER, ANSWER, USER, ANSWER],
    [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": " "}],  # empty answer
    [USER, {"role": "assistant", "content": ""}, USER, ANSWER],
    [USER, {"role": "assistant", "content": "Paris.", "reasoning": "capital of France"}],
    [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}, ANSWER],
    [USER, ANSWER, USER],  # ends with a user turn
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}, ANSWER],
    [USER, ANSWER, ANSWER],  # roles do not alternate: the rich template raises
    [ANSWER, USER, ANSWER],  # starts with an answer: an empty prefix (apply_chat_template refuses it)
]


@dataclass(frozen=True)
class OnePerPrefix:
    """``tokenizer`` without the fast rendering: one ``apply_chat_template`` per prefix."""

    tokenizer: HFTokenizer

    def render_chat_prefixes(self, messages: Any, prefixes: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def _reference(cfg: DataConfig, record: dict[str, Any], tokenizer: HFTokenizer) -> Document:
    """The conversion as it was: one ``apply_chat_template`` per prefix, one ``encode`` per segment, one record."""
    if cfg.source == "text":
        return Document(tokenizer.encode(record["text"]))
    if cfg.source == "chat":
        segments = _chat_segments(record["messages"], OnePerPrefix(tokenizer))
    else:
        segments = [(record["prompt"], False), (record["completion"], True)]
    ids: list[int] = []
    targets: list[bool] = []
    ends: list[int] = []
    for text, answer in segments:
        tokens = tokenizer.encode(text)
        ids += tokens
        targets += [answer or not answer_only(cfg)] * len(tokens)
        if answer:
            ends.append(len(ids))
    return Document(ids, targets, tuple(ends))


def _reference_chunk(cfg: DataConfig, records: list[dict[str, Any]], tokenizer: Any) -> list[Any]:
    out: list[Any] = []
    for record in records:
        try:
            out.append(_reference(cfg, record, tokenizer))
        except ValueError as exc:
            out.append(exc)
    return out


def _document_or_error(tokenizer: Any, messages: list[dict[str, Any]], loss_on: str, reference: bool) -> Any:
    cfg = DataConfig(source="chat", loss_on=loss_on)
    try:
        convert = _reference if reference else record_to_document
        doc = convert(cfg, {"messages": messages}, tokenizer)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return doc.ids, doc.targets, doc.answer_ends


def _assert_same(tokenizer: HFTokenizer, conversations: list[list[dict[str, Any]]]) -> None:
    for i, messages in enumerate(conversations):
        for loss_on in ("answer", "all"):
            fast, slow = (_document_or_error(tokenizer, messages, loss_on, reference) for reference in (False, True))
            assert fast == slow, f"conversation {i} ({loss_on}): {messages}"


def _assert_same_tables(tokenizer: HFTokenizer, source: str, records: list[dict[str, Any]], **fields: Any) -> None:
    """``to_documents`` (chunks of records, batched) gives the reference's table and statistics."""
    cfg = DataConfig(source=source, seq_len=64, **fields)
    rows = [(f"row {i + 1}", record) for i, record in enumerate(records)]
    fast, fast_stats = loader.to_documents(cfg, rows, tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "records_to_documents", _reference_chunk)
        slow, slow_stats = loader.to_documents(cfg, rows, tokenizer)
    for name in ("ids", "targets", "offsets"):
        assert getattr(fast, name).tolist() == getattr(slow, name).tolist(), name
    assert fast_stats == slow_stats and len(fast) > 0


def _tokenizer(tmp_path: Path, template: str) -> HFTokenizer:
    save_chat_tokenizer(tmp_path / "tokenizer", template)
    return HFTokenizer.load(str(tmp_path / "tokenizer"))


def test_the_shipped_chat_demo_gives_the_same_ids_and_targets_on_both_paths():
    tokenizer = HFTokenizer.load(str(chat_demo.ASSETS / chat_demo.TOKENIZER_DIR))
    shipped = (chat_demo.ASSETS / chat_demo.CHATS_FILE).read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in shipped[:600]]
    assert tokenizer.render_chat_prefixes(conversations[0], [(1, True), (2, False)]) is not None  # the fast path ran
    _assert_same(tokenizer, conversations + VARIED[:8])


def test_a_transformers_release_not_checked_takes_the_public_path(monkeypatch):
    """The fast path reads private helpers of the checked releases only; another release renders publicly."""
    import transformers

    tokenizer = HFTokenizer.load(str(chat_demo.ASSETS / chat_demo.TOKENIZER_DIR))
    conversation = json.loads((chat_demo.ASSETS / chat_demo.CHATS_FILE).read_text().splitlines()[0])["messages"]
    assert tokenizer.render_chat_prefixes(conversation, [(1, True)]) is not None
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    assert tokenizer.render_chat_prefixes(conversation, [(1, True)]) is None


@pytest.mark.parametrize("template", [RICH_TEMPLATE, LAST_TURN_TEMPLATE], ids=["rich", "last-turn"])
def test_varied_conversations_and_templates_give_the_same_ids_targets_and_errors(tmp_path, template):
    tokenizer = _tokenizer(tmp_path, template)
    _assert_same(tokenizer, VARIED)
    outcomes = [_document_or_error(tokenizer, messages, "answer", False) for messages in VARIED]
    errors = [o for o in outcomes if isinstance(o, str)]
    if template == RICH_TEMPLATE:  # the set covers successes and a template error (the fallback path)
        assert len(errors) == 2 and all("roles must alternate" in e for e in errors)
        assert tokenizer.render_chat_prefixes(VARIED[8], [(3, False)]) is None
    else:  # and spans that cannot be found, the tool-call probe, an empty prefix (apply_chat_template refuses it)
        assert len(errors) == len(VARIED) and "tool calls" in errors[5] and "empty conversation" in errors[-1]
        assert all("renders turn" in e for e in errors[:5] + errors[6:-1])


def test_chunks_of_records_give_the_tables_of_one_record_at_a_time(tmp_path):
    demo = HFTokenizer.load(str(chat_demo.ASSETS / chat_demo.TOKENIZER_DIR))
    shipped = (chat_demo.ASSETS / chat_demo.CHATS_FILE).read_text().splitlines()
    chats = [json.loads(line) for line in shipped[:700]]  # more than one chunk, the last one partial
    extra = VARIED[:5] + VARIED[6:8] + [[USER, {"role": "assistant", "content": "<|end|>"}]]  # no tool calls here
    chats += [{"messages": m} for m in extra]
    long = {"messages": [USER, ANSWER] * 12}  # longer than seq_len: cut to its leading turns
    _assert_same_tables(demo, "chat", chats[:300] + [long] + chats[300:])
    _assert_same_tables(demo, "chat", chats, loss_on="all")
    texts = [{"text": " ".join(m["content"] or "" for m in c["messages"])} for c in chats] + [{"text": ""}]
    _assert_same_tables(demo, "text", texts)
    pairs = [{"prompt": c["messages"][-2]["content"], "completion": c["messages"][-1]["content"]} for c in chats[:300]]
    _assert_same_tables(demo, "instruction", pairs)
    _assert_same_tables(_tokenizer(tmp_path, RICH_TEMPLATE), "chat", [{"messages": m} for m in VARIED[:8]] * 40)


def test_the_first_bad_record_of_a_chunk_is_the_one_named(tmp_path):
    tokenizer = _tokenizer(tmp_path, RICH_TEMPLATE)
    records = [{"messages": m} for m in VARIED[:8]] * 5 + [{"messages": VARIED[8]}, {"messages": VARIED[9]}]
    long = {"messages": [USER, ANSWER] * 12}
    for bad, match in ((records, "row 41: the chat template cannot render it"), ([long, *records], "row 1: ")):
        rows = [(f"row {i + 1}", r) for i, r in enumerate(bad)]
        with pytest.raises(ValueError, match=match):
            loader.to_documents(DataConfig(source="chat", seq_len=256, long_conversations="error"), rows, tokenizer)


def test_a_reading_error_comes_after_the_rows_read_before_it(tmp_path):
    tokenizer = _tokenizer(tmp_path, RICH_TEMPLATE)
    good, long = json.dumps({"messages": [USER, ANSWER]}), json.dumps({"messages": [USER, ANSWER] * 12})
    bad = json.dumps({"text": "not a chat"})  # refused by the reader's row check, as it reads row 3
    cases = (([good, long, bad], r"row 2: \d+ tokens, longer"), ([good, good, bad], "row 3"))
    for rows, match in cases:
        path = tmp_path / "chat.jsonl"
        path.write_text("\n".join(rows) + "\n")
        cfg = DataConfig(source="chat", path=str(path), seq_len=256, long_conversations="error")
        with pytest.raises(ValueError, match=match):
            loader.prepare_data(cfg, tokenizer, show=False)
