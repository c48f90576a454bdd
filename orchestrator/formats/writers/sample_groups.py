"""The shape of a prompt's samples in an export, for every writer.

A dataset of several samples per prompt exports one record per sample, its ``sample``
index beside the prompt's ``id``, or, grouped (``--group-samples``), one record per
prompt whose ``answers`` list each sample's answer in sample order. A writer (each
JSONL format, Parquet) shapes one sample's record as it would any answer's, then passes
it here: :func:`sampled` marks it, :class:`Groups` folds consecutive records of one
prompt into one. Records come in (position, sample) order (``store.outputs``).

Grouped, what the samples share stays where it was (``id``, ``dataset``, the prompt's
messages or turns, ``tools``) and what is each sample's own goes into its answer:

* ``messages`` / ``sharegpt``, ``regenerate = "last"``: the prompt without an answer;
  each answer is ``{"sample", "message"}`` (ShareGPT: the message a ``gpt`` turn) plus that
  sample's ``finish_reason``, ``usage`` and provenance fields.
* ``regenerate = "all"``: each sample is a conversation of its own; its answer holds the
  whole of it (``messages`` / ``conversations``), and the record keeps only the ids.
* ``completions``: the prompt once; each answer is ``{"sample", "completion"}`` plus that
  sample's ``finish_reason``, ``usage`` and the rest of its own fields.
* ``openai-batch``: the format's own shape for several answers, ``choices``, indexed by
  sample, in one response body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SAMPLE = "sample"
ANSWERS = "answers"

# What each format's record holds of one answer, by regenerate mode; the rest is shared.
_CONVERSATION = {"messages": "messages", "sharegpt": "conversations"}
_SHARED = ("id", "dataset", "tools", "custom_id")


def sampled(record: dict[str, Any], sample: int, fmt: str = "messages") -> dict[str, Any]:
    """One sample's record, its index right after the prompt's id. SpecForge's rows are
    each a conversation with an id of its own: ``<id>#sample<s>``."""
    if fmt == "specforge":
        record = {**record, "id": f"{record['id']}#sample{sample}"}
    out: dict[str, Any] = {}
    for name, value in record.items():
        out[name] = value
        if name in ("id", "custom_id") and SAMPLE not in out:
            out[SAMPLE] = sample
    out.setdefault(SAMPLE, sample)
    return out


def grouped(records: list[dict[str, Any]], fmt: str, regenerate: str) -> dict[str, Any]:
    """One prompt's sample records (marked by :func:`sampled`) as one record."""
    if fmt == "openai-batch":
        return _batch_group(records)
    if fmt == "completions":
        return _completions_group(records)
    field = _CONVERSATION[fmt]
    first = records[0]
    whole = regenerate == "all"
    out = {k: v for k, v in first.items() if k in _SHARED and k != "tools"}
    if not whole:
        out[field] = list(first[field][:-1])
    answers = []
    for record in records:
        own = {k: v for k, v in record.items() if k not in _SHARED and k != field}
        if whole:
            answer = {SAMPLE: own.pop(SAMPLE), field: record[field], **own}
        else:
            message = record[field][-1]
            answer = {SAMPLE: own.pop(SAMPLE), "message": message, **own}
        answers.append(answer)
    out[ANSWERS] = answers
    if "tools" in first:
        out["tools"] = first["tools"]
    return out


def _completions_group(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``prompt``/``completion`` records of one prompt as one record: the prompt once, each
    sample's completion (with its own finish_reason, usage, tokens) in ``answers``."""
    first = records[0]
    out = {k: v for k, v in first.items() if k in _SHARED or k == "prompt"}
    answers = []
    for record in records:
        own = {k: v for k, v in record.items() if k not in out and k != SAMPLE}
        answers.append({SAMPLE: record[SAMPLE], **own})
    out[ANSWERS] = answers
    return out


def _batch_group(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch output lines of one prompt as one line whose body has a choice per sample."""
    first = records[0]
    body = dict(first["response"]["body"])
    body["choices"] = [{**r["response"]["body"]["choices"][0], "index": r[SAMPLE]} for r in records]
    out = {k: v for k, v in first.items() if k != SAMPLE}
    out["response"] = {**first["response"], "body": body}
    return out


class Groups:
    """Folds a stream of sample records into one record per prompt: ``add`` gives back
    the groups it completed, ``finish`` the last one."""

    def __init__(self, fmt: str, regenerate: str) -> None:
        self.fmt = fmt
        self.regenerate = regenerate
        self._key: Any = None
        self._records: list[dict[str, Any]] = []

    def add(self, key: Any, record: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self._records and key != self._key:
            yield grouped(self._records, self.fmt, self.regenerate)
            self._records = []
        self._key = key
        self._records.append(record)

    def finish(self) -> Iterator[dict[str, Any]]:
        if self._records:
            yield grouped(self._records, self.fmt, self.regenerate)
            self._records = []
