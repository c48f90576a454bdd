"""The inference server's own view, from its Prometheus ``/metrics``: SGLang, vLLM or
llama.cpp.

``status --server URL`` shows it beside the orchestrator's figures: how many requests the
server runs and queues, how full its KV cache is, and how fast it generates. A worker's
concurrency that leaves the server's queue empty and its cache half full is too low; a
long queue with a full cache means the server is the limit. :func:`scrape` is
synchronous on purpose: ``status`` stays a quick read with no event loop. The tuner
(``orchestrator.inference.pool``) reads the same figures through :func:`tuning_view`. The
requests themselves are ``orchestrator.inference.probes``'s.

llama.cpp's ``llama-server --metrics`` has no KV-cache gauge (older builds had
``llamacpp:kv_cache_usage_ratio``) and no aggregate throughput gauge: its
``llamacpp:predicted_tokens_seconds`` is the speed of one sequence's decode steps, not
the server's tokens/s, so generation speed comes from ``llamacpp:tokens_predicted_total``
between two scrapes, as for vLLM. ``requests_deferred`` are requests waiting for a free
slot (``-np``): its queue.
"""

from __future__ import annotations

import time
import urllib.error
from typing import Any

from orchestrator._util.urls import split
from orchestrator.inference.client import base_url
from orchestrator.inference.probes import read_metrics

# Our name -> the names SGLang, vLLM (newer, older) and llama.cpp give it.
_GAUGES: dict[str, tuple[str, ...]] = {
    "running": (
        "sglang:num_running_reqs",
        "vllm:num_requests_running",
        "llamacpp:requests_processing",
    ),
    "queued": ("sglang:num_queue_reqs", "vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "kv_cache_usage": (
        "sglang:token_usage",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "llamacpp:kv_cache_usage_ratio",  # older llama.cpp builds only
    ),
    "gen_throughput": ("sglang:gen_throughput",),
}
_COUNTERS: dict[str, tuple[str, ...]] = {
    "generation_tokens_total": (
        "sglang:generation_tokens_total",
        "vllm:generation_tokens_total",
        "llamacpp:tokens_predicted_total",
    ),
    "prompt_tokens_total": (
        "sglang:prompt_tokens_total",
        "vllm:prompt_tokens_total",
        "llamacpp:prompt_tokens_total",  # excludes tokens reused from its prompt cache
    ),
    "preemptions_total": (
        "sglang:num_retracted_requests_total",
        "vllm:num_preemptions_total",
        "vllm:num_preemptions",  # as older vLLM names it
    ),
}


def parse(text: str) -> dict[str, float]:
    """Sum each known metric over its label sets (one entry per model or engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def view(values: dict[str, float]) -> dict[str, Any]:
    """The server's figures under our names; ``kind`` says whose names they were."""
    found: dict[str, Any] = {"kind": None}
    for ours, names in {**_GAUGES, **_COUNTERS}.items():
        for name in names:
            if name in values:
                found[ours] = values[name]
                found["kind"] = found["kind"] or name.split(":", 1)[0]
                break
        else:
            found[ours] = None
    return found


def scrape(server: str, *, timeout: float = 3.0, interval: float = 1.0) -> dict[str, Any]:
    """Two scrapes ``interval`` apart: gauges from the second, generation tok/s from the
    counters' difference when the server has no throughput gauge (vLLM)."""
    server, auth = split(server)  # credentials are sent, never shown
    header = auth.encode() if auth is not None else None
    url = base_url(server) + "/metrics"
    # The same keys whatever happens: a stable shape for status --json.
    out: dict[str, Any] = {"server": server, "url": url, "error": None, **view({})}
    try:
        first = view(parse(read_metrics(url, timeout, header)))
        started = time.monotonic()
        if first.get("gen_throughput") is None and first.get("generation_tokens_total") is not None:
            time.sleep(interval)
            second = view(parse(read_metrics(url, timeout, header)))
            elapsed = time.monotonic() - started
            delta = second["generation_tokens_total"] - first["generation_tokens_total"]
            second["gen_throughput"] = max(delta, 0.0) / elapsed if elapsed > 0 else None
            first = second
    except (OSError, urllib.error.URLError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(first)
    return out


def tuning_view(text: str) -> dict[str, float | None] | None:
    """What the tuner reads of a ``/metrics`` text (``autoconcurrency.Sample``'s names);
    None when it holds none of the names we know, or is not Prometheus text."""
    try:
        found = view(parse(text))
    except ValueError:
        return None
    if found["kind"] is None:
        return None
    return {
        "queued": found["queued"],
        "running": found["running"],
        "kv_usage": found["kv_cache_usage"],
        "retractions": found["preemptions_total"],
    }
