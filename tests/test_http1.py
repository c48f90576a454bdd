"""The lean HTTP/1.1 path of the chat requests (``orchestrator.inference.http1``) against a raw
loopback server that frames its answers every way HTTP/1.1 allows, in pieces of any size,
and misbehaves in the ways that would glue an answer to the wrong request."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import PermanentError, TransientError
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.inference.http1 import Http1Pool, TimedOut
from tests.helpers import chat

MESSAGES = [{"role": "user", "content": "hello"}]

Script = Callable[[int, bytes], list[bytes]]  # (request number, request head) -> pieces


def answer_json(content: str) -> bytes:
    choice = {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    return orjson.dumps({"id": "c", "choices": [choice]})


def framed(payload: bytes, how: str, *, status: bytes = b"200 OK", sizes: list[int] = ()) -> bytes:
    """``payload`` as an HTTP/1.1 answer: ``length``, ``chunked`` (chunks of ``sizes``) or
    ``close`` (delimited by the connection's end)."""
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
    if how == "length":
        return head + b"content-LENGTH: %d\r\n\r\n" % len(payload) + payload
    if how == "close":
        return head + b"Connection: close\r\n\r\n" + payload
    chunks, rest = [], payload
    for size in [*sizes, len(payload)]:
        part, rest = rest[:size], rest[size:]
        if part:
            chunks.append(b"%x\r\n%s\r\n" % (len(part), part))
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(chunks) + b"0\r\n\r\n"


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@dataclass
class Raw:
    """A server that answers each request with the byte pieces ``script`` gives, then
    closes the connection if the script says so (``None`` among the pieces)."""

    script: Script
    url: str = ""
    requests: int = 0
    connections: int = 0
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    asked: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                self.asked.set()
                for piece in self.script(self.requests, head):
                    if piece is None:
                        return
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.lost.set()
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[Script], Raw]]:
    servers = []

    async def start(script: Script) -> Raw:
        server = Raw(script)
        tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        server.url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
        servers.append(tcp)
        return server

    yield start  # type: ignore[misc]
    for tcp in servers:
        tcp.close()


async def post(
    pool: Http1Pool, server: Raw, limit: int = 2**20, seconds: float = 30
) -> tuple[int, bytes]:
    port = int(server.url.rsplit(":", 1)[1])
    resp = await pool.post(
        "127.0.0.1",
        port,
        "/v1/chat/completions",
        b"{}",
        connect_timeout=5,
        deadline=asyncio.get_running_loop().time() + seconds,
        limit=limit,
    )
    return resp.status, resp.body


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    payloads=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=4),
    how=st.sampled_from(["length", "chunked"]),
    sizes=st.lists(st.integers(1, 80), max_size=5),
    cuts=st.lists(st.integers(0, 2000), max_size=8),
)
async def test_every_framing_in_any_pieces_reads_back_the_body_sent_on_one_connection(
    raw: Callable[[Script], Raw], payloads: list[bytes], how: str, sizes: list[int], cuts: list[int]
) -> None:
    """Keep-alive answers, however framed and cut, are read whole, each for its own request,
    all on one connection."""
    server = await raw(lambda n, _: pieces(framed(payloads[n - 1], how, sizes=sizes), cuts))
    pool = Http1Pool({})
    try:
        for payload in payloads:
            assert await post(pool, server) == (200, payload)
    finally:
        pool.close()
    assert server.connections == 1


async def test_a_body_delimited_by_the_connections_end_is_read_and_not_reused(
    raw: Callable[[Script], Raw],
) -> None:
    server = await raw(lambda n, _: [*pieces(framed(b"answer %d" % n, "close"), [20, 40]), None])
    pool = Http1Pool({})
    got = [await post(pool, server) for _ in range(3)]
    assert got == [(200, b"answer %d" % n) for n in (1, 2, 3)]
    assert server.connections == 3


async def test_bytes_nobody_asked_for_never_answer_the_next_request(
    raw: Callable[[Script], Raw],
) -> None:
    """A server that sends a second answer unasked: the next request must not take it."""
    server = await raw(
        lambda n, _: [framed(b"answer %d" % n, "length") + framed(b"stray", "length")]
    )
    pool = Http1Pool({})
    got = [await post(pool, server) for _ in range(3)]
    await asyncio.sleep(0)
    assert got == [(200, b"answer %d" % n) for n in (1, 2, 3)]
    assert server.connections == 3  # each connection that said too much was dropped


async def client(**config: object) -> InferenceClient:
    return InferenceClient(ClientConfig(request_timeout=5, **config))  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["length", "chunked", "close"])
async def test_an_answer_over_the_limit_costs_its_request_only(
    raw: Callable[[Script], Raw], how: str
) -> None:
    """Declared too large, or a chunked / unframed body that keeps coming: refused by name,
    and the next (small) answer is read on a new connection."""
    big = answer_json("x" * 5000)
    end = [None] if how == "close" else []
    server = await raw(
        lambda n, _: [framed(big if n == 1 else answer_json("ok"), how, sizes=[100]), *end]
    )
    async with await client(max_response_bytes=1000) as inference:
        with pytest.raises(PermanentError) as caught:
            await chat(inference, server.url, {"messages": MESSAGES})
        assert caught.value.error_class == "response_too_large"
        assert ("declared" in str(caught.value)) == (how == "length")
        assert (await chat(inference, server.url, {"messages": MESSAGES})).content == "ok"
    assert server.connections == 2


async def test_an_error_with_an_endless_body_keeps_its_reason_and_drops_the_connection(
    raw: Callable[[Script], Raw],
) -> None:
    reason = orjson.dumps({"error": {"message": "model is loading"}})
    huge = reason + b" " * 200_000
    server = await raw(
        lambda n, _: (
            [framed(huge, "chunked", status=b"500 Oops", sizes=[4096] * 60)]
            if n == 1
            else [framed(answer_json("ok"), "length")]
        )
    )
    async with await client() as inference:
        with pytest.raises(TransientError) as caught:
            await chat(inference, server.url, {"messages": MESSAGES})
        assert caught.value.error_class == "http_500"
        assert "model is loading" in str(caught.value)
        assert (await chat(inference, server.url, {"messages": MESSAGES})).content == "ok"
    assert server.connections == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH_9.2\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nContent-Length: 3\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
    ],
)
async def test_bytes_that_are_not_an_http_answer_cost_their_request_only(
    raw: Callable[[Script], Raw], reply: bytes
) -> None:
    server = await raw(lambda n, _: [reply] if n == 1 else [framed(answer_json("ok"), "length")])
    async with await client() as inference:
        with pytest.raises(TransientError) as caught:
            await chat(inference, server.url, {"messages": MESSAGES})
        assert caught.value.error_class == "disconnect"
        assert (await chat(inference, server.url, {"messages": MESSAGES})).content == "ok"


async def test_a_cancelled_request_closes_its_connection(raw: Callable[[Script], Raw]) -> None:
    """A stopped worker's request in flight is cut at the server (which then stops
    generating), and no late answer is left on a pooled connection."""
    server = await raw(lambda n, _: [] if n == 1 else [framed(answer_json("ok"), "length")])
    async with await client() as inference:
        task = asyncio.ensure_future(chat(inference, server.url, {"messages": MESSAGES}))
        await asyncio.wait_for(server.asked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.lost.wait(), 5)
        assert (await chat(inference, server.url, {"messages": MESSAGES})).content == "ok"
    assert server.connections == 2


async def test_a_request_that_gets_no_answer_in_time_is_a_timeout(
    raw: Callable[[Script], Raw],
) -> None:
    server = await raw(lambda n, _: [])
    async with InferenceClient(ClientConfig(request_timeout=0.3)) as inference:
        with pytest.raises(TransientError) as caught:
            await chat(inference, server.url, {"messages": MESSAGES})
    assert caught.value.error_class == "timeout"
    await asyncio.wait_for(server.lost.wait(), 5)


async def test_the_deadline_cuts_a_slow_answer_and_spares_a_quick_one(
    raw: Callable[[Script], Raw],
) -> None:
    """Past its deadline an answer half read is given up, its connection closed (the
    rest of it never taken for another request's); an answer in time leaves no timer
    behind to cut its pooled connection later."""
    whole = framed(answer_json("ok"), "length")
    server = await raw(lambda n, _: [whole[:40]] if n == 1 else [whole])
    pool = Http1Pool({})
    with pytest.raises(TimedOut):
        await post(pool, server, seconds=0.3)
    await asyncio.wait_for(server.lost.wait(), 5)
    assert await post(pool, server, seconds=0.3) == (200, answer_json("ok"))
    await asyncio.sleep(0.5)  # past the second request's deadline
    assert await post(pool, server, seconds=0.3) == (200, answer_json("ok"))
    assert server.connections == 2
    pool.close()


async def test_a_refused_connection_is_the_server_unavailable() -> None:
    from orchestrator.errors import ServerUnavailable

    async with await client() as inference:
        with pytest.raises(ServerUnavailable) as caught:
            await chat(inference, "http://127.0.0.1:9", {"messages": MESSAGES})
    assert caught.value.error_class == "connect"
    assert "cannot connect to http://127.0.0.1:9" in str(caught.value)


async def test_the_request_says_its_host_agent_key_and_length(raw: Callable[[Script], Raw]) -> None:
    heads: list[bytes] = []

    def script(n: int, head: bytes) -> list[bytes]:
        heads.append(head)
        return [framed(answer_json("ok"), "length")]

    server = await raw(script)
    async with await client(api_key="sk-test") as inference:
        await chat(inference, server.url + "/v1", {"messages": MESSAGES})
    lines = heads[0].decode().split("\r\n")
    port = server.url.rsplit(":", 1)[1]
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}" in lines
    assert "Authorization: Bearer sk-test" in lines
    assert "User-Agent: orchestrator" in lines
    assert "Content-Type: application/json" in lines


def test_a_header_with_a_line_break_is_refused_not_written() -> None:
    with pytest.raises(ValueError, match="Authorization"):
        Http1Pool({"Authorization": "Bearer sk\r\nX-Injected: 1"})


async def test_a_connection_reset_at_once_is_a_disconnect_not_a_wait() -> None:
    """A server that resets each connection as it accepts it: each request fails fast
    (nothing written into a closed socket and waited on until the request timeout)."""

    async def reset(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    tcp = await asyncio.start_server(reset, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
    async with tcp, InferenceClient(ClientConfig(request_timeout=30)) as inference:
        for _ in range(5):
            with pytest.raises(TransientError) as caught:
                await asyncio.wait_for(chat(inference, url, {"messages": MESSAGES}), 10)
            assert caught.value.error_class == "disconnect"
