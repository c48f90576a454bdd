"""Several samples per prompt: each sample's seed, which samples one request may ask for
together, and the tokens each choice of such a request is counted.

A prompt's samples are distinct draws only if their seeds differ. Unless the user gave
them, sample ``s`` of the prompt keyed ``key`` is seeded ``base(key) + s``: the same
seeds on every run and every host, never two alike within a prompt, and consecutive, so
that one request with ``n`` choices seeded with the first (which a server draws as it
draws them) stands for the samples it answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

SEED_SPACE = 2**31
"""Seeds are below this: a 32-bit signed integer, which every server takes."""


def base_seed(key: str) -> int:
    """The seed of a prompt's sample 0 when the user gave none."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % SEED_SPACE


def seed_of(key: str, sample: int, seeds: Sequence[int] | None = None) -> int:
    """Sample ``sample``'s seed: the user's, or derived from the prompt's key."""
    if seeds:
        return int(seeds[sample])
    return (base_seed(key) + sample) % SEED_SPACE


#: Marks a choice's ``completion_tokens`` as its share of the request's total (below).
USAGE_SPLIT = "usage_split"


def choice_usages(usage: Any, counted: Sequence[int | None], sizes: Sequence[int]) -> list[Any]:
    """The usage each choice of a request keeps, in choice order.

    Servers count a request's completion tokens for all its choices at once (vLLM,
    SGLang), so a choice's own count comes from what was said of it alone (``counted``:
    its logprobs or token ids, or vLLM's per-choice streamed usage; None: nothing). The
    rest of the request's total is shared among the choices not counted, in proportion to
    the length of their text (``sizes``), whole tokens by largest remainder, at least one
    for a choice with text; each such count is marked ``usage_split``. Counts said alone
    that exceed the total, or all said and not adding up to it, are not trusted. Without a
    total, a choice not counted says no count: no count is not zero. One choice keeps the
    usage as it was.
    """
    if len(sizes) <= 1 or not isinstance(usage, dict):
        return [usage] * len(sizes)
    total = usage.get("completion_tokens")
    total = total if type(total) is int and total >= 0 else None
    known = [c if type(c) is int and c >= 0 else None for c in counted]
    said = sum(c for c in known if c is not None)
    if total is not None and (said > total or (None not in known and said != total)):
        known, said = [None] * len(sizes), 0
    shared = {k: v for k, v in usage.items() if k not in ("completion_tokens", "total_tokens")}
    out: list[Any] = []
    shares = _shares(total - said, known, sizes) if total is not None else {}
    for i, count in enumerate(known):
        own = dict(shared)
        if count is None and i in shares:
            count = shares[i]
            own[USAGE_SPLIT] = True
        if count is not None:
            own["completion_tokens"] = count
            if type(usage.get("prompt_tokens")) is int:
                own["total_tokens"] = usage["prompt_tokens"] + count
        out.append(own)
    return out


def _shares(rest: int, known: Sequence[int | None], sizes: Sequence[int]) -> dict[int, int]:
    """``rest`` tokens over the choices not counted, by choice, in proportion to
    ``sizes`` (evenly when none has text), at least one for each with text."""
    open_ = [i for i, c in enumerate(known) if c is None]
    rest = max(rest, 0)
    weights = [max(sizes[i], 0) for i in open_]
    whole = sum(weights)
    if not whole:
        weights, whole = [1] * len(open_), len(open_)
    exact = [rest * w / whole for w in weights]
    floors = [int(x) for x in exact]
    left = rest - sum(floors)
    for j in sorted(range(len(open_)), key=lambda j: floors[j] - exact[j])[:left]:
        floors[j] += 1
    return {i: max(n, 1) if sizes[i] > 0 else n for i, n in zip(open_, floors, strict=True)}


#: Where an answer asked as one choice of an ``n`` request keeps which (its ``usage``).
CHOICE, CHOICES = "choice", "n"


def as_choice(usage: dict[str, Any] | None, choice: int, of: int) -> dict[str, Any]:
    """An answer's usage, saying it was choice ``choice`` of a request asking ``n = of``
    (seeded with its first sample's seed): what ``inspect`` shows it was sent as."""
    return {**(usage or {}), CHOICE: choice, CHOICES: of}


def sent_as(usage: Any) -> tuple[int, int] | None:
    """(choice, n) when an answer came as one choice of an ``n`` request, else None."""
    if not isinstance(usage, dict):
        return None
    choice, of = usage.get(CHOICE), usage.get(CHOICES)
    if type(choice) is int and type(of) is int and 0 <= choice < of:
        return choice, of
    return None
