"""The server's own token ids of a generated turn: the prompt it evaluated and the tokens it
generated, so that a trainer never re-tokenizes text.

A sampled sequence is often not the canonical tokenization of its own text, and tool
calls the server parsed into JSON come back from a trainer's template other than the
model emitted them. The servers say the ids in their own fields:

- vLLM (``return_token_ids``): ``prompt_token_ids`` at the top of a chat answer (on the
  first chunk of a stream) or on a completion's choice, ``token_ids`` on each choice.
- SGLang (``return_token_ids``, chat, not streamed): ``prompt_token_ids`` and
  ``response_token_ids`` on the choice.
- llama.cpp (``return_tokens`` with ``verbose``): ``__verbose.tokens``, every generated
  id, and no prompt ids: those are asked of its ``/apply-template`` and ``/tokenize``
  (``orchestrator.inference.tokenize``), as vLLM's ``/tokenize`` is asked with the
  messages where an answer carries none. ``prompt_from`` says which way a row got them.

Stored packed (:func:`pack_ids`): int32 ids, byte-shuffled and deflated, as the answer's
logprobs are (``orchestrator.items.tokens``).
"""

from __future__ import annotations

import struct
import zlib
from array import array
from dataclasses import dataclass
from typing import Any

from orchestrator.items.tokens import CHOICE_ID_FIELDS, shuffled, unshuffled

_MAGIC = b"OID1"
_HEADER = struct.Struct("<4sBII")  # magic, where the prompt ids came from, two counts
#: Where a turn's prompt ids came from: the answer itself, or the server's /tokenize.
PROMPT_FROM: tuple[str, ...] = ("none", "response", "tokenize")
_INT32 = (-(2**31), 2**31 - 1)

#: The request fields that ask each server for its ids (vLLM and SGLang read the first;
#: llama.cpp the other two, and every server ignores what it does not know).
REQUEST_FIELDS: dict[str, Any] = {"return_token_ids": True, "return_tokens": True, "verbose": True}


class BadIds(ValueError):
    """Token ids a server sent that are not a list of 32-bit integers."""


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A turn's ids: ``prompt`` (None: not known) then ``generated`` (None: not given)."""

    prompt: tuple[int, ...] | None = None
    generated: tuple[int, ...] | None = None
    prompt_from: str = "none"

    def input_ids(self) -> list[int]:
        """The prompt's ids, then the generated ones: what the model saw and emitted."""
        return [*(self.prompt or ()), *(self.generated or ())]


def asked(body: dict[str, Any]) -> bool:
    """Whether a request body asks for token ids."""
    return body.get("return_token_ids") is True


def _ids(value: Any, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        type(i) is int and _INT32[0] <= i <= _INT32[1] for i in value
    ):
        raise BadIds(f"{what} is not a list of token ids: {str(value)[:80]}")
    return tuple(value)


def prompt_ids_of(doc: dict[str, Any], choice: dict[str, Any]) -> tuple[int, ...] | None:
    """The prompt ids an answer (or a stream's chunk) says: on the choice, else at the top."""
    found = choice.get("prompt_token_ids")
    if found is None:
        found = doc.get("prompt_token_ids")
    return _ids(found, "prompt_token_ids")


def generated_ids_of(doc: dict[str, Any], choice: dict[str, Any]) -> tuple[int, ...] | None:
    """The generated ids an answer (or a stream's chunk) says, in the server's own field."""
    for name in CHOICE_ID_FIELDS:
        if choice.get(name) is not None:
            return _ids(choice[name], name)
    verbose = doc.get("__verbose")
    if isinstance(verbose, dict) and verbose.get("tokens") is not None:
        return _ids(verbose["tokens"], "__verbose.tokens")
    return None


def pack_ids(ids: TokenIds) -> bytes:
    """The compact form the store keeps."""
    prompt, generated = ids.prompt or (), ids.generated or ()
    flags = PROMPT_FROM.index(ids.prompt_from) | (ids.prompt is None) << 4
    flags |= (ids.generated is None) << 5
    head = _HEADER.pack(_MAGIC, flags, len(prompt), len(generated))
    return head + zlib.compress(shuffled(array("i", [*prompt, *generated])), 6)


def unpack_ids(data: bytes) -> TokenIds:
    """What :func:`pack_ids` wrote; ``ValueError`` for anything else."""
    if len(data) < _HEADER.size:
        raise ValueError("packed ids are cut short")
    magic, flags, n_prompt, n_generated = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"not packed ids (magic {magic!r})")
    try:
        raw = zlib.decompress(data[_HEADER.size :])
    except zlib.error as exc:
        raise ValueError(f"packed ids do not inflate: {exc}") from exc
    if len(raw) != 4 * (n_prompt + n_generated):
        raise ValueError("packed ids are cut short")
    values = tuple(unshuffled(memoryview(raw), "i", n_prompt + n_generated))
    return TokenIds(
        prompt=None if flags & 16 else values[:n_prompt],
        generated=None if flags & 32 else values[n_prompt:],
        prompt_from=PROMPT_FROM[flags & 15],
    )
