"""Export writers and row shapes beyond the JSONL line formats of ``formats.export``:
SpecForge's shapes, Parquet tables, the dataset card.

The rows themselves are made in one place, ``formats.export`` (``_Lines.line``), for
every format: a writer here only encodes them, so a Parquet row and a JSONL line of the
same item cannot say different things.
"""
