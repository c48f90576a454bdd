"""A provider's Batch API (OpenAI's shape: ``/v1/files`` and ``/v1/batches``), spoken.

A batch's input file is JSON lines ``{custom_id, method, url, body}``; its output and
error files are lines ``{custom_id, response: {status_code, body}, error}``, in any
order. The run's own id of a batch goes in its ``metadata`` (:data:`KEY_FIELD`), so that
a batch created by a worker killed before it wrote the batch's id down is found again
in the provider's list (:meth:`BatchApi.find`) and adopted, not paid for twice.

This module knows HTTP and the shapes, nothing of the queue: ``orchestrator.worker.batches``
decides what goes in a batch and what its answers become.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from orchestrator.errors import BatchUnanswered, PermanentError, TransientError
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.completions import Completion, parse_answer
from orchestrator.inference.failures import raise_for_status
from orchestrator.items import error_classes as ec

#: The metadata field that carries the run's own id of a batch.
KEY_FIELD = "orchestrator_batch"
#: The provider's statuses after which a batch changes no more.
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
#: Most bytes of a batch's output or error file read (OpenAI's input limit is 200 MB;
#: answers can be larger than the prompts).
MAX_FILE_BYTES = 2 * 2**30
#: Most bytes of a batch object or list answer.
_MAX_OBJECT_BYTES = 16 * 2**20
#: Pages of the provider's batch list read when looking for one batch.
_FIND_PAGES = 20
_JSON = {"Content-Type": "application/json"}

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How batches are made and watched: most requests and bytes of one input file (the
    provider's limits are the most: OpenAI's are 50,000 and 200 MB), seconds with no new
    request after which a batch short of them goes anyway (``linger``), and the first and
    longest wait between two looks at a live batch (doubling in between)."""

    requests: int = 10_000
    bytes: int = 200 * 2**20
    linger: float = 2.0
    poll_first: float = 1.0
    poll_max: float = 60.0
    window: str = "24h"


@dataclass(frozen=True, slots=True)
class LineResult:
    """What a batch said of one line: its answer's choices, or the error it stands for."""

    custom_id: str
    choices: list[Completion] | None = None
    error: Exception | None = None


def input_line(custom_id: str, endpoint: str, body: dict[str, Any]) -> bytes:
    """One line of a batch's input file."""
    line = {"custom_id": custom_id, "method": "POST", "url": ENDPOINTS[endpoint], "body": body}
    return orjson.dumps(line) + b"\n"


class BatchApi:
    """The Batch API of the servers ``client`` talks to, with its credentials."""

    def __init__(self, client: InferenceClient, *, request_seconds: float = 300.0) -> None:
        self.client = client
        self.seconds = request_seconds

    async def _json(self, method: str, server: str, path: str, **kwargs: Any) -> Any:
        body = await self.client.api_call(
            method, server, path, limit=_MAX_OBJECT_BYTES, seconds=self.seconds, **kwargs
        )
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise TransientError(
                f"{server}{path} answered something not JSON: {exc}", error_class=ec.BAD_RESPONSE
            ) from exc

    async def offered(self, server: str) -> str | None:
        """None when the server offers the Batch API; else why not, in words."""
        try:
            await self._json("GET", server, "/v1/batches?limit=1")
        except PermanentError as exc:
            return f"{server} does not offer the Batch API (GET /v1/batches: {exc})"
        return None

    async def upload(self, server: str, name: str, data: bytes) -> dict[str, Any]:
        """Upload a batch's input file; the provider's file object."""
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename=name, content_type="application/jsonl")
        return dict(await self._json("POST", server, "/v1/files", data=form))

    async def create(
        self, server: str, file_id: str, endpoint: str, key: str, window: str = "24h"
    ) -> dict[str, Any]:
        """Create the batch of an uploaded file, the run's id of it in its metadata."""
        doc = {
            "input_file_id": file_id,
            "endpoint": ENDPOINTS[endpoint],
            "completion_window": window,
            "metadata": {KEY_FIELD: key},
        }
        return dict(
            await self._json("POST", server, "/v1/batches", data=orjson.dumps(doc), headers=_JSON)
        )

    async def get(self, server: str, batch_id: str) -> dict[str, Any]:
        return dict(await self._json("GET", server, f"/v1/batches/{batch_id}"))

    async def cancel(self, server: str, batch_id: str) -> dict[str, Any]:
        return dict(await self._json("POST", server, f"/v1/batches/{batch_id}/cancel"))

    async def find(self, server: str, key: str, since: float) -> dict[str, Any] | None:
        """The batch whose metadata names ``key``, looked for in the provider's list
        (newest first) back to ``since``; None when it is not there: never created."""
        after: str | None = None
        for _ in range(_FIND_PAGES):
            path = "/v1/batches?limit=100" + (f"&after={after}" if after else "")
            page = await self._json("GET", server, path)
            data = page.get("data") or []
            for batch in data:
                if (batch.get("metadata") or {}).get(KEY_FIELD) == key:
                    return dict(batch)
            oldest = min((b.get("created_at") or 0 for b in data), default=0)
            if not page.get("has_more") or not data or oldest < since - 60:
                return None
            after = data[-1].get("id")
        return None

    async def content(self, server: str, file_id: str) -> bytes:
        return await self.client.api_call(
            "GET", server, f"/v1/files/{file_id}/content", limit=MAX_FILE_BYTES
        )


def read_results(server: str, data: bytes, *, raw: bool) -> tuple[list[LineResult], int]:
    """Each line of an output or error file, as an answer or an error; and how many
    lines could not be read (a file cut short): their requests count as unanswered."""
    results: list[LineResult] = []
    unread = 0
    for text in data.splitlines():
        if not text.strip():
            continue
        try:
            line = orjson.loads(text)
        except orjson.JSONDecodeError:
            unread += 1
            continue
        if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
            unread += 1
            continue
        results.append(_result(server, line, raw=raw))
    return results, unread


def _result(server: str, line: dict[str, Any], *, raw: bool) -> LineResult:
    custom_id = line["custom_id"]
    response = line.get("response")
    error = line.get("error")
    if isinstance(response, dict) and response.get("status_code") == 200:
        body = orjson.dumps(response.get("body"))
        try:
            choices = parse_answer(body, _JSON, server, 0.0, raw=raw)
        except Exception as exc:
            return LineResult(custom_id, error=exc)
        return LineResult(custom_id, choices=choices)
    if isinstance(response, dict) and isinstance(response.get("status_code"), int):
        status = response["status_code"]
        try:
            raise_for_status(status, orjson.dumps(response.get("body")), {})
        except Exception as exc:
            return LineResult(custom_id, error=exc)
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    said = f"{code or 'error'}: {message or line}"
    return LineResult(custom_id, error=BatchUnanswered(said, released=code == "batch_expired"))
