"""The client's pooled connections against a loopback server that closes them.

llama.cpp's server closes the connection after each streamed answer while its headers
say keep-alive; a pooled connection picked before the close was noticed fails at once.
The server here does the same, deterministically: it answers the first request of each
connection and drops the connection when a second request arrives on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest

from orchestrator.errors import TransientError
from orchestrator.inference.client import ClientConfig, InferenceClient
from tests.helpers import chat

MESSAGES = [{"role": "user", "content": "hello"}]


@dataclass
class Closer:
    """A raw HTTP/1.1 server; ``mode`` says what it does with a connection.

    ``stale``: answers one request per connection with ``Connection: keep-alive`` and
    drops the connection, unanswered, when the next request arrives on it.
    ``close``: answers with ``Connection: close`` and keeps the socket open; a second
    request on it is counted in ``reused`` (a client that honours the header sends none).
    ``drop``: drops every connection on its first request.
    """

    mode: str
    connections: int = 0
    answered: int = 0
    dropped: int = 0
    reused: int = 0
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                if self.mode == "drop" or (self.mode == "stale" and served):
                    self.dropped += 1
                    break
                if served:
                    self.reused += 1
                served += 1
                self.answered += 1
                writer.write(self.response(head, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def response(self, head: bytes, body: dict) -> bytes:
        connection = b"close" if self.mode == "close" else b"keep-alive"
        if head.startswith(b"GET /health"):
            ctype, payload = b"application/json", b"{}"
        elif body.get("stream"):
            ctype = b"text/event-stream"
            chunk = {"id": "c1", "choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
            last = {"id": "c1", "choices": [{"delta": {}, "finish_reason": "stop"}]}
            payload = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in (chunk, last)) + (
                b"data: [DONE]\n\n"
            )
        else:
            ctype = b"application/json"
            choice = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            payload = orjson.dumps({"id": "c1", "choices": [choice]})
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nConnection: " + connection
            + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )  # fmt: skip


@pytest.fixture
async def closer(request: pytest.FixtureRequest) -> AsyncIterator[Closer]:
    server = Closer(request.param)
    tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
    async with tcp:
        yield server


@pytest.mark.parametrize("closer", ["stale"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
async def test_request_on_a_closed_pooled_connection_is_resent(
    closer: Closer, stream: bool
) -> None:
    async with InferenceClient(ClientConfig(stream=stream, request_timeout=5)) as client:
        for _ in range(6):
            answer = await chat(client, closer.url, {"messages": MESSAGES})
            assert answer.content == "hi"
    if stream:
        # The first found its pooled connection closed and went again on a new one; the
        # server's streams then get a new connection each, none is sent in vain again.
        assert (closer.answered, closer.dropped, client.stale_resends) == (6, 1, 1)
        assert closer.connections == 6
    else:
        # Every other request found its pooled connection closed, and went again.
        assert (closer.answered, closer.dropped, client.stale_resends) == (6, 3, 3)
        assert closer.connections == 6


@pytest.mark.parametrize("closer", ["stale"], indirect=True)
async def test_health_on_a_closed_pooled_connection_is_resent(closer: Closer) -> None:
    async with InferenceClient() as client:
        assert all([await client.health(closer.url) for _ in range(4)])


@pytest.mark.parametrize("closer", ["drop"], indirect=True)
async def test_failure_on_a_new_connection_is_an_error_not_resent(closer: Closer) -> None:
    async with InferenceClient(ClientConfig(request_timeout=5)) as client:
        with pytest.raises(TransientError) as caught:
            await chat(client, closer.url, {"messages": MESSAGES})
    assert caught.value.error_class == "disconnect"
    assert (closer.connections, closer.dropped, client.stale_resends) == (1, 1, 0)


@pytest.mark.parametrize("closer", ["close"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
async def test_connection_close_header_is_honoured(closer: Closer, stream: bool) -> None:
    async with InferenceClient(ClientConfig(stream=stream, request_timeout=5)) as client:
        for _ in range(3):
            assert (await chat(client, closer.url, {"messages": MESSAGES})).content == "hi"
    assert (closer.connections, closer.reused, client.stale_resends) == (3, 0, 0)
