"""An answer's tokens: their ids, texts and logprobs, with the top-k alternatives.

Distillation trains on top-k logprobs, and training on the exact tokens the target
model produced avoids re-tokenisation drift; servers say both in their own shapes:

- OpenAI chat (SGLang, vLLM, llama.cpp's chat *and* completions): ``logprobs.content``,
  a list of ``{token, logprob, top_logprobs: [{token, logprob}]}``; llama.cpp adds the
  token ``id`` to each, vLLM run with ``return_tokens_as_token_ids`` writes every token
  as ``"token_id:N"``.
- OpenAI completions (SGLang, vLLM): ``logprobs.tokens``, ``token_logprobs`` and
  ``top_logprobs`` (one ``{token: logprob}`` object per position).
- Token ids beside them: vLLM's ``return_token_ids`` puts ``token_ids`` on the choice,
  SGLang's ``response_token_ids``.

A streamed answer says the same in pieces, one per chunk: :class:`Collector` takes a
choice (or a chunk's choice) at a time and gives one :class:`Tokens`.

Stored packed (:func:`pack`), never as JSON per token: ids as int32, logprobs as
float32 (what servers compute in), the top-k as flat arrays with a count per position,
texts only where a server gave no ids; the numeric arrays byte-shuffled and the whole
deflated. A 1,000-token answer with top-5 logprobs takes at most about 35 KB.
:func:`row_fields` is the one place export rows are built from it.

It sits below the client and the store (like ``orchestrator.items.answer``): neither may
import the other.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Where a choice says its generated ids: vLLM's ``token_ids``, SGLang's ``response_token_ids``.
CHOICE_ID_FIELDS: tuple[str, ...] = ("token_ids", "response_token_ids")

_MAGIC = b"OTK1"
_HEADER = struct.Struct("<4sBI")  # magic, which sections, positions
_IDS, _TEXTS, _LOGPROBS, _TOP, _TOP_IDS, _TOP_TEXTS = (1 << i for i in range(6))
_INT32 = (-(2**31), 2**31 - 1)
#: Most alternatives one position may carry (the count is 16-bit).
MAX_TOP = 2**16 - 1


@dataclass(frozen=True, slots=True)
class Tokens:
    """The generated tokens, position by position. ``ids`` or ``texts`` say which token
    (texts only when the server gave no ids); ``logprobs`` its logprob (NaN: not given);
    ``top_*`` the alternatives at each position, ids or texts likewise. A missing part
    is None."""

    ids: tuple[int, ...] | None = None
    texts: tuple[str, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    top_ids: tuple[tuple[int, ...], ...] | None = None
    top_texts: tuple[tuple[str, ...], ...] | None = None
    top_logprobs: tuple[tuple[float, ...], ...] | None = None

    def __len__(self) -> int:
        for part in (self.ids, self.texts, self.logprobs, self.top_logprobs):
            if part is not None:
                return len(part)
        return 0


# ------------------------------------------------------------------------ packing


def _f32(value: float) -> float:
    """``value`` as float32 holds it: what a packed value reads back as."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def shuffled(arr: array) -> bytes:
    """The array's bytes, byte planes together (the high bytes of small ids, the
    exponents of logprobs): deflate then finds the runs."""
    if sys.byteorder == "big":
        arr = array(arr.typecode, arr)
        arr.byteswap()
    raw = arr.tobytes()
    size = arr.itemsize
    return b"".join(raw[i::size] for i in range(size))


def unshuffled(data: memoryview, typecode: str, count: int) -> array:
    size = array(typecode).itemsize
    raw = bytearray(count * size)
    for i in range(size):
        raw[i::size] = data[i * count : (i + 1) * count]
    arr = array(typecode)
    arr.frombytes(bytes(raw))
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def _texts_bytes(texts: Sequence[str]) -> bytes:
    encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
    lengths = array("I", [len(e) for e in encoded])
    return shuffled(lengths) + b"".join(encoded)


def pack(tokens: Tokens) -> bytes:
    """The compact form the store keeps (see the module's docstring)."""
    n = len(tokens)
    which = 0
    body: list[bytes] = []
    if tokens.ids is not None:
        which |= _IDS
        body.append(shuffled(array("i", tokens.ids)))
    elif tokens.texts is not None:
        which |= _TEXTS
        body.append(_texts_bytes(tokens.texts))
    if tokens.logprobs is not None:
        which |= _LOGPROBS
        body.append(shuffled(array("f", tokens.logprobs)))
    tops = tokens.top_logprobs
    if tops is not None:
        which |= _TOP
        body.append(shuffled(array("H", [len(t) for t in tops])))
        if tokens.top_ids is not None:
            which |= _TOP_IDS
            body.append(shuffled(array("i", [i for t in tokens.top_ids for i in t])))
        elif tokens.top_texts is not None:
            which |= _TOP_TEXTS
            body.append(_texts_bytes([s for t in tokens.top_texts for s in t]))
        body.append(shuffled(array("f", [v for t in tops for v in t])))
    return _HEADER.pack(_MAGIC, which, n) + zlib.compress(b"".join(body), 6)


class _Reader:
    def __init__(self, data: bytes):
        self.view = memoryview(data)
        self.at = 0

    def numbers(self, typecode: str, count: int) -> array:
        size = array(typecode).itemsize * count
        part = self.view[self.at : self.at + size]
        if len(part) != size:
            raise ValueError("packed tokens are cut short")
        self.at += size
        return unshuffled(part, typecode, count)

    def texts(self, count: int) -> list[str]:
        lengths = self.numbers("I", count)
        out = []
        for length in lengths:
            out.append(
                bytes(self.view[self.at : self.at + length]).decode("utf-8", "surrogatepass")
            )
            self.at += length
        return out


def _grouped(flat: Sequence[Any], counts: Sequence[int]) -> tuple[tuple[Any, ...], ...]:
    out, at = [], 0
    for count in counts:
        out.append(tuple(flat[at : at + count]))
        at += count
    return tuple(out)


def unpack(data: bytes) -> Tokens:
    """What :func:`pack` wrote; ``ValueError`` for anything else."""
    if len(data) < _HEADER.size:
        raise ValueError("packed tokens are cut short")
    magic, which, n = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"not packed tokens (magic {magic!r})")
    try:
        reader = _Reader(zlib.decompress(data[_HEADER.size :]))
    except zlib.error as exc:
        raise ValueError(f"packed tokens do not inflate: {exc}") from exc
    parts: dict[str, Any] = {}
    if which & _IDS:
        parts["ids"] = tuple(reader.numbers("i", n))
    elif which & _TEXTS:
        parts["texts"] = tuple(reader.texts(n))
    if which & _LOGPROBS:
        parts["logprobs"] = tuple(reader.numbers("f", n))
    if which & _TOP:
        counts = reader.numbers("H", n)
        total = sum(counts)
        if which & _TOP_IDS:
            parts["top_ids"] = _grouped(reader.numbers("i", total), counts)
        elif which & _TOP_TEXTS:
            parts["top_texts"] = _grouped(reader.texts(total), counts)
        parts["top_logprobs"] = _grouped(reader.numbers("f", total), counts)
    if reader.at != len(reader.view):
        raise ValueError("packed tokens have bytes left over")
    return Tokens(**parts)


def stored(tokens: Tokens) -> Tokens:
    """``tokens`` as they read back once packed: logprobs at float32."""
    return Tokens(
        ids=tokens.ids,
        texts=None if tokens.ids is not None else tokens.texts,
        logprobs=None if tokens.logprobs is None else tuple(_f32(v) for v in tokens.logprobs),
        top_ids=tokens.top_ids if tokens.top_logprobs is not None else None,
        top_texts=(
            tokens.top_texts if tokens.top_ids is None and tokens.top_logprobs is not None else None
        ),
        top_logprobs=(
            None
            if tokens.top_logprobs is None
            else tuple(tuple(_f32(v) for v in t) for t in tokens.top_logprobs)
        ),
    )


# ------------------------------------------------------------------------ export rows


def _plain(values: Sequence[float]) -> list[float | None]:
    # NaN (a logprob the server did not give) has no JSON form: null.
    return [None if math.isnan(v) else v for v in values]


def row_fields(tokens: Tokens | None, *, logprobs: bool, token_ids: bool) -> dict[str, Any]:
    """The export columns of an answer's tokens, flat (a Parquet writer makes each an
    array column): ``token_ids`` when ``token_ids``; with ``logprobs``, ``tokens`` (the
    texts, when there are no ids), ``token_logprobs``, ``top_token_ids`` (or
    ``top_tokens``) and ``top_logprobs``. A part the server did not give is None."""
    t = tokens or Tokens()
    row: dict[str, Any] = {}
    if token_ids:
        row["token_ids"] = list(t.ids) if t.ids is not None else None
    if logprobs:
        if t.ids is None:
            row["tokens"] = list(t.texts) if t.texts is not None else None
        row["token_logprobs"] = _plain(t.logprobs) if t.logprobs is not None else None
        if t.top_ids is not None or t.top_texts is None:
            row["top_token_ids"] = [list(x) for x in t.top_ids] if t.top_ids is not None else None
        else:
            row["top_tokens"] = [list(x) for x in t.top_texts]
        row["top_logprobs"] = (
            [_plain(x) for x in t.top_logprobs] if t.top_logprobs is not None else None
        )
    return row


# ------------------------------------------------------------------------ reading answers


class BadTokens(ValueError):
    """A server's logprobs or token ids that cannot be read as such."""


def _token_id(text: Any) -> int | None:
    """vLLM's ``return_tokens_as_token_ids`` token, ``"token_id:N"``, as N."""
    if isinstance(text, str) and text.startswith("token_id:"):
        try:
            return int(text[9:])
        except ValueError:
            return None
    return None


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not _INT32[0] <= value <= _INT32[1]:
        raise BadTokens(f"{what} is {str(value)[:40]!r}, not a token id")
    return value


def _logprob(value: Any, what: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadTokens(f"{what} is {str(value)[:40]!r}, not a logprob")
    return float(value)


@dataclass(slots=True)
class Collector:
    """Gathers an answer's tokens from its choice, or from each streamed chunk's choice
    in turn; :meth:`result` gives them (None: the server sent none)."""

    ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[tuple[int, ...]] = field(default_factory=list)
    top_texts: list[tuple[str, ...]] = field(default_factory=list)
    top_logprobs: list[tuple[float, ...]] = field(default_factory=list)
    choice_ids: list[int] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def add(self, choice: dict[str, Any]) -> None:
        """One choice (a streamed chunk's too); ``BadTokens`` when it cannot be read."""
        for name in CHOICE_ID_FIELDS:
            ids = choice.get(name)
            if isinstance(ids, list):
                self.seen.add("choice_ids")
                self.choice_ids += [_int(i, name) for i in ids]
        found = choice.get("logprobs")
        if not isinstance(found, dict):
            if found is not None:
                raise BadTokens(f"logprobs is a {type(found).__name__}, not an object")
            return
        if isinstance(found.get("content"), list):
            for entry in found["content"]:
                self._chat_entry(entry)
        elif isinstance(found.get("tokens"), list):
            self._completion(found)

    def _chat_entry(self, entry: Any) -> None:
        if not isinstance(entry, dict):
            raise BadTokens("a logprobs.content entry is not an object")
        self._position(entry.get("id"), entry.get("token"), entry.get("logprob"))
        tops = entry.get("top_logprobs")
        if tops is None:
            return
        if not isinstance(tops, list) or not all(isinstance(t, dict) for t in tops):
            raise BadTokens("top_logprobs is not a list of objects")
        self._top(
            [t.get("id") for t in tops],
            [t.get("token") for t in tops],
            [t.get("logprob") for t in tops],
        )

    def _completion(self, found: dict[str, Any]) -> None:
        tokens, values = found["tokens"], found.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(tokens):
            raise BadTokens("logprobs.token_logprobs does not match logprobs.tokens")
        tops = found.get("top_logprobs")
        if tops is not None and (not isinstance(tops, list) or len(tops) != len(tokens)):
            raise BadTokens("logprobs.top_logprobs does not match logprobs.tokens")
        for i, (token, value) in enumerate(zip(tokens, values, strict=True)):
            self._position(None, token, value)
            if tops is None:
                continue
            top = tops[i] or {}
            if not isinstance(top, dict):
                raise BadTokens("a logprobs.top_logprobs entry is not an object")
            self._top([None] * len(top), list(top), list(top.values()))

    def _position(self, given_id: Any, token: Any, value: Any) -> None:
        ident = given_id if given_id is not None else _token_id(token)
        if ident is not None:
            self.ids.append(_int(ident, "a token id"))
            self.seen.add("ids")
        if not isinstance(token, str):
            raise BadTokens(f"a token is {str(token)[:40]!r}, not text")
        self.texts.append(token)
        self.logprobs.append(_logprob(value, "a logprob"))

    def _top(self, ids: list[Any], texts: list[Any], values: list[Any]) -> None:
        if len(values) > MAX_TOP:
            raise BadTokens(f"{len(values)} alternatives at one position")
        idents = [i if i is not None else _token_id(t) for i, t in zip(ids, texts, strict=True)]
        if all(i is not None for i in idents):
            self.top_ids.append(tuple(_int(i, "a top token id") for i in idents))
        else:
            self.seen.add("top_texts")
        if not all(isinstance(t, str) for t in texts):
            raise BadTokens("a top token is not text")
        self.top_texts.append(tuple(texts))
        self.top_logprobs.append(tuple(_logprob(v, "a top logprob") for v in values))

    def result(self) -> Tokens | None:
        """The answer's tokens. Ids where every position has one (the position's own,
        or else the choice's ``token_ids`` when they are as many); texts otherwise."""
        n = len(self.logprobs)
        if n == 0 and not self.choice_ids:
            return None
        ids: list[int] | None = None
        if "ids" in self.seen and len(self.ids) == n:
            ids = self.ids
        elif self.choice_ids and (n == 0 or len(self.choice_ids) == n):
            ids = self.choice_ids
        has_top = bool(self.top_logprobs) and len(self.top_logprobs) == n
        top_by_id = has_top and "top_texts" not in self.seen and len(self.top_ids) == n
        return Tokens(
            ids=tuple(ids) if ids is not None else None,
            texts=None if ids is not None or n == 0 else tuple(self.texts),
            logprobs=tuple(self.logprobs) if n else None,
            top_ids=tuple(self.top_ids) if top_by_id else None,
            top_texts=tuple(self.top_texts) if has_top and not top_by_id else None,
            top_logprobs=tuple(self.top_logprobs) if has_top else None,
        )
