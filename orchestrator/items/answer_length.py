"""How long an item's answer will be: what the claim order ranks items by.

A run ends when its last answer does. Parallel slots fed longest job first end within
4/3 of the best possible (Graham, 1969), and a continuous-batching server behaves like
slots: a run whose long answers start last ends on a tail in which the server runs a
handful of requests. Lengths are not known ahead, but a ranking is enough:

* a line that already holds an answer (regeneration data: the turns the model writes
  again) predicts the new one by its own length, estimated from its text at enqueue
  (``answer_tokens``, stored per item as ``predicted_tokens``);
* each dataset's latest answers say how the new answers compare with those predictions
  (``LengthStats.scale``: a thinking model writes math longer than the source did), and
  how long the answers of lines without one are (``LengthStats.high``);
* ``max_tokens`` caps both.

``Expected`` applies them; the store ranks pending items with it across the datasets of
one priority, the ETA and ``plan`` count the work left with the same figures.

Pure arithmetic, tested without a database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BYTES_PER_TOKEN",
    "COMPLETION_FRACTION",
    "Expected",
    "LengthStats",
    "answer_tokens",
    "expected",
]

BYTES_PER_TOKEN = 4
"""UTF-8 bytes per generated token, for English text and code; more for other scripts."""

COMPLETION_FRACTION = 0.35
"""Mean answer length as a fraction of max_tokens, until answers are measured: reasoning
models at max_tokens 8k-16k typically write a third of the limit, with a long tail."""

#: Answers a dataset needs before its own figures replace the assumptions.
MEASURED_AFTER = 8
#: Bounds of a measured scale: a dataset whose first answers were all cut short, or all
#: empty, must not rank its items out of sight.
_SCALE_BOUNDS = (0.1, 10.0)


def answer_tokens(turns: Iterable[Mapping[str, Any]]) -> int:
    """Tokens of the answer turns a line holds, estimated from their text: content,
    reasoning and tool calls, ``BYTES_PER_TOKEN`` UTF-8 bytes a token, at least 1."""
    size = 0
    for turn in turns:
        for key in ("content", "reasoning_content", "reasoning"):
            size += _text_bytes(turn.get(key))
        calls = turn.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    size += _text_bytes(function.get("name")) + _text_bytes(
                        function.get("arguments")
                    )
    return max(1, math.ceil(size / BYTES_PER_TOKEN))


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list):  # content parts
        return sum(_text_bytes(part.get("text")) for part in value if isinstance(part, dict))
    return 0


@dataclass(frozen=True, slots=True)
class LengthStats:
    """What one dataset's latest answers measured (``store.lengths``).

    ``answers`` of them; ``tokens`` their completion tokens in all. Of those whose item
    had a prediction, ``predicted_answers`` answers, ``predicted_tokens`` and
    ``actual_tokens`` the sums of the prediction and of what was generated. ``high`` is
    the 90th percentile of the lengths of all of them.
    """

    answers: int = 0
    tokens: int = 0
    high: float = 0.0
    predicted_answers: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0

    @property
    def mean(self) -> float:
        return self.tokens / self.answers if self.answers else 0.0


@dataclass(frozen=True, slots=True)
class Expected:
    """How one dataset's items rank: a prediction times ``scale``, an item without one at
    ``unknown``, neither above ``max_tokens``."""

    scale: float = 1.0
    unknown: float = 0.0
    max_tokens: int | None = None

    def rank(self, predicted: int) -> float:
        value = predicted * self.scale if predicted > 0 else self.unknown
        return min(value, float(self.max_tokens)) if self.max_tokens else value


def expected(stats: LengthStats | None, max_tokens: int | None) -> Expected:
    """A dataset's ranking from its measured answers, or from ``max_tokens`` before.

    An item without a prediction ranks at the 90th percentile of its dataset's answers
    rather than their mean: its length is unknown, and one long answer started last is
    what makes a run end late, while a short one started early costs nothing. Before
    answers, at ``COMPLETION_FRACTION`` of ``max_tokens`` (0 without one).
    """
    cap = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
    scale, unknown = 1.0, COMPLETION_FRACTION * (cap or 0)
    if stats is not None and stats.answers >= MEASURED_AFTER:
        unknown = stats.high
    if stats is not None and stats.predicted_answers >= MEASURED_AFTER and stats.predicted_tokens:
        low, high = _SCALE_BOUNDS
        scale = min(high, max(low, stats.actual_tokens / stats.predicted_tokens))
    return Expected(scale, unknown, cap)
