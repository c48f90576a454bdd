"""A turn's prompt ids from the server that answered it, when its answer carried none,
and whether its generated ids spell its text.

vLLM says them in the answer, SGLang on a chat choice; llama.cpp never does. Then the
same server is asked, never a local tokenizer: llama.cpp's ``/apply-template`` renders
the messages with its own template and ``/tokenize`` makes them ids as a completion's
prompt is made (special tokens added and parsed); vLLM's ``/tokenize`` takes the messages
and applies its template itself. Which way a server takes is found once, by the one it
serves. A failure leaves the turn without prompt ids, which the token export counts.

The generated ids are then spelled by the same server's ``/detokenize`` (llama.cpp says
``content``, vLLM ``prompt``): an answer whose reasoning or content is not in that text
is flagged ``token_mismatch`` (the ids are not what the text says the model emitted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import structlog

from orchestrator.inference.client import InferenceClient, base_url
from orchestrator.inference.completions import Completion
from orchestrator.items.quality import TOKEN_MISMATCH
from orchestrator.items.token_ids import TokenIds, asked

log = structlog.get_logger("orchestrator.inference")

#: What of a chat body a tokenizer reads: the rest is sampling.
_TEMPLATE_FIELDS = ("model", "messages", "tools", "tool_choice", "chat_template_kwargs")
_WAYS = ("llama.cpp", "vllm")


class _NotServed(Exception):
    """The server has no such endpoint (404, 405): another way is tried."""


@dataclass(slots=True)
class PromptTokenizer:
    """Asks servers for the prompt ids their answers left out."""

    client: InferenceClient
    seconds: float = 30.0
    ways: dict[str, str] = field(default_factory=dict)

    async def completed(
        self, server: str, body: dict[str, Any], answers: list[Completion]
    ) -> list[Completion]:
        """``answers`` with the prompt ids they lack, where ``body`` asked for ids."""
        if not asked(body):
            return answers
        if not all(a.ids is not None and a.ids.prompt is not None for a in answers):
            prompt = await self.prompt_ids(server, body)
            if prompt is not None:
                answers = [_with_prompt(a, prompt) for a in answers]
        return [await self._spelled(server, body.get("model"), a) for a in answers]

    async def _spelled(self, server: str, model: Any, answer: Completion) -> Completion:
        """The answer, flagged ``token_mismatch`` where the server spells its generated
        ids otherwise than its text (unflagged where it cannot spell them)."""
        generated = answer.ids.generated if answer.ids is not None else None
        if not generated:
            return answer
        try:
            said = await self._post(server, "/detokenize", {"model": model, "tokens": generated})
        except (_NotServed, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("detokenize_failed", server=server, error=str(exc)[:200])
            return answer
        text = said.get("content", said.get("prompt"))
        if not isinstance(text, str) or spells(text, answer):
            return answer
        return dataclasses.replace(answer, flags=answer.flags | TOKEN_MISMATCH)

    async def prompt_ids(self, server: str, body: dict[str, Any]) -> tuple[int, ...] | None:
        """The server's own ids of ``body``'s prompt, or None (logged) when it gives none."""
        known = self.ways.get(server)
        for way in (known,) if known else _WAYS:
            try:
                ids = await (self._llamacpp if way == "llama.cpp" else self._vllm)(server, body)
            except _NotServed:
                continue
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                log.warning("prompt_ids_failed", server=server, way=way, error=str(exc)[:200])
                return None
            self.ways[server] = way
            return ids
        log.warning("prompt_ids_unavailable", server=server, reason="no /tokenize served")
        return None

    async def _llamacpp(self, server: str, body: dict[str, Any]) -> tuple[int, ...]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            applied = await self._post(server, "/apply-template", body)
            prompt = applied["prompt"]
        doc = {"content": prompt, "add_special": True, "parse_special": True}
        return _ids((await self._post(server, "/tokenize", doc))["tokens"])

    async def _vllm(self, server: str, body: dict[str, Any]) -> tuple[int, ...]:
        if isinstance(body.get("prompt"), str):
            doc = {"model": body.get("model"), "prompt": body["prompt"]}
        else:
            doc = {k: body[k] for k in _TEMPLATE_FIELDS if k in body}
            doc["add_generation_prompt"] = True
        return _ids((await self._post(server, "/tokenize", doc))["tokens"])

    async def _post(self, server: str, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.seconds)
        async with self.client.session.post(
            base_url(server) + path,
            data=orjson.dumps(doc),
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        ) as resp:
            if resp.status in (404, 405, 501):
                raise _NotServed(path)
            if resp.status != 200:
                raise ValueError(f"{path} answered HTTP {resp.status}")
            found = orjson.loads(await resp.read())
        if not isinstance(found, dict):
            raise ValueError(f"{path} answered no object")
        return found


def spells(text: str, answer: Completion) -> bool:
    """Whether ``text`` (the generated ids, detokenized) holds the answer's reasoning and
    content, in that order: the markup a server's parser took out around them (think
    tags, tool-call syntax) may lie between."""
    at = 0
    for part in (answer.reasoning, answer.content):
        if not part or not part.strip():
            continue
        found = text.find(part.strip(), at)
        if found < 0:
            return False
        at = found + len(part.strip())
    return True


def _ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError("/tokenize answered no list of token ids")
    return tuple(value)


def _with_prompt(answer: Completion, prompt: tuple[int, ...]) -> Completion:
    generated = answer.ids.generated if answer.ids is not None else None
    return dataclasses.replace(answer, ids=TokenIds(prompt, generated, "tokenize"))
