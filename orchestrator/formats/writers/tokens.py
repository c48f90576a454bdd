"""``export --format tokens``: one row per generated turn, in the server's own token ids.

A draft model learns the target's next token, so what it trains on must be what the
target saw and emitted, id for id: ``input_ids`` are the prompt ids the server evaluated
then the ids it generated, and ``loss_mask`` (as long) is 0 on the prompt and 1 on every
generated token (reasoning and tool-call tokens included). Tool calls and agentic turns
come whole: no template renders them again.

A multi-turn item's rows are named as ``--per-turn`` names them (``<id>#turn<k>``), a
sample's as ``<id>#sample<s>``. A turn whose ids are missing or do not add up to what
the server counted is left out, never misaligned; the report counts each reason
(:data:`REASONS`) and the command shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from orchestrator.items.quality import flag_names
from orchestrator.items.token_ids import TokenIds, unpack_ids
from orchestrator.store.outputs import DatasetRef, TokenRow

#: Why a turn is left out of the token rows, by the short name the report counts.
REASONS = {
    "not_asked": "no token ids: enqueue the dataset with --token-ids",
    "no_prompt_ids": "no prompt ids: the answer carried none and the server's /tokenize gave none",
    "no_generated_ids": "no generated ids: the server sent none",
    "generated_count": "fewer or more generated ids than the server's completion_tokens "
    "(a llama.cpp stream drops the ids of text it held back: ask without --stream)",
    "prompt_count": "fewer or more prompt ids than the server's prompt_tokens",
    "unreadable": "stored ids that do not unpack",
}


@dataclass(slots=True)
class TokenWriter:
    """Writes one dataset's token rows; counts what it leaves out, and why."""

    dataset: DatasetRef
    provenance: bool = False
    exclude_flags: int = 0
    merge_turns: bool = False
    excluded: int = 0
    #: Conversations left a row per turn by ``merge_turns`` (their ids are no chain).
    unmerged: int = 0
    left_out: dict[str, int] = field(default_factory=dict)
    #: Rows written beyond one per item (a multi-turn item's further turns).
    extra: int = 0
    #: As a ``LineWriter`` counts them for the export's report: no pre-tokenised input
    #: rows, nothing SpecForge's validator skips.
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def write(self, write: Callable[[bytes], object], batch: Iterable[TokenRow]) -> int:
        """Each item's rows (its turns in order); the lines written."""
        lines = 0
        for row in batch:
            whole = self._whole(row)
            if whole is not None:
                write(whole)
                write(b"\n")
                lines += 1
                continue
            written = 0
            for name, turn in self._turns(row):
                if turn.flags & self.exclude_flags:
                    self.excluded += 1
                    continue
                line = self._line(name, turn)
                if line is None:
                    continue
                write(line)
                write(b"\n")
                written += 1
            if written:
                lines += written
                self.extra += written - 1
        return lines

    def _base(self, row: TokenRow) -> str:
        """A row's id before any ``#turn<k>``: its key, and its sample when it has one."""
        return row.key if self.dataset.samples <= 1 else f"{row.key}#sample{row.sample}"

    def _turns(self, row: TokenRow) -> list[tuple[str, TokenRow]]:
        base = self._base(row)
        if self.dataset.regenerate != "all":
            return [(base, row)]
        turns = row.turns or [row]
        return [(f"{base}#turn{k}", turn) for k, turn in enumerate(turns)]

    def _whole(self, row: TokenRow) -> bytes | None:
        """With ``merge_turns``, a conversation of several turns in one row, when every
        turn's ids are whole and each prompt begins with the row before it; else None."""
        if not self.merge_turns or self.dataset.regenerate != "all" or len(row.turns or ()) < 2:
            return None
        turns = row.turns or []
        if any(t.flags & self.exclude_flags for t in turns):
            return None
        found = [checked(t)[0] for t in turns]
        if any(ids is None for ids in found):
            return None
        chain = merged([ids for ids in found if ids is not None])
        if chain is None:
            self.unmerged += 1
            return None
        return self._record(self._base(row), turns[-1], found[-1], *chain)  # type: ignore[arg-type]

    def _line(self, name: str, turn: TokenRow) -> bytes | None:
        ids, reason = checked(turn)
        if ids is None:
            self.left_out[reason] = self.left_out.get(reason, 0) + 1
            return None
        prompt, generated = ids.prompt or (), ids.generated or ()
        mask = [0] * len(prompt) + [1] * len(generated)
        return self._record(name, turn, ids, [*prompt, *generated], mask)

    def _record(
        self, name: str, turn: TokenRow, ids: TokenIds, input_ids: list[int], mask: list[int]
    ) -> bytes:
        record: dict[str, Any] = {
            "id": name,
            "dataset": self.dataset.name,
            "input_ids": input_ids,
            "loss_mask": mask,
        }
        if self.provenance:
            record |= {
                "model": turn.model,
                "params_hash": turn.params_hash,
                "server": turn.server,
                "created_at": turn.created_at,
                "flags": flag_names(turn.flags),
                "prompt_ids_from": ids.prompt_from,
            }
        return orjson.dumps(record)


def merged(turns: list[TokenIds]) -> tuple[list[int], list[int]] | None:
    """One conversation's turns as one row: the last turn's ``input_ids``, and a mask of
    1 on every turn's generated ids; None when a turn's prompt does not begin with the
    ids of the turn before it (its prompt, then what it generated)."""
    before: list[int] = []
    spans: list[tuple[int, int]] = []
    for ids in turns:
        prompt, generated = list(ids.prompt or ()), list(ids.generated or ())
        if prompt[: len(before)] != before:
            return None
        spans.append((len(prompt), len(prompt) + len(generated)))
        before = prompt + generated
    mask = [0] * len(before)
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return before, mask


def checked(turn: TokenRow) -> tuple[TokenIds | None, str]:
    """The turn's ids when they are whole, else None and the reason (:data:`REASONS`)."""
    if turn.ids is None:
        return None, "not_asked"
    try:
        ids = unpack_ids(turn.ids)
    except ValueError:
        return None, "unreadable"
    if ids.prompt is None:
        return None, "no_prompt_ids"
    if ids.generated is None:
        return None, "no_generated_ids"
    usage = orjson.loads(turn.usage) if turn.usage else {}
    said = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if type(said) is int and not usage.get("usage_split") and said != len(ids.generated):
        return None, "generated_count"
    said = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if type(said) is int and said != len(ids.prompt):
        return None, "prompt_count"
    return ids, ""


def unmerged_summary(unmerged: int) -> str | None:
    """The line saying how many conversations stayed a row per turn (``--merge-turns``)."""
    if not unmerged:
        return None
    return (
        f"{unmerged} conversations stay a row per turn: a later turn's prompt ids do not "
        "begin with the ids of the turn before (the template renders earlier turns "
        "otherwise than they were generated)"
    )


def summary(left_out: dict[str, int]) -> str | None:
    """The line naming the turns left out of the token rows, by reason; None: none."""
    if not left_out:
        return None
    total = sum(left_out.values())
    parts = "; ".join(f"{n} {REASONS.get(k, k)}" for k, n in sorted(left_out.items()))
    return f"{total} generated turns left out of the token rows: {parts}"
