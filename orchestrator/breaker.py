"""The run-level circuit breaker: tell a wrong setting from a bad item.

A missing API key, a model the server does not serve or a parameter it refuses makes the
server reject *every* request the same way; failing each item on its own would turn one
wrong setting into a queue of failed items in seconds. An item that is rejected for a
reason that may be run-level (401, 403, 404, 405, or a 400/422 whose message is the same
for several items) is therefore *held*: its outcome waits here until the evidence says
which it is.

* An answer from the same server for the same dataset says the setting works: the items
  held there failed on their own, and fail now.
* ``threshold`` different items held in a row for one server and dataset with the same
  cause trip the breaker: the run stops and every held item gets its attempt back.

A context-length error is never run-level: its message carries the item's own lengths
(vLLM, SGLang) or names the context outright (llama.cpp), and only long items get it.

The module is pure: the worker feeds it outcomes and acts on what it answers.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: Rejections that no single item can cause: the credentials, or the model or endpoint.
ALWAYS_RUN_LEVEL = frozenset({"http_401", "http_403", "http_404", "http_405", "redirect"})
#: Rejections that are run-level when several items get the very same message.
SAME_MESSAGE = frozenset({"http_400", "http_422"})

_CONTEXT = re.compile(
    r"context (length|size|window)|maximum context|context_length|prompt is too long"
    r"|input length|too many (input |prompt )?tokens|reduce the length",
    re.IGNORECASE,
)

#: What to check for each cause, in the breaker's one line.
ADVICE = {
    "http_401": "check the API key (--api-key-file, or env ORCHESTRATOR_API_KEY)",
    "http_403": "check the API key and what it is allowed to use",
    "http_404": "check the dataset's model name and the server URL's path",
    "http_405": "check the server URL's path: it should be the server's base URL",
    "redirect": "check the server URL: redirects are not followed, give the URL the server "
    "answers at (the Location the redirect names, if it is the same server)",
}
_PARAM_ADVICE = "check the dataset's parameters (--param, [defaults] and [[dataset]] keys)"


def cause(error_class: str, message: str) -> str | None:
    """The run-level cause a rejection may be (a key to compare), or None when it is one
    an item can earn alone."""
    if error_class in ALWAYS_RUN_LEVEL:
        return error_class
    if error_class in SAME_MESSAGE and not _CONTEXT.search(message):
        return f"{error_class} {message}"
    return None


def advice(error_class: str) -> str:
    return ADVICE.get(error_class, _PARAM_ADVICE)


@dataclass(frozen=True, slots=True)
class Trip:
    """Why the breaker opened: where, which status, the server's own words."""

    key: Hashable
    error_class: str
    message: str
    items: int

    @property
    def advice(self) -> str:
        return advice(self.error_class)


@dataclass(slots=True)
class _Run(Generic[T]):
    """Items held for one key and cause, in the order they came."""

    error_class: str
    message: str
    items: dict[Hashable, T] = field(default_factory=dict)


class Breaker(Generic[T]):
    """Holds possibly run-level rejections until an answer or a run of them decides.

    ``key`` is where the evidence counts (the worker uses server and dataset): an answer
    clears only that key's runs.
    """

    def __init__(self, threshold: int = 5):
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        self.threshold = threshold
        self.tripped: Trip | None = None
        self._runs: dict[Hashable, dict[str, _Run[T]]] = {}

    def rejected(
        self, key: Hashable, item: Hashable, error_class: str, message: str, payload: T
    ) -> bool:
        """Offer a rejection. True: held here (see ``tripped``); False: it is the item's
        own, fail it as usual."""
        found = cause(error_class, message)
        if found is None:
            return False
        runs = self._runs.setdefault(key, {})
        run = runs.setdefault(found, _Run(error_class, message))
        run.items[item] = payload
        if self.tripped is None and len(run.items) >= self.threshold:
            self.tripped = Trip(key, error_class, message, len(run.items))
        return True

    def answered(self, key: Hashable) -> list[T]:
        """An answer for ``key``: what was held there failed on its own (unless tripped)."""
        if self.tripped is not None:
            return []
        runs = self._runs.pop(key, {})
        return [payload for run in runs.values() for payload in run.items.values()]

    def take_all(self) -> list[T]:
        """Everything held, oldest run first; the breaker holds nothing after."""
        taken = [
            payload
            for runs in self._runs.values()
            for run in runs.values()
            for payload in run.items.values()
        ]
        self._runs.clear()
        return taken

    def __len__(self) -> int:
        return sum(len(run.items) for runs in self._runs.values() for run in runs.values())
