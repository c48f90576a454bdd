"""What a server says before any item is sent to it: is it up, and if not, why not.

The pool's prober asks :func:`probe` until a server answers; its reason is what the
operator reads while the worker waits (connection refused, DNS, TLS, a wrong path), so
it names the cause and what to try, not only that the check failed. :func:`models`
reads ``/v1/models`` once a server is up: a 401 there is a wrong key before a single item
is spent on it, and the list names what the server serves.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import aiohttp
import orjson

from orchestrator.client import base_url


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
    hosted API) counts as up when its ``/v1/models`` answers."""
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
        return Models(status, reason=_reason(doc, body))
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return Models(status, reason="no model list in the answer")
    names = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    return Models(status, names)


def _reason(doc: object, body: bytes) -> str:
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(doc.get("detail"), str):
            return doc["detail"]
    return body[:300].decode("utf-8", "replace").strip()
