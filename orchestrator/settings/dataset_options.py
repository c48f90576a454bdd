"""What a dataset's columns may hold, without SQLAlchemy.

The run file is checked against these before any database is opened (``orchestrator plan
--config`` may never open one), so they live apart from the engine that ``datasets`` pulls in.
"""

from __future__ import annotations

REGENERATE: tuple[str, ...] = ("last", "all", "each")
"""``last``: one request per row, for its final answer; ``all``: one per assistant turn,
each after the turns generated before it; ``each``: one per assistant turn, each against
the original history, as items of their own that run side by side."""
ON_TRUNCATED: tuple[str, ...] = ("keep", "retry", "fail")
"""What an answer cut at max_tokens becomes: kept, retried, or the item failed."""
ON_INVALID: tuple[str, ...] = ("keep", "retry", "fail")
"""What structured output that does not parse or match its schema becomes."""
ON_OVERFLOW: tuple[str, ...] = ("fail", "fit")
"""What a request longer than the server's context does: the item fails
(``context_overflow``), or it is asked again with ``max_tokens`` lowered to fit."""
HISTORY_REASONING: tuple[str, ...] = ("keep", "drop")
"""Whether earlier assistant turns go back to the server with their reasoning: ``keep``
(the server's template decides what it renders; models that think in a tool loop need
it) or ``drop`` (for a server that refuses reasoning in the history)."""
INT_MAX = 2**31 - 1
"""The largest concurrency or priority: what a PostgreSQL INTEGER column holds."""
ENDPOINTS: tuple[str, ...] = ("chat", "completions")
"""Where a dataset's items go: ``/v1/chat/completions`` (messages) or ``/v1/completions``
(a plain prompt, no chat template: base models, few-shot prompts)."""
