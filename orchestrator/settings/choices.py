"""The names of the file formats, without the readers and writers behind them.

The commands offer these as choices before anything is read, and must start without
loading orjson or the store; the readers and the export take them from here too.
"""

from __future__ import annotations

LINE_FORMATS: tuple[str, ...] = ("messages", "sharegpt", "prompt", "openai-batch")
"""The prompt line formats, detected per line."""
INPUT_FORMATS: tuple[str, ...] = ("auto", *LINE_FORMATS, "tokens")
"""What a file may be declared as: ``auto`` takes any mix of ``LINE_FORMATS`` (and of
messages, sharegpt and tokens rows when passing through); ``tokens`` is for pass-through
only."""
EXPORT_FORMATS: tuple[str, ...] = (
    "messages",
    "sharegpt",
    "openai-batch",
    "specforge",
    "completions",
    "parquet",
    "tokens",
)
"""The export's formats: OpenAI messages, ShareGPT, OpenAI Batch API output, SpecForge's
regenerated data, ``prompt``/``completion`` pairs (the datasets enqueued with
``--endpoint completions``) and the server's own token ids of each generated turn
(``tokens``: ``input_ids`` and ``loss_mask``), all JSONL lines, and Parquet (the messages
rows as a table)."""
TABLE_FORMATS: tuple[str, ...] = ("parquet",)
"""The export formats written as tables (``formats.writers``) rather than lines."""
REASONING_MODES: tuple[str, ...] = ("separate", "inline", "drop")
"""Where the export puts generated reasoning: its own field, inline as <think>, nowhere."""
