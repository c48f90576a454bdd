"""Logging: structlog events with fields; JSON lines off a terminal, readable on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error")

_json_lines = False


class _Stderr:
    """stderr that survives its reader going away (``run ... 2>&1 | tee log`` and Ctrl-C).

    A log line written to a closed pipe raised BrokenPipeError inside the shutdown, which
    then skipped releasing the items in flight and exited 1. The first such write points
    file descriptor 2 at /dev/null instead, so the clean stop runs to its end.
    """

    def write(self, text: str) -> int:
        try:
            n = sys.stderr.write(text)
            sys.stderr.flush()
            return n
        except (BrokenPipeError, ValueError):
            _silence_stderr()
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (BrokenPipeError, ValueError):
            _silence_stderr()


def _silence_stderr() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def json_lines() -> bool:
    """Whether stderr carries JSON lines only, so nothing else may be written there."""
    return _json_lines


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Set up structlog once per process.

    ``json`` defaults to "stderr is not a terminal": a service under systemd or a run
    piped to a file gets one JSON object per line, a person at a terminal gets colour.
    """
    name = (level or os.environ.get("ORCHESTRATOR_LOG_LEVEL") or "info").lower()
    if name not in LEVELS:
        name = "info"
    global _json_lines
    if json is None:
        json = not sys.stderr.isatty()
    _json_lines = json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
