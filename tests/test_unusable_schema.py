"""A JSON schema that cannot check answers (a ``$ref`` to nothing, to another document)
is refused wherever it is given; and whatever breaks while an answer is handled settles
its item instead of leaving it held, with the run waiting for it for ever."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.items.structured import check, schema_problem
from tests.helpers import SimProcess, cli, db_snapshot, prompts, query, write_jsonl

BAD = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
SAID = "$ref '#/$defs/missing' points to nothing in the schema"
FMT = {"type": "json_schema", "json_schema": {"name": "a", "schema": BAD}}
USER = [{"role": "user", "content": "q"}]
DRAFT7 = "http://json-schema.org/draft-07/schema#"


def test_an_unusable_schema_is_refused_by_every_command_path(tmp_path: Path) -> None:
    """``--json-schema``, ``--param response_format=``, an input line's own
    ``response_format``, a batch line's body and a run file's ``extra_body``: exit 2,
    the reason named, nothing written."""
    db = str(tmp_path / "q.db")
    plain = write_jsonl(tmp_path / "plain.jsonl", prompts(2))
    assert cli("enqueue", str(plain), "-d", "first", "--db", db).returncode == 0
    before = db_snapshot(db)
    schema = str(tmp_path / "bad.json")
    Path(schema).write_bytes(orjson.dumps(BAD))
    rows = [*prompts(2), {"id": "x", "messages": USER, "response_format": FMT}]
    per_line = write_jsonl(tmp_path / "lines.jsonl", rows)
    batch = write_jsonl(
        tmp_path / "batch.jsonl",
        [{"custom_id": "a", "body": {"model": "m", "messages": USER, "response_format": FMT}}],
    )
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        '[[dataset]]\nname = "d"\nfile = "plain.jsonl"\nmax_tokens = 8\n'
        "[dataset.extra_body.response_format]\n"
        'type = "json_schema"\njson_schema = { name = "a", schema = '
        '{ properties = { a = { "$ref" = "#/$defs/missing" } } } }\n'
    )
    param = f"response_format={orjson.dumps(FMT).decode()}"
    results = {
        "schema file": cli("enqueue", str(plain), "-d", "d", "--db", db, "--json-schema", schema),
        "param": cli("enqueue", str(plain), "-d", "d", "--db", db, "--param", param),
        "line": cli("enqueue", str(per_line), "-d", "d", "--db", db),
        "batch": cli("enqueue", str(batch), "-d", "d", "--db", db),
        "run file": cli("enqueue", "--config", str(run_file), "--db", db),
    }
    for where, result in results.items():
        assert result.returncode == 2, (where, result.stderr)
        assert SAID in result.stderr, (where, result.stderr)
    assert f"--json-schema {schema}: " in results["schema file"].stderr
    assert "lines.jsonl:3: response_format: its schema" in results["line"].stderr
    assert "batch.jsonl:1: body: response_format: its schema" in results["batch"].stderr
    assert db_snapshot(db) == before


async def test_an_unusable_schema_is_refused_by_the_api(tmp_path: Path) -> None:
    import orchestrator as orc
    from orchestrator.errors import ConfigError, OrchestratorError

    db = tmp_path / "q.db"
    async with orc.open(str(db)) as q:
        with pytest.raises(ConfigError, match="json_schema: " + SAID.replace("$", r"\$")):
            await q.enqueue(prompts(2), dataset="a", model="m", json_schema=BAD)
        with pytest.raises(ConfigError, match=r"params\['response_format'\]: its schema"):
            await q.enqueue(prompts(2), dataset="b", model="m", params={"response_format": FMT})
        rows = [{"messages": USER, "response_format": FMT, "id": "x"}]
        with pytest.raises(OrchestratorError, match="response_format: its schema"):
            await q.enqueue(rows, dataset="c", model="m")
    assert query(db, "SELECT count(*) FROM datasets") == [(0,)]


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"$ref": "#/$defs/nope"}, "points to nothing"),
        ({"items": {"$ref": "#nope"}}, "names an anchor the schema does not define"),
        ({"$ref": "https://example.invalid/s.json"}, "names a document outside the schema"),
        ({"$ref": "other.json"}, "names a document outside the schema"),
        ({"$dynamicRef": "#meta"}, "names an anchor"),
        ({"$id": "https://e.x/r", "$defs": {"s": {"$id": "s", "$ref": "#/$defs/t"}}}, "nothing"),
        ({"type": "string", "pattern": "("}, "not a valid JSON schema at pattern"),
        ([1], "must be an object"),
    ],
)
def test_each_unresolvable_reference_is_found(schema: Any, said: str) -> None:
    assert said in schema_problem(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"x": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/x"}}},
        {"$defs": {"x": {"$anchor": "here"}}, "items": {"$ref": "#here"}},
        {"$id": "https://e.x/r", "$defs": {"s": {"$id": "s", "$defs": {"t": {}}}}, "$ref": "s"},
        {"$schema": DRAFT7, "$ref": "#/definitions/a", "definitions": {"a": {}}},
        {"$ref": "https://json-schema.org/draft/2020-12/schema"},
    ],
)
def test_a_schema_whose_references_resolve_is_kept(schema: dict[str, Any]) -> None:
    assert schema_problem(schema) == ""
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    check('{"a": "x"}', fmt)  # and the worker's own check does not raise


def test_a_reference_to_another_document_is_never_fetched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's validator holds no retriever: a remote ``$ref`` (stored before it was
    refused) fails the check at once, not fetched over the network for every answer."""
    import urllib.request

    from referencing.exceptions import Unresolvable

    fetched: list[object] = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: fetched.append(a))
    fmt = {"type": "json_schema", "json_schema": {"schema": {"$ref": "http://127.0.0.1:9/s"}}}
    with pytest.raises(Unresolvable):
        check("{}", fmt)
    assert fetched == []


def test_an_answer_whose_check_raises_settles_its_item(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A dataset stored with a schema no answer can be checked against (as an earlier
    version let through): each answer's check raises; the item is retried as
    ``internal``, failed once its attempts are spent, and the run exits."""
    db = tmp_path / "q.db"
    server = sim_process()
    good = tmp_path / "s.json"
    good.write_bytes(orjson.dumps({"type": "object"}))
    data = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    enqueued = cli("enqueue", str(data), "-d", "d", "--db", str(db), "--json-schema", str(good))
    assert enqueued.returncode == 0, enqueued.stderr
    (params,) = query(db, "SELECT params FROM datasets")[0]
    body = orjson.loads(params)
    body["response_format"]["json_schema"]["schema"] = {"$ref": "#/$defs/missing"}
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE datasets SET params = ?", (orjson.dumps(body).decode(),))
    run = ("--exit-when-done", "--max-attempts", "2", "--retry-backoff", "0.01")
    # Before, the run waited for the stranded items for ever: the timeout is a backstop.
    result = cli("run", "--server", server.url, "--db", str(db), *run, timeout=120)
    assert result.returncode == 6, result.stderr  # finished, with failed items
    items = query(db, "SELECT state, attempts, error_class, last_error FROM items")
    assert len(items) == 6
    for state, attempts, error_class, error in items:
        assert (state, attempts, error_class) == ("failed", 2, "internal")
        assert "PointerToNowhere" in error or "does not exist" in error, error
