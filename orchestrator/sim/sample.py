"""A deterministic sample dataset of chat prompts, for demos, rehearsals and benchmarks.

Lines are built from small word lists in code so that any size can be produced without
shipping data, and the same ``(n, seed)`` always gives the same file.
"""

from __future__ import annotations

import os
import random
from typing import Any

import orjson

__all__ = ["write_sample"]

_TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest",
    "the water cycle", "binary search", "plate tectonics", "the immune system",
    "supply and demand", "quantum entanglement", "the Roman Empire", "neural networks",
    "climate change", "the printing press", "public key cryptography", "volcanoes",
    "the stock market", "DNA replication", "the Silk Road", "garbage collection",
    "jazz music", "the theory of evolution", "TCP congestion control", "sourdough bread",
    "the moon landing", "hash tables", "ocean currents", "impressionist painting",
    "vaccines", "the Pythagorean theorem", "electric cars", "coral reefs",
)  # fmt: skip

_AUDIENCES = (
    "a ten-year-old", "a busy executive", "a first-year student", "a retired engineer",
    "someone new to the subject", "an expert", "a curious teenager", "a journalist",
)  # fmt: skip

_FORMS = (
    "in three sentences", "as a short poem", "in plain words", "as a numbered list",
    "with one concrete example", "in under fifty words", "as a dialogue", "step by step",
)  # fmt: skip

_TEMPLATES = (
    "Explain {topic} to {audience} {form}.",
    "Write a short summary of {topic} {form}.",
    "What are the three most common misconceptions about {topic}?",
    "Give me a quiz question about {topic} and its answer.",
    "Compare {topic} with {other} {form}.",
    "Why does {topic} matter today? Answer for {audience}.",
    "Write a tweet-length fact about {topic}.",
    "List five keywords someone should know about {topic}.",
    "Describe the history of {topic} {form}.",
    "Translate this sentence into French: 'I am reading about {topic}.'",
)

_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a patient teacher. Keep answers short and accurate.",
    "You are a concise technical writer. Avoid filler.",
    "Answer in a friendly tone and end with a question for the reader.",
    "You are an expert tutor. Use simple language and concrete examples.",
)

_FOLLOW_UPS = (
    "Can you make that shorter?",
    "Now give an example from everyday life.",
    "What would be a good next topic to learn after this?",
    "Please explain the hardest part again, more slowly.",
    "Turn that into three bullet points.",
    "How would you explain this to {audience} instead?",
)

_REPLIES = (
    "Sure. In short, {topic} is about how a few simple rules produce complex results.",
    "Here is a brief overview of {topic}: it has a long history and many practical uses.",
    "{topic} can be understood through one key idea, which I will outline below.",
)


def _prompt(rng: random.Random) -> tuple[str, str]:
    topic, other = rng.sample(_TOPICS, 2)
    text = rng.choice(_TEMPLATES).format(
        topic=topic, other=other, audience=rng.choice(_AUDIENCES), form=rng.choice(_FORMS)
    )
    return topic, text


def _record(index: int, rng: random.Random) -> dict[str, Any]:
    topic, text = _prompt(rng)
    roll = rng.random()
    messages: list[dict[str, str]] = []
    if roll < 0.2:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": text})
    elif roll < 0.35:
        reply = rng.choice(_REPLIES).format(topic=topic)
        follow_up = rng.choice(_FOLLOW_UPS).format(audience=rng.choice(_AUDIENCES))
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": reply[0].upper() + reply[1:]})
        messages.append({"role": "user", "content": follow_up})
    else:
        messages.append({"role": "user", "content": text})
    return {"id": f"sample-{index:06d}", "messages": messages}


def write_sample(path: str | os.PathLike[str], n: int = 10_000, seed: int = 0) -> int:
    """Write ``n`` JSONL prompt lines to ``path``, one record at a time; returns ``n``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    with open(path, "wb") as out:
        for index in range(1, n + 1):
            out.write(orjson.dumps(_record(index, rng)) + b"\n")
    return n
