"""Export writers and row shapes beyond the JSONL line formats of ``formats.export``."""
