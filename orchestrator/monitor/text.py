"""``status`` as text for a terminal: one row per dataset, a total, errors, workers."""

from __future__ import annotations

from typing import Any

MESSAGE_WIDTH = 140  # characters of an error message shown per line


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def percent(part: int, total: int) -> str:
    """``part`` of ``total`` in per cent, rounded down to a tenth: 100.0% only when it is
    all of it (2,889 of 3,000 is 96.3%, 2,999 of 3,000 is 99.9%, never 100.0%)."""
    tenths = part * 1000 // total if total > 0 else 0
    return f"{tenths // 10}.{tenths % 10}%"


def _row(name: str, e: dict[str, Any], waiting: bool = False) -> list[str]:
    c = e["counts"]
    tokens = e["completion_tokens"]
    mean = tokens["mean"]
    return [
        name,
        f"{c['done']:,}/{c['total']:,}",
        percent(c["done"], c["total"]),
        f"{c['pending']:,}",
        f"{c['running']:,}",
        f"{c['failed']:,}",
        f"{e['recent']['requests_per_s']:.2f}",
        f"{e['recent']['tokens_per_s']:.0f}",
        f"{e['overall']['requests_per_s']:.2f}",
        f"{e['overall']['tokens_per_s']:.0f}",
        f"{mean:.0f}" if mean is not None else "-",
        _tokens(tokens.get("p50")),
        _tokens(tokens.get("p90")),
        eta_cell(e, waiting),
    ]


def eta_cell(e: dict[str, Any], waiting: bool) -> str:
    """A dataset's (or the total's) ETA; while no server is reachable, with items left,
    that it waits for one."""
    left = e["counts"]["pending"] + e["counts"]["running"]
    return "waiting for a server" if waiting and left else duration(e["eta_seconds"])


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _flag_counts(flags: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in flags.items() if n)


def _flag_lines(snap: dict[str, Any]) -> list[str]:
    """Answers kept but marked unfit (cut off, empty...): in total, then per dataset."""
    total = snap["totals"].get("flags") or {}
    if not any(total.values()):
        return []
    lines = ["", "flagged answers (kept, marked unfit): " + _flag_counts(total)]
    flagged = [e for e in snap["datasets"] if any(e.get("flags", {}).values())]
    if len(snap["datasets"]) > 1:
        width = max(len(e["name"]) for e in flagged)
        lines += [f"  {e['name']:<{width}}  {_flag_counts(e['flags'])}" for e in flagged]
    first = next(name for name, n in total.items() if n)
    lines.append(f"  (`orchestrator export --exclude-flag {first}` leaves them out)")
    return lines


def _structured_lines(snap: dict[str, Any]) -> list[str]:
    """Per dataset asking for JSON: the share of its done answers that are not that JSON."""
    asked = [e for e in snap["datasets"] if e.get("structured")]
    if not asked:
        return []
    width = max(len(e["name"]) for e in asked)
    lines = ["", "structured output (answers not the JSON asked for):"]
    for e in asked:
        share = e["structured"]["invalid_share"]
        shown = f"{share:.1%}" if share is not None else "-"
        lines.append(f"  {e['name']:<{width}}  invalid {shown} ({e['structured']['invalid']:,})")
    return lines


def _cache_lines(prompt: dict[str, Any] | None) -> list[str]:
    """The share of prompt tokens the servers' prefix caches served: what routing a
    prompt to the server holding its prefix saves. Nothing when no server says."""
    if not prompt or prompt.get("cached_share") is None:
        return []
    return [
        f"prompt tokens {prompt['total']:,}, {prompt['cached']:,} from the servers' prefix"
        f" caches ({100 * prompt['cached_share']:.1f}% of those counted)"
    ]


def _cause_counts(wasted: dict[str, Any]) -> str:
    """``cause tokens (share, N requests[, M tokens unknown])`` for each cause."""
    parts = []
    for cause, f in wasted["by_cause"].items():
        share = f"{100 * f['share']:.1f}%, " if f["share"] is not None and f["tokens"] else ""
        unknown = f", {f['unknown']:,} of unknown tokens" if f["unknown"] else ""
        parts.append(f"{cause} {f['tokens']:,} ({share}{f['requests']:,} requests{unknown})")
    return "; ".join(parts)


def _waste_lines(snap: dict[str, Any]) -> list[str]:
    """Tokens generated and thrown away, per cause: in total, then per dataset."""
    total = snap["totals"].get("wasted")
    if not total or not total["requests"]:
        return []
    share = f" ({100 * total['share']:.1f}%)" if total["share"] is not None else ""
    lines = [
        "",
        f"tokens thrown away: {total['tokens']:,} of {total['generated_tokens']:,}"
        f" generated{share}: " + _cause_counts(total),
    ]
    wasting = [e for e in snap["datasets"] if e.get("wasted", {}).get("requests")]
    if len(snap["datasets"]) > 1:
        width = max(len(e["name"]) for e in wasting)
        lines += [f"  {e['name']:<{width}}  {_cause_counts(e['wasted'])}" for e in wasting]
    if total["unknown"]:
        lines.append(
            "  (requests of unknown tokens: cut before the server said how many it had"
            " generated; counted as requests, not in the tokens)"
        )
    return lines


def _cost_lines(cost: dict[str, Any] | None) -> list[str]:
    """The run's cost at the prices given (``orchestrator.settings.prices``): in total,
    the tokens billed, and each dataset's share when there are several."""
    if not cost:
        return []
    lines = ["", "cost: " + _cost_figures(cost) + f" ({cost['basis']})"]
    billed = cost.get("billed")
    if billed and billed["requests"]:
        lines.append(
            f"  billed: {billed['requests']:,} requests, {billed['prompt_tokens']:,} prompt "
            f"tokens ({billed['cached_tokens']:,} cached), {billed['completion_tokens']:,} "
            "completion tokens"
        )
    by_cause = {c: usd for c, usd in (cost.get("wasted_by_cause") or {}).items() if usd}
    if by_cause:
        lines.append(
            "  wasted by cause: " + ", ".join(f"{c} ${usd:,.2f}" for c, usd in by_cause.items())
        )
    datasets = cost.get("datasets") or {}
    if len(datasets) > 1:
        lines += [f"  {name}: {_cost_figures(figures)}" for name, figures in datasets.items()]
    return lines


def _cost_figures(cost: dict[str, Any]) -> str:
    to_go = cost.get("to_go")
    left = f"${to_go:,.2f}" if to_go is not None else "?"
    return f"${cost['so_far']:,.2f} so far, {left} to go, ${cost['wasted']:,.2f} wasted"


def _sample_lines(snap: dict[str, Any]) -> list[str]:
    """Datasets of several samples per prompt count samples above: their prompts here."""
    return [
        f"{e['name']}: {e['samples']} samples per prompt; prompts with every sample done "
        f"{e['prompts']['done']:,}/{e['prompts']['total']:,}"
        for e in snap["datasets"]
        if e.get("samples", 1) > 1
    ]


def render_status(snap: dict[str, Any]) -> str:
    window = int(snap["window_seconds"])
    header = [
        "dataset",
        "done/total",
        "done",
        "pending",
        "running",
        "failed",
        f"req/s {window // 60}m",
        f"tok/s {window // 60}m",
        "req/s all",
        "tok/s all",
        "mean tok",
        "p50 tok",
        "p90 tok",
        "ETA",
    ]
    rows = []
    waiting = bool(snap["totals"].get("waiting_for_server"))
    for e in snap["datasets"]:
        name = e["name"] + (" (paused)" if e["paused"] else "")
        rows.append(_row(name, e, waiting))
    if len(snap["datasets"]) != 1:
        rows.append(_row("TOTAL", snap["totals"], waiting))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"database: {snap['database']}"]
    if not snap["datasets"]:
        lines.append("no datasets yet: start with `orchestrator enqueue FILE --dataset NAME`")
        return "\n".join(lines)
    for r in [header, *rows]:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    lines.extend(outage_lines(snap))
    lines.extend(_crash_lines(snap["totals"].get("after_crash")))
    lines.extend(_cache_lines(snap["totals"].get("prompt_tokens")))
    lines.extend(_waste_lines(snap))
    lines.extend(_cost_lines(snap.get("cost")))
    lines.extend(_sample_lines(snap))
    errors = snap["totals"]["errors"]
    if errors:
        lines.append("")
        lines.append("errors by class (attempts):")
        messages = snap["totals"].get("error_messages") or {}
        for cls, n in sorted(errors.items(), key=lambda kv: -sum(kv[1].values())):
            parts = [f"{k} {v:,}" for k, v in n.items() if v]
            lines.append(f"  {cls:<16} " + ", ".join(parts))
            lines.extend(_message_lines(messages.get(cls), snap.get("generated_at", 0.0)))
    failed = snap["totals"]["failed_by_class"]
    if failed:
        lines.append("failed items by class: " + ", ".join(f"{k} {v:,}" for k, v in failed.items()))
        lines.append(
            "  (`orchestrator inspect --state failed --error-class CLASS` shows them, "
            "`orchestrator requeue --error-class CLASS` sends them back)"
        )
    lines.extend(_flag_lines(snap))
    lines.extend(_structured_lines(snap))
    lines.extend(_worker_lines(snap))
    lines.extend(_batch_lines(snap.get("batches")))
    lines.extend(_limited_lines(snap.get("rate_limited") or []))
    lines.extend(_server_lines(snap.get("servers") or []))
    lines.extend(_launched_lines(snap.get("launched") or []))
    return "\n".join(lines)


def worker_note(w: dict[str, Any], now: float) -> str:
    """What is wrong with a worker, in a few words ("" when nothing is)."""
    if w.get("dead"):
        return f"DEAD: its process is gone (last heartbeat {duration(w['heartbeat_age_s'])} ago)"
    if w["silent"]:
        silent = f"SILENT: no heartbeat for {duration(w['heartbeat_age_s'])}"
        return silent + (", longer than its lease: presumed dead" if w.get("presumed_dead") else "")
    if w.get("waiting_for_server"):
        return "WAITING FOR A SERVER: " + servers_down(w, now)
    if w.get("stalled"):
        return f"STALLED: no answer for {duration(w['progress_age_s'])}"
    if w.get("servers_down"):
        return f"{len(w['servers_down'])} of {w['servers']} servers down: " + servers_down(w, now)
    return ""


def outage_lines(snap: dict[str, Any]) -> list[str]:
    """When no worker reaches a server: for how long, each server and why, and that the
    ETA waits for one to answer."""
    totals = snap["totals"]
    if not totals.get("waiting_for_server"):
        return []
    now = snap.get("generated_at", 0.0)
    since = totals.get("unreachable_since")
    long = f" for {duration(max(now - since, 0.0))}" if since else ""
    down = [{**d, "since": None} for d in totals.get("servers_down") or []]
    why = servers_down({"servers_down": down}, now) or "none left"
    return ["", f"servers: none reachable{long}: {why}; no ETA until one answers"]


def servers_down(w: dict[str, Any], now: float) -> str:
    """Each server the worker found down: why, and since when."""
    parts = []
    for d in w.get("servers_down") or []:
        since = f", for {duration(max(now - d['since'], 0.0))}" if d.get("since") else ""
        parts.append(f"{d['server']} ({d.get('reason') or 'down'}{since})")
    return "; ".join(parts)


def _worker_lines(snap: dict[str, Any]) -> list[str]:
    """The workers not stopped: their work, and what is wrong with any (dead, silent,
    waiting for a server); a line above them when the whole run waits for one."""
    now = snap.get("generated_at", 0.0)
    rows = []
    for w in snap["workers"]:
        if w["stopped"]:
            continue
        note = worker_note(w, now)
        rows.append(
            f"  {w['id']}  in flight {w['in_flight']}, done {w['completed']:,},"
            f" last heartbeat {duration(w['heartbeat_age_s'])} ago" + (f"  {note}" if note else "")
        )
    return _section("workers:", rows)


def _batch_lines(batches: dict[str, Any] | None) -> list[str]:
    """A provider's batches: how many in each state, and each live one."""
    if not batches:
        return []
    states = ", ".join(
        f"{state} {b['batches']:,} ({b['requests']:,} requests)"
        for state, b in sorted(batches["by_state"].items())
    )
    rows = [f"  {states}"]
    for b in batches["live"]:
        window = b["window_left_s"]
        left = f", {duration(window)} left of its window" if window is not None else ""
        rows.append(
            f"  {b['provider_id'] or b['key']}: {b['status'] or b['state']}, "
            f"{b['completed']:,}/{b['requests']:,} answered, {b['failed']:,} failed, "
            f"{duration(b['age_s'])} old{left}"
        )
    return _section("batches:", rows)


def _crash_lines(after: dict[str, int] | None) -> list[str]:
    """Items left that were in flight when a worker died (``store.crashes``)."""
    if not after or not after["items"]:
        return []
    lines = [
        f"after a crash: {after['items']:,} items left were in flight when a worker died;"
        " those that died once run at full concurrency"
    ]
    if after["rationed"]:
        lines.append(
            f"  {after['rationed']:,} died twice or more: rationed, a group per worker at a"
            " time, until the item that kills its worker is found (not in the ETA)"
        )
    return lines


def _launched_lines(launched: list[dict[str, Any]]) -> list[str]:
    """The servers the running workers launched: where each stands, and its log."""
    rows = []
    for s in launched:
        pid = f" pid {s['pid']}," if s.get("pid") else ""
        last = f", last exit: {s['last_exit']}" if s.get("last_exit") else ""
        rows.append(f"  {s['name']} {s['url']}  {s['state']},{pid} restarts {s['restarts']}{last}")
        rows.append(f"    log: {s['log']}")
    return _section("launched servers:", rows)


def _limited_lines(limited: list[dict[str, Any]]) -> list[str]:
    """Servers that answer nothing but 429: the run waits on them, and says so."""
    rows = [
        f"RATE LIMITED: {s['server']} has answered only HTTP 429 for "
        f"{duration(s['limited_for_s'])} (latest {duration(s['last_429_age_s'])} ago): "
        "check the key's quota and --rpm/--tpm"
        for s in limited
    ]
    return _section(None, rows)


def _message_lines(entry: dict[str, Any] | None, now: float) -> list[str]:
    """The class's latest messages, newest first, one line each: why items are retried."""
    lines = []
    for m in (entry or {}).get("latest", []):
        text = " ".join((m["message"] or "(no message)").split())
        if len(text) > MESSAGE_WIDTH:
            text = text[: MESSAGE_WIDTH - 3] + "..."
        where = f"{m.get('dataset')}/{m.get('item')}" if m.get("item") else ""
        lines.append(f"    {duration(max(now - m['at'], 0.0)):>6} ago  {where}  {text}")
    return lines


def _server_lines(servers: list[dict[str, Any]]) -> list[str]:
    """The servers' own view (their /metrics), beside the orchestrator's figures above."""
    return _section("servers (their own /metrics):", [_server_line(s) for s in servers])


def _server_line(s: dict[str, Any]) -> str:
    if s.get("error"):
        return f"  {s['server']}  unreachable: {s['error']}"
    if s.get("kind") is None:
        return f"  {s['server']}  no SGLang, vLLM or llama.cpp metrics at {s['url']}"
    usage = s.get("kv_cache_usage")
    speed = s.get("gen_throughput")
    return (
        f"  {s['server']}  ({s['kind']})  running {_num(s.get('running'))},"
        f" queued {_num(s.get('queued'))},"
        f" KV cache {'-' if usage is None else f'{usage:.0%}'},"
        f" generating {'-' if speed is None else f'{speed:,.0f}'} tok/s"
    )


def _section(title: str | None, rows: list[str]) -> list[str]:
    """``rows`` under ``title`` after a blank line; nothing at all when there are none, so
    a quiet run's status stays short."""
    if not rows:
        return []
    return ["", *([title] if title else []), *rows]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
