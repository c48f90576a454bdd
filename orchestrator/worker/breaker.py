"""The run-level circuit breaker: tell a wrong setting from a bad item.

A missing API key, a model the server does not serve or a parameter it refuses makes the
server reject *every* request the same way; failing each item on its own would turn one
wrong setting into a queue of failed items in seconds. An item that is rejected for a
reason that may be run-level is therefore *held*: its outcome waits here until the
evidence says which it is.

* What counts together: a refusal no item can earn alone (401, 403, 404, 405, a
  redirect, a 400 or 422 that says the model is unknown: the key, the endpoint, the
  model) per server, across datasets, so that ten small datasets with a wrong model
  name count as one large one; another 400 or 422 per server, dataset and settings, by
  what identifies it (``cause``): its status and its message without what the server
  echoed of the request.
* An answer from the same server for the same dataset and settings says the setting
  works: the items held there failed on their own, and fail now.
* ``threshold`` different items held for one cause, with no answer in between, trip the
  breaker (the run stops and every held item gets its attempt back), once no request
  that could still answer is out: one of the same datasets sent before the threshold
  was reached. A server refuses a wrong setting before it queues the request, so the
  wait is short when the setting is wrong; when it is not, the answers of requests sent
  earlier (a trial in flight, a burst of 256 with a few bad items in it) come first.

A context-length error is never run-level: its message carries the item's own lengths
(vLLM, SGLang) or names the context outright (llama.cpp), and only long items get it.

The module is pure: the worker feeds it requests and outcomes and acts on what it
answers.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: Rejections that no single item can cause: the credentials, the model or the endpoint.
#: They count per server, across datasets.
SERVER_LEVEL = frozenset({"http_401", "http_403", "http_404", "http_405", "redirect"})
#: Rejections that are run-level when several items get the same one (see ``cause``);
#: they count per server, dataset and settings.
SAME_MESSAGE = frozenset({"http_400", "http_422"})

#: A 400 or 422 that says the model is unknown (LiteLLM, OpenRouter and others answer
#: so where vLLM answers 404): server-level too.
_UNKNOWN_MODEL = re.compile(
    r"\bmodel\b.{0,80}?\b(does not exist|not found|is not served|not a valid model)"
    r"|\b(unknown|invalid|unsupported|no such) model\b",
    re.IGNORECASE,
)

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

#: The part of a message that identifies it: error bodies are kept to 2,000 characters.
_LOOKED_AT = 2000
#: A key that introduces an echo of the request: pydantic's ``input`` (FastAPI's 422,
#: in JSON or as a Python repr) and its ``input_value=`` (``str(ValidationError)``).
_ECHO = re.compile(r"""(["']?)\b(input|input_value)\1\s*[:=]\s*""")
#: A quoted string, opened and closed away from letters (``model's`` opens nothing).
_QUOTED = re.compile(r"""(?<!\w)(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"|`[^`\n]*`)(?!\w)""")
#: A quoted name the server refers to (a field, a parameter), kept as it is.
_NAME = re.compile(r"[A-Za-z_][\w.\-\[\]]{0,63}")
#: A position in a path: ``messages[3]``, ``messages.3.content``, ``("body", 3)``.
_INDEX = re.compile(r"(?<=[\[.,(])\s?\d+(?=\s?[\].,)])")
_OPENS = {"{": "}", "[": "]", "(": ")"}


def cause(error_class: str, message: str) -> str | None:
    """What identifies a rejection that may be run-level (a key to compare), or None
    when it is one an item can earn alone.

    A server-level refusal is its status. A 400 or 422 is its status and its message
    without what the server echoed of the request (``plain``): FastAPI's 422 quotes each
    request back, so no two raw texts match, yet it is one refusal.
    """
    if server_level(error_class, message):
        return error_class
    if error_class in SAME_MESSAGE and not _CONTEXT.search(message):
        return f"{error_class} {plain(message)}"
    return None


def server_level(error_class: str, message: str) -> bool:
    """A refusal no item earns alone: it counts per server, across datasets."""
    if error_class in SERVER_LEVEL:
        return True
    return error_class in SAME_MESSAGE and _UNKNOWN_MODEL.search(message) is not None


def plain(message: str) -> str:
    """A refusal's message with the request's echo taken out: pydantic's ``input``
    values, quoted content other than a plain name, and positions in paths."""
    text = message[:_LOOKED_AT]
    text = _without_echoes(text)
    text = _QUOTED.sub(_quoted, text)
    text = _INDEX.sub("#", text)
    return " ".join(text.split())


def _quoted(match: re.Match[str]) -> str:
    quoted = match.group(0)
    return quoted if _NAME.fullmatch(quoted[1:-1]) else quoted[0] + "…" + quoted[-1]


def _without_echoes(text: str) -> str:
    pieces: list[str] = []
    at = 0
    while (found := _ECHO.search(text, at)) is not None:
        pieces.append(text[at : found.end()] + "…")
        at = _value_end(text, found.end())
    pieces.append(text[at:])
    return "".join(pieces)


def _value_end(text: str, start: int) -> int:
    """Where the JSON or Python value starting at ``start`` ends (the end of the text,
    when it was cut short): brackets and quotes are matched, a bare value runs to the
    next separator."""
    closing: list[str] = []
    quote = ""
    at = start
    while at < len(text):
        char = text[at]
        if quote:
            if char == "\\":
                at += 1
            elif char == quote:
                quote = ""
                if not closing:
                    return at + 1
        elif char in "\"'":
            quote = char
        elif char in _OPENS:
            closing.append(_OPENS[char])
        elif closing and char == closing[-1]:
            closing.pop()
            if not closing:
                return at + 1
        elif not closing and char in ",}])\n":
            return at
        at += 1
    return at


#: A refusal that names the history's reasoning: its field refused, or found missing.
_REASONING = re.compile(r"reasoning(_content)?\b", re.IGNORECASE)
_REASONING_ADVICE = (
    "the server refuses the history's reasoning as sent: `orchestrator dataset set NAME "
    "--history-reasoning drop` if it refuses the field, keep if it requires it"
)


def advice(error_class: str, message: str = "") -> str:
    if error_class in SAME_MESSAGE and _UNKNOWN_MODEL.search(message):
        return ADVICE["http_404"]
    if error_class in SAME_MESSAGE and _REASONING.search(message):
        return _REASONING_ADVICE
    return ADVICE.get(error_class, _PARAM_ADVICE)


@dataclass(frozen=True, slots=True)
class Trip:
    """Why the breaker opened: which server, the datasets of the items held (in the
    order they came), which status, the server's own words."""

    server: str
    datasets: tuple[Hashable, ...]
    error_class: str
    message: str
    items: int

    @property
    def advice(self) -> str:
        return advice(self.error_class, self.message)


@dataclass(slots=True)
class _Run(Generic[T]):
    """Items held for one cause, in the order they came, each with its dataset; ``full``:
    the request count when it first held ``threshold`` items."""

    server: str
    dataset: Hashable | None  # None: a server-level cause, any dataset
    error_class: str
    message: str
    items: dict[Hashable, tuple[Hashable, T]] = field(default_factory=dict)
    full: int | None = None


class Breaker(Generic[T]):
    """Holds possibly run-level rejections until an answer or a run of them decides.

    ``sent`` and ``back`` tell it which requests are out (by item, with its dataset: any
    hashable, the worker's is the dataset and its settings); ``answered`` clears only
    what was held for that server and dataset.
    """

    def __init__(self, threshold: int = 5):
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        self.threshold = threshold
        self.tripped: Trip | None = None
        self._runs: dict[tuple[Hashable, ...], _Run[T]] = {}
        self._out: dict[Hashable, tuple[Hashable, int]] = {}  # item -> dataset, when sent
        self._sent = 0
        self._waiting: list[_Run[T]] = []  # full runs waiting for requests sent before

    def sent(self, item: Hashable, dataset: Hashable) -> None:
        """A request for ``item`` is out."""
        self._sent += 1
        self._out[item] = (dataset, self._sent)

    def back(self, item: Hashable) -> Trip | None:
        """The request for ``item`` came back (offer its outcome first): a run waiting
        for it may trip now."""
        self._out.pop(item, None)
        for run in list(self._waiting):
            self._check(run)
        return self.tripped

    def rejected(
        self,
        server: str,
        dataset: Hashable,
        item: Hashable,
        error_class: str,
        message: str,
        payload: T,
    ) -> bool:
        """Offer a rejection. True: held here (see ``tripped``); False: it is the item's
        own, fail it as usual."""
        found = cause(error_class, message)
        if found is None:
            return False
        self._out.pop(item, None)
        where = None if server_level(error_class, message) else dataset
        run = self._runs.setdefault(
            (server, where, found), _Run(server, where, error_class, message)
        )
        run.items[item] = (dataset, payload)
        self._check(run)
        return True

    def answered(self, server: str, dataset: Hashable) -> list[T]:
        """An answer from ``server`` for ``dataset``: what was held for both failed on
        its own (unless tripped)."""
        if self.tripped is not None:
            return []
        failed: list[T] = []
        for key, run in list(self._runs.items()):
            if run.server != server or run.dataset not in (None, dataset):
                continue
            for item in [i for i, (d, _) in run.items.items() if d == dataset]:
                failed.append(run.items.pop(item)[1])
            if len(run.items) < self.threshold:
                run.full = None
                if run in self._waiting:
                    self._waiting.remove(run)
            if not run.items:
                del self._runs[key]
        return failed

    def take_all(self) -> list[T]:
        """Everything held, oldest run first; the breaker holds nothing after."""
        taken = [payload for run in self._runs.values() for _, payload in run.items.values()]
        self._runs.clear()
        self._waiting.clear()
        return taken

    def __len__(self) -> int:
        return sum(len(run.items) for run in self._runs.values())

    def _check(self, run: _Run[T]) -> None:
        """Trip on a full run once no request that could answer for it is out."""
        if self.tripped is not None or len(run.items) < self.threshold:
            return
        if run.full is None:
            run.full = self._sent
        datasets = {dataset for dataset, _ in run.items.values()}
        if any(d in datasets and when <= run.full for d, when in self._out.values()):
            if run not in self._waiting:
                self._waiting.append(run)
            return
        self._waiting.clear()
        order = dict.fromkeys(dataset for dataset, _ in run.items.values())
        self.tripped = Trip(run.server, tuple(order), run.error_class, run.message, len(run.items))
