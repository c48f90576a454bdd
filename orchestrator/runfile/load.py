"""Reading a run file and checking it as a whole: every problem at once, or the plans.

Format::

    [defaults]                # optional; any dataset key except name and file
    model = "Qwen/Qwen3-8B"
    max_tokens = 10240        # integer >= 1; required (here or per dataset) unless passthrough
    temperature = 0.6         # number >= 0
    top_p = 0.95              # number in (0, 1]
    concurrency = 150         # integer >= 1: most requests of the dataset in flight
    regenerate = "last"       # last | all | each: the final answer, every assistant turn
                              # after the ones generated, or each turn against the original
    on_truncated = "keep"     # keep | retry | fail: what an answer cut at max_tokens does
    on_invalid = "keep"       # keep | retry | fail: structured output that is not the JSON asked
    on_overflow = "fail"      # fail | fit: a prompt and max_tokens longer than the context
    history_reasoning = "keep"  # keep | drop: earlier turns' reasoning in the history sent
    token_ids = false         # true: keep the server's own prompt and generated token ids
    samples = 1               # answers per prompt, each its own item (1 to 1024)
    # seeds = [1, 2, 3, 4]    # one per sample, all different (default: from each key)
    sample_requests = "n"     # n: one request with n choices | seeds: one per sample
    chat_template_kwargs = { enable_thinking = true }
    [defaults.extra_body]     # any other request body fields, sent as they are
    top_k = 20

    [[dataset]]
    name = "toolcalls"              # 1 to 200 characters, unique
    file = "data/toolcalls.jsonl"   # relative to the config file's folder: a JSONL, Parquet,
                                    # CSV/TSV or Arrow file, a folder of shards, a save_to_disk
                                    # folder, or a glob ("data/train-*.parquet")
    # hf = "ORG/NAME"               # instead of file: a Hub dataset (needs orchestrator[hf])
    # split = "train"               # a Hub dataset's or a DatasetDict folder's split
    # config = "default"            # a Hub dataset's configuration
    format = "auto"                 # auto | messages | sharegpt | prompt | openai-batch | tokens
    priority = 0                    # higher first
    passthrough = false             # rows already in the target model's format: stored as done
    # prompt_column / messages_column / template / template_file: what builds the messages
    # system, id_column, tools_column: see docs/CONFIG.md
    # plus any key of [defaults], overriding it

A dataset's value replaces the default; ``chat_template_kwargs`` and ``extra_body`` tables
merge key by key instead (the dataset's keys win). ``format = "tokens"`` (pre-tokenised
``{"input_ids": [...], "loss_mask": [...]}`` rows) exists for pass-through datasets only.
Pass-through datasets send no requests: they take only ``model`` from ``[defaults]`` and
refuse sampling and request keys of their own.
"""

from __future__ import annotations

import difflib
import os
import stat
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.readers import columns as row_columns
from orchestrator.formats.readers.rows import INPUT_FORMATS, PASSTHROUGH_FORMATS
from orchestrator.formats.readers.source import open_source
from orchestrator.items import params
from orchestrator.items.params import logprob_params, token_id_params
from orchestrator.settings import checks
from orchestrator.settings.dataset_options import (
    ENDPOINTS,
    HISTORY_REASONING,
    ON_INVALID,
    ON_OVERFLOW,
    ON_TRUNCATED,
    REGENERATE,
)

__all__ = ["FORMATS", "DatasetPlan", "Problem", "RunConfigError", "load_prices", "load_run"]

FORMATS: tuple[str, ...] = INPUT_FORMATS
"""auto, messages, sharegpt, prompt, openai-batch, tokens: ``auto`` detects each line's
format, as ``enqueue`` does; ``tokens`` is pass-through only."""
# Request body fields with keys of their own (checked); extra_body holds the rest.
_BODY_KEYS = ("model", "max_tokens", "temperature", "top_p", "chat_template_kwargs")
# Keys that shape requests: meaningless on a pass-through dataset.
_SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "chat_template_kwargs",
    "extra_body",
    "logprobs",
    "token_ids",
)
_REQUEST_KEYS = (
    "concurrency",
    "regenerate",
    "on_truncated",
    "on_invalid",
    "on_overflow",
    "history_reasoning",
    "samples",
    "seeds",
    "sample_requests",
)
# extra_body keys that would bypass a check (the rest go through orchestrator.items.params).
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
    file: Path | None
    """Absolute: relative paths are resolved against the config file's folder. None for a
    Hub dataset (``hf``)."""
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
    on_invalid: str = "keep"
    """Structured output (``response_format``) that does not parse or match its schema:
    ``keep`` it flagged, ``retry`` it, or ``fail`` the item."""
    on_overflow: str = "fail"
    """A prompt and ``max_tokens`` longer than the server's context: ``fail`` the item
    (``context_overflow``), or ``fit``: ask again with ``max_tokens`` lowered to fit."""
    history_reasoning: str = "keep"
    """Earlier assistant turns go back with their reasoning (``keep``) or without (``drop``)."""
    hf: str | None = None
    """A Hub dataset (``ORG/NAME``) read instead of a file."""
    split: str | None = None
    config: str | None = None
    columns: row_columns.Columns | None = None
    """How rows are read by their columns; None: as JSONL lines."""
    endpoint: str = "chat"
    """``chat`` or ``completions`` (each row's plain prompt to ``/v1/completions``)."""
    logprobs: int | None = None
    """Top alternatives kept per token with each token's logprob; None: no logprobs."""
    samples: int | None = None
    """Answers per prompt; None: the dataset's (1 for a new one)."""
    seeds: tuple[int, ...] | None = None
    sample_requests: str | None = None

    @property
    def source(self) -> str:
        """What ``enqueue`` reads: the file's path, or ``hf://ORG/NAME``."""
        return f"hf://{self.hf}" if self.hf is not None else str(self.file)

    @property
    def reading(self) -> dict[str, Any]:
        """How its rows are read: the options of ``formats.read`` and ``iter_records``
        beside the source, so that ``plan`` and ``enqueue`` read the same rows."""
        return {
            "fmt": self.format,
            "regenerate": self.regenerate,
            "passthrough": self.passthrough,
            "columns": self.columns,
            "split": self.split,
            "config": self.config,
            "endpoint": self.endpoint,
        }


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


def load_run(path: str | os.PathLike[str]) -> list[DatasetPlan]:
    """Read and check the run file at ``path``; every problem at once, or the plans.

    Raises ``RunConfigError`` (a ``ConfigError``) and has no other effect: the data files
    are only looked up (present, a file, not empty), not read.
    """
    source, document = _read(path)
    base = Path(os.path.abspath(source)).parent
    problems: list[Problem] = []
    plans = _Checker(base, problems).run(document)
    if problems:
        raise RunConfigError(source, problems)
    return plans


def load_prices(path: str | os.PathLike[str]) -> dict[str, float]:
    """The run file's ``[prices]`` (``gpu_hour_cost``, ``price_input``, ``price_output``:
    ``orchestrator.settings.prices.Prices``' fields), checked; {} when it has none."""
    source, document = _read(path)
    problems: list[Problem] = []
    prices = _prices(document.get("prices", {}), problems)
    if problems:
        raise RunConfigError(source, problems)
    return prices


def _prices(table: object, problems: list[Problem]) -> dict[str, float]:
    """A ``[prices]`` table's keys that pass their rule; the rest become problems."""
    if not isinstance(table, dict):
        problems.append(Problem("prices", f"must be a table ([prices]), got {_kind(table)}"))
        return {}
    good: dict[str, float] = {}
    for key, value in table.items():
        rule = checks.PRICES.get(key)
        if rule is None:
            known = ", ".join(checks.PRICES)
            problems.append(Problem(f"prices.{key}", f"unknown key (a price is one of {known})"))
            continue
        want = rule.expected(value)
        if want:
            problems.append(Problem(f"prices.{key}", f"must be {want}, got {_kind(value)}"))
        else:
            good[key] = value
    return good


def _read(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """The run file's path as given and its parsed document, or ``RunConfigError``."""
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
        return source, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunConfigError(source, [Problem("", f"not valid TOML: {exc}")]) from None


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


def _by(expected: Callable[[object], str]) -> Check:
    """A key checked by the rule the same setting has everywhere (``orchestrator.settings.checks``,
    ``orchestrator.items.params``), in a run file's words for what was given."""

    def check(value: object) -> list[tuple[str, str]]:
        want = expected(value)
        if not want:
            return []
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return [("", f"must be {want}, got {value if number else _kind(value)}")]

    return check


def _param(name: str) -> Check:
    """``orchestrator.items.params``' check, the one ``enqueue`` options and input lines get."""
    return _by(lambda value: params.expected(name, value))


def _string(value: object) -> list[tuple[str, str]]:
    if not isinstance(value, str):
        return [("", f"must be a string, got {_kind(value)}")]
    if not value.strip():
        return [("", "must not be empty")]
    return []


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


_FINITE = checks.Number()


def _json_value(value: object, where: str) -> list[tuple[str, str]]:
    """TOML dates and times, NaN and infinities have no JSON form (a NaN would be sent as
    null): refuse them anywhere in a request table."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _json_value(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _json_value(v, f"{where}[{i}]")]
    if isinstance(value, float) and (want := _FINITE.expected(value)):
        return [(where, f"must be {want}, got {value} (it has no JSON form)")]
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


def _seeds(value: Any) -> list[tuple[str, str]]:
    """A list of distinct integers, one per sample."""
    if not isinstance(value, list) or not value:
        return [("", "must be a non-empty list of integers")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 for v in value):
        return [("", f"must hold integers from 0 to {2**31 - 1}")]
    repeated = sorted({v for v in value if value.count(v) > 1})
    if repeated:
        return [("", f"holds {repeated[0]} twice: every sample must be a distinct draw")]
    return []


_CHECKS: dict[str, Check] = {
    "name": _by(checks.DATASET_NAME.expected),
    "file": _string,
    "format": _choice(FORMATS),
    "priority": _by(checks.DATASET["priority"].expected),
    "passthrough": _boolean,
    "model": _param("model"),
    "max_tokens": _param("max_tokens"),
    "temperature": _param("temperature"),
    "top_p": _param("top_p"),
    "concurrency": _by(checks.DATASET["concurrency"].expected),
    "regenerate": _choice(REGENERATE),
    "on_truncated": _choice(ON_TRUNCATED),
    "on_invalid": _choice(ON_INVALID),
    "on_overflow": _choice(ON_OVERFLOW),
    "history_reasoning": _choice(HISTORY_REASONING),
    "endpoint": _choice(ENDPOINTS),
    "logprobs": _by(checks.DATASET["logprobs"].expected),
    "token_ids": _boolean,
    "samples": _by(checks.DATASET["samples"].expected),
    "seeds": _seeds,
    "sample_requests": _choice(("n", "seeds")),
    "chat_template_kwargs": _table,
    "extra_body": _extra_body,
    "hf": _string,
    "split": _by(checks.DATASET["split"].expected),
    "config": _by(checks.DATASET["config"].expected),
    "prompt_column": _by(checks.COLUMNS["prompt_column"].expected),
    "messages_column": _by(checks.COLUMNS["messages_column"].expected),
    "template": _by(checks.COLUMNS["template"].expected),
    # A path, as file is: a string, resolved against the run file's folder.
    "template_file": _string,
    "system": _by(checks.COLUMNS["system"].expected),
    "id_column": _by(checks.COLUMNS["id_column"].expected),
    "tools_column": _by(checks.COLUMNS["tools_column"].expected),
}
_OWN_KEYS = ("name", "file", "hf")
"""Keys of each dataset alone: [defaults] cannot hold them."""
_COLUMN_KEYS = tuple(f.name for f in fields(row_columns.Columns))
_DATASET_KEYS = tuple(_CHECKS)
_DEFAULT_KEYS = tuple(k for k in _CHECKS if k not in _OWN_KEYS)
_TOP_KEYS = ("defaults", "dataset", "prices")
_REQUEST_DEFAULTS = {
    "regenerate": "last",
    "on_truncated": "keep",
    "on_invalid": "keep",
    "on_overflow": "fail",
    "history_reasoning": "keep",
}


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
        return "unknown key (a run file has [defaults], [[dataset]] and [prices] tables only)"
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
                if key in _OWN_KEYS:
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
        _prices(document.get("prices", {}), self.problems)
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
        if "name" not in entry:
            self.add(f"{where}.name", "missing (required)")
        if "file" not in entry and "hf" not in entry:
            self.add(f"{where}.file", "missing (required): a file, or hf for a Hub dataset")
        if "file" in entry and "hf" in entry:
            self.add(f"{where}.hf", "a dataset reads a file or a Hub dataset (hf), not both")

        if "name" in own:
            if own["name"] in seen:
                self.add(f"{where}.name", f"duplicate: {seen[own['name']]} has the same name")
            else:
                seen[own["name"]] = where
        passthrough = own.get("passthrough", defaults.get("passthrough", False))
        fmt = own.get("format", defaults.get("format", "auto"))
        split = own.get("split", defaults.get("split"))
        config = own.get("config", defaults.get("config"))
        file = self.source(own, where, split, config)
        columns = self.columns(own, defaults, where, fmt, passthrough)
        from_defaults = " (from [defaults])" if "format" not in own else ""
        if passthrough:
            for key in (*_SAMPLING_KEYS, *_REQUEST_KEYS):
                if key in entry:
                    self.add(f"{where}.{key}", _passthrough_refusal(key))
            if fmt not in PASSTHROUGH_FORMATS:
                self.add(
                    f"{where}.format",
                    f'"{fmt}"{from_defaults} rows hold no answer to pass through; a '
                    f"passthrough dataset takes {' | '.join(PASSTHROUGH_FORMATS)}",
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
        plan = _plan(own, defaults, file if isinstance(file, Path) else None)
        return replace(plan, hf=own.get("hf"), split=split, config=config, columns=columns)

    def source(
        self, own: dict[str, Any], where: str, split: str | None, config: str | None
    ) -> Path | str | None:
        """The dataset's file (absolute) or Hub name, opened as ``enqueue`` will open it:
        a missing file, an empty folder, an unknown split is a problem here."""
        if "hf" in own and "file" in own:
            return None  # reported already: one or the other
        if "hf" in own:
            spec = f"hf://{own['hf']}"
            if self._opened(spec, f"{where}.hf", split, config):
                return str(own["hf"])
            return None
        if "file" not in own:
            return None
        where = f"{where}.file"
        path = Path(os.path.abspath(self.base / Path(own["file"]).expanduser()))
        try:
            st = path.stat()
        except OSError:
            st = None  # a glob, or missing: opening it says which
        if st is not None and stat.S_ISREG(st.st_mode):
            if st.st_size == 0:
                self.add(where, f"is empty: {path}")
                return None
            if not os.access(path, os.R_OK):
                self.add(where, f"not readable: {path}")
                return None
        return path if self._opened(str(path), where, split, config) else None

    def _opened(self, spec: str, where: str, split: str | None, config: str | None) -> bool:
        try:
            open_source(spec, split=split, config=config)
        except InputError as exc:
            self.add(where, f"{exc.reason}: {exc.path}" if exc.path else exc.reason)
            return False
        except ConfigError as exc:
            self.add(where, str(exc))
            return False
        return True

    def columns(
        self,
        own: dict[str, Any],
        defaults: dict[str, Any],
        where: str,
        fmt: str,
        passthrough: bool,
    ) -> row_columns.Columns | None:
        """The dataset's column keys, checked as ``enqueue`` checks its options."""
        values = {key: own.get(key, defaults.get(key)) for key in _COLUMN_KEYS}
        if values["template_file"] is not None:
            values["template_file"] = os.path.abspath(
                self.base / Path(values["template_file"]).expanduser()
            )
        columns = row_columns.Columns(**values)
        if not columns.given():
            return None
        regenerate = own.get("regenerate", defaults.get("regenerate", "last"))
        mode = "passthrough" if passthrough else regenerate
        found = row_columns.problems(columns, fmt=fmt, mode=mode)
        for key, reason in found:
            self.add(f"{where}.{key}", reason)
        if not found:
            try:
                row_columns.check(columns, fmt=fmt, mode=mode)
            except ConfigError as exc:
                key = "template_file" if columns.template_file is not None else "template"
                self.add(f"{where}.{key}", str(exc))
        return columns


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
    endpoint = value("endpoint", "chat")
    params.update(logprob_params(endpoint, value("logprobs")))
    params.update(token_id_params(value("token_ids")))
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
        on_invalid=value("on_invalid", _REQUEST_DEFAULTS["on_invalid"]),
        on_overflow=value("on_overflow", _REQUEST_DEFAULTS["on_overflow"]),
        history_reasoning=value("history_reasoning", _REQUEST_DEFAULTS["history_reasoning"]),
        endpoint=endpoint,
        logprobs=value("logprobs"),
        samples=value("samples"),
        seeds=tuple(value("seeds")) if value("seeds") is not None else None,
        sample_requests=value("sample_requests"),
    )
