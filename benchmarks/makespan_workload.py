"""The workload of ``bench_makespan.py``: an EAGLE-3 regeneration run at reduced scale.

Eight datasets in the proportions of an 83,288-prompt run, every line a conversation
whose original answer the target model writes again. The simulated server draws each new
answer's length from its dataset's lognormal (``LENGTHS``, written as a
``--length-model`` file); the original answer in the line is that length divided by the
dataset's ratio of new to original lengths (``RATIO``: a thinking model writes longer
math than the source did) times a lognormal noise of log-sigma ``NOISE``, so it predicts
the new length about as well as a real source does, and no better.

Everything is fixed by ``seed``: the same files, the same lengths, in every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from orchestrator.sim import request_digest
from orchestrator.sim.length_model import LengthModel, Lognormal
from orchestrator.sim.offline import Request

RUN_PROMPTS = 83_288


@dataclass(frozen=True, slots=True)
class Dataset:
    """One prompt set: its share of the run, answers, limit and prompt lengths."""

    name: str
    prompts: int  # in the full run
    mean: float  # new answer, tokens
    sigma: float
    max_tokens: int
    prompt_words: int  # median prompt length
    prompt_sigma: float
    ratio: float  # new answer length / original answer length, on average
    long: bool = False  # a long-prompt set (fixed concurrency 32 when run on its own)


DATASETS: tuple[Dataset, ...] = (
    Dataset("function_calling", 10_000, 150, 0.8, 10_240, 300, 0.3, 0.9),
    Dataset("code", 14_714, 700, 0.9, 10_240, 250, 0.6, 1.3),
    Dataset("chat", 15_000, 350, 0.9, 10_240, 120, 0.8, 1.0),
    Dataset("math", 12_000, 800, 1.0, 10_240, 100, 0.5, 1.6),
    Dataset("multilingual", 10_000, 300, 0.8, 10_240, 150, 0.6, 1.1),
    Dataset("writing", 9_000, 600, 0.7, 10_240, 150, 0.5, 1.0),
    Dataset("long_documents", 9_002, 400, 0.8, 10_240, 3_000, 0.4, 0.8, long=True),
    Dataset("agentic", 3_572, 800, 1.0, 16_384, 6_000, 0.4, 1.2, long=True),
)

#: Log-sigma of the noise between an original answer's length and the new one's.
NOISE = 0.4

_WORDS = (
    "alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "field", "light",
    "shadow", "signal", "vector", "matrix", "kernel", "tensor", "north", "amber", "cobalt",
)  # fmt: skip


def length_model() -> LengthModel:
    return LengthModel({d.name: Lognormal(d.mean, d.sigma) for d in DATASETS})


def length_model_json() -> bytes:
    doc = {"datasets": {d.name: {"mean": d.mean, "sigma": d.sigma} for d in DATASETS}}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def counts(total: int) -> dict[str, int]:
    """Prompts per dataset for a run of about ``total``, in the full run's proportions."""
    return {d.name: max(1, round(total * d.prompts / RUN_PROMPTS)) for d in DATASETS}


@dataclass(frozen=True, slots=True)
class Line:
    dataset: str
    key: str
    messages: list[dict[str, str]]  # as sent: the original answer dropped
    original: int  # words of the original answer in the file
    prompt: int  # prompt tokens as the simulated server counts them (words)
    tokens: int  # the new answer's length, cut at max_tokens
    max_tokens: int


def lines(total: int, seed: int = 0) -> Iterator[Line]:
    """Every line of the workload, dataset by dataset, in file order."""
    model = length_model()
    rng = random.Random(seed)
    for d, n in zip(DATASETS, counts(total).values(), strict=True):
        for i in range(n):
            words = max(8, round(d.prompt_words * math.exp(rng.gauss(0, d.prompt_sigma))))
            text = f"{d.name} {i}: " + " ".join(rng.choices(_WORDS, k=words - 2))
            messages = [{"role": "user", "content": text}]
            drawn = model.tokens(d.name, request_digest(messages), seed) or 1
            original = max(1, round(drawn / d.ratio * math.exp(rng.gauss(0, NOISE))))
            yield Line(
                dataset=d.name,
                key=f"{d.name}-{i:06d}",
                messages=messages,
                original=original,
                prompt=words,
                tokens=min(drawn, d.max_tokens),
                max_tokens=d.max_tokens,
            )


def write(work: Path, total: int, seed: int = 0, *, answers: bool = True) -> list[Line]:
    """One JSONL file per dataset (``<name>.jsonl``), the length model, a run file;
    returns the lines. Without ``answers`` every line is the bare prompt, as a prompt set
    that never had answers."""
    rows = list(lines(total, seed))
    files: dict[str, Any] = {}
    try:
        for line in rows:
            fh = files.get(line.dataset)
            if fh is None:
                fh = files[line.dataset] = open(work / f"{line.dataset}.jsonl", "wb")  # noqa: SIM115
            words = (_WORDS[(len(line.key) + k) % len(_WORDS)] for k in range(line.original))
            answer = " ".join(words)
            reply = [{"role": "assistant", "content": answer}] if answers else []
            conversation = [*line.messages, *reply]
            fh.write(orjson.dumps({"id": line.key, "messages": conversation}) + b"\n")
    finally:
        for fh in files.values():
            fh.close()
    (work / "lengths.json").write_bytes(length_model_json())
    (work / "run.toml").write_text(run_file())
    return rows


def run_file(caps: bool = False) -> str:
    """The run file a user would write: each dataset, its max_tokens, and its name in the
    requests' metadata for the simulated server's length model."""
    parts = ['[defaults]\nmodel = "sim-model"\nmax_tokens = 10240\n']
    for d in DATASETS:
        parts.append(
            f'\n[[dataset]]\nname = "{d.name}"\nfile = "{d.name}.jsonl"\nformat = "messages"\n'
            + (f"max_tokens = {d.max_tokens}\n" if d.max_tokens != 10_240 else "")
            + (f"concurrency = {32 if d.long else 150}\n" if caps else "")
            + f'[dataset.extra_body]\nmetadata = {{ dataset = "{d.name}" }}\n'
        )
    return "".join(parts)


def requests(rows: list[Line]) -> list[Request]:
    """The lines as the offline scheduler takes them, in file order."""
    return [Request(r.prompt, r.tokens, r.max_tokens) for r in rows]
