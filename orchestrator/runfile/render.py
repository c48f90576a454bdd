"""A plan as people read it (a plain-text table) and as programs do (a JSON document)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

from orchestrator.runfile.plan import DatasetEstimate, RunPlan

__all__ = ["plan_json", "render_plan"]


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _rows(plan: RunPlan) -> Iterator[list[str]]:
    stored = plan.source == "database"
    for d in plan.datasets:
        sending = d.mode != "passthrough"
        kind = "p" if d.predicted else "m" if d.measured else "a"
        per = f"{d.tokens_per_request:,.0f} {kind}" if sending else "-"
        states = [
            f"{n:,}" if sending and n is not None else "-" for n in (d.running, d.pending, d.failed)
        ]
        yield [
            d.name,
            d.format,
            d.mode,
            f"{d.rows:,}",
            f"{d.requests:,}" if sending else "-",
            f"{d.done:,}" if sending else "-",
            *(states if stored else []),
            f"{d.max_tokens:,}" if d.max_tokens is not None else "-",
            per,
            f"{d.generated_tokens:,}" if sending else "-",
            _duration(d.duration_seconds) if sending else "-",
            _size(d.db_bytes),
        ]
    totals = [f"{sum(getattr(d, k) or 0 for d in plan.datasets):,}" for k in _STATES]
    yield [
        "total",
        "",
        "",
        f"{plan.rows:,}",
        f"{plan.requests:,}",
        f"{plan.done:,}",
        *(totals if stored else []),
        "",
        "",
        f"{plan.generated_tokens:,}",
        _duration(plan.duration_seconds),
        _size(plan.db_bytes),
    ]


_STATES = ("running", "pending", "failed")
_HEADER = (
    "dataset",
    "format",
    "mode",
    "rows",
    "requests",
    "done",
    "max_tokens",
    "tok/request",
    "tokens",
    "time left",
    "database",
)
_LEFT = 3  # the first three columns are text, the rest numbers


def _header(plan: RunPlan) -> list[str]:
    if plan.source != "database":
        return list(_HEADER)
    done = _HEADER.index("done") + 1
    return [*_HEADER[:done], *_STATES, *_HEADER[done:]]


def render_plan(plan: RunPlan) -> str:
    """A plain-text table: one line per dataset, the totals, then the assumptions.

    A plan from a database (``plan_stored``) also shows the running, pending and failed
    requests.
    """
    header = _header(plan)
    table = [header, *_rows(plan)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.ljust(width) if i < _LEFT else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(table[0]), rule, *(line(r) for r in table[1:-1]), rule, line(table[-1]), ""]
    remaining = f"{plan.remaining_tokens:,} tokens still to generate"
    out.append(
        f"{remaining}, {_duration(plan.duration_seconds)} at {plan.tokens_per_second:,.0f} tok/s"
    )
    out.append("")
    for note in plan.assumptions:
        out.extend(textwrap.wrap(note, width=88, initial_indent="- ", subsequent_indent="  "))
    out.extend(overflow_warnings(plan))
    return "\n".join(out) + "\n"


def overflow_warnings(plan: RunPlan) -> list[str]:
    """With the server's context known: each dataset whose requests will not fit it."""
    if plan.context is None:
        return []
    out = []
    for d in plan.datasets:
        if not d.overflows:
            continue
        alone = f", {d.too_long:,} of them with a prompt longer than it alone" if d.too_long else ""
        out.append(
            f"warning: dataset {d.name}: about {d.overflows:,} of {d.requests:,} requests will "
            f"not fit the server's context of {plan.context:,} tokens (prompt and max_tokens)"
            f'{alone}; they fail as context_overflow, or, with on_overflow = "fit", are '
            "answered with max_tokens lowered"
        )
    return out


def plan_json(plan: RunPlan) -> dict[str, Any]:
    """The plan as a JSON-ready document: every estimate, the totals and the assumptions."""
    stored = plan.source == "database"

    def dataset(d: DatasetEstimate) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": d.name,
            "format": d.format,
            "mode": d.mode,
            "rows": d.rows,
            "requests": d.requests,
            "done": d.done,
        }
        if stored:
            doc.update(running=d.running, pending=d.pending, failed=d.failed)
        doc.update(
            max_tokens=d.max_tokens,
            tokens_per_request=round(d.tokens_per_request, 1),
            measured=d.measured,
            predicted=d.predicted,
            samples=d.samples,
            sample_requests=d.sample_requests if d.samples > 1 else None,
            generated_tokens=d.generated_tokens,
            remaining_tokens=d.remaining_tokens,
            duration_seconds=round(d.duration_seconds, 1),
            db_bytes=d.db_bytes,
        )
        if plan.context is not None:
            doc.update(overflows=d.overflows, too_long=d.too_long)
        return doc

    return {
        "source": plan.source,
        "tokens_per_second": plan.tokens_per_second,
        "completion_fraction": plan.completion_fraction,
        "context": plan.context,
        "datasets": [dataset(d) for d in plan.datasets],
        "total": {
            "rows": plan.rows,
            "requests": plan.requests,
            "done": plan.done,
            "generated_tokens": plan.generated_tokens,
            "remaining_tokens": plan.remaining_tokens,
            "duration_seconds": round(plan.duration_seconds, 1),
            "db_bytes": plan.db_bytes,
        },
        "assumptions": list(plan.assumptions),
    }
