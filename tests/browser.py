"""A headless Chromium driven over the DevTools protocol, for the dashboard and report tests.

Only aiohttp (a websocket) is needed: Chromium is started with
``--remote-debugging-port=0``, the port it picked is read from ``DevToolsActivePort`` in
its profile directory, and one page target is driven with ``Page.navigate`` and
``Runtime.evaluate``. Exceptions thrown by the page and console errors are collected,
so that a test can insist there were none.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM = os.environ.get("ORCHESTRATOR_CHROMIUM", "/usr/bin/chromium")


def require_chromium() -> str:
    """The browser's path; a missing one fails the test with how to install it, or skips
    it when ORCHESTRATOR_SKIP_BROWSER=1."""
    found = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if found:
        return found
    if os.environ.get("ORCHESTRATOR_SKIP_BROWSER") == "1":
        pytest.skip("chromium not installed (ORCHESTRATOR_SKIP_BROWSER=1)")
    pytest.fail(
        "the browser tests need Chromium: `apt-get install chromium` "
        "(or set ORCHESTRATOR_SKIP_BROWSER=1 to skip them)",
        pytrace=False,
    )


class Browser:
    """One headless Chromium and one page in it."""

    def __init__(self, width: int = 1400, height: int = 900) -> None:
        self.width = width
        self.height = height
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, list[dict[str, Any]]] = {}

    async def __aenter__(self) -> Browser:
        self._launch(require_chromium())
        try:
            port = await self._port()
            self._http = aiohttp.ClientSession()
            async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page = next(t for t in targets if t["type"] == "page")
            self._ws = await self._http.ws_connect(
                page["webSocketDebuggerUrl"], max_msg_size=64 * 2**20
            )
            self._reader = asyncio.create_task(self._read())
            for domain in ("Page", "Runtime", "Log"):
                await self.send(f"{domain}.enable")
            await self.send(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _launch(self, exe: str) -> None:
        self._profile = tempfile.mkdtemp(prefix="orch-chromium-")
        self._proc = subprocess.Popen(
            [
                exe,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def __aexit__(self, *_exc: object) -> None:
        with contextlib.suppress(Exception):
            self._reader.cancel()
        with contextlib.suppress(Exception):
            await self._ws.close()
        with contextlib.suppress(Exception):
            await self._http.close()
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    async def _port(self) -> int:
        marker = Path(self._profile) / "DevToolsActivePort"
        for _ in range(300):
            if marker.exists():
                text = marker.read_text().split()
                if text:
                    return int(text[0])
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode}")
            await asyncio.sleep(0.05)
        raise RuntimeError("chromium did not open its debugging port")

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = msg.json()
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method = data.get("method", "")
            params = data.get("params", {})
            self._events.setdefault(method, []).append(params)
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                self.errors.append(f"exception: {text}")
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.errors.append(f"log: {params['entry'].get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                args = [a.get("value", a.get("description")) for a in params.get("args", [])]
                self.errors.append(f"console.error: {args}")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self._ws.send_json({"id": ident, "method": method, "params": params})
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self._events.pop("Page.loadEventFired", None)
        await self.send("Page.navigate", url=url)
        for _ in range(600):
            if self._events.get("Page.loadEventFired"):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{url} did not load")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JS expression (awaited if it is a promise), as JSON."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, seconds: float = 15.0) -> Any:
        """Poll until the expression is truthy (the page updates on its own)."""
        deadline = asyncio.get_running_loop().time() + seconds
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"never became true: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, out: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        out.write_bytes(base64.b64decode(shot["data"]))

    def requests(self) -> list[str]:
        """URLs the page asked the network for (needs Network.enable)."""
        return [e["request"]["url"] for e in self._events.get("Network.requestWillBeSent", [])]
