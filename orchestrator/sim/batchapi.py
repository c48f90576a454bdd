"""OpenAI's Files and Batch API on the simulated server: ``/v1/files`` and
``/v1/batches``, answered as OpenAI answers them, errors in its ``{"error": {...}}``
shape. What the batches do is ``orchestrator.sim.batchstore``; this is their HTTP side
and its registration (:func:`add_batch_api`).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from orchestrator.sim.batchstore import ENDPOINTS, BatchStore, SimBatch
from orchestrator.sim.refusals import JSON_TYPE
from orchestrator.sim.runtime import STATE

__all__ = ["BATCH_STORE", "add_batch_api", "batch_api_stats"]

BATCH_STORE = web.AppKey("sim_batch_store", BatchStore)

#: The most metadata pairs a batch may carry, and the longest key and value.
_METADATA_PAIRS, _KEY_CHARS, _VALUE_CHARS = 16, 64, 512


#: OpenAI's Files and Batch endpoints, each declared beside its handler.
ROUTES = web.RouteTableDef()


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type=JSON_TYPE)


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    """OpenAI's error answer."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return _json({"error": error}, status)


def _no_file(file_id: str) -> web.Response:
    return _error(404, f"No such File object: {file_id}", "id")


def _no_batch(batch_id: str) -> web.Response:
    return _error(404, f"No batch found with id '{batch_id}'.", "batch_id")


@ROUTES.post("/v1/files")
async def _upload(request: web.Request) -> web.Response:
    """``POST /v1/files``: a multipart ``file`` and its ``purpose``."""
    store = request.app[BATCH_STORE]
    try:
        form = await request.post()
    except ValueError as exc:
        return _error(400, f"the request is not a multipart form: {exc}")
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, web.FileField):
        return _error(400, "'file' is a required property", "file")
    if purpose != "batch":
        return _error(400, f"'{purpose}' is not a supported purpose here: use 'batch'", "purpose")
    made = store.add_file(upload.filename or "upload.jsonl", purpose, upload.file.read())
    return _json(made.as_json())


@ROUTES.get("/v1/files/{file_id}")
async def _file(request: web.Request) -> web.Response:
    found = request.app[BATCH_STORE].files.get(request.match_info["file_id"])
    return _json(found.as_json()) if found else _no_file(request.match_info["file_id"])


@ROUTES.get("/v1/files/{file_id}/content")
async def _file_content(request: web.Request) -> web.Response:
    found = request.app[BATCH_STORE].files.get(request.match_info["file_id"])
    if found is None or found.missing:
        return _no_file(request.match_info["file_id"])
    return web.Response(body=found.content, content_type="application/octet-stream")


@ROUTES.delete("/v1/files/{file_id}")
async def _delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if request.app[BATCH_STORE].files.pop(file_id, None) is None:
        return _no_file(file_id)
    return _json({"id": file_id, "object": "file", "deleted": True})


def _metadata_problem(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "'metadata' must be an object of strings"
    if len(metadata) > _METADATA_PAIRS:
        return f"'metadata' may hold at most {_METADATA_PAIRS} pairs, got {len(metadata)}"
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > _KEY_CHARS or len(value) > _VALUE_CHARS:
            return (
                f"'metadata' keys (up to {_KEY_CHARS} characters) and values (up to "
                f"{_VALUE_CHARS}) must be strings; {key!r} is not"
            )
    return None


@ROUTES.post("/v1/batches")
async def _create(request: web.Request) -> web.Response:
    """``POST /v1/batches``."""
    store = request.app[BATCH_STORE]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "We could not parse the JSON body of your request.")
    if not isinstance(body, dict):
        return _error(400, "The request body must be a JSON object.")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        return _error(400, "'input_file_id' is a required property", "input_file_id")
    if file_id not in store.files:
        return _no_file(file_id)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        message = f"'{endpoint}' is not one of {', '.join(ENDPOINTS)} - 'endpoint'"
        return _error(400, message, "endpoint")
    if body.get("completion_window") != "24h":
        message = f"'{body.get('completion_window')}' is not one of ['24h']"
        return _error(400, message, "completion_window")
    metadata = body.get("metadata")
    problem = _metadata_problem(metadata)
    if problem:
        return _error(400, problem, "metadata")
    return _json(store.create(file_id, endpoint, metadata).as_json())


def _found(request: web.Request) -> SimBatch | None:
    return request.app[BATCH_STORE].find(request.match_info["batch_id"])


@ROUTES.get("/v1/batches/{batch_id}")
async def _batch(request: web.Request) -> web.Response:
    batch = _found(request)
    return _json(batch.as_json()) if batch else _no_batch(request.match_info["batch_id"])


@ROUTES.post("/v1/batches/{batch_id}/cancel")
async def _cancel(request: web.Request) -> web.Response:
    batch = _found(request)
    if batch is None:
        return _no_batch(request.match_info["batch_id"])
    if not request.app[BATCH_STORE].cancel(batch):
        message = f"Cannot cancel a batch with status '{batch.status}'."
        return _error(400, message, code="batch_not_cancellable")
    return _json(batch.as_json())


@ROUTES.get("/v1/batches")
async def _list(request: web.Request) -> web.Response:
    """``GET /v1/batches?limit=&after=``: newest first, ``after`` an id of the list."""
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        return _error(400, "'limit' must be an integer", "limit")
    if not 1 <= limit <= 100:
        return _error(400, "'limit' must be from 1 to 100", "limit")
    listed = request.app[BATCH_STORE].listed()
    after = request.query.get("after")
    if after is not None:
        ids = [b.id for b in listed]
        listed = listed[ids.index(after) + 1 :] if after in ids else []
    page = listed[:limit]
    doc = {
        "object": "list",
        "data": [b.as_json() for b in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(listed) > limit,
    }
    return _json(doc)


def batch_api_stats(app: web.Application) -> dict[str, Any]:
    """The ``batch_api`` counts of ``/sim/stats``."""
    return app[BATCH_STORE].as_json()


def add_batch_api(app: web.Application) -> None:
    """Give the app its batch store and, unless ``--no-batch-api``, the routes."""
    state = app[STATE]
    store = BatchStore(state)
    app[BATCH_STORE] = store

    async def on_cleanup(app: web.Application) -> None:
        await store.close()

    app.on_cleanup.append(on_cleanup)
    if not state.config.batch_api:
        return
    app.add_routes(ROUTES)
