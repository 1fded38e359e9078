"""Chat data: OpenAI-style tool calls rendered when the template can (else refused); empty answers counted/refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.tokenizer import HFTokenizer
from tests.recipe_helpers import save_chat_tokenizer

# The tests' template, plus tool calls: an assistant turn with tool_calls renders "call <name>: <arguments>".
TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['function']['name'] }}: "
    "{{ c['function']['arguments'] }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALL = {"type": "function", "function": {"name": "weather", "arguments": "city Paris"}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


def _tokenizer(tmp_path: Path, template: str | None = None) -> HFTokenizer:
    directory = tmp_path / "tokenizer"
    save_chat_tokenizer(directory, *([template] if template else []))
    return HFTokenizer.load(str(directory))


def _prepare(tmp_path: Path, tokenizer: HFTokenizer, *conversations: list[dict], **fields):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return prepare_data(DataConfig(source="chat", path=str(path), seq_len=256, **fields), tokenizer)


def _labelled(tokenizer: HFTokenizer, rows) -> str:
    labels = [t for t in rows.labels[0].tolist() if t != -100]
    return "".join(tokenizer._tokenizer.convert_ids_to_tokens(labels))


def test_a_tool_call_turn_is_rendered_and_learned_when_the_template_supports_tool_calls(tmp_path):
    tokenizer = _tokenizer(tmp_path, TOOL_TEMPLATE)
    data = _prepare(tmp_path, tokenizer, TOOL_CONVERSATION)
    # both assistant turns are answers (the call, then the reply), the user's and the tool's turns are not
    assert _labelled(tokenizer, data.train) == "call weather: city Paris<|end|>It is sunny.<|end|>"


def test_a_tool_call_turn_is_refused_naming_file_and_row_when_the_template_ignores_tool_calls(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"chat\.jsonl: row 2: message 1 \(assistant\) has tool calls, but the chat"):
        _prepare(tmp_path, tokenizer, TOOL_CONVERSATION[:1] + [TOOL_CONVERSATION[3]], TOOL_CONVERSATION)
    ignored = [TOOL_CONVERSATION[0], {**TOOL_CONVERSATION[1], "content": ""}, *TOOL_CONVERSATION[2:]]
    with pytest.raises(ValueError, match=r"does not render them"):  # content "" would be an empty answer
        _prepare(tmp_path, tokenizer, ignored)


def test_content_null_without_tool_calls_and_malformed_tool_calls_are_refused(tmp_path):
    tokenizer = _tokenizer(tmp_path, TOOL_TEMPLATE)
    no_calls = [TOOL_CONVERSATION[0], {"role": "assistant", "content": None}]
    with pytest.raises(
        ValueError, match=r"row 1 message 1 \(assistant\) has no string 'content' \(content may be null"
    ):
        _prepare(tmp_path, tokenizer, no_calls)
    bad = [TOOL_CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [{"name": "weather"}]}]
    with pytest.raises(ValueError, match=r"row 1 message 1 has malformed 'tool_calls'"):
        _prepare(tmp_path, tokenizer, bad)


def test_empty_answers_are_counted_with_a_warning_or_refused(tmp_path, caplog):
    tokenizer = _tokenizer(tmp_path)
    full = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]
    with caplog.at_level(logging.WARNING, logger="nemo_automodel.finetune"):
        data = _prepare(tmp_path, tokenizer, full, empty, empty)
    assert "2 empty assistant answers (trained as an immediate end of turn, e.g. data.path=" in data.summary
    assert "data: 2 assistant answers are empty" in caplog.text
    with pytest.raises(ValueError, match=r"chat\.jsonl: row 2: message 1 \(assistant\) is empty"):
        _prepare(tmp_path, tokenizer, full, empty, empty_answers="error")
