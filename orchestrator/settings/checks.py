"""What an option or an argument may be, said once for every way it is given.

The commands' options (``orchestrator.cli``), the Python API's arguments
(``orchestrator.api``), the settings both build (``RunSettings``, ``EnqueueOptions``,
``ExportOptions``), the dashboard's query and a run file's keys all take their rule from
here, so the same value is refused everywhere with the same words. A rule says what a
value must be (``"at least 1"``) or ``""`` when it will do; :func:`checked` words the
refusal as a ``ConfigError`` naming the argument and what it got.

Nothing heavy is imported: ``orchestrator --help`` loads this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator._util.tables import is_table
from orchestrator.errors import ConfigError
from orchestrator.items.tokens import MAX_TOP
from orchestrator.settings import dataset_options
from orchestrator.settings.choices import EXPORT_FORMATS, INPUT_FORMATS, REASONING_MODES
from orchestrator.settings.dataset_options import INT_MAX


class Rule(Protocol):
    def expected(self, value: object) -> str:
        """What ``value`` must be instead, or "" when it will do."""
        ...


def _bound(number: float) -> str:
    return f"{number:g}"


@dataclass(frozen=True, slots=True)
class Integer:
    """A whole number (never a bool), within the bounds given."""

    minimum: int | None = None
    maximum: int | None = None

    def expected(self, value: object) -> str:
        if not isinstance(value, int) or isinstance(value, bool):
            return "an integer"
        if self.minimum is not None and value < self.minimum:
            return f"at least {self.minimum}"
        if self.maximum is not None and value > self.maximum:
            if self.minimum is None:
                return f"at most {self.maximum}"
            return f"{self.minimum} to {self.maximum}"
        return ""


@dataclass(frozen=True, slots=True)
class Number:
    """A finite number (an int or a float, never a bool): NaN passes every comparison, so
    a NaN number of seconds would get past any bound. ``above``: the minimum itself is out."""

    minimum: float | None = None
    above: bool = False
    maximum: float | None = None

    def expected(self, value: object) -> str:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return "a number"
        if isinstance(value, float) and not math.isfinite(value):
            return "a finite number"
        if self.maximum is not None and value > self.maximum:
            return f"at most {_bound(self.maximum)}"
        if self.minimum is None:
            return ""
        if self.above and value <= self.minimum:
            return f"more than {_bound(self.minimum)}"
        return f"at least {_bound(self.minimum)}" if value < self.minimum else ""


@dataclass(frozen=True, slots=True)
class Text:
    """A string with something in it."""

    max_length: int | None = None

    def expected(self, value: object) -> str:
        if not isinstance(value, str):
            return "a string"
        if not value.strip():
            return "a non-empty string"
        if self.max_length is not None and len(value) > self.max_length:
            return f"at most {self.max_length} characters"
        return ""


@dataclass(frozen=True, slots=True)
class Choice:
    choices: tuple[str, ...]

    def expected(self, value: object) -> str:
        return "" if value in self.choices else f"one of {' | '.join(self.choices)}"


@dataclass(frozen=True, slots=True)
class Flag:
    """True or False: a string such as "no" is truthy, so nothing else is taken as one."""

    def expected(self, value: object) -> str:
        return "" if isinstance(value, bool) else "True or False"


@dataclass(frozen=True, slots=True)
class Names:
    """One name, or a list (tuple, set) of them: a lone string is one name, not its letters."""

    what: str = "a name"

    def expected(self, value: object) -> str:
        want = f"{self.what} or a list of them"
        if isinstance(value, str):
            return "" if value.strip() else want
        if not isinstance(value, list | tuple | set | frozenset):
            return want
        return "" if all(isinstance(v, str) and v.strip() for v in value) else want


@dataclass(frozen=True, slots=True)
class PathName:
    """A file's path: a non-empty ``str`` or an ``os.PathLike`` of one."""

    what: str = "a path (str or os.PathLike)"

    def expected(self, value: object) -> str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        return "" if isinstance(value, str) and value else self.what


@dataclass(frozen=True, slots=True)
class Records:
    """What ``enqueue`` reads: a path (a file, a folder, a glob, ``-``, ``hf://``), a table
    a program holds (``pyarrow``, pandas, ``datasets``), or an iterable of rows. A single
    dict, a string's letters or a bytes' numbers are no rows."""

    def expected(self, value: object) -> str:
        if not PathName().expected(value):
            return ""
        if is_table(value):
            return ""
        rows = isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)
        return "" if rows else "a path, a table or an iterable of dicts"


@dataclass(frozen=True, slots=True)
class Cap:
    """A per-server concurrency: a whole number of requests, at least 1, or ``"auto"``."""

    def expected(self, value: object) -> str:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            return ""
        return "a whole number of at least 1 or 'auto'"


@dataclass(frozen=True, slots=True)
class JsonObject:
    """Request fields: a dict of JSON values under string keys (NaN and infinities have no
    JSON form; an integer past 64 bits has none the server reads)."""

    def expected(self, value: object) -> str:
        if not isinstance(value, Mapping):
            return "a dict of request fields"
        where = _not_json(value, "")
        return f"a dict of JSON values under string keys ({where})" if where else ""


def _not_json(value: object, where: str, depth: int = 0) -> str:
    """Where in ``value`` the first value without a JSON form is, and what it is; ""."""
    if depth > 64:
        return f"{where or 'it'} nests too deep"
    if value is None or isinstance(value, bool | str):
        return ""
    if isinstance(value, int):
        return "" if -(2**63) <= value < 2**64 else f"{where} is an integer past 64 bits"
    if isinstance(value, float):
        return "" if math.isfinite(value) else f"{where} is {value!r}"
    if isinstance(value, list | tuple):
        found = (_not_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        return next((p for p in found if p), "")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where or 'a'} key {shown(key)} is not a string"
            if found := _not_json(item, f"{where}[{key!r}]", depth + 1):
                return found
        return ""
    return f"{where} is {shown(value)}"


@dataclass(frozen=True, slots=True)
class OrNone:
    """``None`` (the default: not given), or what ``rule`` takes."""

    rule: Rule

    def expected(self, value: object) -> str:
        return "" if value is None else self.rule.expected(value)


def shown(value: object) -> str:
    """A refused value as a message gives it: numbers and short strings as written,
    anything else by its type."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def problem(name: str, value: object, rule: Rule) -> str:
    """``"name: must be ..., got ..."`` when ``value`` will not do, else ""."""
    want = rule.expected(value)
    return f"{name}: must be {want}, got {shown(value)}" if want else ""


def checked(name: str, value: Any, rule: Rule) -> Any:
    """``value`` when ``rule`` takes it; else the ConfigError that says why."""
    found = problem(name, value, rule)
    if found:
        raise ConfigError(found)
    return value


def check_all(values: Mapping[str, object], rules: Mapping[str, Rule]) -> None:
    """Each of ``values`` that has a rule, checked; every refusal in one ConfigError."""
    found = [problem(name, values[name], rule) for name, rule in rules.items() if name in values]
    found = [p for p in found if p]
    if found:
        raise ConfigError("; ".join(found))


FLAG = Flag()
PATH = PathName()
RECORDS = Records()

#: Seconds of recent history the rates are taken over: ``status``, ``watch``,
#: ``dashboard`` and ``report --window``, the dashboard's ``?window=``, ``Queue.status``.
WINDOW = Number(minimum=1)


#: Prices (``orchestrator.settings.prices``): USD per server-hour, and per million prompt,
#: completion and cached prompt tokens, and the share a provider's Batch API takes off;
#: by the field names of ``orchestrator.settings.prices.Prices``, which are also the
#: servers file's option names and a run file's ``[prices]`` keys.
PRICE = OrNone(Number(minimum=0))
DISCOUNT = OrNone(Number(minimum=0, maximum=1))
PRICES: dict[str, Rule] = {
    "gpu_hour_cost": PRICE,
    "price_input": PRICE,
    "price_output": PRICE,
    "price_cached_input": PRICE,
    "batch_discount": DISCOUNT,
}

#: Most USD a run may spend at its token prices (``run --budget``).
BUDGET = OrNone(Number(minimum=0, above=True))

#: How many servers a price per server-hour is paid for (``Queue.status``).
SERVERS = Integer(minimum=1)

#: What a dataset's name may be (every source of one: options, run files, the API).
DATASET_NAME = Text(max_length=200)

#: A name that picks one of a source's parts: a column, a split, a Hub configuration.
PART_NAME = OrNone(Text())

#: Text written into every request as given: a template, a system message.
PROMPT_TEXT = OrNone(Text())

#: A dataset's settings (``orchestrator enqueue``'s options, ``Queue.enqueue``'s
#: arguments, a run file's keys), by the field names of ``EnqueueOptions``.
DATASET: dict[str, Rule] = {
    "dataset": DATASET_NAME,
    "params": JsonObject(),
    "concurrency": OrNone(Integer(1, INT_MAX)),
    "priority": OrNone(Integer(-INT_MAX, INT_MAX)),
    "format": Choice(INPUT_FORMATS),
    "regenerate": OrNone(Choice(dataset_options.REGENERATE)),
    "on_truncated": OrNone(Choice(dataset_options.ON_TRUNCATED)),
    "on_invalid": OrNone(Choice(dataset_options.ON_INVALID)),
    "on_overflow": OrNone(Choice(dataset_options.ON_OVERFLOW)),
    "history_reasoning": OrNone(Choice(dataset_options.HISTORY_REASONING)),
    "passthrough": FLAG,
    "update": FLAG,
    "endpoint": OrNone(Choice(dataset_options.ENDPOINTS)),
    "logprobs": OrNone(Integer(0, MAX_TOP)),
    "token_ids": FLAG,
    "samples": OrNone(Integer(1, 1024)),
    "sample_requests": OrNone(Choice(("n", "seeds"))),
    "split": PART_NAME,
    "config": PART_NAME,
}

#: How a table's rows are read (``enqueue``'s column options, ``Queue.enqueue``'s
#: arguments, a run file's keys), by the field names of
#: ``orchestrator.formats.readers.columns.Columns``.
COLUMNS: dict[str, Rule] = {
    "prompt_column": PART_NAME,
    "messages_column": PART_NAME,
    "template": PROMPT_TEXT,
    "template_file": OrNone(PATH),
    "system": PROMPT_TEXT,
    "id_column": PART_NAME,
    "tools_column": PART_NAME,
}

#: How an export is shaped and where it goes (``orchestrator export``'s options,
#: ``Queue.export`` and ``Queue.results``), by the field names of
#: ``orchestrator.formats.options.ExportOptions``.
EXPORT: dict[str, Rule] = {
    "format": Choice(EXPORT_FORMATS),
    "reasoning": Choice(REASONING_MODES),
    "exclude_flags": Integer(minimum=0),
    "provenance": FLAG,
    "parsed": FLAG,
    "group_samples": FLAG,
    "split": FLAG,
    "include_failed": OrNone(PATH),
    "shard_rows": OrNone(Integer(minimum=1)),
    "card": OrNone(PATH),
    "logprobs": FLAG,
    "token_ids": FLAG,
    "per_turn": FLAG,
    "merge_turns": FLAG,
}
