"""Export writers that are more than a line per item: Parquet tables, the dataset card.

The rows themselves are made in one place, ``formats.export`` (``_Lines.record``), for
every format: a writer here only encodes them, so a Parquet row and a JSONL line of the
same item cannot say different things.
"""
