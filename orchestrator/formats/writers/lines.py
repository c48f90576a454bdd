"""The line formats: one JSON object per done item (or per generated turn, or per
failed sample), in every shape an export writes; the table formats encode the same
lines (``writers.parquet``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.errors import StorageError
from orchestrator.formats.options import ExportOptions, check_shape
from orchestrator.formats.writers import sample_groups as draws
from orchestrator.formats.writers import specforge
from orchestrator.formats.writers import turns as per_turn
from orchestrator.items import structured
from orchestrator.items.conversation import assemble, targets
from orchestrator.items.params import REASONING_KEYS, item_body
from orchestrator.items.quality import TOOL_MISMATCH, flag_names
from orchestrator.items.tokens import row_fields, unpack
from orchestrator.settings.choices import (  # noqa: F401
    EXPORT_FORMATS,
    REASONING_MODES,
    TABLE_FORMATS,
)
from orchestrator.store.outputs import (
    DatasetRef,
    DoneItem,
    DoneRow,
    FailedRow,
    FullBatch,
    FullRow,
)

if TYPE_CHECKING:
    pass


# Request fields worth carrying into a training example next to the conversation.
_CARRIED = ("tools",)


# ShareGPT speakers, as SpecForge's parser and this project's reader map them back. A
# developer message is a system prompt under its newer name; any other role is kept.
_SHAREGPT_FROM = {
    "system": "system",
    "developer": "system",
    "user": "human",
    "assistant": "gpt",
    "tool": "tool",
}


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
    out = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k)), None)
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


class LineIndex:
    """The next line's index in a file of whole conversations: ``--per-turn`` rows name
    the row they come from by it, across the datasets that share the file."""

    def __init__(self) -> None:
        self.next = 0
        self._source: str | None = None
        self._current = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1

    def of(self, source_id: str) -> int:
        """The index of conversation ``source_id``, whose turns (a ``regenerate = "each"``
        dataset's items) come one after the other: a new one is taken when it changes."""
        if source_id != self._source:
            self._source, self._current = source_id, self.take()
        return self._current


class LineWriter:
    """Shapes one dataset's full rows into lines of the chosen format."""

    def __init__(
        self,
        dataset: DatasetRef,
        options: ExportOptions,
        *,
        shared: bool = False,
        index: LineIndex | None = None,
        skip: Callable[[bytes], object] | None = None,
    ):
        check_shape(options, dataset)
        self.dataset = dataset
        self.options = options
        # The file holds other datasets' lines too: ids must say whose each line is.
        self.shared = shared
        self.index = index or LineIndex()
        # Where rows SpecForge cannot take go (None: counted only).
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
        if self.dataset.regenerate == "each":
            # An item of regenerate="each" is one turn already, keyed as per-turn rows are.
            yield per_turn.named(line, self.index.of) if self.options.per_turn else line
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
        """A row SpecForge cannot take as written: counted, and sent to the skipped file."""
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


def token_fields(packed: bytes | None, options: ExportOptions) -> dict[str, Any]:
    """An answer's token columns as the options ask (``orchestrator.items.tokens.row_fields``):
    the one place a line (or a table's row) gets them."""
    tokens = unpack(bytes(packed)) if packed is not None else None
    return row_fields(tokens, logprobs=options.logprobs, token_ids=options.token_ids)


def errors_path(out: str | os.PathLike[str]) -> Path:
    """``train.jsonl`` → ``train.errors.jsonl``: where the batch format's failures go."""
    path = Path(out)
    if path.suffix == ".jsonl":
        return path.with_suffix(".errors.jsonl")
    return path.with_name(f"{path.name}.errors.jsonl")
