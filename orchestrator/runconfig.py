"""A whole run declared in one TOML file, checked as a whole before anything is queued.

A 30-hour run usually mixes a dozen prompt sets with their own limits and sampling; typed
out as a dozen ``enqueue`` commands, one typo is found only when its dataset is reached.
``load_run`` reads the file, reports every problem at once (the config file, the key
path, the reason), and only then returns one ``DatasetPlan`` per dataset.
``plan_run`` then estimates requests, tokens, duration and database size from the data
files, without touching the database. docs/CONFIG.md has an annotated example.

Format::

    [defaults]                # optional; any dataset key except name and file
    model = "Qwen/Qwen3-8B"
    max_tokens = 10240        # integer >= 1; required (here or per dataset) unless passthrough
    temperature = 0.6         # number >= 0
    top_p = 0.95              # number in (0, 1]
    concurrency = 150         # integer >= 1: most requests of the dataset in flight
    regenerate = "last"       # last | all: the final answer, or every assistant turn
    on_truncated = "keep"     # keep | retry | fail: what an answer cut at max_tokens does
    chat_template_kwargs = { enable_thinking = true }
    [defaults.extra_body]     # any other request body fields, sent as they are
    top_k = 20

    [[dataset]]
    name = "toolcalls"              # 1 to 200 characters, unique
    file = "data/toolcalls.jsonl"   # relative to the config file's folder
    format = "auto"                 # auto | messages | sharegpt | prompt | openai-batch | tokens
    priority = 0                    # higher first
    passthrough = false             # rows already in the target model's format: stored as done
    # plus any key of [defaults], overriding it

A dataset's value replaces the default; ``chat_template_kwargs`` and ``extra_body`` tables
merge key by key instead (the dataset's keys win). ``format = "tokens"`` (pre-tokenised
``{"input_ids": [...], "loss_mask": [...]}`` rows) exists for pass-through datasets only.
Pass-through datasets send no requests: they take only ``model`` from ``[defaults]`` and
refuse sampling and request keys of their own.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
import textwrap
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from orchestrator import params
from orchestrator.errors import ConfigError
from orchestrator.formats.readers import INPUT_FORMATS, PASSTHROUGH_FORMATS, iter_records

__all__ = [
    "BYTES_PER_TOKEN",
    "COMPLETION_FRACTION",
    "FORMATS",
    "ITEM_OVERHEAD_BYTES",
    "ON_TRUNCATED",
    "OUTPUT_OVERHEAD_BYTES",
    "REGENERATE",
    "DatasetEstimate",
    "DatasetPlan",
    "Problem",
    "RunConfigError",
    "RunPlan",
    "StoredDataset",
    "done_stats",
    "load_run",
    "plan_json",
    "plan_run",
    "plan_stored",
    "render_plan",
]

FORMATS: tuple[str, ...] = INPUT_FORMATS
"""auto, messages, sharegpt, prompt, openai-batch, tokens: ``auto`` detects each line's
format, as ``enqueue`` does; ``tokens`` is pass-through only."""
REGENERATE: tuple[str, ...] = ("last", "all")
ON_TRUNCATED: tuple[str, ...] = ("keep", "retry", "fail")

# Formats whose rows hold an answer that can be passed through.
_PASSTHROUGH_FORMATS = PASSTHROUGH_FORMATS
# Request body fields with keys of their own (checked); extra_body holds the rest.
_BODY_KEYS = ("model", "max_tokens", "temperature", "top_p", "chat_template_kwargs")
# Keys that shape requests: meaningless on a pass-through dataset.
_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "chat_template_kwargs", "extra_body")
_REQUEST_KEYS = ("concurrency", "regenerate", "on_truncated")
# extra_body keys that would bypass a check (the rest go through orchestrator.params).
_EXTRA_BODY_REFUSED = {
    key: f'set it as the key "{key}" (outside extra_body), where it is checked'
    for key in _BODY_KEYS
}


@dataclass(frozen=True, slots=True)
class DatasetPlan:
    """One ``[[dataset]]`` of a run file, with ``[defaults]`` applied and checked.

    ``params`` is the request body every item is sent with (an item's own fields win over
    it): model, max_tokens, temperature, top_p, chat_template_kwargs and the merged
    extra_body, without unset values; what ``DatasetSpec.params`` takes. For pass-through
    datasets it holds at most ``model``, and ``regenerate`` / ``on_truncated`` keep their
    defaults without meaning anything.
    """

    name: str
    file: Path
    """Absolute: relative paths are resolved against the config file's folder."""
    format: str
    """One of ``FORMATS``."""
    params: dict[str, Any]
    concurrency: int | None
    """None: only the workers' own limits apply."""
    priority: int
    regenerate: str
    """``last``: one request per row, for its final answer (the readers drop trailing
    assistant turns). ``all``: one request per assistant turn of the row."""
    on_truncated: str
    """``keep`` the answer cut at max_tokens (finish_reason ``length``), ``retry`` it as a
    transient failure, or ``fail`` the item."""
    passthrough: bool
    """The rows are stored as they are, as done; no request is sent."""


class Problem(NamedTuple):
    where: str
    """Key path, e.g. ``dataset[3] "code".max_tokens``; empty for the file as a whole."""
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" if self.where else self.reason


class RunConfigError(ConfigError):
    """A run file that cannot be used; ``problems`` lists every one found."""

    def __init__(self, path: str | os.PathLike[str], problems: Sequence[Problem]):
        self.path = os.fspath(path)
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = f"{self.path}: {self.problems[0]}"
        else:
            lines = "".join(f"\n  {p}" for p in self.problems)
            message = f"{self.path}: {len(self.problems)} problems:{lines}"
        super().__init__(message)


# --- loading -------------------------------------------------------------------------------


def load_run(path: str | os.PathLike[str]) -> list[DatasetPlan]:
    """Read and check the run file at ``path``; every problem at once, or the plans.

    Raises ``RunConfigError`` (a ``ConfigError``) and has no other effect: the data files
    are only looked up (present, a file, not empty), not read.
    """
    source = os.fspath(path)
    try:
        data = Path(source).read_bytes()
    except FileNotFoundError:
        raise RunConfigError(source, [Problem("", "no such file")]) from None
    except IsADirectoryError:
        raise RunConfigError(source, [Problem("", "is a directory, not a file")]) from None
    except OSError as exc:
        raise RunConfigError(source, [Problem("", f"cannot read: {exc.strerror}")]) from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        raise RunConfigError(source, [Problem("", reason)]) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunConfigError(source, [Problem("", f"not valid TOML: {exc}")]) from None
    base = Path(os.path.abspath(source)).parent
    problems: list[Problem] = []
    plans = _Checker(base, problems).run(document)
    if problems:
        raise RunConfigError(source, problems)
    return plans


Check = Callable[[object], list[tuple[str, str]]]
"""A key's check: (sub-path, reason) pairs, empty when the value is fine."""


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a float ({value})"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({orjson.dumps(shown).decode()})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return "a date or time"


def _integer(minimum: int | None = None) -> Check:
    """An integer from ``minimum`` up to what every database's INTEGER column holds."""
    high = 2**31 - 1

    def check(value: object) -> list[tuple[str, str]]:
        if isinstance(value, bool) or not isinstance(value, int):
            return [("", f"must be an integer, got {_kind(value)}")]
        if minimum is not None and value < minimum:
            return [("", f"must be at least {minimum}, got {value}")]
        if abs(value) > high:
            low = -high if minimum is None else minimum
            return [("", f"must be {low} to {high}, got {value}")]
        return []

    return check


def _param(name: str) -> Check:
    """``orchestrator.params``' check, the one ``enqueue`` options and input lines get."""

    def check(value: object) -> list[tuple[str, str]]:
        want = params.expected(name, value)
        if not want:
            return []
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return [("", f"must be {want}, got {value if number else _kind(value)}")]

    return check


def _string(value: object) -> list[tuple[str, str]]:
    if not isinstance(value, str):
        return [("", f"must be a string, got {_kind(value)}")]
    if not value.strip():
        return [("", "must not be empty")]
    return []


def _name(value: object) -> list[tuple[str, str]]:
    if isinstance(value, str) and len(value) > 200:
        return [("", f"must be at most 200 characters, got {len(value)}")]
    return _string(value)


def _boolean(value: object) -> list[tuple[str, str]]:
    return [] if isinstance(value, bool) else [("", f"must be true or false, got {_kind(value)}")]


def _choice(choices: tuple[str, ...]) -> Check:
    def check(value: object) -> list[tuple[str, str]]:
        if not isinstance(value, str):
            return [("", f"must be a string, one of {' | '.join(choices)}; got {_kind(value)}")]
        if value not in choices:
            close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
            hint = f'; did you mean "{close[0]}"?' if close else ""
            quoted = orjson.dumps(value).decode()
            return [("", f"must be one of {' | '.join(choices)}, got {quoted}{hint}")]
        return []

    return check


def _json_value(value: object, where: str) -> list[tuple[str, str]]:
    """TOML dates and times have no JSON form: refuse them anywhere in a request table."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _json_value(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _json_value(v, f"{where}[{i}]")]
    if isinstance(value, str | int | float | bool):
        return []
    return [(where, "a date or time has no JSON form: write it as a string")]


def _table(value: object) -> list[tuple[str, str]]:
    if not isinstance(value, dict):
        return [("", f"must be a table, got {_kind(value)}")]
    return _json_value(value, "")


def _extra_body(value: object) -> list[tuple[str, str]]:
    problems = _table(value)
    if isinstance(value, dict):
        problems += [
            (f".{key}", _EXTRA_BODY_REFUSED[key]) for key in value if key in _EXTRA_BODY_REFUSED
        ]
        rest = {k: v for k, v in value.items() if k not in _EXTRA_BODY_REFUSED}
        problems += [(f".{key}", why) for key, why in params.problems(rest)]
    return problems


_CHECKS: dict[str, Check] = {
    "name": _name,
    "file": _string,
    "format": _choice(FORMATS),
    "priority": _integer(),
    "passthrough": _boolean,
    "model": _string,
    "max_tokens": _param("max_tokens"),
    "temperature": _param("temperature"),
    "top_p": _param("top_p"),
    "concurrency": _integer(1),
    "regenerate": _choice(REGENERATE),
    "on_truncated": _choice(ON_TRUNCATED),
    "chat_template_kwargs": _table,
    "extra_body": _extra_body,
}
_DATASET_KEYS = tuple(_CHECKS)
_DEFAULT_KEYS = tuple(k for k in _CHECKS if k not in ("name", "file"))
_TOP_KEYS = ("defaults", "dataset")
_REQUEST_DEFAULTS = {"regenerate": "last", "on_truncated": "keep"}


# Request body fields people reach for that belong in extra_body: a hint, not a limit.
_EXTRA_BODY_HINTS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "reasoning_effort",
    "response_format",
    "tools",
    "tool_choice",
    "logprobs",
    "skip_special_tokens",
)


def _unknown_key(key: str, known: Sequence[str], *, section: str) -> str:
    if section == "top":
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if close:
            return f'unknown key; did you mean "{close[0]}"?'
        return "unknown key (a run file has [defaults] and [[dataset]] tables only)"
    hints = {k: f'"{k}"' for k in known} | {k: f"extra_body.{k}" for k in _EXTRA_BODY_HINTS}
    if key in _EXTRA_BODY_HINTS:
        return f"not a key of its own: request body fields like this go in extra_body.{key}"
    close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {hints[close[0]]}?"
    return "unknown key (other request body fields go in extra_body)"


def _is_typo_of(key: str, table: Mapping[str, Any]) -> bool:
    """Whether ``table`` has a misspelt ``key``, already reported as an unknown key."""
    return any(difflib.get_close_matches(key, [k], cutoff=0.6) for k in table if k != key)


def _quote(name: str) -> str:
    return orjson.dumps(name).decode()


class _Checker:
    """Walks the parsed document, collecting problems instead of stopping at the first."""

    def __init__(self, base: Path, problems: list[Problem]):
        self.base = base
        self.problems = problems
        self.raw_defaults: dict[str, Any] = {}

    def add(self, where: str, reason: str) -> None:
        self.problems.append(Problem(where, reason))

    def checked(self, table: Mapping[str, Any], where: str, known: Sequence[str]) -> dict[str, Any]:
        """The keys of ``table`` that passed their checks; the rest become problems."""
        good: dict[str, Any] = {}
        for key, value in table.items():
            path = f"{where}.{key}"
            if key not in known:
                if key in ("name", "file"):
                    self.add(path, "belongs to each [[dataset]], not to [defaults]")
                else:
                    self.add(path, _unknown_key(key, known, section="dataset"))
                continue
            found = _CHECKS[key](value)
            for sub, reason in found:
                self.add(path + sub, reason)
            if not found:
                good[key] = value
        return good

    def run(self, document: dict[str, Any]) -> list[DatasetPlan]:
        for key in document:
            if key not in _TOP_KEYS:
                self.add(key, _unknown_key(key, _TOP_KEYS, section="top"))
        defaults: dict[str, Any] = {}
        raw_defaults = document.get("defaults", {})
        if isinstance(raw_defaults, dict):
            self.raw_defaults = raw_defaults
            defaults = self.checked(raw_defaults, "defaults", _DEFAULT_KEYS)
        else:
            self.add("defaults", f"must be a table ([defaults]), got {_kind(raw_defaults)}")

        entries = document.get("dataset")
        if entries is None or entries == []:
            self.add("dataset", "no datasets: add at least one [[dataset]] table")
            return []
        if not isinstance(entries, list):
            self.add("dataset", f"must be an array of tables ([[dataset]]), got {_kind(entries)}")
            return []
        plans: list[DatasetPlan] = []
        seen: dict[str, str] = {}
        for index, entry in enumerate(entries, start=1):
            plan = self.dataset(index, entry, defaults, seen)
            if plan is not None:
                plans.append(plan)
        return plans

    def dataset(
        self, index: int, entry: object, defaults: dict[str, Any], seen: dict[str, str]
    ) -> DatasetPlan | None:
        where = f"dataset[{index}]"
        if not isinstance(entry, dict):
            self.add(where, f"must be a table ([[dataset]]), got {_kind(entry)}")
            return None
        name = entry.get("name")
        if isinstance(name, str) and name.strip():
            where = f"{where} {_quote(name)}"
        before = len(self.problems)
        own = self.checked(entry, where, _DATASET_KEYS)
        for key in ("name", "file"):
            if key not in entry:
                self.add(f"{where}.{key}", "missing (required)")

        if "name" in own:
            if own["name"] in seen:
                self.add(f"{where}.name", f"duplicate: {seen[own['name']]} has the same name")
            else:
                seen[own["name"]] = where
        file = self.file(own["file"], f"{where}.file") if "file" in own else None

        passthrough = own.get("passthrough", defaults.get("passthrough", False))
        fmt = own.get("format", defaults.get("format", "auto"))
        from_defaults = " (from [defaults])" if "format" not in own else ""
        if passthrough:
            for key in (*_SAMPLING_KEYS, *_REQUEST_KEYS):
                if key in entry:
                    self.add(f"{where}.{key}", _passthrough_refusal(key))
            if fmt not in _PASSTHROUGH_FORMATS:
                self.add(
                    f"{where}.format",
                    f'"{fmt}"{from_defaults} rows hold no answer to pass through; a '
                    f"passthrough dataset takes {' | '.join(_PASSTHROUGH_FORMATS)}",
                )
        else:
            if fmt == "tokens":
                self.add(
                    f"{where}.format",
                    f'"tokens"{from_defaults} rows are pre-tokenised training rows, not '
                    "prompts: they need passthrough = true",
                )
            # Set but invalid or misspelt (here or in [defaults]) is reported already.
            if not any(
                "max_tokens" in table or _is_typo_of("max_tokens", table)
                for table in (entry, self.raw_defaults)
            ):
                self.add(
                    f"{where}.max_tokens",
                    "missing: a dataset that sends requests needs max_tokens (here or in "
                    "[defaults]), or one runaway answer can run to the context limit",
                )
        if len(self.problems) > before or file is None:
            return None
        return _plan(own, defaults, file)

    def file(self, value: str, where: str) -> Path | None:
        path = Path(os.path.abspath(self.base / Path(value).expanduser()))
        try:
            st = path.stat()
        except FileNotFoundError:
            self.add(where, f"no such file: {path}")
            return None
        except OSError as exc:
            self.add(where, f"cannot use {path}: {exc.strerror}")
            return None
        if stat.S_ISDIR(st.st_mode):
            self.add(where, f"is a directory, not a file: {path}")
            return None
        if st.st_size == 0:
            self.add(where, f"is empty: {path}")
            return None
        if not os.access(path, os.R_OK):
            self.add(where, f"not readable: {path}")
            return None
        return path


def _passthrough_refusal(key: str) -> str:
    what = "sampling fields" if key in _SAMPLING_KEYS else f"{key}"
    verb = "do" if key in _SAMPLING_KEYS else "does"
    return (
        f"not allowed on a passthrough dataset: its rows are stored as they are and no "
        f"request is sent, so {what} {verb} not apply"
    )


def _plan(own: dict[str, Any], defaults: dict[str, Any], file: Path) -> DatasetPlan:
    def value(key: str, fallback: Any = None) -> Any:
        return own.get(key, defaults.get(key, fallback))

    passthrough = bool(value("passthrough", False))
    params: dict[str, Any] = {}
    if value("model") is not None:
        params["model"] = value("model")
    if passthrough:
        return DatasetPlan(
            name=own["name"],
            file=file,
            format=value("format", "auto"),
            params=params,
            concurrency=None,
            priority=value("priority", 0),
            regenerate=_REQUEST_DEFAULTS["regenerate"],
            on_truncated=_REQUEST_DEFAULTS["on_truncated"],
            passthrough=True,
        )
    for key in ("max_tokens", "temperature", "top_p"):
        if value(key) is not None:
            params[key] = value(key)
    kwargs = {**defaults.get("chat_template_kwargs", {}), **own.get("chat_template_kwargs", {})}
    if kwargs:
        params["chat_template_kwargs"] = kwargs
    extra = {**defaults.get("extra_body", {}), **own.get("extra_body", {})}
    params.update({k: v for k, v in extra.items() if v is not None})
    return DatasetPlan(
        name=own["name"],
        file=file,
        format=value("format", "auto"),
        params=params,
        concurrency=value("concurrency"),
        priority=value("priority", 0),
        regenerate=value("regenerate", _REQUEST_DEFAULTS["regenerate"]),
        on_truncated=value("on_truncated", _REQUEST_DEFAULTS["on_truncated"]),
        passthrough=False,
    )


# --- planning ------------------------------------------------------------------------------

COMPLETION_FRACTION = 0.35
"""Mean answer length as a fraction of max_tokens, until answers are measured: reasoning
models at max_tokens 8k-16k typically write a third of the limit, with a long tail."""
BYTES_PER_TOKEN = 4
"""UTF-8 bytes per generated token, for English text and code; more for other scripts."""
OUTPUT_COPIES = 2
"""An answer's text is stored twice: the content and reasoning columns, and the message
JSON the server sent (outputs table)."""
ITEM_OVERHEAD_BYTES = 300
OUTPUT_OVERHEAD_BYTES = 600
"""Bytes per item row and per output row beyond their text: fixed columns, usage JSON,
indexes and page slack. Measured on a 3,000-item simulated run: 264 and 624."""


@dataclass(frozen=True, slots=True)
class DatasetEstimate:
    """What one dataset will cost: requests, tokens, time and database bytes."""

    name: str
    format: str
    mode: str
    """``last``, ``all`` (the dataset's regenerate) or ``passthrough``."""
    rows: int
    """Non-blank lines of the file."""
    requests: int
    """Requests to send: a row each for ``last``, a row's assistant turns for ``all``, 0 for
    pass-through."""
    done: int
    """Answers already done (from ``done_stats``)."""
    max_tokens: int | None
    tokens_per_request: float
    measured: bool
    """True: ``tokens_per_request`` is the mean of the answers done so far; False: it is
    ``COMPLETION_FRACTION`` of each request's max_tokens."""
    generated_tokens: int
    """Tokens generated by the whole dataset, done answers included."""
    remaining_tokens: int
    """Tokens still to generate."""
    duration_seconds: float
    """``remaining_tokens`` at the run's tokens per second, as if the dataset ran alone."""
    request_bytes: int
    output_bytes: int
    overhead_bytes: int
    running: int | None = None
    pending: int | None = None
    failed: int | None = None
    """Requests of running, pending and failed items (``plan_stored`` only): with ``done``
    they add up to ``requests``."""

    @property
    def db_bytes(self) -> int:
        return self.request_bytes + self.output_bytes + self.overhead_bytes


@dataclass(frozen=True, slots=True)
class RunPlan:
    """Every dataset's estimate, the totals, and the assumptions behind them."""

    datasets: tuple[DatasetEstimate, ...]
    tokens_per_second: float
    completion_fraction: float
    assumptions: tuple[str, ...]
    source: str = "config"
    """``config``: from a run file's data files (``plan_run``); ``database``: from what a
    database holds (``plan_stored``)."""

    @property
    def rows(self) -> int:
        return sum(d.rows for d in self.datasets)

    @property
    def requests(self) -> int:
        return sum(d.requests for d in self.datasets)

    @property
    def done(self) -> int:
        return sum(d.done for d in self.datasets)

    @property
    def generated_tokens(self) -> int:
        return sum(d.generated_tokens for d in self.datasets)

    @property
    def remaining_tokens(self) -> int:
        return sum(d.remaining_tokens for d in self.datasets)

    @property
    def duration_seconds(self) -> float:
        """The datasets share the server, so their times add up."""
        return self.remaining_tokens / self.tokens_per_second

    @property
    def db_bytes(self) -> int:
        return sum(d.db_bytes for d in self.datasets)


def plan_run(
    plans: Sequence[DatasetPlan],
    *,
    tokens_per_second: float,
    done_stats: Mapping[str, tuple[int, float]] | None = None,
    completion_fraction: float = COMPLETION_FRACTION,
) -> RunPlan:
    """Estimate the run from the data files (read once each) and what is done so far.

    ``done_stats`` maps a dataset name to (answers done, their mean completion tokens), as
    ``status`` reports them; a dataset with answers done is estimated from their mean
    instead of ``completion_fraction`` × max_tokens. A bad line raises ``InputError``
    (``FILE:LINE: reason``), as ``enqueue`` would.
    """
    _check_rates(tokens_per_second, completion_fraction)
    stats = dict(done_stats or {})
    estimates = tuple(
        _estimate(plan, _scan(plan), stats.get(plan.name), completion_fraction, tokens_per_second)
        for plan in plans
    )
    return RunPlan(
        datasets=estimates,
        tokens_per_second=float(tokens_per_second),
        completion_fraction=completion_fraction,
        assumptions=_assumptions(estimates, tokens_per_second, completion_fraction),
    )


class _Scan(NamedTuple):
    rows: int
    requests: int
    budget: int
    """Sum of the requests' max_tokens (a row's own max_tokens wins over the dataset's)."""
    request_bytes: int


def _scan(plan: DatasetPlan) -> _Scan:
    """Read the data file as ``enqueue`` will, so both accept and refuse the same lines."""
    default_cap = plan.params.get("max_tokens", 0)
    rows = requests = budget = size = 0
    records = iter_records(
        plan.file, fmt=plan.format, regenerate=plan.regenerate, passthrough=plan.passthrough
    )
    for record in records:
        rows += 1
        size += len(orjson.dumps(record.request))
        if plan.passthrough:
            continue
        request = record.request
        cap = request.get("max_tokens") or request.get("max_completion_tokens") or default_cap
        requests += record.turns
        budget += cap * record.turns
    return _Scan(rows, requests, budget, size)


@dataclass(frozen=True, slots=True)
class StoredDataset:
    """What a database holds of one dataset, in requests (a turn each), for planning.

    ``orchestrator.store.planning.stored_datasets`` reads it. Requests add up:
    ``requests == done + running + pending + failed``.
    """

    name: str
    format: str | None
    """The dataset's input format (``mixed`` for several); None when unknown."""
    mode: str
    """``last``, ``all`` or ``passthrough``."""
    params: dict[str, Any]
    items: int
    requests: int
    """Turns to generate over all items (0 for pass-through)."""
    done: int
    """Turns generated: every turn of a done item, the turns done so far of the others."""
    running: int
    pending: int
    failed: int
    """Turns still to generate of running, pending and failed items."""
    request_bytes: int
    answers: int
    """Outputs that report their completion tokens."""
    completion_tokens: int
    """Their sum: every turn of the item each."""
    answer_turns: int
    """The turns those outputs cover (one each for ``last``)."""

    @property
    def mean_completion_tokens(self) -> float:
        """Per request (turn)."""
        return self.completion_tokens / self.answer_turns if self.answer_turns else 0.0


def done_stats(stored: Sequence[StoredDataset]) -> dict[str, tuple[int, float]]:
    """``plan_run``'s ``done_stats`` from a database: requests done and their mean tokens,
    for the datasets whose answers report tokens."""
    return {
        s.name: (s.done, s.mean_completion_tokens)
        for s in stored
        if s.mode != "passthrough" and s.answers
    }


def plan_stored(
    stored: Sequence[StoredDataset],
    *,
    tokens_per_second: float,
    completion_fraction: float = COMPLETION_FRACTION,
) -> RunPlan:
    """Estimate the rest of a run from what its database holds, without data files.

    Tokens per request are the mean of the answers done when some report tokens, else
    ``completion_fraction`` of the dataset's max_tokens (an item's own max_tokens is not
    read). Time left counts the running and pending requests; failed ones run only if
    requeued.
    """
    _check_rates(tokens_per_second, completion_fraction)
    estimates = []
    for s in stored:
        max_tokens = s.params.get("max_tokens")
        max_tokens = max_tokens if isinstance(max_tokens, int) else None
        passthrough = s.mode == "passthrough"
        measured = bool(s.answers) and not passthrough
        if passthrough:
            per = 0.0
        elif measured:
            per = s.mean_completion_tokens
        else:
            per = completion_fraction * (max_tokens or 0)
        generated = round(s.requests * per)
        remaining = round((s.running + s.pending) * per)
        estimates.append(
            DatasetEstimate(
                name=s.name,
                format=s.format or "-",
                mode=s.mode,
                rows=s.items,
                requests=s.requests,
                done=s.done,
                max_tokens=max_tokens,
                tokens_per_request=per,
                measured=measured,
                generated_tokens=generated,
                remaining_tokens=remaining,
                duration_seconds=remaining / tokens_per_second,
                request_bytes=s.request_bytes,
                output_bytes=generated * BYTES_PER_TOKEN * OUTPUT_COPIES,
                overhead_bytes=(s.items if passthrough else s.requests)
                * (ITEM_OVERHEAD_BYTES + OUTPUT_OVERHEAD_BYTES),
                running=s.running,
                pending=s.pending,
                failed=s.failed,
            )
        )
    return RunPlan(
        datasets=tuple(estimates),
        tokens_per_second=float(tokens_per_second),
        completion_fraction=completion_fraction,
        assumptions=_assumptions(estimates, tokens_per_second, completion_fraction, stored=True),
        source="database",
    )


def _check_rates(tokens_per_second: float, completion_fraction: float) -> None:
    if isinstance(tokens_per_second, bool) or not (
        isinstance(tokens_per_second, int | float)
        and math.isfinite(tokens_per_second)
        and tokens_per_second > 0
    ):
        raise ConfigError(f"tokens per second must be a positive number, got {tokens_per_second!r}")
    if not 0 < completion_fraction <= 1:
        raise ConfigError(f"completion fraction must be in (0, 1], got {completion_fraction!r}")


def _estimate(
    plan: DatasetPlan,
    scan: _Scan,
    stats: tuple[int, float] | None,
    fraction: float,
    tokens_per_second: float,
) -> DatasetEstimate:
    if plan.passthrough:
        return DatasetEstimate(
            name=plan.name,
            format=plan.format,
            mode="passthrough",
            rows=scan.rows,
            requests=0,
            done=0,
            max_tokens=None,
            tokens_per_request=0.0,
            measured=False,
            generated_tokens=0,
            remaining_tokens=0,
            duration_seconds=0.0,
            request_bytes=scan.request_bytes,
            output_bytes=0,
            overhead_bytes=scan.rows * (ITEM_OVERHEAD_BYTES + OUTPUT_OVERHEAD_BYTES),
        )
    done, mean = stats if stats is not None else (0, 0.0)
    measured = done > 0
    if measured:
        per_request = float(mean)
        generated = round(scan.requests * per_request)
        remaining = round(max(scan.requests - done, 0) * per_request)
    else:
        generated = remaining = round(scan.budget * fraction)
        per_request = generated / scan.requests if scan.requests else 0.0
    return DatasetEstimate(
        name=plan.name,
        format=plan.format,
        mode=plan.regenerate,
        rows=scan.rows,
        requests=scan.requests,
        done=done,
        max_tokens=plan.params.get("max_tokens"),
        tokens_per_request=per_request,
        measured=measured,
        generated_tokens=generated,
        remaining_tokens=remaining,
        duration_seconds=remaining / tokens_per_second,
        request_bytes=scan.request_bytes,
        output_bytes=generated * BYTES_PER_TOKEN * OUTPUT_COPIES,
        overhead_bytes=scan.requests * (ITEM_OVERHEAD_BYTES + OUTPUT_OVERHEAD_BYTES),
    )


def _assumptions(
    estimates: Sequence[DatasetEstimate],
    tokens_per_second: float,
    fraction: float,
    *,
    stored: bool = False,
) -> tuple[str, ...]:
    senders = [d for d in estimates if d.mode != "passthrough"]
    notes = []
    if any(d.measured for d in senders):
        notes.append("m: tokens per request measured, the mean of the answers done so far")
    if any(not d.measured for d in senders):
        whose = (
            "the dataset's max_tokens (items' own max_tokens are not read)"
            if stored
            else "max_tokens (a row's own max_tokens wins over the dataset's)"
        )
        notes.append(
            f"a: tokens per request assumed, {fraction:g} x {whose} until answers are measured"
        )
    if stored and any(d.max_tokens is None and not d.measured for d in senders):
        notes.append("datasets without max_tokens and without answers yet count no tokens")
    notes.append(
        f"time left: tokens still to generate at {tokens_per_second:,.0f} tok/s, the servers' "
        "total generation rate shared by all datasets; prefill, retries and idle time not "
        "counted"
        + (
            "; running and pending requests only (failed ones run again if requeued)"
            if stored
            else ""
        )
    )
    notes.append(
        f"database: request JSON, plus {BYTES_PER_TOKEN} bytes per generated token stored "
        f"{OUTPUT_COPIES} times (text columns and message JSON), plus "
        f"{ITEM_OVERHEAD_BYTES + OUTPUT_OVERHEAD_BYTES} bytes per request for rows, indexes "
        "and page slack"
    )
    if any(d.mode == "all" for d in senders):
        notes.append(
            "regenerate = all: one request per assistant turn after the first user turn, "
            "plus the final answer when a row ends on a user or tool turn; the conversation "
            "is stored once, with each generated turn"
        )
    if any(d.mode == "passthrough" for d in estimates):
        notes.append(
            "passthrough: rows stored as they are, as done, without requests; counted at "
            "their stored size plus the per-row overhead"
        )
    return tuple(notes)


# --- rendering -----------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _rows(plan: RunPlan) -> Iterator[list[str]]:
    stored = plan.source == "database"
    for d in plan.datasets:
        sending = d.mode != "passthrough"
        per = f"{d.tokens_per_request:,.0f} {'m' if d.measured else 'a'}" if sending else "-"
        states = [
            f"{n:,}" if sending and n is not None else "-" for n in (d.running, d.pending, d.failed)
        ]
        yield [
            d.name,
            d.format,
            d.mode,
            f"{d.rows:,}",
            f"{d.requests:,}" if sending else "-",
            f"{d.done:,}" if sending else "-",
            *(states if stored else []),
            f"{d.max_tokens:,}" if d.max_tokens is not None else "-",
            per,
            f"{d.generated_tokens:,}" if sending else "-",
            _duration(d.duration_seconds) if sending else "-",
            _size(d.db_bytes),
        ]
    totals = [f"{sum(getattr(d, k) or 0 for d in plan.datasets):,}" for k in _STATES]
    yield [
        "total",
        "",
        "",
        f"{plan.rows:,}",
        f"{plan.requests:,}",
        f"{plan.done:,}",
        *(totals if stored else []),
        "",
        "",
        f"{plan.generated_tokens:,}",
        _duration(plan.duration_seconds),
        _size(plan.db_bytes),
    ]


_STATES = ("running", "pending", "failed")
_HEADER = (
    "dataset",
    "format",
    "mode",
    "rows",
    "requests",
    "done",
    "max_tokens",
    "tok/request",
    "tokens",
    "time left",
    "database",
)
_LEFT = 3  # the first three columns are text, the rest numbers


def _header(plan: RunPlan) -> list[str]:
    if plan.source != "database":
        return list(_HEADER)
    done = _HEADER.index("done") + 1
    return [*_HEADER[:done], *_STATES, *_HEADER[done:]]


def render_plan(plan: RunPlan) -> str:
    """A plain-text table: one line per dataset, the totals, then the assumptions.

    A plan from a database (``plan_stored``) also shows the running, pending and failed
    requests.
    """
    header = _header(plan)
    table = [header, *_rows(plan)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.ljust(width) if i < _LEFT else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(table[0]), rule, *(line(r) for r in table[1:-1]), rule, line(table[-1]), ""]
    remaining = f"{plan.remaining_tokens:,} tokens still to generate"
    out.append(
        f"{remaining}, {_duration(plan.duration_seconds)} at {plan.tokens_per_second:,.0f} tok/s"
    )
    out.append("")
    for note in plan.assumptions:
        out.extend(textwrap.wrap(note, width=88, initial_indent="- ", subsequent_indent="  "))
    return "\n".join(out) + "\n"


def plan_json(plan: RunPlan) -> dict[str, Any]:
    """The plan as a JSON-ready document: every estimate, the totals and the assumptions."""
    stored = plan.source == "database"

    def dataset(d: DatasetEstimate) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": d.name,
            "format": d.format,
            "mode": d.mode,
            "rows": d.rows,
            "requests": d.requests,
            "done": d.done,
        }
        if stored:
            doc.update(running=d.running, pending=d.pending, failed=d.failed)
        doc.update(
            max_tokens=d.max_tokens,
            tokens_per_request=round(d.tokens_per_request, 1),
            measured=d.measured,
            generated_tokens=d.generated_tokens,
            remaining_tokens=d.remaining_tokens,
            duration_seconds=round(d.duration_seconds, 1),
            db_bytes=d.db_bytes,
        )
        return doc

    return {
        "source": plan.source,
        "tokens_per_second": plan.tokens_per_second,
        "completion_fraction": plan.completion_fraction,
        "datasets": [dataset(d) for d in plan.datasets],
        "total": {
            "rows": plan.rows,
            "requests": plan.requests,
            "done": plan.done,
            "generated_tokens": plan.generated_tokens,
            "remaining_tokens": plan.remaining_tokens,
            "duration_seconds": round(plan.duration_seconds, 1),
            "db_bytes": plan.db_bytes,
        },
        "assumptions": list(plan.assumptions),
    }
