"""Tables that tests leave for the end of the session (the fault suite's, the fuzzers' case
counts): tests/conftest.py prints them after the run. Under pytest-xdist each worker hands its
own to the controller (workeroutput), so they print there too."""

from __future__ import annotations

REPORTS: list[tuple[str, str]] = []  # (title, text)


def add(title: str, text: str) -> None:
    REPORTS.append((title, text))
