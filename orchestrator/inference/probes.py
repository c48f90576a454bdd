"""What a server says beside the requests: whether it is up and why not (the pool's
prober, ``doctor``), what it serves and how long a request it takes (the run guard,
``doctor``), its ``/metrics`` (the tuner, ``status --server``, the run's samples).

Apart from the client (``orchestrator.inference.client``) because none of it is a
request to answer: each look is a plain GET that takes the session to use, reports
rather than raises (or raises only :class:`RequestFailed`), and is never retried.
"""

from __future__ import annotations

import ssl
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from orchestrator.inference.client import base_url, basic_auth_middleware
from orchestrator.inference.failures import RequestFailed


@dataclass(frozen=True, slots=True)
class Probe:
    """One look at ``/health``: up, or the reason it is not."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Models:
    """What ``/v1/models`` said: the model names served, or a status and the reason."""

    status: int | None
    names: tuple[str, ...] = ()
    reason: str = ""
    #: Model name -> its context length, where the server says (vLLM's ``max_model_len``).
    contexts: dict[str, int] = field(default_factory=dict)


def _connect_reason(server: str, exc: aiohttp.ClientConnectorError) -> str:
    """Connection failures in the words an operator acts on."""
    where = f"{exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"DNS lookup of {exc.host!r} failed ({exc.os_error}): check the host name"
    if isinstance(exc, aiohttp.ClientSSLError) or isinstance(exc.os_error, ssl.SSLError):
        hint = (
            "; the port may speak plain HTTP: try http://" if server.startswith("https://") else ""
        )
        return f"TLS handshake with {where} failed ({exc.os_error}){hint}"
    if isinstance(exc.os_error, ConnectionRefusedError):
        return f"connection refused by {where}: nothing listens there (is the server up?)"
    return f"cannot connect to {where}: {exc.os_error or exc}"


async def probe(session: aiohttp.ClientSession, server: str, seconds: float) -> Probe:
    """``/health`` answers 200; else why not. A server without ``/health`` (a proxy, a
    hosted API) counts as up when its ``/v1/models`` answers, and one that refuses the
    credentials (401, 403) as up too: it is there, and the run guard judges the refusal."""
    base = base_url(server)
    limit = aiohttp.ClientTimeout(total=seconds)
    try:
        async with session.get(base + "/health", timeout=limit) as resp:
            await resp.read()
            if resp.status == 200:
                return Probe(True)
            status = resp.status
        if status == 404:
            async with session.get(base + "/v1/models", timeout=limit) as resp:
                await resp.read()
                if resp.status == 200:
                    return Probe(True, "no /health; /v1/models answers")
            return Probe(
                False,
                f"HTTP 404 on {base}/health and {base}/v1/models: the URL's path is wrong; "
                "give the server's base URL (scheme://host:port, and a proxy's path prefix "
                "if it has one)",
            )
        if status == 503:
            return Probe(False, f"{base}/health answers 503: the server is starting or stopping")
        if status in (401, 403):
            # It answers, and refuses the credentials (a proxy's Basic auth guards every
            # path): the look at /v1/models that follows says so and stops the run, where
            # waiting for a "health" that never comes would hang it.
            return Probe(True, f"{base}/health answers HTTP {status}: credentials refused")
        return Probe(False, f"{base}/health answers HTTP {status}")
    except aiohttp.ClientConnectorError as exc:
        return Probe(False, _connect_reason(server, exc))
    except TimeoutError:
        return Probe(False, f"no answer from {base}/health within {seconds:g}s")
    except aiohttp.ServerDisconnectedError:
        return Probe(False, f"{base} closed the connection without answering (TLS expected?)")
    except (aiohttp.ClientError, OSError) as exc:
        return Probe(False, f"{base}/health failed: {type(exc).__name__}: {exc}")


async def models(session: aiohttp.ClientSession, server: str, seconds: float) -> Models:
    """The names ``/v1/models`` lists, or its status and the server's reason."""
    url = base_url(server) + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            body = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Models(None, reason=f"{type(exc).__name__}: {exc}")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if status != 200:
        return Models(status, reason=_models_reason(doc, body))
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return Models(status, reason="no model list in the answer")
    names = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    return Models(status, names, contexts=_contexts(data))


def _contexts(data: list[Any]) -> dict[str, int]:
    """``max_model_len`` of each listed model that has a usable one (vLLM lists it)."""
    found: dict[str, int] = {}
    for entry in data:
        if not isinstance(entry, dict) or "id" not in entry:
            continue
        length = entry.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            found[str(entry["id"])] = length
    return found


async def context_length(session: aiohttp.ClientSession, server: str, seconds: float) -> int | None:
    """The longest request the server takes, in tokens, where it says: ``max_model_len``
    in ``/v1/models`` (vLLM, SGLang), else llama.cpp's ``/props`` (its
    ``n_ctx`` is per slot: ``-c`` over ``-np``); None when neither does."""
    base = base_url(server)
    for path, read in (("/v1/models", _max_model_len), ("/props", _props_n_ctx)):
        try:
            reply = await get(session, base + path, seconds)
            doc = orjson.loads(reply.body) if reply.status == 200 else None
        except (RequestFailed, orjson.JSONDecodeError):
            continue
        found = read(doc)
        if isinstance(found, int) and not isinstance(found, bool) and found > 0:
            return found
    return None


def _max_model_len(doc: Any) -> Any:
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    return first.get("max_model_len") if isinstance(first, dict) else None


def _props_n_ctx(doc: Any) -> Any:
    settings = doc.get("default_generation_settings") if isinstance(doc, dict) else None
    return settings.get("n_ctx") if isinstance(settings, dict) else None


def _models_reason(doc: object, body: bytes) -> str:
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(doc.get("detail"), str):
            return doc["detail"]
    return body[:300].decode("utf-8", "replace").strip()


async def metrics_text(session: aiohttp.ClientSession, server: str, seconds: float) -> str:
    """The server's Prometheus ``/metrics`` text; ``RequestFailed`` says why not."""
    url = base_url(server) + "/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            if resp.status != 200:
                raise RequestFailed(f"{url} answers HTTP {resp.status}")
            return await resp.text()
    except TimeoutError as exc:
        raise RequestFailed(f"no answer from {url} within {seconds:g}s") from exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise RequestFailed(f"{url}: {type(exc).__name__}: {exc}") from exc


def read_metrics(url: str, timeout: float, authorization: str | None = None) -> str:
    """``/metrics`` at ``url`` without an event loop (``status`` stays a quick read);
    raises ``OSError`` (``urllib.error.URLError``) or ``ValueError`` when it cannot."""
    request = urllib.request.Request(url)
    if authorization:
        request.add_header("Authorization", authorization)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Reply:
    """A plain GET's answer, read whole."""

    status: int
    body: bytes
    date: str | None  # the server's Date header


def plain_session(
    user_agent: str, api_key: str | None, basic_auth: dict[str, aiohttp.BasicAuth]
) -> aiohttp.ClientSession:
    """A session for a few plain GETs, with the worker's credentials."""
    headers = {"User-Agent": user_agent}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    middlewares = (basic_auth_middleware(basic_auth),) if basic_auth else ()
    return aiohttp.ClientSession(headers=headers, middlewares=middlewares)


async def get(session: aiohttp.ClientSession, url: str, seconds: float) -> Reply:
    """GET ``url`` within ``seconds``; ``RequestFailed`` when nothing answered."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            body = await resp.read()
            return Reply(resp.status, body, resp.headers.get("Date"))
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise RequestFailed(str(exc) or type(exc).__name__) from exc
