"""``orchestrator watch``: the status document as a live terminal view (rich).

One progress bar per dataset with its rates, token lengths and ETA, the errors and
quality flags, the workers, and each server's own view; redrawn in place every few
seconds. It reads the same document as ``status --json`` (``docs/STATUS.md``), so what
the view shows is what a script would see, and it works over ssh in any terminal.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from orchestrator.monitor.text import duration, eta_cell, outage_lines, percent, worker_note


def render(snap: dict[str, Any]) -> RenderableType:
    """Everything ``watch`` shows, for one status document."""
    parts: list[RenderableType] = [_datasets(snap)]
    problems = _problems(snap)
    if problems is not None:
        parts.append(problems)
    workers = _workers(snap)
    if workers is not None:
        parts.append(workers)
    servers = _servers(snap)
    if servers is not None:
        parts.append(servers)
    return Group(*parts)


def _datasets(snap: dict[str, Any]) -> Table:
    window = int(snap["window_seconds"]) // 60
    table = Table(title=f"orchestrator: {snap['database']}", title_justify="left", expand=True)
    table.add_column("dataset", no_wrap=True)
    table.add_column("progress", ratio=2, no_wrap=True)
    table.add_column("done", justify="right", no_wrap=True)
    table.add_column("done/total", justify="right", no_wrap=True)
    table.add_column("failed", justify="right")
    table.add_column(f"req/s {window}m", justify="right")
    table.add_column(f"tok/s {window}m", justify="right")
    table.add_column("tokens mean/p50/p90", justify="right", no_wrap=True)
    table.add_column("ETA", justify="right")
    rows = [(e["name"] + (" (paused)" if e["paused"] else ""), e) for e in snap["datasets"]]
    if len(rows) != 1:
        rows.append(("TOTAL", snap["totals"]))
    waiting = bool(snap["totals"].get("waiting_for_server"))
    for name, e in rows:
        counts = e["counts"]
        tokens = e["completion_tokens"]
        bar = ProgressBar(
            total=max(counts["total"], 1), completed=counts["done"] + counts["failed"]
        )
        table.add_row(
            Text(name, style="bold" if name == "TOTAL" else ""),
            bar,
            percent(counts["done"], counts["total"]),
            f"{counts['done']:,}/{counts['total']:,}",
            Text(f"{counts['failed']:,}", style="red" if counts["failed"] else ""),
            f"{e['recent']['requests_per_s']:.2f}",
            f"{e['recent']['tokens_per_s']:,.0f}",
            "/".join(_n(tokens.get(k)) for k in ("mean", "p50", "p90")),
            eta_cell(e, waiting),
        )
    return table


def _problems(snap: dict[str, Any]) -> Panel | None:
    totals = snap["totals"]
    lines: list[str] = []
    messages = totals.get("error_messages") or {}
    for cls, by_outcome in sorted(totals["errors"].items()):
        parts = ", ".join(f"{k} {v:,}" for k, v in by_outcome.items() if v)
        lines.append(f"{cls}: {parts}")
        last = (messages.get(cls) or {}).get("latest") or []
        if last:  # why, in the server's own words (markup escaped: it is their text)
            ago = duration(max(snap["generated_at"] - last[0]["at"], 0.0))
            text = " ".join((last[0]["message"] or "").split())[:140]
            lines.append(f"  [dim]{ago} ago[/dim] {escape(text)}")
    flagged = {k: v for k, v in (totals.get("flags") or {}).items() if v}
    if flagged:
        lines.append("flagged answers: " + ", ".join(f"{k} {v:,}" for k, v in flagged.items()))
    if not lines:
        return None
    return Panel("\n".join(lines), title="errors by class (attempts) and quality flags")


def _workers(snap: dict[str, Any]) -> Panel | None:
    listed = [w for w in snap["workers"] if not w["stopped"]]
    if not listed:
        return None
    now = snap.get("generated_at", 0.0)
    lines = [f"[red]{escape(line)}[/red]" for line in outage_lines(snap) if line]
    for w in listed:
        note = worker_note(w, now)
        lines.append(
            f"{escape(w['id'])}  in flight {w['in_flight']}, done {w['completed']:,}, "
            f"heartbeat {duration(w['heartbeat_age_s'])} ago"
            + (f"  [red]{escape(note)}[/red]" if note else "")
        )
    return Panel("\n".join(lines), title="workers")


def _servers(snap: dict[str, Any]) -> Panel | None:
    servers = snap.get("servers") or []
    if not servers:
        return None
    lines = []
    for s in servers:
        if s.get("error"):
            lines.append(f"{s['server']}  [red]unreachable[/red]: {s['error']}")
        elif s.get("kind") is None:
            lines.append(f"{s['server']}  no SGLang, vLLM or llama.cpp metrics")
        else:
            usage = s.get("kv_cache_usage")
            lines.append(
                f"{s['server']} ({s['kind']})  running {_n(s.get('running'))}, "
                f"queued {_n(s.get('queued'))}, "
                f"KV cache {'-' if usage is None else f'{usage:.0%}'}, "
                f"generating {_n(s.get('gen_throughput'))} tok/s"
            )
    return Panel("\n".join(lines), title="servers (their own /metrics)")


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
