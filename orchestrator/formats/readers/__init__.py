"""Input formats: one module per source format (JSONL, Parquet, CSV, Arrow, the Hub,
tables in memory) over the protocol in ``source``, and the per-row rules written once
(``rows``, ``lines``, ``columns``, ``template``)."""
