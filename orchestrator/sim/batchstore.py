"""OpenAI's Batch API as the simulated provider keeps it: files, batches and the task
that takes a batch through its life.

A batch is validated (its input file read whole: a line that breaks the format fails the
batch, nothing answered), then its lines are answered evenly over ``--batch-delay``
seconds, each by the same code as the online endpoint (``orchestrator.sim.answer``), and
its output and error files written in an order that is not the input's. A batch still
unfinished at ``--batch-window`` expires; a cancelled one keeps what it answered. The
HTTP side is ``orchestrator.sim.batchapi``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from orchestrator.sim.answer import answer_body
from orchestrator.sim.generation import count_prompt_tokens
from orchestrator.sim.runtime import State

__all__ = ["ENDPOINTS", "BatchStore", "SimBatch", "SimFile"]

#: The endpoints a batch may run.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
#: Statuses of a batch whose lines still count against the token limit.
LIVE = ("validating", "in_progress", "finalizing")
#: Lines answered between two yields to the event loop.
_CHUNK = 64
#: Seconds between two looks at a running batch's clock.
_TICK = 0.05
#: The most validation errors a failed batch lists.
_MAX_ERRORS = 100


def _now() -> int:
    return int(time.time())


def _digest(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()


@dataclass(slots=True)
class SimFile:
    """An uploaded input file, or a batch's output or error file."""

    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int = field(default_factory=_now)
    missing: bool = False  # the missing_output fault: its content answers 404

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
        }


_TIMES = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclass(slots=True)
class SimBatch:
    """One batch, as ``GET /v1/batches/{id}`` says it, and what its task keeps."""

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None
    created_at: int = field(default_factory=_now)
    begun: float = field(default_factory=time.monotonic)
    status: str = "validating"
    times: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(_TIMES))
    lines: list[dict[str, Any]] = field(default_factory=list)
    answered: int = 0  # lines taken, in input order
    output: list[dict[str, Any]] = field(default_factory=list)
    errored: list[dict[str, Any]] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    tokens: int = 0  # prompt tokens of its lines, once validated
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    lost: bool = False  # the lost_batch fault

    def stamp(self, name: str) -> None:
        self.times[name] = _now()

    def as_json(self) -> dict[str, Any]:
        errors = None if self.errors is None else {"object": "list", "data": self.errors}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            **self.times,
            "request_counts": {
                "total": len(self.lines),
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


def _problem(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _line_tokens(body: Any, plain: bool) -> int:
    """The prompt tokens of a line's body, as the online path counts them."""
    if not isinstance(body, dict):
        return 0
    if plain:
        prompt = body.get("prompt")
        return count_prompt_tokens([{"content": prompt}]) if isinstance(prompt, str) else 0
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return count_prompt_tokens([m for m in messages if isinstance(m, dict)])


class BatchStore:
    """The files and batches of one simulated server, and the counts ``/sim/stats``
    says of them."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.config = state.config
        self.files: dict[str, SimFile] = {}
        self.batches: dict[str, SimBatch] = {}  # in creation order
        self.faults = list(self.config.batch_faults)
        self.tasks: set[asyncio.Task[None]] = set()
        self.submitted = 0
        self.answered = 0

    def add_file(self, filename: str, purpose: str, content: bytes) -> SimFile:
        made = SimFile(f"file-{secrets.token_hex(12)}", filename, purpose, content)
        self.files[made.id] = made
        return made

    def create(
        self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None
    ) -> SimBatch:
        """A new batch, its task started."""
        batch = SimBatch(f"batch_{secrets.token_hex(12)}", input_file_id, endpoint, "24h", metadata)
        batch.times["expires_at"] = batch.created_at + math.ceil(self.config.batch_window)
        self.batches[batch.id] = batch
        task = asyncio.get_running_loop().create_task(self._run(batch), name=batch.id)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return batch

    def find(self, batch_id: str) -> SimBatch | None:
        batch = self.batches.get(batch_id)
        return None if batch is None or batch.lost else batch

    def listed(self) -> list[SimBatch]:
        """The batches a list shows, newest first."""
        return [b for b in reversed(self.batches.values()) if not b.lost]

    def cancel(self, batch: SimBatch) -> bool:
        """Ask a running batch to stop (False: it has already ended)."""
        if batch.status not in ("validating", "in_progress", "finalizing"):
            return batch.status == "cancelling"
        batch.status = "cancelling"
        batch.stamp("cancelling_at")
        return True

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def as_json(self) -> dict[str, Any]:
        return {
            "files": len(self.files),
            "batches": len(self.batches),
            "requests_submitted": self.submitted,
            "requests_answered": self.answered,
            "duplicate_requests": self.state.bill.duplicates,
        }

    async def _run(self, batch: SimBatch) -> None:
        problems = await self._validate(batch)
        if batch.status == "cancelling":
            await self._finish(batch, "cancelled")
            return
        if not problems:
            problems = self._over_token_limit(batch)
        if problems:
            batch.lines = []
            batch.errors = problems[:_MAX_ERRORS]
            batch.status = "failed"
            batch.stamp("failed_at")
            return
        self.submitted += len(batch.lines)
        batch.status = "in_progress"
        batch.stamp("in_progress_at")
        ended = await self._answer_all(batch)
        if ended == "completed":
            batch.status = "finalizing"
            batch.stamp("finalizing_at")
            await asyncio.sleep(_TICK)
            if batch.status == "cancelling":
                ended = "cancelled"
        await self._finish(batch, ended)

    async def _validate(self, batch: SimBatch) -> list[dict[str, Any]]:
        """Read the input file; the problems that fail the batch (none: its lines kept)."""
        source = self.files.get(batch.input_file_id)
        content = source.content if source is not None else b""
        limit = self.config.batch_max_bytes
        if len(content) > limit:
            message = f"The input file has {len(content)} bytes, more than the {limit} allowed."
            return [_problem("file_too_large", message)]
        raw_lines = [(i, r) for i, r in enumerate(content.split(b"\n"), 1) if r.strip()]
        most = self.config.batch_max_requests
        if len(raw_lines) > most:
            message = f"The input file has {len(raw_lines)} requests, more than the {most} allowed."
            return [_problem("too_many_requests", message)]
        if not raw_lines:
            return [_problem("empty_file", "The input file has no requests.")]
        problems: list[dict[str, Any]] = []
        seen: set[str] = set()
        lines: list[dict[str, Any]] = []
        for k, (number, raw) in enumerate(raw_lines):
            if k % 2000 == 1999:
                await asyncio.sleep(0)
            line, problem = self._read_line(batch, number, raw, seen)
            if problem is not None:
                problems.append(problem)
            elif line is not None:
                lines.append(line)
        if not problems:
            batch.lines = lines
        return problems

    def _read_line(
        self, batch: SimBatch, number: int, raw: bytes, seen: set[str]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """One input line, or what breaks the format in it."""
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, _problem("invalid_json_line", "This line is not valid JSON.", number)
        if not isinstance(line, dict):
            return None, _problem("invalid_json_line", "This line is not a JSON object.", number)
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            message = "This line has no custom_id."
            return None, _problem("missing_custom_id", message, number, "custom_id")
        if custom_id in seen:
            message = f"The custom_id {custom_id!r} is used more than once."
            return None, _problem("duplicate_custom_id", message, number, "custom_id")
        seen.add(custom_id)
        if line.get("method") != "POST":
            message = "The method of every line must be POST."
            return None, _problem("invalid_method", message, number, "method")
        if line.get("url") != batch.endpoint:
            message = f"The url of this line is not the batch's endpoint {batch.endpoint}."
            return None, _problem("mismatched_url", message, number, "url")
        if "body" not in line:
            return None, _problem("missing_body", "This line has no body.", number, "body")
        return line, None

    def _over_token_limit(self, batch: SimBatch) -> list[dict[str, Any]]:
        """The token_limit_exceeded problem, when the batch's prompt tokens and those of
        the live batches pass ``--batch-token-limit``; else none (its tokens counted)."""
        plain = batch.endpoint == "/v1/completions"
        batch.tokens = sum(_line_tokens(line["body"], plain) for line in batch.lines)
        limit = self.config.batch_token_limit
        if limit is None:
            return []
        live = sum(b.tokens for b in self.batches.values() if b.status in LIVE and b is not batch)
        tokens = batch.tokens
        if tokens + live <= limit:
            return []
        batch.tokens = 0
        message = (
            f"Enqueued token limit reached: this batch has {tokens} prompt tokens and "
            f"{live} are enqueued in live batches, more than the limit of {limit}."
        )
        return [_problem("token_limit_exceeded", message)]

    async def _answer_all(self, batch: SimBatch) -> str:
        """Answer the lines evenly over the batch's delay; the status it ends with."""
        total, delay = len(batch.lines), self.config.batch_delay
        while True:
            if batch.status == "cancelling":
                return "cancelled"
            elapsed = time.monotonic() - batch.begun
            if elapsed >= self.config.batch_window:
                return "expired"
            due = total if elapsed >= delay else math.floor(total * elapsed / delay)
            stop = min(due, batch.answered + _CHUNK)
            while batch.answered < stop:
                self._answer(batch, batch.lines[batch.answered])
                batch.answered += 1
            if batch.answered >= total:
                return "completed"
            if batch.answered < due:
                await asyncio.sleep(0)  # more is due: let the server answer others first
            else:
                await asyncio.sleep(_TICK)

    def _answer(self, batch: SimBatch, line: dict[str, Any]) -> None:
        """One line answered, into the output (200) or the error list."""
        custom_id, body = line["custom_id"], line["body"]
        self.answered += 1
        if self._draws_failure(custom_id):
            status, doc = 500, _error_doc("The server had an error processing your request.")
        elif isinstance(body, dict) and body.get("stream") is True:
            status, doc = 400, _error_doc("stream is not supported in a batch.", "stream", 400)
        else:
            plain = batch.endpoint == "/v1/completions"
            status, doc = answer_body(self.state, body, plain=plain)
        entry = {
            "id": f"batch_req_{_digest(batch.id, custom_id)[:24]}",
            "custom_id": custom_id,
            "response": {
                "status_code": status,
                "request_id": f"req_{_digest('request', batch.id, custom_id)[:32]}",
                "body": doc,
            },
            "error": None,
        }
        if status == 200:
            batch.output.append(entry)
            batch.completed += 1
            self.state.bill.charge(body, doc["usage"], batch=True)
        else:
            batch.errored.append(entry)
            batch.failed += 1

    def _draws_failure(self, custom_id: str) -> bool:
        rate = self.config.batch_fail_rate
        if rate <= 0:
            return False
        draw = int(_digest(self.config.seed, "batch-fail", custom_id)[:13], 16) / 16**13
        return draw < rate

    async def _finish(self, batch: SimBatch, ended: str) -> None:
        """Write the batch's files and give it its last status."""
        if ended == "expired":
            for line in batch.lines[batch.answered :]:
                batch.errored.append(_expired_entry(batch, line["custom_id"]))
                batch.failed += 1
        rng = random.Random(f"{self.config.seed}:{batch.id}")
        for entries, kind in ((batch.output, "output"), (batch.errored, "error")):
            if not entries:
                continue
            rng.shuffle(entries)
            content = await _written(entries)
            made = self.add_file(f"{batch.id}_{kind}.jsonl", f"batch_{kind}", content)
            setattr(batch, f"{kind}_file_id", made.id)
        batch.status = ended
        batch.stamp(f"{ended}_at")
        batch.tokens = 0
        if ended == "completed":
            self._strike(batch)

    def _strike(self, batch: SimBatch) -> None:
        """The --batch-fault faults not yet used that this completed batch can take."""
        output = self.files.get(batch.output_file_id or "")
        for fault in list(self.faults):
            if fault == "lost_batch":
                batch.lost = True
            elif output is None:
                continue
            elif fault == "missing_output":
                output.missing = True
            elif fault == "truncated_output":
                body = output.content.rstrip(b"\n")
                start = body.rfind(b"\n") + 1
                output.content = body[: start + (len(body) - start) // 2]
            self.faults.remove(fault)


async def _written(entries: list[dict[str, Any]]) -> bytes:
    """The JSON lines of a file, the event loop let go between chunks."""
    parts: list[bytes] = []
    for start in range(0, len(entries), 2000):
        parts += [orjson.dumps(e) + b"\n" for e in entries[start : start + 2000]]
        await asyncio.sleep(0)
    return b"".join(parts)


def _error_doc(message: str, param: str | None = None, code: int = 500) -> dict[str, Any]:
    """An error body as the server words one: a 500's ``server_error``, else a 400's."""
    kind = "server_error" if code == 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _expired_entry(batch: SimBatch, custom_id: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{_digest(batch.id, custom_id)[:24]}",
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        },
    }
