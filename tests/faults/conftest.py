"""Print the fault figures (tests/faults/figures.py) at the end of the run."""

from __future__ import annotations

from tests.faults import figures


def pytest_terminal_summary(terminalreporter) -> None:
    lines = figures.summary()
    if lines:
        terminalreporter.section("fault injection figures (every rank raised; 0 hangs, or the tests failed)")
        for line in lines:
            terminalreporter.write_line(line)
