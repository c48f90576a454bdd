"""The simulated server's token ids and logprobs, as a function of the request.

Position ``i`` of the answer to a request of digest ``D`` (``request_digest``) is the
token ``id = u32(h[0:4]) % VOCAB`` with logprob ``-(u16(h[4:6]) % 512) / 64``, where
``h = sha256(f"{D}:{i}")`` and ``u32``/``u16`` read little-endian; its ``k`` top
alternatives are the token itself, then ``(id + 7919 j) % VOCAB`` at ``logprob - j / 4``
for ``j = 1 .. k-1``. Every value is exact in float32, so what a client stores packed
reads back equal. An alternative's text is ``" t<id>"``; a generated token's is its word
(after a space, but the first of the answer or of the reasoning).

Asked as each server asks: chat ``logprobs: true`` with ``top_logprobs: k`` gives
``logprobs.content``; a raw completion's ``logprobs: k`` gives ``tokens``,
``token_logprobs`` and ``top_logprobs`` objects; ``return_token_ids`` adds the choice's
``token_ids`` (vLLM), ``return_tokens_as_token_ids`` writes each token as
``"token_id:<id>"`` (vLLM).
"""

from __future__ import annotations

import hashlib
from typing import Any

VOCAB = 32000
_STEP = 7919


def token(digest: str, i: int) -> tuple[int, float]:
    """The id and logprob of the answer's token ``i``."""
    h = hashlib.sha256(f"{digest}:{i}".encode()).digest()
    return int.from_bytes(h[:4], "little") % VOCAB, -(int.from_bytes(h[4:6], "little") % 512) / 64


def answer_ids(digest: str, n: int) -> list[int]:
    """The ids of an answer's ``n`` tokens, reasoning first."""
    return [token(digest, i)[0] for i in range(n)]


def prompt_ids(words: list[str]) -> list[int]:
    """The ids of a prompt's words (``sim.prefix.prompt_words``): one token a word, its id
    a function of the word alone, so the same text has the same ids in any prompt."""
    return [
        int.from_bytes(hashlib.sha256(f"word:{w}".encode()).digest()[:4], "little") % VOCAB
        for w in words
    ]


def top(digest: str, i: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens at position ``i``, the generated one first."""
    ident, logprob = token(digest, i)
    return [((ident + _STEP * j) % VOCAB, logprob - j / 4) for j in range(k)]


def asked(body: dict[str, Any], raw: bool) -> int | None:
    """The top-k a request asks for (0: the tokens' own logprobs only); None: none."""
    value = body.get("logprobs")
    if raw:
        return value if type(value) is int and value >= 0 else None
    if value is not True:
        return None
    k = body.get("top_logprobs")
    return k if type(k) is int and k >= 0 else 0


def choice_fields(
    body: dict[str, Any], digest: str, texts: list[str], start: int, *, raw: bool
) -> dict[str, Any]:
    """What a choice (or a streamed chunk's choice) carries of the tokens ``start ..
    start + len(texts)``: ``logprobs`` and ``token_ids``, as the request asked."""
    fields: dict[str, Any] = {}
    positions = range(start, start + len(texts))
    if body.get("return_token_ids") is True:
        fields["token_ids"] = [token(digest, i)[0] for i in positions]
    k = asked(body, raw)
    if k is None:
        return fields
    as_ids = body.get("return_tokens_as_token_ids") is True

    def name(ident: int, text: str) -> str:
        return f"token_id:{ident}" if as_ids else text

    entries = []
    for i, text in zip(positions, texts, strict=True):
        ident, logprob = token(digest, i)
        alternatives = [
            (t, lp, text if j == 0 else f" t{t}") for j, (t, lp) in enumerate(top(digest, i, k))
        ]
        entries.append(
            (name(ident, text), logprob, [(name(t, s), lp) for t, lp, s in alternatives])
        )
    if raw:
        fields["logprobs"] = {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [dict(e[2]) for e in entries],
        }
    else:
        fields["logprobs"] = {
            "content": [
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in tops
                    ],
                }
                for text, logprob, tops in entries
            ]
        }
    return fields


def texts_of(parts: list[list[str]]) -> list[str]:
    """Each generated word as a token's text: after a space, but the first of its part."""
    out: list[str] = []
    for words in parts:
        out += [w if n == 0 else " " + w for n, w in enumerate(words)]
    return out
