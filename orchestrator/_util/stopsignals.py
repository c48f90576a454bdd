"""SIGTERM and SIGINT of ``orchestrator run``, caught from the process's first moment.

A worker stops cleanly on either: in-flight requests get their grace, the rest go back
to pending, exit 0. Its event loop takes the signals only once the database is open and
the worker built, which on a busy machine is seconds after the process started; a
signal before then (a supervisor's stop right after a start) would kill it with -15.
:func:`hold` notes them from the start instead, and :func:`hand_over` gives each one
noted to the worker as soon as it can stop. A second signal before that ends the process
at once, as a second signal does to a running worker. Standard library only: it runs
before any slow import.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_caught: list[int] = []
_previous: dict[int, Any] = {}


def _note(signum: int, _frame: object) -> None:
    _caught.append(signum)
    if len(_caught) > 1:  # a second one: stop at once, as the signal itself would
        release()


def hold() -> None:
    """Note SIGTERM and SIGINT instead of dying of them, until :func:`hand_over`."""
    if _previous:
        return
    for sig in STOP_SIGNALS:
        _previous[sig] = signal.signal(sig, _note)


def release() -> None:
    """The handlers as they were before :func:`hold`; a signal noted meanwhile and not
    handed over is delivered again now, so it has the effect it would have had."""
    if not _previous:
        return
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
    caught = list(_caught)
    _caught.clear()
    for sig in caught:
        signal.raise_signal(sig)


def hand_over(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """``loop`` takes both signals (``stop`` on each), and each noted so far is acted on."""
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    noted = len(_caught)
    _caught.clear()
    for _ in range(noted):
        stop()


def forget() -> None:
    """After the run: the handlers before :func:`hold`, with nothing left noted."""
    _caught.clear()
    release()
