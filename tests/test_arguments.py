"""Wrong arguments to every public call of the Python API, and the commands' options that
take the same values: only the documented errors come out (a ConfigError naming the
argument), before anything is read or written, and the command refuses what the API
refuses, in the same words.

The rules below are written from docs/API.md, apart from the code's own
(orchestrator.settings.checks):
a value is drawn only when the documentation says it will not do.
"""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchestrator as orc
from orchestrator.items.quality import ALL_FLAGS
from tests.helpers import cli, is_postgres, prompts, query, write_jsonl

INT_MAX = 2**31 - 1
INPUT_FORMATS = ("auto", "messages", "sharegpt", "prompt", "openai-batch", "tokens")
EXPORT_FORMATS = ("messages", "sharegpt", "openai-batch")
REASONING = ("separate", "inline", "drop")


# ------------------------------------------------------------------ what will do


def _int(v: object, low: int | None = None, high: int | None = None) -> bool:
    return type(v) is int and (low is None or v >= low) and (high is None or v <= high)


def _number(v: object, low: float, *, above: bool = False) -> bool:
    if type(v) not in (int, float) or not math.isfinite(v):  # type: ignore[arg-type]
        return False
    return v > low if above else v >= low  # type: ignore[operator]


def _text(v: object) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _bool(v: object) -> bool:
    return type(v) is bool


def _maybe(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or ok(v)


def _names(v: object) -> bool:
    if isinstance(v, str):
        return _text(v)
    return isinstance(v, list | tuple | set | frozenset) and all(_text(x) for x in v)


def _flags(v: object) -> bool:
    def one(spec: object) -> bool:
        if not isinstance(spec, str):
            return False
        parts = [p.strip().lower().replace("-", "_") for p in spec.split(",") if p.strip()]
        return bool(parts) and all(p in ALL_FLAGS for p in parts)

    if isinstance(v, str):
        return one(v)
    return isinstance(v, list | tuple | set | frozenset) and all(one(x) for x in v)


def _path(v: object) -> bool:
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    return isinstance(v, str) and v != ""


def _records(v: object) -> bool:
    if _path(v):
        return True
    return hasattr(v, "__iter__") and not isinstance(v, str | bytes | dict)


def _json(v: object) -> bool:
    if v is None or isinstance(v, bool | str):
        return True
    if isinstance(v, int):
        return -(2**63) <= v < 2**64
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list | tuple):
        return all(_json(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _json(x) for k, x in v.items())


def _fields(params: dict[str, Any]) -> bool:
    """Request fields as docs/API.md has them: the worker's own are refused, the named ones
    hold what their arguments take."""
    named = VALID["enqueue"]
    for key, value in params.items():
        if key in ("messages", "stream", "stream_options"):
            return False
        if key == "n" and not (type(value) is int and value == 1):
            return False
        if key in ("model", "max_tokens", "temperature", "top_p") and not named[key](value):
            return False
    return True


def _cap(v: object) -> bool:
    if isinstance(v, str):
        text = v.strip().lower()
        if text == "auto":
            return True
        try:
            return int(text) >= 1
        except ValueError:
            return False
    return _int(v, 1)


def _choice(*choices: str) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and v in choices


FLAG = _bool
FINITE_AT_LEAST_1 = lambda v: _number(v, 1)  # noqa: E731

# (method, argument) -> what the argument takes; the valid call each is put in.
VALID: dict[str, dict[str, Callable[[object], bool]]] = {
    "enqueue": {
        "records": _records,
        "dataset": lambda v: _text(v) and len(v) <= 200,  # type: ignore[arg-type]
        "model": _maybe(_text),
        "max_tokens": _maybe(lambda v: _int(v, 1, INT_MAX)),
        "temperature": _maybe(lambda v: _number(v, 0)),
        "top_p": _maybe(lambda v: _number(v, 0, above=True) and v <= 1),  # type: ignore[operator]
        "params": _maybe(lambda v: isinstance(v, dict) and _json(v) and _fields(v)),
        "concurrency": _maybe(lambda v: _int(v, 1, INT_MAX)),
        "priority": _maybe(lambda v: _int(v, -INT_MAX, INT_MAX)),
        "format": _choice(*INPUT_FORMATS),
        "regenerate": _maybe(_choice("last", "all")),
        "on_truncated": _maybe(_choice("keep", "retry", "fail")),
        "passthrough": FLAG,
        "update": FLAG,
        "skip_invalid": FLAG,
        "prompt_column": _maybe(_text),
        "messages_column": _maybe(_text),
        "template": _maybe(_text),
        "template_file": _maybe(_path),
        "system": _maybe(_text),
        "id_column": _maybe(_text),
        "tools_column": _maybe(_text),
        "split": _maybe(_text),
        "config": _maybe(_text),
    },
    "enqueue_config": {"config": _path, "update": FLAG, "skip_invalid": FLAG},
    "run": {
        "servers": lambda v: _names(v) and len(v) > 0,  # type: ignore[arg-type]
        "concurrency": _cap,
        "datasets": _names,
        "until_done": FLAG,
        "give_up_after": _maybe(lambda v: _number(v, 0, above=True)),
        "request_timeout": FINITE_AT_LEAST_1,
        "lease_seconds": lambda v: _number(v, 2),
        "max_attempts": lambda v: _int(v, 1),
        "retry_backoff": lambda v: _number(v, 0.01),
        "grace": lambda v: _number(v, 0),
        "stream": FLAG,
        "stream_idle_timeout": FINITE_AT_LEAST_1,
        "api_key": _maybe(_text),
        "max_response_mb": lambda v: _number(v, 0.001),
    },
    "status": {"window": FINITE_AT_LEAST_1},
    "results": {
        "dataset": _names,
        "format": _choice(*EXPORT_FORMATS),
        "reasoning": _choice(*REASONING),
        "exclude_flags": lambda v: v in ((), []) or _flags(v),
        "provenance": FLAG,
    },
    "export": {
        "out": _path,
        "datasets": _names,
        "format": _choice(*EXPORT_FORMATS),
        "reasoning": _choice(*REASONING),
        "split": FLAG,
        "exclude_flags": lambda v: v in ((), []) or _flags(v),
        "include_failed": _maybe(_path),
        "provenance": FLAG,
    },
    "requeue": {
        "state": _choice("failed", "done"),
        "datasets": _names,
        "error_class": _maybe(_text),
        "flags": lambda v: v in ((), []) or _flags(v),
        "max_tokens": _maybe(_int),
        "all": FLAG,
        "dry_run": FLAG,
    },
    "inspect": {
        "dataset": _names,
        "id": _maybe(_text),
        "sample": _maybe(lambda v: _int(v, 1)),
        "seed": _maybe(_int),
        "flags": lambda v: v in ((), []) or _flags(v),
        "error_class": _maybe(_text),
        "state": _maybe(_choice("pending", "running", "done", "failed")),
    },
    "undo_requeue": {"dry_run": FLAG},
    "pause": {"dataset": lambda v: _text(v) and len(v) <= 200},  # type: ignore[arg-type]
    "resume": {"dataset": lambda v: _text(v) and len(v) <= 200},  # type: ignore[arg-type]
}
# Calls that hand back an iterator: what they refuse may come with the first row.
ITERATORS = ("results", "inspect")
POSITIONAL = {"enqueue": "records", "enqueue_config": "config", "export": "out"}
POSITIONAL |= {"pause": "dataset", "resume": "dataset"}


def _base(method: str, folder: Path) -> dict[str, Any]:
    """A call that would go through (and write) with every argument as given."""
    return {
        "enqueue": {"records": prompts(2, "new"), "dataset": "new"},
        "enqueue_config": {"config": folder / "run.toml"},
        "run": {"servers": ["http://127.0.0.1:9"], "give_up_after": 0.5, "datasets": "d"},
        "status": {},
        "results": {"dataset": "d"},
        "export": {"out": folder / "out.jsonl", "datasets": "d"},
        "requeue": {"state": "failed", "datasets": "d"},
        "inspect": {"dataset": "d"},
        "undo_requeue": {},
        "pause": {"dataset": "d"},
        "resume": {"dataset": "d"},
    }[method]


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["", "  ", "auto", "x" * 201, "truncated,", "nope,truncated"]),
    st.binary(max_size=3),
    st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=3),
    st.tuples(st.integers()),
    st.sets(st.integers(), max_size=2),
    st.dictionaries(
        st.one_of(st.text(max_size=3), st.integers()),
        st.one_of(
            st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.text(max_size=2)
        ),
        max_size=2,
    ),
    st.builds(object),
)
CASES = [(method, name) for method, args in VALID.items() for name in args]


def _wrong(data: st.DataObject, method: str, name: str) -> Any:
    ok = VALID[method][name]
    return data.draw(ANY.filter(lambda v: not ok(v)), label=f"{method}({name}=...)")


def _split(method: str, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    first = POSITIONAL.get(method)
    if first is None:
        return [], kwargs
    rest = dict(kwargs)
    return [rest.pop(first)], rest


# ------------------------------------------------------------------ the database


def _contents(db: str) -> list[Any]:
    """Every row of every table (on SQLite through its own connection: a refused call must
    leave the WAL as well as the file as they were)."""
    if is_postgres(db):
        tables = query(
            db,
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            " ORDER BY table_name",
        )
        return [(t, query(db, f'SELECT * FROM "{t}" ORDER BY 1')) for (t,) in tables]
    with closing(sqlite3.connect(db)) as conn:
        names = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY 1")
        tables = [n for (n,) in names.fetchall()]
        return [(t, conn.execute(f'SELECT * FROM "{t}" ORDER BY 1').fetchall()) for t in tables]


@pytest.fixture
def filled(tmp_path: Path, db_url: str) -> Iterator[tuple[str, Path]]:
    """A queue with a dataset ``d`` and a run file beside it; the folder a call may write to."""
    folder = tmp_path / "calls"
    folder.mkdir()
    data = write_jsonl(folder / "a.jsonl", prompts(2, "a"))
    (folder / "run.toml").write_text(f'[[dataset]]\nname = "a"\nfile = "{data}"\nmodel = "m"\n')
    with orc.open_sync(db_url) as q:
        q.enqueue(prompts(3), dataset="d", model="m")
    yield db_url, folder


def _refused(error: BaseException, name: str) -> None:
    assert isinstance(error, orc.ConfigError), f"{type(error).__name__}: {error}"
    assert name in str(error), f"{name!r} is not named in: {error}"


PROPERTY = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class _Loop:
    """An event loop of the test's own in a thread, for the async ``Queue`` (one queue
    across every example, as a program keeps one)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __call__(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def test_wrong_arguments_to_the_async_queue_are_config_errors(
    filled: tuple[str, Path],
) -> None:
    db, folder = filled
    before = _contents(db)
    on_loop = _Loop()
    queue = orc.open(db)
    on_loop(queue.__aenter__())

    async def call(method: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        made = getattr(queue, method)(*args, **kwargs)
        if method in ITERATORS:
            await made.__anext__()
        else:
            await made

    @PROPERTY
    @given(case=st.sampled_from(CASES), data=st.data())
    def check(case: tuple[str, str], data: st.DataObject) -> None:
        method, name = case
        kwargs = {**_base(method, folder), name: _wrong(data, method, name)}
        with pytest.raises(Exception) as caught:
            on_loop(call(method, *_split(method, kwargs)))
        _refused(caught.value, name)

    try:
        check()
    finally:
        on_loop(queue.close())
        on_loop.close()
    assert _contents(db) == before
    assert sorted(p.name for p in folder.iterdir()) == ["a.jsonl", "run.toml"]


def test_wrong_arguments_to_the_sync_queue_are_config_errors(
    filled: tuple[str, Path],
) -> None:
    db, folder = filled
    before = _contents(db)

    @PROPERTY
    @given(case=st.sampled_from(CASES), data=st.data())
    def check(case: tuple[str, str], data: st.DataObject) -> None:
        method, name = case
        kwargs = {**_base(method, folder), name: _wrong(data, method, name)}
        args, rest = _split(method, kwargs)
        with pytest.raises(Exception) as caught:
            got = getattr(q, method)(*args, **rest)
            if method in ITERATORS:
                next(got)
        _refused(caught.value, name)

    with orc.open_sync(db) as q:
        check()
    assert _contents(db) == before
    assert sorted(p.name for p in folder.iterdir()) == ["a.jsonl", "run.toml"]


@given(db=ANY.filter(lambda v: not (v is None or _path(v))))
@settings(max_examples=100, deadline=None, database=None)
def test_a_wrong_database_name_is_a_config_error(db: Any) -> None:
    threads = threading.active_count()
    for opener in (orc.open, orc.open_sync, orc.Queue, orc.SyncQueue):
        with pytest.raises(Exception) as caught:
            opener(db)
        _refused(caught.value, "db")
    assert threading.active_count() == threads  # no loop thread was started


# ------------------------------------------------------------------ the commands


def _one_queue(db: str) -> None:
    with orc.open_sync(db) as q:
        q.enqueue(prompts(1), dataset="d", model="m")


RUN_OPTIONS = [
    ("--lease-seconds", "nan", "must be a finite number"),
    ("--grace", "inf", "must be a finite number"),
    ("--request-timeout", "-1", "must be at least 1"),
    ("--retry-backoff", "-1", "must be at least 0.01"),
    ("--stream-idle-timeout", "0", "must be at least 1"),
    ("--max-response-mb", "0", "must be at least 0.001"),
    ("--give-up-after", "0", "must be more than 0"),
    ("--max-attempts", "0", "must be at least 1"),
]


@pytest.mark.parametrize(("option", "value", "words"), RUN_OPTIONS)
def test_run_refuses_what_queue_run_refuses_in_the_same_words(
    db_url: str, option: str, value: str, words: str
) -> None:
    _one_queue(db_url)
    before = _contents(db_url)
    server = ["--server", "http://127.0.0.1:9", "--exit-when-done", "--give-up-after", "2"]
    done = cli("run", *server, option, value, "--db", db_url)
    assert done.returncode == 2, done.stderr
    assert f"Invalid value for '{option}': {words}, got {value}" in done.stderr
    name = option.removeprefix("--").replace("-", "_")
    given = int(value) if name == "max_attempts" else float(value)
    with orc.open_sync(db_url) as q, pytest.raises(orc.ConfigError) as caught:
        q.run(servers=["http://127.0.0.1:9"], **{"give_up_after": 2, name: given})
    assert f"{name}: {words}, got {given!r}" in str(caught.value)
    assert _contents(db_url) == before


ENQUEUE_OPTIONS = [
    ("--concurrency", "0", 0, "must be at least 1"),
    ("--priority", "99999999999", 99999999999, "must be -2147483647 to 2147483647"),
    ("--dataset", "", "", "must be a non-empty string"),
    ("--model", " ", " ", "must be a non-empty string"),
    ("--prompt-column", " ", " ", "must be a non-empty string"),
    ("--messages-column", "", "", "must be a non-empty string"),
    ("--template", " ", " ", "must be a non-empty string"),
    ("--system", "", "", "must be a non-empty string"),
    ("--id-column", " ", " ", "must be a non-empty string"),
    ("--tools-column", "", "", "must be a non-empty string"),
    ("--split", " ", " ", "must be a non-empty string"),
    ("--hf-config", "", "", "must be a non-empty string"),
]
# The Python names of the options whose name differs from the command's.
_ARGUMENT = {"hf-config": "config"}


@pytest.mark.parametrize(("option", "value", "given", "words"), ENQUEUE_OPTIONS)
def test_enqueue_refuses_what_queue_enqueue_refuses_in_the_same_words(
    tmp_path: Path, db_url: str, option: str, value: str, given: object, words: str
) -> None:
    _one_queue(db_url)
    before = _contents(db_url)
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2, "x"))
    named = [] if option == "--dataset" else ["--dataset", "d2"]
    done = cli("enqueue", str(data), *named, option, value, "--db", db_url)
    assert done.returncode == 2, done.stderr
    assert option in done.stderr and words in done.stderr, done.stderr
    spelled = option.removeprefix("--")
    name = _ARGUMENT.get(spelled, spelled.replace("-", "_"))
    arguments = {"dataset": "d2", name: given}
    with orc.open_sync(db_url) as q, pytest.raises(orc.ConfigError) as caught:
        q.enqueue(data, **arguments)
    assert str(caught.value).startswith(f"{name}: {words}, got ")
    assert _contents(db_url) == before
