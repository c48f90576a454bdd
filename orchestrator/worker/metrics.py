"""Prometheus metrics of one worker, served on ``run --metrics-port`` with a health check.

A worker fills them as it goes (outcomes as they are written, leases as they are
renewed) and refreshes the queue-wide counts by state every few seconds, so a Prometheus
scraping every worker sees both what each one does and where the whole run stands. Each
worker has its own registry: several workers in one process (tests) do not mix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Seconds: a short answer to a 16k-token reasoning answer on a busy server.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class WorkerMetrics:
    """The worker's metrics, each named ``orchestrator_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.items = Gauge(
            "orchestrator_items",
            "Items of the whole queue by dataset and state (refreshed every few seconds).",
            ["dataset", "state"],
            registry=r,
        )
        self.outcomes = Counter(
            "orchestrator_outcomes",
            "Outcomes this worker wrote: complete, advance (a turn), retry, release, fail.",
            ["dataset", "outcome", "error_class"],
            registry=r,
        )
        self.tokens = Counter(
            "orchestrator_tokens",
            "Tokens of the answers this worker committed: prompt, completion, and cached"
            " (prompt tokens the server took from its prefix cache).",
            ["dataset", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "orchestrator_request_latency_seconds",
            "Time from sending a request to its full answer, for answers committed.",
            ["dataset"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "orchestrator_in_flight_requests", "Requests running now.", registry=r
        )
        self.prefetched = Gauge(
            "orchestrator_prefetched_items", "Items claimed ahead, waiting for a slot.", registry=r
        )
        self.renewals = Counter(
            "orchestrator_lease_renewals",
            "Leases renewed (kept) or found taken over (lost).",
            ["result"],
            registry=r,
        )
        self.server_up = Gauge(
            "orchestrator_server_up", "1 while the server answers /health.", ["server"], registry=r
        )
        self.server_concurrency = Gauge(
            "orchestrator_server_concurrency",
            "Requests this worker sends the server at most (adapted under --concurrency auto).",
            ["server"],
            registry=r,
        )
        self.started = Gauge(
            "orchestrator_worker_start_time_seconds", "When this worker started.", registry=r
        )
        self.started.set(time.time())
        self.wasted = _Wasted()
        r.register(self.wasted)

    def settled(
        self,
        dataset: str,
        outcome: str,
        error_class: str | None,
        usage: dict[str, Any] | None,
        latency: float | None,
    ) -> None:
        """One outcome written (accepted by the store)."""
        self.outcomes.labels(dataset, outcome, error_class or "").inc()
        if outcome in ("complete", "advance"):
            for kind in ("prompt", "completion", "cached"):
                value = (usage or {}).get(f"{kind}_tokens")
                if isinstance(value, int):
                    self.tokens.labels(dataset, kind).inc(value)
            if latency is not None:
                self.latency.labels(dataset).observe(latency)

    def set_items(self, counts: dict[tuple[str, str], int]) -> None:
        self.items.clear()
        for (dataset, state), n in counts.items():
            self.items.labels(dataset, state).set(n)

    def set_wasted(self, wasted: dict[tuple[str, str], tuple[int, int, int]]) -> None:
        """The queue-wide work thrown away, (requests, tokens, unknown) by (dataset, cause)."""
        self.wasted.figures = dict(wasted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Wasted:
    """Tokens and requests thrown away in the whole queue, by dataset and cause, as the
    store counts them (``store.waste``): counters read from the database with the items
    gauge, so every worker shows the run's figures, not only its own."""

    def __init__(self) -> None:
        self.figures: dict[tuple[str, str], tuple[int, int, int]] = {}

    def collect(self) -> Any:
        labels = ["dataset", "cause"]
        tokens = CounterMetricFamily(
            "orchestrator_wasted_tokens",
            "Completion tokens generated and thrown away (killed, stopped, fenced, truncated,"
            " bad_response, requeued), whole queue.",
            labels=labels,
        )
        requests = CounterMetricFamily(
            "orchestrator_wasted_requests",
            "Requests whose work was thrown away, whole queue (those of unknown tokens too).",
            labels=labels,
        )
        unknown = CounterMetricFamily(
            "orchestrator_wasted_unknown_requests",
            "Requests thrown away whose tokens nobody counted (a worker killed mid-request).",
            labels=labels,
        )
        for (dataset, cause), (n, t, u) in sorted(self.figures.items()):
            requests.add_metric([dataset, cause], n)
            tokens.add_metric([dataset, cause], t)
            unknown.add_metric([dataset, cause], u)
        yield from (tokens, requests, unknown)


def metrics_app(metrics: WorkerMetrics, health: Callable[[], dict[str, Any]]) -> web.Application:
    """``/metrics`` (Prometheus text format) and ``/health`` (JSON, 200 while running)."""

    async def serve_metrics(_request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def serve_health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **health()})

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/health", serve_health)
    return app


async def serve_metrics(
    metrics: WorkerMetrics, health: Callable[[], dict[str, Any]], host: str, port: int
) -> tuple[web.AppRunner, int]:
    """Start the metrics server; returns the runner (to clean up) and the bound port."""
    runner = web.AppRunner(metrics_app(metrics, health), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
