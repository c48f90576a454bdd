"""Durable, resumable batch generation against OpenAI-compatible inference servers."""

__version__ = "0.1.0"
