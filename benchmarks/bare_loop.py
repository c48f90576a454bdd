"""The floor the worker is measured against: the same requests, no queue, no persistence.

``C`` coroutines share one aiohttp session (unlimited connector, like the worker's client)
and post the prompts of a JSONL file as chat completion bodies, reading and parsing each
answer. Prints one JSON line: requests, errors, seconds (first send to last answer).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import orjson


async def bare_loop(server: str, bodies: list[bytes], concurrency: int) -> tuple[int, int]:
    url = server.rstrip("/") + "/v1/chat/completions"
    done = errors = 0
    it = iter(bodies)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one_slot() -> None:
            nonlocal done, errors
            for body in it:
                async with session.post(url, data=body, headers=headers) as resp:
                    raw = await resp.read()
                if resp.status == 200 and orjson.loads(raw)["choices"]:
                    done += 1
                else:
                    errors += 1

        await asyncio.gather(*(one_slot() for _ in range(concurrency)))
    return done, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop to run on"
    )
    args = parser.parse_args(argv)
    # The same body the worker sends: the line's messages, plus "stream": false.
    bodies = []
    with open(args.prompts, "rb") as fh:
        for line in fh:
            obj = orjson.loads(line)
            bodies.append(orjson.dumps({"messages": obj["messages"], "stream": False}))
    start = time.perf_counter()
    factory = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        done, errors = runner.run(bare_loop(args.server, bodies, args.concurrency))
    seconds = time.perf_counter() - start
    sys.stdout.write(
        orjson.dumps({"requests": done, "errors": errors, "seconds": seconds}).decode() + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
