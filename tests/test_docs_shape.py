"""The shape issue 20 gave the docs: the README is an entry point, design.md's prose is wrapped."""

from __future__ import annotations

from tests.recipe_helpers import REPO


def _long_prose_lines(text: str, width: int) -> list[int]:
    """1-based numbers of lines over ``width`` columns, outside tables and fenced code (those cannot wrap)."""
    long, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith("|") and len(line) > width:
            long.append(number)
    return long


def test_readme_is_an_entry_point_of_at_most_300_lines():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move reference material into docs/"


def test_design_prose_is_wrapped_at_120_columns():
    assert _long_prose_lines((REPO / "docs" / "design.md").read_text(), 120) == []


def test_the_wrap_check_sees_a_long_line():
    text = "short\n" + "x " * 70 + "\n| " + "y" * 200 + " |\n```\n" + "z" * 200 + "\n```\n"
    assert _long_prose_lines(text, 120) == [2]
