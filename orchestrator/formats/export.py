"""Writing training-ready JSONL from committed outputs.

Every file is written beside its destination under a temporary name, flushed to disk and
renamed over the destination once all of an export's files are complete: a crash
mid-export leaves the previous files intact, and a reader never sees half a file. A stream
(standard output, a FIFO, ``>(cmd)``, ``/dev/stdout``: ``atomicfile.open_stream``) has
nothing to rename and is written in place, as the lines come. Order
and bytes depend only on the committed rows, so exporting twice gives identical files.

The stored message and usage are orjson's own encoding of what was received (the store
writes every JSON column with ``orjson.dumps``), so they go into the line as they are
(``orjson.Fragment``): the bytes are those a parse and a re-encode would give, at a
fraction of the cost. The default shape (:func:`write_lines`) parses only the request,
to splice its messages in; the other shapes (:class:`ExportOptions`) parse what they
change.

Four line formats (README, "Export formats"): ``messages`` (the default), ``sharegpt``
(``from``/``value`` turns, as SpecForge and other EAGLE-3 trainers read them),
``openai-batch`` (the OpenAI Batch API / ``vllm run-batch`` output line, failed items in
an error file beside it) and ``specforge`` (SpecForge's regenerated data, rows its
validator refuses and failed items in files beside it: ``writers.specforge``). Any
conversation format can be written a row per generated turn (``writers.turns``).
The table formats (``parquet``) encode the ``messages`` rows in ``formats.writers``,
and so does the dataset card (``writers.card``); every row of every format is made
by ``_Lines.line`` (or, for the plain lines, ``plain_record``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from orchestrator._util import atomicfile
from orchestrator.errors import ConfigError, StorageError
from orchestrator.formats import support
from orchestrator.formats.writers import sample_groups as draws
from orchestrator.formats.writers import specforge
from orchestrator.formats.writers import turns as per_turn
from orchestrator.items import structured
from orchestrator.items.conversation import assemble, targets
from orchestrator.items.params import item_body
from orchestrator.items.quality import TOOL_MISMATCH, flag_names
from orchestrator.settings.choices import (  # noqa: F401
    EXPORT_FORMATS,
    REASONING_MODES,
    TABLE_FORMATS,
)
from orchestrator.store import access
from orchestrator.store.outputs import (
    DatasetRef,
    DoneItem,
    DoneRow,
    FailedRow,
    FullBatch,
    FullRow,
    dataset_refs,
    done_rows,
    failed_rows,
    full_batches,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from orchestrator.store.access import Batches
    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

FORMATS = EXPORT_FORMATS

# Request fields worth carrying into a training example next to the conversation.
_CARRIED = ("tools",)
# Where a generated message keeps its reasoning: the store writes reasoning_content; a
# message from newer vLLM may say reasoning.
_REASONING_KEYS = ("reasoning_content", "reasoning")
# ShareGPT speakers, as SpecForge's parser and this project's reader map them back. A
# developer message is a system prompt under its newer name; any other role is kept.
_SHAREGPT_FROM = {
    "system": "system",
    "developer": "system",
    "user": "human",
    "assistant": "gpt",
    "tool": "tool",
}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

Progress = Callable[[int], None]
_BUFFER = 1 << 20


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """How lines are shaped and which go where; the defaults give the historic format."""

    format: str = "messages"
    reasoning: str = "separate"
    # Done items whose quality flags (orchestrator.items.quality) share a bit with this
    # are left out.
    exclude_flags: int = 0
    provenance: bool = False
    # Structured output: each line gets ``parsed``, its answer's JSON value (None when
    # the answer is not the JSON its request asked for).
    parsed: bool = False
    # A prompt's samples in one line (``answers``), not a line each
    # (orchestrator.formats.writers.sample_groups).
    group_samples: bool = False
    # OUT is a directory with one file per dataset.
    split: bool = False
    # Where failed items go (for openai-batch, instead of OUT.errors.jsonl).
    include_failed: str | os.PathLike[str] | None = None
    # Each answer's token logprobs and top-k, and its token ids (orchestrator.items.tokens).
    logprobs: bool = False
    token_ids: bool = False
    # One line per generated assistant turn (writers.turns).
    per_turn: bool = False
    # A table format's --split: at most this many rows per shard (None: SHARD_ROWS).
    shard_rows: int | None = None
    # The dataset card (README.md in the Hub's format); a table format's --split writes
    # OUT/README.md without being asked.
    card: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        from orchestrator.settings.checks import EXPORT, check_all

        check_all({name: getattr(self, name) for name in EXPORT}, EXPORT)
        support.check(self)  # every option honoured by the format, or refused here

    @property
    def plain(self) -> bool:
        """The default line shape, which the fast path writes from the narrow rows."""
        return (
            self.format == "messages"
            and self.reasoning == "separate"
            and not self.exclude_flags
            and not self.provenance
            and not self.parsed
            and not self.logprobs
            and not self.token_ids
            and not self.per_turn
            and not self.group_samples
        )


@dataclass(slots=True)
class ExportReport:
    lines: int = 0  # lines written: one per done item, or per generated turn (per_turn)
    excluded: int = 0  # done items left out for their quality flags
    failed: int = 0  # failed items written to failed_files
    files: list[Path] = field(default_factory=list)
    failed_files: list[Path] = field(default_factory=list)
    # (file, pre-tokenised rows, other lines) for each file that mixes the two kinds.
    mixed: list[tuple[Path, int, int]] = field(default_factory=list)
    card: Path | None = None  # the dataset card written beside the files, if any
    # specforge: rows its validator refuses, by reason (writers.specforge.REASONS).
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_files: list[Path] = field(default_factory=list)
    items: int = 0  # done items the lines came from (fewer than lines with per_turn)

    @property
    def summary(self) -> str | None:
        """The line naming the skipped rows by reason, or None when none were."""
        return specforge.summary(self.skipped, self.skipped_files)


def messages_line(item: DoneItem) -> dict[str, Any]:
    """``{id, dataset, messages, finish_reason, usage}``: the input turns, then the answer."""
    line: dict[str, Any] = {
        "id": item.key,
        "dataset": item.dataset,
        "messages": [*item.request.get("messages", []), item.message],
        "finish_reason": item.finish_reason,
        "usage": item.usage,
    }
    for name in _CARRIED:
        if name in item.request:
            line[name] = item.request[name]
    return line


def write_lines(write: Callable[[bytes], object], dataset: str, rows: Iterable[DoneRow]) -> None:
    """Write rows as JSONL, each line exactly ``orjson.dumps(messages_line(item))``.

    Line by line into a buffered file on purpose: joining a batch into one large bytes
    object made the C heap grow and shrink by a megabyte per batch, and the page faults
    of that cost more system time than the whole export spends reading.
    """
    loads, dumps, record = orjson.loads, orjson.dumps, plain_record
    for key, request_json, message_json, finish_reason, usage_json in rows:
        write(
            dumps(
                record(key, dataset, loads(request_json), message_json, finish_reason, usage_json)
            )
        )
        write(b"\n")


def plain_record(
    key: str,
    dataset: str,
    request: dict[str, Any],
    message_json: str,
    finish_reason: str | None,
    usage_json: str | None,
) -> dict[str, Any]:
    """The default line of a done item before encoding (``messages_line``'s shape), the
    stored answer and usage as they are (``orjson.Fragment``): what :func:`write_lines`
    writes and the Parquet export's plain rows are made of."""
    line: dict[str, Any] = {
        "id": key,
        "dataset": dataset,
        "messages": [*request.get("messages", []), orjson.Fragment(message_json)],
        "finish_reason": finish_reason,
        "usage": orjson.Fragment(usage_json) if usage_json else None,
    }
    for name in _CARRIED:
        if name in request:
            line[name] = request[name]
    return line


# ---------------------------------------------------------------------- line shapes


def apply_reasoning(message: dict[str, Any], mode: str) -> dict[str, Any]:
    """A generated assistant message with its reasoning kept apart, inlined or dropped.

    ``inline`` writes it the way reasoning models' chat templates render it, so a trainer
    that tokenises ``content`` alone still learns the thinking.
    """
    if mode == "separate":
        return message
    out = {k: v for k, v in message.items() if k not in _REASONING_KEYS}
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k)), None)
    if mode == "inline" and reasoning:
        block = f"<think>\n{reasoning}\n</think>\n\n"
        content = message.get("content")
        if isinstance(content, list):
            out["content"] = [{"type": "text", "text": block}, *content]
        else:
            out["content"] = block + (content or "")
    return out


def sharegpt_turn(message: dict[str, Any]) -> dict[str, Any]:
    """``{"from", "value", ...}``: the role renamed, content as value, other keys kept.

    ``tool_calls`` stay on the ``gpt`` turn and tool results are ``tool`` turns with
    their ``tool_call_id``: the OpenAI shapes that SpecForge's parser and chat templates
    take, rather than LLaMA-Factory's ``function_call``/``observation`` strings, which
    lose the call ids.
    """
    role = message.get("role")
    content = message.get("content")
    turn: dict[str, Any] = {
        "from": _SHAREGPT_FROM.get(role, role) if isinstance(role, str) else role,
        "value": "" if content is None else content,
    }
    for key, value in message.items():
        if key not in ("role", "content"):
            turn[key] = value
    return turn


def batch_ids(dataset: str, key: str, sample: int | None = None) -> str:
    """A stable hex id for a line of the batch format: same item, same id, every export
    (``sample``: which of its prompt's samples, when the prompt has several)."""
    name = f"{dataset}\x00{key}" if sample is None else f"{dataset}\x00{key}\x00{sample}"
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def failed_line(dataset: str, row: FailedRow) -> dict[str, Any]:
    key, error_class, last_error, attempts, turn, turns = row[:6]
    line: dict[str, Any] = {
        "id": key,
        "dataset": dataset,
        "error_class": error_class,
        "last_error": last_error,
        "attempts": attempts,
    }
    if turns > 1:
        line["turn"] = turn
        line["turns"] = turns
    return line


def line_id(dataset: str, key: str) -> str:
    """``<dataset>/<key>``: an item's id in a file that holds several datasets.

    Keys are unique within a dataset only, and files read without ids number them from 1
    in each one. ``/`` and ``%`` in the dataset name are written ``%2F`` and ``%25``, so
    the name is what comes before the first ``/`` and the key, as it was, what follows.
    """
    return f"{dataset.replace('%', '%25').replace('/', '%2F')}/{key}"


def batch_error_line(
    dataset: str, row: FailedRow, *, shared: bool = False, sampled: bool = False
) -> dict[str, Any]:
    """A failed item as the batch format's error line; ``shared``: the file has others' too;
    ``sampled``: the prompt has several samples, and the line's id names this one's."""
    key, error_class, last_error = row[0], row[1], row[2]
    return {
        "id": f"batch_req_{batch_ids(dataset, key, row[6] if sampled else None)}",
        "custom_id": line_id(dataset, key) if shared else key,
        "response": None,
        "error": {"code": error_class, "message": last_error},
    }


class _Index:
    """The next line's index in a file of whole conversations: ``--per-turn`` rows name
    the row they come from by it, across the datasets that share the file."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


class _Lines:
    """Shapes one dataset's full rows into lines of the chosen format."""

    def __init__(
        self,
        dataset: DatasetRef,
        options: ExportOptions,
        *,
        shared: bool = False,
        index: _Index | None = None,
        skip: Callable[[bytes], object] | None = None,
    ):
        check_shape(options, dataset)
        self.dataset = dataset
        self.options = options
        # The file holds other datasets' lines too: ids must say whose each line is.
        self.shared = shared
        self.index = index or _Index()
        # Where rows SpecForge's validator refuses go (None: counted only).
        self.skip = skip
        self.skipped: dict[str, int] = {}
        self.excluded = 0
        self.extra = 0  # lines written beyond one per item (per_turn)
        self.tokens = 0  # pre-tokenised rows written
        # The generated turns are read only where they are written: the batch format
        # answers with the final completion alone.
        self.turns = (
            dataset.regenerate == "all"
            and not dataset.passthrough
            and options.format != "openai-batch"
        )
        self.groups = (
            draws.Groups(options.format, dataset.regenerate)
            if options.group_samples and dataset.samples > 1
            else None
        )

    def write(self, write: Callable[[bytes], object], batch: FullBatch) -> int:
        rows, turns = batch
        written = 0
        for row in rows:
            for line in self.rows(row, turns):
                write(orjson.dumps(line))
                write(b"\n")
                written += 1
        return written

    def finish(self, write: Callable[[bytes], object]) -> int:
        """The dataset's last lines, held back until its rows ended (a group of samples)."""
        if self.groups is None:
            return 0
        written = 0
        for record in self.groups.finish():
            write(orjson.dumps(record))
            write(b"\n")
            written += 1
            self.extra += 1
        return written

    def rows(self, row: FullRow, turns: dict[int, list[str]]) -> Iterator[dict[str, Any]]:
        """What one done item becomes, for any writer: nothing (left out for its flags, or
        refused by SpecForge's rules), its line, or with ``per_turn`` a line per turn."""
        tokens = self.tokens
        line = self.line(row, turns)
        if line is None:
            return
        if self._refused(line):
            self.tokens = tokens  # not in the file: no mix to warn of
            return
        if self.dataset.samples > 1:
            line = draws.sampled(line, row[15], self.options.format)
            if self.groups is not None:
                self.extra -= 1  # an item, in the line of its prompt
                for group in self.groups.add(row[1], line):
                    self.extra += 1
                    yield group
                return
        index = self.index.take()
        if not self.options.per_turn:
            yield line
            return
        count = 0
        every = self.dataset.regenerate == "all" or self.dataset.passthrough
        fmt, mode = self.options.format, self.options.reasoning
        for event in per_turn.expand(line, fmt, index, every_turn=every, reasoning=mode):
            count += 1
            yield event
        self.extra += count - 1

    def _refused(self, line: dict[str, Any]) -> bool:
        """A SpecForge row its validator would refuse: counted, and sent to the skipped file."""
        if self.options.format != "specforge":
            return False
        found = specforge.problem(line)
        if found is None:
            return False
        reason, error = found
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if self.skip is not None:
            self.skip(orjson.dumps(specforge.skipped(line, error)))
            self.skip(b"\n")
        return True

    def line(self, row: FullRow, turns: dict[int, list[str]]) -> dict[str, Any] | None:
        item_id, key, request_json, message_json, finish_reason, usage_json, flags = row[:7]
        if flags & self.options.exclude_flags:
            self.excluded += 1
            return None
        request = orjson.loads(request_json)
        passthrough = self.dataset.passthrough
        if passthrough and "messages" not in request:
            self.tokens += 1
            return self._token_line(key, request)
        usage = orjson.Fragment(usage_json) if usage_json else None
        line: dict[str, Any]
        if self.options.format == "completions":
            line = {
                "id": key,
                "dataset": self.dataset.name,
                "prompt": request.get("prompt"),
                "completion": orjson.loads(message_json).get("content"),
                "finish_reason": finish_reason,
                "usage": usage,
            }
            if self.options.provenance:
                line.update(self._provenance(row))
        elif self.options.format == "openai-batch":
            if passthrough:
                last = request["messages"][-1] if request["messages"] else None
                message = (
                    last if isinstance(last, dict) and last.get("role") == "assistant" else None
                )
            else:
                message = self._generated(message_json)
            line = self._batch_line(row, message, usage)
        else:
            if passthrough:
                messages = request["messages"]
            elif self.turns:
                messages = self._assembled(item_id, key, request, message_json, turns, flags)
            else:
                messages = [*request.get("messages", []), self._generated(message_json)]
            if self.options.format == "sharegpt":
                line = {
                    "id": self._id(key),
                    "conversations": [sharegpt_turn(m) for m in messages],
                    # On every line: a loader that takes its columns from the first rows
                    # (HF Dataset.from_generator, as SpecForge builds its dataset) fails
                    # or drops every tool schema when only some lines have the key.
                    "tools": request.get("tools") or [],
                }
            elif self.options.format == "specforge":
                line = specforge.line(self._id(key), messages, request)
            else:
                line = {
                    "id": key,
                    "dataset": self.dataset.name,
                    "messages": messages,
                    "finish_reason": finish_reason,
                    "usage": usage,
                }
                for name in _CARRIED:
                    if name in request:
                        line[name] = request[name]
            if self.options.provenance:
                line.update(self._provenance(row))
        if self.options.parsed:
            line["parsed"] = None if passthrough else _parsed(request, message_json, row[13])
        if self.options.logprobs or self.options.token_ids:
            line.update(token_fields(row[14], self.options))
        return line

    def _id(self, key: str) -> str:
        return line_id(self.dataset.name, key) if self.shared else key

    def _token_line(self, key: str, row: dict[str, Any]) -> dict[str, Any]:
        """A pre-tokenised row as it was read, plus what its file needs to tell it apart.

        In a file of several datasets it gets the identifying fields of the format's lines
        (``id`` and ``dataset``; ``id``; ``custom_id``), and in a ShareGPT file the
        ``tools`` key every line of such a file has.
        """
        fmt = self.options.format
        if self.shared or fmt == "specforge":  # a SpecForge row always has its id
            if fmt == "messages":
                rest = {k: v for k, v in row.items() if k not in ("id", "dataset")}
                row = {"id": key, "dataset": self.dataset.name, **rest}
            else:
                name = "custom_id" if fmt == "openai-batch" else "id"
                row = {name: self._id(key), **{k: v for k, v in row.items() if k != name}}
        if fmt == "sharegpt":
            row["tools"] = row.get("tools") or []
        return row

    def _generated(self, message_json: str) -> Any:
        """The stored answer as the line needs it: the stored bytes when unchanged."""
        # Parsed where the line changes it or looks into it (per-turn rows).
        options = self.options
        kept = options.format in ("messages", "openai-batch", "parquet") and not options.per_turn
        if options.reasoning == "separate" and kept:
            return orjson.Fragment(message_json)
        return apply_reasoning(orjson.loads(message_json), self.options.reasoning)

    def _assembled(
        self,
        item_id: int,
        key: str,
        request: dict[str, Any],
        message_json: str,
        turns: dict[int, list[str]],
        flags: int,
    ) -> list[dict[str, Any]]:
        """The whole conversation, each original answer replaced by its generated turn.

        A conversation stopped where the model's tool calls went another way
        (``tool_mismatch``) ends with that turn, its last stored one: what comes after it
        in the original answers calls that were never made.
        """
        original = request.get("messages", [])
        stored = turns.get(item_id, [])
        wanted = len(targets(original))
        stopped = bool(flags & TOOL_MISMATCH) and 0 < len(stored) < wanted
        if len(stored) == wanted - 1 and not stopped:
            stored = [*stored, message_json]  # the final turn lives in outputs anyway
        if len(stored) != wanted and not stopped:
            raise StorageError(
                f"dataset {self.dataset.name!r}, item {key!r}: {wanted} generated turns "
                f"expected, {len(stored)} stored"
            )
        mode = self.options.reasoning
        generated = [apply_reasoning(orjson.loads(m), mode) for m in stored]
        try:
            return assemble(original, generated)
        except ValueError as exc:
            raise StorageError(
                f"dataset {self.dataset.name!r}, item {key!r}: flagged tool_mismatch, but {exc}"
            ) from exc

    def _batch_line(self, row: FullRow, message: Any, usage: Any) -> dict[str, Any]:
        key, finish_reason, model, response_id, created_at = row[1], row[4], row[7], row[8], row[9]
        ids = batch_ids(self.dataset.name, key, row[15] if self.dataset.samples > 1 else None)
        line: dict[str, Any] = {
            "id": f"batch_req_{ids}",
            "custom_id": self._id(key),
            "response": {
                "status_code": 200,
                "request_id": response_id or f"req_{ids}",
                "body": {
                    "id": response_id or f"chatcmpl-{ids}",
                    "object": "chat.completion",
                    "created": int(created_at),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "logprobs": None,
                            "finish_reason": finish_reason,
                        }
                    ],
                    "usage": usage,
                },
            },
            "error": None,
        }
        if self.options.provenance:
            provenance = self._provenance(row)
            del provenance["model"]  # in the body already
            line["provenance"] = provenance
        return line

    @staticmethod
    def _provenance(row: FullRow) -> dict[str, Any]:
        flags, model = row[6], row[7]
        created_at, latency, server, params_hash, params_json = row[9:14]
        return {
            "model": model,
            "params": orjson.Fragment(params_json) if params_json else None,
            "params_hash": params_hash,
            "server": server,
            "created_at": created_at,
            "started_at": created_at - latency,
            "flags": flag_names(flags),
        }


def _parsed(request: dict[str, Any], message_json: str, params_json: str | None) -> Any:
    """The answer's JSON value, recomputed from the stored content and the request it was
    made with (its parameter set, the item's own fields over them): None when the
    request did not ask for JSON or the answer is not the JSON it asked for."""
    body = item_body(orjson.loads(params_json) if params_json else {}, request)
    fmt = structured.expected_format(body)
    if fmt is None:
        return None
    content = orjson.loads(message_json).get("content")
    checked = structured.check(content if isinstance(content, str) else None, fmt)
    return checked.parsed if not checked.flags else None


# ---------------------------------------------------------------------- files


def token_fields(packed: bytes | None, options: ExportOptions) -> dict[str, Any]:
    """An answer's token columns as the options ask (``orchestrator.items.tokens.row_fields``):
    the one place a line (or a table's row) gets them."""
    from orchestrator.items.tokens import row_fields, unpack

    tokens = unpack(bytes(packed)) if packed is not None else None
    return row_fields(tokens, logprobs=options.logprobs, token_ids=options.token_ids)


def errors_path(out: str | os.PathLike[str]) -> Path:
    """``train.jsonl`` → ``train.errors.jsonl``: where the batch format's failures go."""
    path = Path(out)
    if path.suffix == ".jsonl":
        return path.with_suffix(".errors.jsonl")
    return path.with_name(f"{path.name}.errors.jsonl")


def file_stems(names: Sequence[str]) -> dict[str, str]:
    """A file name (without ``.jsonl``) per dataset, safe on any filesystem, never shared.

    Names made of letters, digits, ``.``, ``_`` and ``-`` stay as they are; any other
    name is cleaned and gets a short hash of itself, so two names never meet in one file
    (also not on a case-insensitive filesystem).
    """

    def tagged(name: str, stem: str) -> str:
        return f"{stem or 'dataset'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"

    stems = {}
    for name in names:
        stem = _UNSAFE.sub("_", name).lstrip(".")
        stems[name] = stem if stem == name and stem else tagged(name, stem)
    folded: dict[str, list[str]] = {}
    for name, stem in stems.items():
        folded.setdefault(stem.casefold(), []).append(name)
    for clash in folded.values():
        if len(clash) > 1:
            for name in clash:
                stems[name] = tagged(name, stems[name])
    return stems


# ``export -``: the lines go to standard output, written as they come (nothing to rename).
STDOUT = Path("-")


def _fast(options: ExportOptions, dataset: DatasetRef) -> bool:
    """Whether the dataset's lines are written from the narrow rows (``write_lines``)."""
    return (
        options.plain
        and dataset.regenerate == "last"
        and not dataset.passthrough
        and dataset.endpoint == "chat"
        and dataset.samples == 1
    )


def check_shape(options: ExportOptions, dataset: DatasetRef) -> None:
    """A dataset of raw completions has no conversation to write, a chat dataset no plain
    prompt: the other format is refused, naming the dataset and the one to use."""
    raw = dataset.endpoint == "completions"
    if raw and options.format != "completions":
        raise ConfigError(
            f"dataset {dataset.name!r} holds raw completions (--endpoint completions): export "
            f"it with --format completions (prompt and completion), not {options.format}"
        )
    if not raw and options.format == "completions":
        raise ConfigError(
            f"dataset {dataset.name!r} holds chat answers: --format completions is for "
            "datasets enqueued with --endpoint completions"
        )


def plain_rows(options: ExportOptions, dataset: DatasetRef) -> bool:
    """Whether the dataset's rows are :func:`plain_record`'s, in any format that writes
    the messages shape (JSONL, Parquet): nothing in them changes the stored answer."""
    plain = options.reasoning == "separate" and not options.exclude_flags
    plain = plain and not options.provenance and not options.per_turn and not options.parsed
    plain = plain and not options.logprobs and not options.token_ids
    plain = plain and dataset.regenerate == "last" and not dataset.passthrough
    return plain and dataset.samples == 1


def _check_target(target: Path, *, output: bool = False) -> None:
    """A file the export will write; ``output``: the export's own file (not --split)."""
    if target == STDOUT or atomicfile.is_stream(target):
        return
    if target.is_dir():
        hint = ", or --split to write a file per dataset into it" if output else ""
        raise ConfigError(f"{target}: is a directory; give a file name{hint}")
    if not target.parent.exists():
        raise ConfigError(f"{target}: directory {target.parent} does not exist")
    if not target.parent.is_dir():
        raise ConfigError(f"{target}: {target.parent} is a file, not a directory")


def _card_path(target: Path, options: ExportOptions, stream: bool) -> Path | None:
    """Where the dataset card goes: ``card``, or README.md in a table format's folder."""
    if options.card is None:
        split_table = options.split and options.format in TABLE_FORMATS
        return target / "README.md" if split_table else None
    if stream:
        raise ConfigError(
            f"{options.card}: a dataset card names the export's files; the export goes "
            f"to a stream ({target}), which has none"
        )
    return Path(options.card)


def _check_table_target(target: Path, options: ExportOptions) -> None:
    """A table format's target: a folder with ``split``, a file without."""
    if options.split and target.suffix in (".parquet", ".pq"):
        raise ConfigError(
            f"{target}: --split writes a folder of shards per dataset; give a folder "
            "name, not a .parquet file (or leave out --split for one file)"
        )


# What writing an export file can meet, and what to do about it.
_WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full: free space there, or export to another disk",
    errno.EDQUOT: "the disk quota is used up: free space there, or export to another disk",
    errno.EFBIG: "the file would pass the file size limit (ulimit -f): raise it, or export "
    "less at a time (--dataset, --split)",
    errno.EROFS: "the file system is read-only: export to a writable directory",
    errno.EACCES: "permission denied: export to a directory you can write",
    errno.EPERM: "permission denied: export to a directory you can write",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENOENT: "its directory does not exist",
    errno.EBADF: "it names a file descriptor that is not open",
}


def make_folder(target: Path) -> None:
    """``target`` made a folder (and its parents, as ``mkdir -p``) if it is not one, or
    one line saying why it cannot be."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(target, exc) from None


def _write_error(target: Path, exc: OSError) -> ConfigError:
    """One line for a file that could not be written: the path, the cause, what to do."""
    reason = _WRITE_ERRORS.get(exc.errno or 0, f"cannot write it: {exc.strerror or exc}")
    return ConfigError(f"{target}: {reason}")


class _Staged:
    """Files written under temporary names, renamed over their targets together at the end
    (streams are written in place).

    While any temporary file exists, SIGTERM does what SIGINT does (from the main thread:
    ``KeyboardInterrupt``, or the event loop's cancellation), so that a stop by a service
    manager or ``timeout`` unwinds and removes them too. Those of a process killed outright
    are removed by the next write to the same target (``atomicfile.remove_stale``).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []
        self._sigterm: tuple[Any] | None = None

    @contextlib.contextmanager
    def open(self, target: Path) -> Iterator[IO[bytes]]:
        if target == STDOUT:
            yield sys.stdout.buffer
            sys.stdout.buffer.flush()
            return
        try:
            stream = atomicfile.open_stream(target)
        except OSError as exc:
            raise _write_error(target, exc) from None
        if stream is not None:
            # A FIFO, a device, ``>(cmd)``, /dev/stdout: written in place, as it comes.
            with self._file_errors(target), open(stream, "wb", buffering=_BUFFER) as fh:
                yield fh
                fh.flush()
            return
        self._interrupt_on_sigterm()
        try:
            # Mode kept (or the umask's for a new file), symlinks written through.
            fd, tmp = atomicfile.open_temp(target)
        except OSError as exc:
            raise _write_error(target, exc) from None
        self._pending.append((tmp, target))
        with self._file_errors(target), open(fd, "wb", buffering=_BUFFER) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())

    @staticmethod
    @contextlib.contextmanager
    def _file_errors(target: Path) -> Iterator[None]:
        """The file's own faults as one line; a database read error (or a reader that
        went away: EPIPE) stays what it is."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _WRITE_ERRORS:
                raise
            raise _write_error(target, exc) from None

    def retarget(self, target: Path, final: Path) -> None:
        """Rename into ``final`` rather than ``target`` at commit: a name that is known
        only once the file is written (a shard's ``-of-N``)."""
        self._pending = [(tmp, final if t == target else t) for tmp, t in self._pending]

    def commit(self) -> None:
        try:
            while self._pending:
                tmp, target = self._pending[0]
                try:
                    atomicfile.replace(tmp, target)
                except OSError as exc:
                    raise _write_error(target, exc) from None
                self._pending.pop(0)
        finally:
            self.discard()  # what was not renamed (an error, a signal) goes

    def discard(self) -> None:
        for tmp, _ in self._pending:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._pending.clear()
        if self._sigterm is not None:
            previous = self._sigterm[0]
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._sigterm = None

    def _interrupt_on_sigterm(self) -> None:
        if self._sigterm is not None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIGINT ignored (a background job): interrupt anyway
            handler = signal.default_int_handler
        self._sigterm = (signal.signal(signal.SIGTERM, handler),)


class _Counter:
    """Lines written so far, reported every 10,000 to a progress callback."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.count = 0

    def add(self, n: int) -> None:
        before, self.count = self.count, self.count + n
        if self.progress and before // 10_000 != self.count // 10_000:
            self.progress(self.count)

    def done(self) -> int:
        if self.progress:
            self.progress(self.count)
        return self.count


class _Job:
    """One export: which files get which datasets, the line shapes, the tally.

    Either read adapter drives it the same way, so both write the same bytes. Used as a
    context manager: every file is renamed into place on success, none on failure.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        options: ExportOptions,
        datasets: list[DatasetRef],
        progress: Progress | None,
    ):
        self.options = options
        self.counter = _Counter(progress)
        self.staged = _Staged()
        self._lines: list[_Lines] = []
        self._failed = 0
        target = Path(out)
        # Where each dataset's done items go, and where its failed items go (if anywhere).
        self.outputs: list[tuple[Path, list[DatasetRef]]] = []
        self.failures: list[tuple[Path, list[DatasetRef]]] = []
        batch = options.format == "openai-batch"
        sides = options.format == "specforge"  # its skipped and error files beside OUT
        stream = target == STDOUT or atomicfile.is_stream(target)
        if stream and (options.split or sides or (batch and options.include_failed is None)):
            raise ConfigError(
                f"{target}: a stream (standard output, a pipe, a device), written as one: "
                "--split needs a directory, --format openai-batch needs "
                "--include-failed FILE for the failed items, and --format specforge "
                "writes its skipped rows beside OUT"
            )
        table = options.format in TABLE_FORMATS
        if options.split:
            if target.exists() and not target.is_dir():
                raise ConfigError(
                    f"{target}: not a directory (--split writes one file per dataset)"
                )
            stems = file_stems([d.name for d in datasets])
            # A table format's dataset is a folder of shards (formats.writers.parquet).
            suffix = "" if table else ".jsonl"
            self.outputs = [(target / f"{stems[d.name]}{suffix}", [d]) for d in datasets]
            if batch and options.include_failed is None:
                self.failures = [(target / f"{stems[d.name]}.errors.jsonl", [d]) for d in datasets]
        else:
            self.outputs = [(target, datasets)]
            if batch and options.include_failed is None:
                self.failures = [(errors_path(target), datasets)]
        if sides and options.include_failed is None:
            self.failures = [(specforge.beside(p, "error"), group) for p, group in self.outputs]
        if options.include_failed is not None:
            self.failures = [(Path(options.include_failed), datasets)]
        self.card = _card_path(target, options, stream)
        # Each output's file of rows SpecForge's validator would refuse.
        self.skips = {p: specforge.beside(p, "skipped") for p, _ in self.outputs if sides}
        self._skip: Callable[[bytes], object] | None = None
        self._index = _Index()
        paths = [p for p, _ in [*self.outputs, *self.failures]] + list(self.skips.values())
        paths += [self.card] if self.card is not None else []
        seen = {os.path.abspath(p) for p in paths}
        if len(seen) != len(paths):
            raise ConfigError("two export files would share a name; choose other paths")
        if table:
            _check_table_target(target, options)
        if options.split:
            make_folder(target)
        outputs = {p for p, _ in self.outputs}
        for path in paths:  # (a table's dataset folder: its writer checks it)
            if not (table and options.split and path in outputs):
                _check_target(path, output=path in outputs and not options.split)
        # Run once every file is in place: a table writer's removal of older shards, and
        # of the files of a folder's earlier card that this export does not write.
        self.after_commit: list[Callable[[], None]] = []
        self._drop_unlisted(self.card if options.split else None)
        # Rows written per dataset id, for the card.
        self.written: dict[int, int] = {}
        # The files each output became, where a writer names them as it goes (a table
        # format's folder of shards); else each output is its one file.
        self.output_files: dict[Path, list[Path]] = {}
        # Datasets whose lines share a file with another dataset's.
        self._shared = {d.id for _, group in self.outputs if len(group) > 1 for d in group}
        self._shared_failures = {
            d.id for _, group in self.failures if len(group) > 1 for d in group
        }
        self._mixed: list[tuple[Path, int, int]] = []

    def _drop_unlisted(self, card: Path | None) -> None:
        """After the commit, the files of the folder's earlier card that this export did
        not write go (``writers.card.drop_unlisted``)."""
        if card is None:
            return
        from orchestrator.formats.writers.card import drop_unlisted, listed

        before = listed(card)

        def drop() -> None:
            written = [f for p, _ in self.outputs for f in self.files_of(p)]
            drop_unlisted(card, before, written)

        if before:
            self.after_commit.append(drop)

    def excluded_by_dataset(self) -> dict[int, int]:
        """Done items left out for their flags so far, by dataset id."""
        return {lines.dataset.id: lines.excluded for lines in self._lines}

    def restart_index(self) -> None:
        """Row indexes (``per_turn``'s ``source_row_index``) count from 0 in a new output,
        as ``output`` does for a file of lines."""
        self._index = _Index()

    def files_of(self, target: Path) -> list[Path]:
        """The files the output ``target`` became."""
        return self.output_files.get(target, [target])

    def fast(self, dataset: DatasetRef) -> bool:
        return _fast(self.options, dataset)

    def lines(self, dataset: DatasetRef) -> _Lines:
        shared = dataset.id in self._shared
        lines = _Lines(dataset, self.options, shared=shared, index=self._index, skip=self._skip)
        self._lines.append(lines)
        return lines

    @contextlib.contextmanager
    def output(self, target: Path) -> Iterator[IO[bytes]]:
        """A file of done items (and its skipped file, if it has one), noted in ``mixed``
        if it mixes token rows with others."""
        before, shapes = self.counter.count, len(self._lines)
        self._index = _Index()
        skips = self.skips.get(target)
        with (
            self.staged.open(target) as fh,
            self.staged.open(skips) if skips else contextlib.nullcontext() as skip,
        ):
            self._skip = skip.write if skip is not None else None
            yield fh
        self._skip = None
        tokens = sum(lines.tokens for lines in self._lines[shapes:])
        others = self.counter.count - before - tokens
        if tokens and others:
            self._mixed.append((target, tokens, others))

    def write_failed(
        self, write: Callable[[bytes], object], dataset: DatasetRef, rows: Sequence[FailedRow]
    ) -> None:
        fmt, several = self.options.format, dataset.samples > 1
        shared = dataset.id in self._shared_failures
        for row in rows:
            if fmt == "openai-batch":
                line = batch_error_line(dataset.name, row, shared=shared, sampled=several)
            else:
                line = failed_line(dataset.name, row)
                if fmt == "specforge":
                    line["id"] = line_id(dataset.name, row[0]) if shared else row[0]
            if several:  # each failed sample named as its done rows are (ids that join)
                line = draws.sampled(line, row[6], fmt)
            if fmt == "specforge":
                line = specforge.error_line(line)
            write(orjson.dumps(line))
            write(b"\n")
        self._failed += len(rows)

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.staged.commit()
            for step in self.after_commit:
                step()
        else:
            self.staged.discard()

    def report(self) -> ExportReport:
        return ExportReport(
            lines=self.counter.done(),
            excluded=sum(lines.excluded for lines in self._lines),
            failed=self._failed,
            files=[f for p, _ in self.outputs for f in self.files_of(p)],
            failed_files=[p for p, _ in self.failures],
            mixed=list(self._mixed),
            card=self.card,
            skipped=_merged(lines.skipped for lines in self._lines),
            skipped_files=list(self.skips.values()),
            items=self.counter.count - sum(lines.extra for lines in self._lines),
        )


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in counts:
        for name, n in part.items():
            total[name] = total.get(name, 0) + n
    return total


# ---------------------------------------------------------------------- writing


MIXED_TOKEN_ROWS = (
    "SpecForge skips pre-tokenised rows in a conversation file without a word, and "
    "trainers that read messages or conversations cannot use them: export those "
    "datasets apart (--split, or --dataset NAME)"
)


def warn_mixed(report: ExportReport, fmt: str) -> None:
    """One structlog warning per file that mixes pre-tokenised rows with conversations.

    structlog is imported only here, when there is something to say: a plain export
    does not load it.
    """
    if not report.mixed:
        return
    import structlog

    log = structlog.get_logger("orchestrator.export")
    for path, tokens, others in report.mixed:
        log.warning(
            "export_mixed_token_rows",
            file=str(path),
            format=fmt,
            token_rows=tokens,
            other_lines=others,
            hint=MIXED_TOKEN_ROWS,
        )


def export_rows(
    rows: Rows,
    out: str | os.PathLike[str],
    *,
    dataset_names: Sequence[str] = (),
    progress: Progress | None = None,
    options: ExportOptions | None = None,
    warn: bool = True,
) -> ExportReport:
    """Write the export from one read transaction, through either adapter.

    ``warn``: log :func:`warn_mixed`'s events (the CLI does it itself, once its logging
    is set up).
    """
    job = _Job(out, options or ExportOptions(), dataset_refs(rows, dataset_names), progress)
    with job:
        if job.options.format in TABLE_FORMATS:
            from orchestrator.formats.writers.parquet import write_tables

            write_tables(job, rows)
        else:
            _write_jsonl(job, rows)
        for target, group in job.failures:
            with job.staged.open(target) as fh:
                for dataset in group:
                    job.write_failed(fh.write, dataset, failed_rows(rows, dataset.id))
        if job.card is not None:
            from orchestrator.formats.writers.card import write_card

            write_card(job, rows)
    report = job.report()
    if warn:
        warn_mixed(report, job.options.format)
    return report


def _write_jsonl(job: _Job, rows: Rows) -> None:
    """The line formats: each output file's datasets, line after line."""
    for target, group in job.outputs:
        with job.output(target) as fh:
            for dataset in group:
                before = job.counter.count
                if job.fast(dataset):
                    for part in done_rows(rows, dataset.id):
                        write_lines(fh.write, dataset.name, part)
                        job.counter.add(len(part))
                else:
                    lines = job.lines(dataset)
                    for batch in full_batches(rows, dataset, turns=lines.turns):
                        job.counter.add(lines.write(fh.write, batch))
                    job.counter.add(lines.finish(fh.write))
                job.written[dataset.id] = job.counter.count - before


def export_fast(
    db: str | os.PathLike[str] | None, out: str | os.PathLike[str], **how: Any
) -> ExportReport | None:
    """:func:`export_rows` through plain sqlite3 in this thread, or None where that path
    does not apply (``how``: its keyword arguments)."""
    return access.read_fast(db, lambda rows: export_rows(rows, out, **how))


async def export_database(
    database: Database, out: str | os.PathLike[str], **how: Any
) -> ExportReport:
    """Write the export from any database, in one read transaction: a consistent
    snapshot even while workers commit (``store.access`` picks the adapter; ``how``:
    :func:`export_rows`'s keyword arguments)."""
    return await access.read(database, lambda rows: export_rows(rows, out, **how))


def _line_batches(
    rows: Rows, dataset_names: Sequence[str], options: ExportOptions
) -> Iterator[list[bytes]]:
    datasets = dataset_refs(rows, dataset_names)
    shared = len(datasets) > 1
    index = _Index()
    for dataset in datasets:
        out: list[bytes] = []
        # Both writers put a line, then its newline: every other entry is a line.
        if _fast(options, dataset):
            for part in done_rows(rows, dataset.id):
                write_lines(out.append, dataset.name, part)
                yield out[::2]
                out.clear()
            continue
        lines = _Lines(dataset, options, shared=shared, index=index)
        for batch in full_batches(rows, dataset, turns=lines.turns):
            lines.write(out.append, batch)
            yield out[::2]
            out.clear()
        if lines.finish(out.append):
            yield out[::2]
            out.clear()


def line_batches(
    database: Database,
    *,
    dataset_names: Sequence[str] = (),
    options: ExportOptions | None = None,
) -> Batches[list[bytes]]:
    """The done items' lines one export file would hold, in its order, without a file:
    the same line shapes as :func:`export_database` (one read transaction throughout,
    ended by the last batch or the iterator's ``aclose``).

    ``split`` and ``include_failed`` name files and do not apply; each line is the bytes
    of one JSON object, without its newline.
    """
    chosen = options or ExportOptions()
    if chosen.split or chosen.include_failed is not None or chosen.card is not None:
        raise ConfigError(
            "the lines of an export are one stream: split, include_failed and card name files"
        )
    if chosen.format in TABLE_FORMATS:
        raise ConfigError(
            f"format {chosen.format!r} is a file format; the lines are those of 'messages'"
        )
    produce = functools.partial(_line_batches, dataset_names=dataset_names, options=chosen)
    return access.read_batches(database, produce)


async def iter_lines(
    database: Database,
    *,
    dataset_names: Sequence[str] = (),
    options: ExportOptions | None = None,
) -> AsyncIterator[bytes]:
    """:func:`line_batches`, a line at a time."""
    batches = line_batches(database, dataset_names=dataset_names, options=options)
    async with batches:
        async for lines in batches:
            for line in lines:
                yield line


async def export_jsonl(
    database: Database,
    out: str | os.PathLike[str],
    *,
    dataset_names: Sequence[str] = (),
    progress: Progress | None = None,
    options: ExportOptions | None = None,
) -> int:
    """:func:`export_database`, returning how many done items were written."""
    report = await export_database(
        database, out, dataset_names=dataset_names, progress=progress, options=options
    )
    return report.lines
