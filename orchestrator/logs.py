"""Logging: structlog events with fields; JSON lines off a terminal, readable on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error")

_json_lines = False


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
