"""Several samples per prompt: each sample's seed, and which samples one request may ask
for together.

A prompt's samples are distinct draws only if their seeds differ. Unless the user gave
them, sample ``s`` of the prompt keyed ``key`` is seeded ``base(key) + s``: the same
seeds on every run and every host, never two alike within a prompt, and consecutive, so
that one request with ``n`` choices seeded with the first (which a server draws as it
draws them) stands for the samples it answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

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
