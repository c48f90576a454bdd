"""The simulated server's prefix cache: which prompt prefixes it has computed lately.

A prompt's tokens (its words, as the simulator counts them) are kept in blocks of
``BLOCK`` tokens, each block standing for the whole prompt up to its end, so a prompt
hits exactly as far as it repeats one seen before (a conversation's earlier turns, a
shared system prompt); least recently used blocks go first once ``capacity`` tokens are
held, as a radix cache evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

#: Tokens per cached block (SGLang's page size is 1; llama.cpp's cache reuse is by chunks).
BLOCK = 16


def prompt_words(messages: list[Any]) -> list[str]:
    """The prompt's tokens as the simulator counts them, in order."""
    words: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            words += content.split()
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    words += part["text"].split()
    return words


class PrefixCache:
    """Blocks of prompts computed lately, at most ``capacity`` tokens of them."""

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.limit = max(capacity // BLOCK, 1)
        self.hits = 0  # prompt tokens served from the cache, for /metrics

    def serve(self, words: list[str], answer: list[str]) -> int:
        """The prompt's tokens the cache holds, from its start; the prompt and its answer
        are cached after (a conversation's next turn repeats both)."""
        cached = self._walk(words, count=True)
        self._walk(words + answer, count=False)
        # A whole prompt cached still has its last token computed, as servers do.
        cached = min(cached, max(len(words) - 1, 0))
        self.hits += cached
        return cached

    def _walk(self, words: list[str], *, count: bool) -> int:
        """Blocks of ``words`` held from the start (as tokens); each is kept, newest."""
        last, cached, missed = 0, 0, False
        for start in range(0, len(words) - BLOCK + 1, BLOCK):
            last = hash((last, *words[start : start + BLOCK]))
            if not missed and last in self.blocks:
                cached += BLOCK
            else:
                missed = True
            if not count:
                self.blocks[last] = None
                self.blocks.move_to_end(last)
        while len(self.blocks) > self.limit:
            self.blocks.popitem(last=False)
        return cached
