"""Logging: structlog events with fields; JSON lines off a terminal, readable on one.

Events about single items (they carry an ``item`` field: ``item_retry``,
``item_failed``, ``lease_lost``, ...) can come by the tens of thousands when a server
misbehaves. Below debug level, the first few of each per interval are written as they
are and the rest are counted, then told in one ``repeated`` line per interval and event
(``item_retry x 412 in 60 s: http_500 (321), timeout (91)``). ``--log-level debug``
writes every one.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error")
# How long one summary interval lasts, and how many of an event each interval shows.
REPEAT_SECONDS = 60.0
REPEAT_SHOWN = 3

_json_lines = False
#: Debug events are kept: False once :func:`configure` set a higher level, so that a hot
#: path skips building an event nobody will see (structlog left unconfigured keeps all).
_debug = True
_LEVEL_ORDER = {name: n for n, name in enumerate(("debug", "info", "warning", "error", "critical"))}


class _Stderr:
    """stderr that survives its reader going away (``run ... 2>&1 | tee log`` and Ctrl-C),
    and keeps a live status line (``run`` on a terminal) below the log lines.

    A log line written to a closed pipe raised BrokenPipeError inside the shutdown, which
    then skipped releasing the items in flight and exited 1. The first such write points
    file descriptor 2 at /dev/null instead, so the clean stop runs to its end.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.status = ""  # the status line, redrawn after every log line
        self.shown = False  # whether it is on the screen now (the cursor at its end)
        self.partial = ""  # a log line written up to, not including, its newline

    def write(self, text: str) -> int:
        with self.lock:
            # Whole lines only (print writes a message and its newline apart), so that a
            # status line drawn from another thread never lands inside a log line.
            self.partial += text
            end = self.partial.rfind("\n") + 1
            if end:
                lines, self.partial = self.partial[:end], self.partial[end:]
                self._raw("\r\x1b[K" + lines if self.shown else lines)
                self.shown = False
                if self.status:
                    self._raw(self.status)
                    self.shown = True
            return len(text)

    def set_status(self, line: str) -> None:
        """Show ``line`` as the status line ("" takes it off the screen)."""
        with self.lock:
            if self.shown:
                self._raw("\r\x1b[K")
            self.status = line
            self.shown = bool(line)
            if line:
                self._raw(line)

    def _raw(self, text: str) -> int:
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


_STDERR = _Stderr()


def set_status_line(line: str) -> None:
    """Draw (or with "" clear) the one status line kept below the log lines."""
    _STDERR.set_status(line)


def _silence_stderr() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


@dataclass
class _Window:
    """One event's current interval: when it began, how many came, of which classes."""

    started: float
    count: int = 0
    level: str = "info"
    classes: Counter[str] = field(default_factory=Counter)


class RepeatSummariser:
    """A structlog processor that lets the first ``shown`` per-item events of a name
    through per interval and counts the rest, for one summary line per interval.

    Summaries are written by a daemon thread as each interval ends (so a burst is told
    even when nothing is logged after it), before an event of the same name that opens
    the next interval, and by :meth:`flush` (at exit, and before a worker's last line).
    """

    def __init__(
        self,
        interval: float = REPEAT_SECONDS,
        shown: int = REPEAT_SHOWN,
        *,
        json: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.shown = shown
        self.json = json
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def __call__(
        self, _logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if event_dict.pop("_summary", False):
            return event_dict
        name = event_dict.get("event")
        if "item" not in event_dict or not isinstance(name, str):
            if name in ("worker_stopped", "run_halted"):
                self.flush()  # what was counted comes before the worker's last word
            return event_dict
        now = self.clock()
        due: list[tuple[str, _Window]] = []
        with self._lock:
            window = self._windows.get(name)
            if window is not None and now - window.started >= self.interval:
                due.append((name, self._windows.pop(name)))
                window = None
            if window is None:
                window = self._windows[name] = _Window(started=now)
            window.count += 1
            if _LEVEL_ORDER.get(method, 1) > _LEVEL_ORDER.get(window.level, 1):
                window.level = method
            window.classes[_class_of(event_dict)] += 1
            suppress = window.count > self.shown
        self._emit(due, now)
        self._start_ticker()
        if suppress:
            raise structlog.DropEvent
        return event_dict

    def flush(self, *, only_due: bool = False) -> None:
        """Write the summary of every interval that counted more than it showed."""
        now = self.clock()
        with self._lock:
            names = [
                name
                for name, window in self._windows.items()
                if not only_due or now - window.started >= self.interval
            ]
            due = [(name, self._windows.pop(name)) for name in names]
        self._emit(due, now)

    def _emit(self, due: list[tuple[str, _Window]], now: float) -> None:
        for name, window in due:
            if window.count <= self.shown:
                continue
            seconds = round(min(self.interval, max(now - window.started, 0.0)))
            classes = {k: n for k, n in window.classes.most_common() if k}
            text = f"{name} x {window.count:,} in {seconds} s"
            if classes:
                text += ": " + ", ".join(f"{k} ({n:,})" for k, n in classes.items())
            fields: dict[str, Any] = {
                "_summary": True,
                "shown": self.shown,
                "hint": "--log-level debug shows each",
            }
            if self.json:
                fields.update(repeated=name, count=window.count, seconds=seconds)
                fields.update(by_class=classes, summary=text)
                text = "repeated"
            logger = structlog.get_logger("orchestrator.logs")
            getattr(logger, window.level)(text, **fields)

    def _start_ticker(self) -> None:
        if self._ticker is not None:
            return
        with self._lock:
            if self._ticker is not None:
                return
            self._ticker = threading.Thread(target=self._tick, name="log-repeats", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        pause = min(max(self.interval / 4, 0.05), 5.0)
        while _summariser is self:  # a new configure() retires this one
            time.sleep(pause)
            self.flush(only_due=True)


def _class_of(event_dict: MutableMapping[str, Any]) -> str:
    value = event_dict.get("error_class") or event_dict.get("kind") or ""
    return str(value)


_summariser: RepeatSummariser | None = None


def flush_repeats() -> None:
    """Write what the summariser has counted so far (the run's end, before a report)."""
    if _summariser is not None:
        _summariser.flush()


atexit.register(flush_repeats)


def debug_enabled() -> bool:
    """Whether a debug event would be kept (a per-request one is worth skipping)."""
    return _debug


def json_lines() -> bool:
    """Whether stderr carries JSON lines only, so nothing else may be written there."""
    return _json_lines


def _repeat_seconds() -> float:
    raw = os.environ.get("ORCHESTRATOR_LOG_REPEAT_SECONDS")
    try:
        value = float(raw) if raw else REPEAT_SECONDS
    except ValueError:
        return REPEAT_SECONDS
    return value if value > 0 else REPEAT_SECONDS


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Set up structlog once per process.

    ``json`` defaults to "stderr is not a terminal": a service under systemd or a run
    piped to a file gets one JSON object per line, a person at a terminal gets colour.
    Repeated per-item events are summarised unless ``level`` is debug.
    """
    name = (level or os.environ.get("ORCHESTRATOR_LOG_LEVEL") or "info").lower()
    if name not in LEVELS:
        name = "info"
    global _json_lines, _summariser, _debug
    if json is None:
        json = not sys.stderr.isatty()
    _json_lines = json
    _debug = name == "debug"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    flush_repeats()
    _summariser = None if name == "debug" else RepeatSummariser(_repeat_seconds(), json=json)
    summarise: list[structlog.typing.Processor] = [_summariser] if _summariser else []
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *summarise,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
