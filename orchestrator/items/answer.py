"""One generated answer, as the client reads it and the store keeps it.

The inference client makes it and the store writes it; neither layer may import the
other, so the fields are defined here, below both, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from orchestrator.items.token_ids import TokenIds


@dataclass(frozen=True, slots=True)
class Answer:
    """The assistant message and what came with it. Reasoning left in the content as
    ``<think>…</think>`` has been split out into ``reasoning``; ``flags`` is its
    ``orchestrator.items.quality`` mask."""

    message: dict[str, Any]
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    latency: float
    server: str | None
    model: str | None
    response_id: str | None
    flags: int = 0
    #: The server's own prompt and generated token ids, where asked for and given; by
    #: keyword, so that the fields of every kind of answer keep their places.
    ids: TokenIds | None = field(default=None, kw_only=True)
    #: The provider's batch the answer came back in (a Batch API server), None when it
    #: was asked online: a batched answer is billed at the batch price.
    batch: str | None = field(default=None, kw_only=True)


ANSWER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Answer))
"""The fields every kind of answer shares, in order."""
