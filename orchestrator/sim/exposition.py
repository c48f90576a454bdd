"""The simulated server's ``/metrics`` text, under SGLang's names or vLLM's.

The same figures either way; only the names differ, as between the two servers: what a
client reads from ``/metrics`` must work against both (``orchestrator.inference.server_metrics``).
vLLM publishes no throughput gauge and says preemptions where SGLang says retractions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.sim.runtime import LATENCY_BUCKETS, Stats

__all__ = ["Figures", "metrics_text"]


@dataclass(frozen=True, slots=True)
class Figures:
    """What the server publishes, whatever the names: the engine's gauges now, and the
    server's counters (requests, tokens, the latency histogram) since it started."""

    running: int
    queued: int
    usage: float
    throughput: float
    retracted: int
    counts: Stats


class _Writer:
    """Prometheus text, one family at a time, every sample with the same labels."""

    def __init__(self, labels: str) -> None:
        self.labels = labels
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for sample_name, value in samples:
            self.lines.append(f"{sample_name} {float(value)!r}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.metric(name, "gauge", help_text, [(f"{name}{{{self.labels}}}", value)])

    def counter(self, name: str, help_text: str, value: float) -> None:
        self.metric(name, "counter", help_text, [(f"{name}_total{{{self.labels}}}", value)])

    def histogram(self, name: str, help_text: str, counts: Stats) -> None:
        latency = zip(LATENCY_BUCKETS, counts.latency_buckets, strict=True)
        samples = [(f'{name}_bucket{{{self.labels},le="{b!r}"}}', n) for b, n in latency]
        samples.append((f'{name}_bucket{{{self.labels},le="+Inf"}}', counts.completed))
        samples.append((f"{name}_sum{{{self.labels}}}", counts.latency_sum))
        samples.append((f"{name}_count{{{self.labels}}}", counts.completed))
        self.metric(name, "histogram", help_text, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _sglang(w: _Writer, f: Figures) -> None:
    w.gauge("sglang:num_running_reqs", "The number of running requests.", f.running)
    w.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", f.queued)
    w.gauge("sglang:token_usage", "The token usage.", f.usage)
    w.gauge("sglang:gen_throughput", "The generation throughput (token/s).", f.throughput)
    w.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", 0)
    w.counter("sglang:prompt_tokens", "Number of prefill tokens processed.", f.counts.prompt_tokens)
    w.counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        f.counts.generation_tokens,
    )
    w.counter("sglang:num_requests", "Number of requests processed.", f.counts.completed)
    w.counter("sglang:num_aborted_requests", "Number of requests aborted.", f.counts.aborted)
    w.counter(
        "sglang:num_retracted_requests",
        "Number of requests retracted (the KV cache overflowed).",
        f.retracted,
    )
    w.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        f.counts,
    )


def _vllm(w: _Writer, f: Figures) -> None:
    w.gauge("vllm:num_requests_running", "Number of requests in model execution.", f.running)
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting.", f.queued)
    w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", f.usage)
    w.counter("vllm:num_preemptions", "Cumulative number of preemptions.", f.retracted)
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", f.counts.prompt_tokens)
    w.counter("vllm:generation_tokens", "Number of generation tokens.", f.counts.generation_tokens)
    w.counter(
        "vllm:request_success", "Count of successfully processed requests.", f.counts.completed
    )
    w.histogram(
        "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", f.counts
    )


def metrics_text(names: str, model: str, figures: Figures) -> str:
    """The ``/metrics`` body under ``names`` ("sglang" or "vllm") for a server of
    ``model``."""
    label = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    labels = f'model_name="{label}"' + (',engine="0"' if names == "vllm" else "")
    writer = _Writer(labels)
    (_vllm if names == "vllm" else _sglang)(writer, figures)
    return writer.text()
