"""``inspect`` for a person: one panel per item (rich), and the JSON lines for scripts.

Every text that came from a row (prompts, answers, error messages, server names) is put
in a ``rich.text.Text``, never parsed as markup, and its control characters are shown
escaped (``\\x1b``): an answer holding terminal escapes must not drive the terminal it
is read on. Long texts are folded in the middle, where the start and the end (where a
truncated answer was cut) stay in view; ``full`` shows them whole. On a terminal the
panels are coloured; piped, rich writes them without colour.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from orchestrator.items.conversation import targets
from orchestrator.monitor.text import duration
from orchestrator.store.item_detail import (
    AnswerRecord,
    AttemptRecord,
    ItemRecord,
    RequeueRecord,
    TurnRecord,
)

# A text longer than this (characters or lines) is folded unless ``full``.
FOLD_CHARS = 2000
FOLD_LINES = 40
_HEAD_CHARS, _HEAD_LINES = 1200, 24
_TAIL_CHARS, _TAIL_LINES = 600, 12
_STATE_STYLES = {"done": "green", "failed": "red", "running": "yellow", "pending": "cyan"}
_KEPT = {"\n", "\t"}
# Bidirectional overrides and isolates reorder what follows them on screen.
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029)}


def as_json(record: ItemRecord) -> bytes:
    """One item as the JSON line ``inspect --json`` writes (docs/API.md names the keys):
    the record's fields, nested records as objects (orjson writes dataclasses itself, in
    field order, without the deep copy ``dataclasses.asdict`` makes)."""
    return orjson.dumps(record)


def visible(text: str) -> str:
    """``text`` with control characters (but newline and tab) and bidirectional controls
    written as escapes, so that a terminal shows them instead of obeying them."""
    if text.isprintable():
        return text
    return "".join(
        f"\\x{ord(c):02x}"
        if ord(c) < 0x100 and c not in _KEPT and unicodedata.category(c) == "Cc"
        else f"\\u{ord(c):04x}"
        if c in _BIDI
        else c
        for c in text
    )


def fold(text: str, *, full: bool = False) -> tuple[str, str]:
    """``text`` as shown: whole, or its start and end around what was left out. Returns
    (head, tail); tail is "" when nothing was folded."""
    if full or (len(text) <= FOLD_CHARS and text.count("\n") < FOLD_LINES):
        return text, ""
    head = "\n".join(text[:_HEAD_CHARS].split("\n")[:_HEAD_LINES])
    tail = "\n".join(text[-_TAIL_CHARS:].split("\n")[-_TAIL_LINES:])
    return head, tail


def render(record: ItemRecord, *, full: bool = False, now: float | None = None) -> Panel:
    """One item's panel: header, request, answer (every turn), attempts, requeues."""
    now = time.time() if now is None else now
    parts: list[RenderableType] = [_header(record, now)]
    again = record.regenerate == "all" and not record.passthrough
    parts += _request(record.request, full=full, regenerated=again)
    parts += _answers(record, full=full)
    parts += _history(record)
    for requeue in record.requeues:
        parts += _requeue(requeue, full=full)
    title = Text(visible(record.dataset), "bold")
    title.append(" / ")
    title.append(visible(record.key), "bold")
    title.append(f"  {record.state}", _STATE_STYLES.get(record.state, ""))
    return Panel(Group(*parts), title=title, title_align="left")


def _at(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _fields(pairs: Iterable[tuple[str, Any]]) -> Text:
    """``name value · name value`` of the pairs whose value is not None."""
    out = Text()
    for name, value in pairs:
        if value is None or value == "":
            continue
        if out:
            out.append(" · ", "dim")
        out.append(f"{name} ", "dim")
        out.append(value if isinstance(value, Text) else visible(str(value)))
    return out


def _header(r: ItemRecord, now: float) -> RenderableType:
    kind = "pass-through" if r.passthrough else f"regenerate {r.regenerate}"
    turn = f"{min(r.turn + 1, r.turns)} of {r.turns}" if r.turns > 1 else None
    lines = [
        _fields(
            [
                ("position", r.position),
                # A prompt's sample, when its request is seeded as samples are.
                ("sample", r.draw if r.draw or "seed" in r.request else None),
                # Asked in one request with its prompt's other samples: which choice.
                ("choice", None if r.choice is None else f"{r.choice} of n={r.request['n']}"),
                ("kind", kind),
                ("attempts", r.attempts),
                ("turn", turn),
                ("enqueued", _at(r.created_at)),
                ("updated", _at(r.updated_at)),
                ("finished", _at(r.finished_at) if r.finished_at else None),
                ("not before", _at(r.not_before) if r.not_before else None),
            ]
        )
    ]
    if r.error_class:
        lines.append(
            _fields([("error", Text(r.error_class, "red")), ("reason", r.last_error or "")])
        )
    if r.lease is not None:
        beat = r.lease.heartbeat_at
        lines.append(
            _fields(
                [
                    ("held by", r.lease.worker),
                    ("lease until", _at(r.lease.expires_at)),
                    ("heartbeat", f"{duration(max(now - beat, 0.0))} ago" if beat else "none"),
                ]
            )
        )
    return Group(*lines)


def _section(name: str, detail: Text | None = None) -> Text:
    out = Text("\n")
    out.append(name, "bold underline")
    if detail:
        out.append("  ")
        out.append_text(detail)
    return out


def _body(text: str, *, full: bool, style: str = "") -> list[Text]:
    head, tail = fold(text, full=full)
    if not tail:
        return [Text(visible(head), style)]
    left = len(text) - len(head) - len(tail)
    note = f"… {left:,} characters folded (--full shows them whole) …"
    return [Text(visible(head), style), Text(note, "dim italic"), Text(visible(tail), style)]


def _content(value: Any, *, full: bool, style: str = "") -> list[Text]:
    if value is None:
        return [Text("(none)", "dim")]
    if not isinstance(value, str):  # content parts: shown as their JSON
        value = orjson.dumps(value).decode()
    if not value.strip():
        return [Text(repr(value) if value else "(empty)", "dim")]
    return _body(value, full=full, style=style)


def _message(m: dict[str, Any], *, full: bool, note: str = "") -> list[RenderableType]:
    """One message: its role, reasoning, content and tool calls, indented."""
    role = str(m.get("role", "?"))
    head = Text(visible(role), "bold magenta" if role == "assistant" else "bold")
    if m.get("tool_call_id"):
        head.append(f" (answers {visible(str(m['tool_call_id']))})", "dim")
    if note:
        head.append(f"  ({note})", "dim")
    out: list[RenderableType] = [head]
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning:
        out.append(Text("reasoning:", "dim"))
        out += _body(str(reasoning), full=full, style="italic")
        out.append(Text("content:", "dim"))
    out += _content(m.get("content"), full=full)
    calls = m.get("tool_calls") or []
    for call in calls if isinstance(calls, list) else [calls]:
        out.append(_call(call))
    return [_indent(out)]


def _call(call: Any) -> Text:
    """A tool call as ``→ call name(arguments)  id ...`` (anything else as its JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return Text("→ call " + visible(orjson.dumps(call).decode()), "cyan")
    line = Text("→ call ", "cyan")
    line.append(visible(f"{function.get('name')}({function.get('arguments')})"))
    line.append(f"  id {visible(str(call.get('id')))}", "dim")
    return line


def _indent(parts: Sequence[RenderableType]) -> RenderableType:
    return Padding(Group(*parts), (0, 0, 0, 2))


def _parameters(request: dict[str, Any]) -> Text:
    """A body's parameters (all but its messages and tools), each as its JSON."""
    return _fields(
        (k, v if isinstance(v, str) else orjson.dumps(v).decode())
        for k, v in request.items()
        if k not in ("messages", "tools")
    )


def _request(
    request: dict[str, Any], *, full: bool, regenerated: bool = False
) -> list[RenderableType]:
    """The body as sent. For a conversation generated turn by turn, the stored messages,
    each original answer marked with the turn that generates it again (each turn is
    asked with the messages before it, the earlier answers the generated ones)."""
    out: list[RenderableType] = [_section("request", _parameters(request))]
    tools = request.get("tools") or []
    if tools:
        names = [str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)]
        out.append(_fields([("tools", ", ".join(names))]))
    messages = request.get("messages") or []
    turns = _turn_places(messages) if regenerated else {}
    for place, message in enumerate(messages):
        note = f"the original of turn {turns[place]}, generated again" if place in turns else ""
        out += _message(message, full=full, note=note)
    if len(messages) in turns:
        out.append(Text(f"  turn {turns[len(messages)]}: the answer to the last message", "dim"))
    return out


def _turn_places(messages: list[dict[str, Any]]) -> dict[int, int]:
    """Each generated turn's place in the conversation, and its number (from 1)."""
    try:
        return {place: n + 1 for n, place in enumerate(targets(messages))}
    except (AttributeError, TypeError):  # not a list of messages: nothing to mark
        return {}


def _usage(usage: dict[str, Any] | None) -> str | None:
    if not usage:
        return None
    return f"{usage.get('prompt_tokens', '?')} in, {usage.get('completion_tokens', '?')} out"


def _flags(flags: list[str]) -> Text | None:
    return Text(", ".join(flags), "bold yellow") if flags else None


def _answer_fields(a: AnswerRecord | TurnRecord) -> Text:
    return _fields(
        [
            ("finish", a.finish_reason),
            ("flags", _flags(a.flags)),
            ("tokens", _usage(a.usage)),
            ("model", a.model),
            ("server", a.server),
            ("attempt", a.attempt if isinstance(a, AnswerRecord) else None),
            ("took", f"{a.latency:.2f}s"),
            ("at", _at(a.created_at)),
        ]
    )


def _answers(r: ItemRecord, *, full: bool) -> list[RenderableType]:
    """The answer, or for a conversation generated turn by turn, every turn."""
    out: list[RenderableType] = []
    if r.generated:
        out.append(_section(f"turns generated: {len(r.generated)} of {r.turns}"))
        out += _turns(r.generated, r.turns, full=full)
    if r.answer is not None:
        out.append(_section("answer", _answer_fields(r.answer)))
        if r.generated:
            out.append(Text("  (its message is the last turn above)", "dim"))
        else:
            out += _message(r.answer.message, full=full)
    elif not r.generated:
        out.append(_section("answer", Text("none yet", "dim")))
    return out


def _turns(turns: Sequence[TurnRecord], of: int, *, full: bool) -> list[RenderableType]:
    out: list[RenderableType] = []
    for t in turns:
        out.append(Text.assemble((f"turn {t.turn + 1} of {of}  ", "bold"), _answer_fields(t)))
        out += _message(t.message, full=full)
    return out


def _history(r: ItemRecord) -> list[RenderableType]:
    """Every attempt in time order (those that gave no answer, and the answer's), with
    the requeues between them: one line each, the server's message below its line."""
    rows: list[tuple[float, list[RenderableType]]] = [(e.at, _attempt(e)) for e in r.errors]
    if r.answer is not None:
        a = r.answer
        line = _event(a.attempt, Text("answered", "green"), a.server, a.created_at)
        rows.append((a.created_at, [line]))
    for q in r.requeues:
        what = Text(f"requeue #{q.requeue}: sent back from {q.state}", "cyan")
        rows.append((q.at, [_event(None, what, None, q.at)]))
    for b in r.batches:
        said = f"in batch {b.provider_id or b.batch} (turn {b.turn}): {b.status or b.state}"
        what = Text(said + (", answer written" if b.settled else ""), "blue")
        rows.append((b.at, [_event(None, what, b.server, b.at)]))
    if not rows:
        return []
    without = Text(f"{len(r.errors)} without an answer", "red") if r.errors else None
    lines = [part for _, parts in sorted(rows, key=lambda row: row[0]) for part in parts]
    return [_section("attempts", without), _indent(lines)]


def _attempt(e: AttemptRecord) -> list[RenderableType]:
    style = "red" if e.outcome == "failed" else "yellow" if e.outcome == "retry" else ""
    what = Text.assemble((visible(e.error_class), "red"), " → ", (e.outcome, style))
    message = Text(visible(" ".join((e.message or "(no message)").split())))
    return [_event(e.attempt, what, e.server, e.at), _indent([message])]


def _event(attempt: int | None, what: Text, server: str | None, at: float) -> Text:
    line = Text(f"#{attempt} " if attempt is not None else "", "bold")
    line.append_text(what)
    line.append("  ")
    line.append_text(_fields([("server", server), ("at", _at(at))]))
    return line


def _requeue(q: RequeueRecord, *, full: bool) -> list[RenderableType]:
    """A requeue, and the answer it set aside (kept beside the live answers, never
    exported; ``requeue --undo`` puts it back while the item is unclaimed)."""
    detail = _fields(
        [
            ("at", _at(q.at)),
            ("was", q.state),
            ("attempts", q.attempts),
            ("error", q.error_class),
        ]
    )
    out: list[RenderableType] = [_section(f"requeue #{q.requeue}", detail)]
    if q.answer is None and not q.generated:
        return out
    out.append(_indent([Text("set aside, asked with:", "bold"), _parameters(q.request)]))
    if q.generated:
        out.append(_indent(_turns(q.generated, len(q.generated), full=full)))
    if q.answer is not None:
        out.append(
            _indent([Text.assemble(("set-aside answer  ", "bold"), _answer_fields(q.answer))])
        )
        if not q.generated:
            out.append(_indent(_message(q.answer.message, full=full)))
    return out
