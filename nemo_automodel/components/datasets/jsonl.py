"""Documents from a JSONL file: one ``{"text": ...}`` object per line."""

from __future__ import annotations

import json
from pathlib import Path


def jsonl_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The ``text_field`` of every non-empty line of ``path``.

    Raises:
        ValueError: naming the file and line of a malformed record.
    """
    documents: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.path={path}: line {line_no} is not valid JSON ({exc.msg})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(
                    f"data.path={path}: line {line_no} has no string field {text_field!r}; "
                    f"each line must be an object like {{{text_field!r}: ...}} (or set data.text_field)"
                )
            documents.append(text)
    if not documents:
        raise ValueError(f"data.path={path}: no documents found (expected one JSON object per line)")
    return documents
