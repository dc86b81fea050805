"""Prints what the compose tests measured (image size, time to healthy) after the results."""
from __future__ import annotations

from compose_stack import REPORT


def pytest_terminal_summary(terminalreporter):
    for line in REPORT:
        terminalreporter.write_line(f"compose-test: {line}")
