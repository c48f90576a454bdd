"""``export --format parquet``: the messages rows as Parquet, streamed a row group at a time.

A row is the line the JSONL export writes for the same item (``LineWriter.line``, the one
place rows are made), read into Arrow by pyarrow's JSON reader against a fixed schema:
nothing here decides what a row says, only how it is typed. Three columns are retyped
on the way: ``tools`` (JSON schemas of any shape) and the provenance ``params`` become
JSON text, and ``flags`` (the quality flags' names) is on every row. With ``token_ids``
and ``logprobs`` an answer's tokens are list columns (``TOKEN_IDS``, ``LOGPROBS``).

``messages`` is a list of structs of ``role``, ``content``, ``reasoning_content``,
``tool_calls`` (``id``, ``type``, ``function`` of ``name`` and ``arguments``) and
``tool_call_id``; other message keys are not kept. A ``content`` that is not text (a
list of content parts) is written as its JSON text, and so is a tool call's
``arguments`` sent as an object.

Memory is bounded by a row group (``ROW_GROUP_ROWS`` rows or ``ROW_GROUP_BYTES`` of Arrow
data, whichever comes first), never the export. With ``split`` each dataset is a folder
of shards of at most ``shard_rows`` rows, named as the Hugging Face Hub names them
(``train-00000-of-00003.parquet``); each shard is written under a temporary name and
renamed with the others at the end (``export._Staged``), and shards of an earlier export
that this one does not replace are removed after the rename.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from orchestrator.errors import ConfigError, StorageError
from orchestrator.formats.options import plain_rows
from orchestrator.formats.writers.job import make_folder
from orchestrator.formats.writers.lines import plain_record
from orchestrator.items.params import REASONING_KEYS
from orchestrator.items.quality import flag_names
from orchestrator.store.outputs import flagged_rows, full_batches

if TYPE_CHECKING:
    from orchestrator.formats.writers.job import ExportJob
    from orchestrator.formats.writers.lines import LineWriter
    from orchestrator.store.outputs import DatasetRef
    from orchestrator.store.reader import Rows

SHARD_ROWS = 100_000
ROW_GROUP_ROWS = 20_000
ROW_GROUP_BYTES = 64 << 20
COMPRESSION = "zstd"
SPLIT = "train"
# A shard of any export: train-00000-of-00003.parquet.
SHARD_NAME = re.compile(rf"{SPLIT}-\d{{5}}-of-\d{{5}}\.parquet")

_TEXT = pa.string()
_INT64 = (-(2**63), 2**63 - 1)
TOOL_CALL = pa.struct(
    [
        ("id", _TEXT),
        ("type", _TEXT),
        ("function", pa.struct([("name", _TEXT), ("arguments", _TEXT)])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", _TEXT),
        ("content", _TEXT),
        ("reasoning_content", _TEXT),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", _TEXT),
    ]
)
USAGE = pa.struct(
    [("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("total_tokens", pa.int64())]
)
COLUMNS = [
    ("id", _TEXT),
    ("dataset", _TEXT),
    ("messages", pa.list_(MESSAGE)),
    ("tools", _TEXT),
    ("finish_reason", _TEXT),
    ("usage", USAGE),
    ("flags", pa.list_(_TEXT)),
]
PROVENANCE = [
    ("model", _TEXT),
    ("params", _TEXT),
    ("params_hash", _TEXT),
    ("server", _TEXT),
    ("created_at", pa.float64()),
    ("started_at", pa.float64()),
]


# With per_turn, after id: what writers.turns adds to each row.
PER_TURN = [
    ("source_id", _TEXT),
    ("source_row_index", pa.int64()),
    ("assistant_turn_index", pa.int64()),
]


# With token_ids / logprobs: an answer's tokens (``orchestrator.items.tokens.row_fields``), as
# the server gave them: ids as int32, logprobs as float32 (null where none was given);
# ``tokens`` and ``top_tokens`` hold the texts of answers whose server gave no ids.
TOKEN_IDS = [("token_ids", pa.list_(pa.int32()))]
LOGPROBS = [
    ("tokens", pa.list_(_TEXT)),
    ("token_logprobs", pa.list_(pa.float32())),
    ("top_token_ids", pa.list_(pa.list_(pa.int32()))),
    ("top_tokens", pa.list_(pa.list_(_TEXT))),
    ("top_logprobs", pa.list_(pa.list_(pa.float32()))),
]


def schema(
    provenance: bool,
    per_turn: bool = False,
    parsed: bool = False,
    sampled: bool = False,
    *,
    token_ids: bool = False,
    logprobs: bool = False,
) -> pa.Schema:
    """The export's columns: the per-turn ones after ``id`` (or ``sample``, the sample's
    index, when a dataset has several per prompt), the provenance ones, ``parsed`` (the
    structured answer's JSON text), then the answer's tokens."""
    head = COLUMNS[:1] + ([("sample", pa.int64())] if sampled else [])
    columns = head + (PER_TURN if per_turn else []) + COLUMNS[1:]
    columns += PROVENANCE if provenance else []
    columns += [("parsed", _TEXT)] if parsed else []
    columns += TOKEN_IDS if token_ids else []
    return pa.schema(columns + (LOGPROBS if logprobs else []))


def write_tables(job: ExportJob, rows: Rows) -> None:
    """Every output of ``job`` as Parquet: one file, or (``split``) a folder per dataset."""
    options = job.options
    sampled = any(d.samples > 1 for _, group in job.outputs for d in group)
    table_schema = schema(
        options.provenance,
        options.per_turn,
        options.parsed,
        sampled,
        token_ids=options.token_ids,
        logprobs=options.logprobs,
    )
    for target, group in job.outputs:
        job.restart_index()
        with _Sink(job, target, table_schema) as sink:
            for dataset in group:
                before = sink.rows
                for table in _tables(job.lines(dataset), rows, dataset, table_schema):
                    sink.add(table)
                    job.counter.add(table.num_rows)
                job.written[dataset.id] = sink.rows - before
        job.output_files[target] = sink.files


def _tables(
    lines: LineWriter, rows: Rows, dataset: DatasetRef, table_schema: pa.Schema
) -> Iterator[pa.Table]:
    """A dataset's rows as Arrow tables, one per batch read from the store: the plain
    rows from the narrow read where nothing in them changes (as the JSONL export does),
    else each row through ``LineWriter.rows``."""
    encoder = _Encoder(dataset, table_schema)
    if plain_rows(lines.options, dataset):
        loads, add, record = orjson.loads, encoder.add, plain_record
        name = dataset.name
        for part in flagged_rows(rows, dataset.id):
            for key, request, message, finish_reason, usage, flags in part:
                add(record(key, name, loads(request), message, finish_reason, usage), key, flags)
            if encoder.lines:
                yield encoder.table()
        return
    for part, turns in full_batches(rows, dataset, turns=lines.turns):
        for row in part:
            for full in lines.rows(row, turns):  # one, none, or one per turn (per_turn)
                encoder.add(full, row[1], row[6], row[13])
        if encoder.lines:
            yield encoder.table()


class _Encoder:
    """Records in, Arrow tables out, through the JSON text every format starts from."""

    def __init__(self, dataset: DatasetRef, table_schema: pa.Schema):
        self.dataset = dataset
        self.schema = table_schema
        self.lines: list[bytes] = []
        self.keys: list[str] = []
        self._flags: dict[int, list[str]] = {}
        self._parse = pajson.ParseOptions(
            explicit_schema=table_schema, unexpected_field_behavior="ignore"
        )

    def add(self, record: dict[str, Any], key: str, flags: int, params: str | None = None) -> None:
        """``record`` as a line of the table's JSON; ``params``: the stored JSON text of
        the provenance ``params``."""
        if "messages" not in record:
            raise ConfigError(
                f"dataset {self.dataset.name!r}, item {key!r}: a pre-tokenised row, which a "
                "Parquet export of conversations cannot hold: export this dataset as JSONL "
                "(--format messages --dataset NAME), the others with --dataset"
            )
        tools = record.get("tools")
        if tools is not None:
            record["tools"] = orjson.dumps(tools).decode()
        if "params" in record:
            record["params"] = params  # the stored JSON text, as it is
        if record.get("parsed") is not None:
            record["parsed"] = orjson.dumps(record["parsed"]).decode()
        if "flags" not in record:
            names = self._flags.get(flags)
            if names is None:
                names = self._flags[flags] = flag_names(flags)
            record["flags"] = names
        self.lines.append(orjson.dumps(record))
        self.keys.append(key)

    def table(self) -> pa.Table:
        lines, keys = self.lines, self.keys
        self.lines, self.keys = [], []
        try:
            return self._read(lines)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
        # Some value is not of its column's type (content parts, arguments as an
        # object, a float count): each line conformed, and a line that still fails named.
        conformed = [orjson.dumps(_conform(orjson.loads(line))) for line in lines]
        try:
            return self._read(conformed)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            for key, line in zip(keys, conformed, strict=True):
                try:
                    self._read([line])
                except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                    raise StorageError(
                        f"dataset {self.dataset.name!r}, item {key!r}: cannot be written "
                        f"as Parquet: {exc}"
                    ) from None
            raise

    def _read(self, lines: list[bytes]) -> pa.Table:
        data = b"\n".join(lines)
        options = pajson.ReadOptions(use_threads=False, block_size=len(data) + 1)
        return pajson.read_json(
            pa.BufferReader(data), read_options=options, parse_options=self._parse
        )


def _text(value: Any) -> str | None:
    """A value for a text column: text as it is, anything else as its JSON text."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _count(value: Any) -> int | None:
    """A token count as its int64 column holds it; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        return value
    return None


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        return {"function": {"arguments": _text(call)}}
    function = call.get("function")
    if not isinstance(function, dict):
        function = {"arguments": _text(function)}
    return {
        "id": _text(call.get("id")),
        "type": _text(call.get("type")),
        "function": {
            "name": _text(function.get("name")),
            "arguments": _text(function.get("arguments")),
        },
    }


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        return {"content": _text(message)}
    calls = message.get("tool_calls")
    out = {k: _text(message.get(k)) for k in ("role", "content", "tool_call_id")}
    # Newer vLLM's ``reasoning`` goes in the one column, as in every other format.
    out["reasoning_content"] = _text(
        next((message[k] for k in REASONING_KEYS if k in message), None)
    )
    if calls is not None:
        out["tool_calls"] = [_call(c) for c in (calls if isinstance(calls, list) else [calls])]
    return out


def _conform(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every value of its column's type (see the module)."""
    messages = record.get("messages")
    if isinstance(messages, list):
        record["messages"] = [_message(m) for m in messages]
    usage = record.get("usage")
    if isinstance(usage, dict):
        record["usage"] = {name: _count(usage.get(name)) for name in USAGE.names}
    elif usage is not None:
        record["usage"] = None
    for name in ("finish_reason", "model", "params_hash", "server"):
        if name in record:
            record[name] = _text(record[name])
    return record


class _Sink:
    """One output: a single Parquet file, or (``split``) a dataset's folder of shards.

    Tables are gathered into row groups, a shard is closed at ``shard_rows`` rows, and
    the shards are given their ``-of-N`` names once N is known.
    """

    def __init__(self, job: ExportJob, target: Path, table_schema: pa.Schema):
        self.job = job
        self.target = target
        self.schema = table_schema
        self.folder = job.options.split
        self.limit = (job.options.shard_rows or SHARD_ROWS) if self.folder else None
        self.rows = 0
        self.files: list[Path] = []
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self._shards: list[Path] = []  # provisional names, in order
        self._shard_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._file: contextlib.ExitStack | None = None
        if self.folder:
            if target.exists() and not target.is_dir():
                raise ConfigError(f"{target}: a file; a dataset's shards go in a folder here")
            make_folder(target)

    def add(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._pending_bytes += table.nbytes
        self.rows += table.num_rows
        if self._pending_rows >= ROW_GROUP_ROWS or self._pending_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        table = pa.concat_tables(self._pending) if self._pending else None
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0
        while table is not None and table.num_rows:
            if self._writer is None:
                self._open()
            room = table.num_rows if self.limit is None else self.limit - self._shard_rows
            head, table = table.slice(0, room), table.slice(room)
            assert self._writer is not None
            self._writer.write_table(head, row_group_size=max(head.num_rows, 1))
            self._shard_rows += head.num_rows
            if self.limit is not None and self._shard_rows >= self.limit:
                self._close()

    def _open(self) -> None:
        if self.folder:
            path = self.target / f"{SPLIT}-{len(self._shards):05d}.parquet"
        else:
            path = self.target
        self._file = contextlib.ExitStack()
        handle = self._file.enter_context(self.job.staged.open(path))
        self._shards.append(path)
        self._writer = pq.ParquetWriter(handle, self.schema, compression=COMPRESSION)
        self._shard_rows = 0

    def _close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            with contextlib.suppress(Exception):
                if self._writer is not None:
                    self._writer.close()
            if self._file is not None:
                self._file.__exit__(exc_type, exc, tb)
            return
        self._flush()
        if not self._shards:
            self._open()  # no rows: a file of the columns alone, so every config loads
        self._close()
        self._name_shards()

    def _name_shards(self) -> None:
        if not self.folder:
            self.files = list(self._shards)
            return
        total = len(self._shards)
        for index, path in enumerate(self._shards):
            final = self.target / f"{SPLIT}-{index:05d}-of-{total:05d}.parquet"
            self.job.staged.retarget(path, final)
            self.files.append(final)
        keep = {p.name for p in self.files}
        self.job.after_commit.append(lambda: _remove_older_shards(self.target, keep))


def _remove_older_shards(folder: Path, keep: set[str]) -> None:
    """Shards of an earlier export of this folder that this one did not replace: a
    reader of ``folder/train-*`` must see this export's rows only."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        if SHARD_NAME.fullmatch(name) and name not in keep:
            with contextlib.suppress(OSError):
                (folder / name).unlink()
