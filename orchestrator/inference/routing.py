"""Prefix routing: which server holds a prompt's prefix in its cache, as SGLang's
router guesses it (an approximate index of prompt text per server)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


#: Characters of prompt per block the prefix index remembers (a block is kept whole or
#: not at all, as a server's radix cache keeps pages).
PREFIX_BLOCK = 256
#: Blocks remembered per server, least recently used forgotten first: about 25 MB of
#: prompt text each, more than a server's KV cache holds.
PREFIX_BLOCKS = 100_000
#: Share of a prompt's blocks a server must hold for it to be sent there (SGLang's
#: router's ``cache_threshold``); below it the prompt goes to the least-loaded server.
CACHE_THRESHOLD = 0.5
#: How much busier (in-flight over cap) the server holding the prefix may be than the
#: least-loaded one and still get it: past that, the load is balanced instead (SGLang's
#: ``balance_abs_threshold``, as a share of the cap since caps differ per server).
BALANCE_THRESHOLD = 0.5


def prefix_blocks(text: str) -> list[int]:
    """Chained hashes of ``text``'s whole blocks: block ``i``'s hash stands for the
    prompt up to its end, so two prompts share hashes exactly as long as they share
    a prefix."""
    hashes: list[int] = []
    last = 0
    for start in range(0, len(text) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        last = hash((last, text[start : start + PREFIX_BLOCK]))
        hashes.append(last)
    return hashes


class PrefixIndex:
    """Which prompt prefixes each server has been sent lately: a model of the servers'
    prefix caches, so a prompt goes where its prefix is cached (a conversation's next
    turn, a retry, items sharing a system prompt) and is not computed again."""

    def __init__(self, servers: Iterable[str], limit: int = PREFIX_BLOCKS):
        self.limit = limit
        self.blocks: dict[str, OrderedDict[int, None]] = {s: OrderedDict() for s in servers}

    def matched(self, server: str, hashes: list[int]) -> int:
        """Blocks of the prompt, from its start, that ``server`` holds."""
        held = self.blocks[server]
        count = 0
        for value in hashes:
            if value not in held:
                break
            count += 1
        return count

    def add(self, server: str, hashes: list[int]) -> None:
        held = self.blocks[server]
        for value in hashes:
            held[value] = None
            held.move_to_end(value)
        while len(held) > self.limit:
            held.popitem(last=False)

    def forget(self, server: str) -> None:
        """A server that went down comes back with its cache empty."""
        self.blocks[server].clear()
