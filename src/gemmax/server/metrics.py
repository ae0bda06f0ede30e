"""Prometheus metrics of one server (its own CollectorRegistry, so several apps can live in one
process, as they do in the tests). Names live under `gemmax:`.

Request-side metrics are observed by the server as requests finish; engine-side gauges (running,
waiting, KV slots, weight bytes, the precision in use) and the prefix cache's counters are read from
the engine at scrape time by a custom collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


# The prefix cache's figures (EngineStats.prefix_cache): (metric, key, help); counters, then gauges.
PREFIX_COUNTERS = (
    ("gemmax:prefix_cache_hits", "hits", "requests that found a cached prefix of their prompt"),
    ("gemmax:prefix_cache_misses", "misses", "requests that found none"),
    ("gemmax:prefix_cache_cached_tokens", "cached_tokens", "prompt tokens copied from the prefix cache, not prefilled"),
    ("gemmax:prefix_cache_queried_tokens", "queried_tokens", "prompt tokens of the requests that looked"),
    ("gemmax:prefix_cache_evicted_bytes", "evicted_bytes", "bytes of cached blocks evicted (LRU) to make room"),
)
PREFIX_GAUGES = (
    ("gemmax:prefix_cache_used_bytes", "used_bytes", "bytes of cached blocks held now"),
    ("gemmax:prefix_cache_budget_bytes", "budget_bytes", "the prefix cache's byte budget"),
)


class EngineCollector:
    """Gauges read from the engine at scrape time; `get_engine()` is None while the model loads."""

    def __init__(self, get_engine: Callable[[], Any]):
        self._get_engine = get_engine

    def collect(self):
        engine = self._get_engine()
        ready = GaugeMetricFamily("gemmax:ready", "1 once the engine is warm and serving")
        ready.add_metric([], float(bool(engine is not None and engine.ready)))
        yield ready
        if engine is None:
            return
        stats = engine.stats()
        info = engine.info
        for name, doc, value in (
            ("gemmax:num_requests_running", "requests holding a decode slot", stats.running),
            ("gemmax:num_requests_waiting", "requests queued for a slot", stats.waiting),
            ("gemmax:kv_slots_in_use", "KV-cache slots in use", stats.slots_in_use),
            ("gemmax:kv_slots_total", "KV-cache slots", stats.slots_total),
            ("gemmax:max_model_len", "longest prompt + completion, tokens", engine.max_model_len),
            ("gemmax:weight_bytes", "bytes of model weights held on the device", info.get("weight_bytes", 0)),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family
        if stats.prefix_cache is not None:
            for name, key, doc in PREFIX_COUNTERS:
                yield CounterMetricFamily(name, doc, value=float(stats.prefix_cache[key]))
            for name, key, doc in PREFIX_GAUGES:
                yield GaugeMetricFamily(name, doc, value=float(stats.prefix_cache[key]))
        precision = info.get("precision") or {}
        policy = info.get("policy") or {}
        labels = {"model": str(info.get("model", "")), "platform": str(policy.get("platform", "")),
                  "device_kind": str(policy.get("device_kind", "")),
                  **{k: str(precision.get(k, "")) for k in ("weights", "activations", "kv_cache")}}
        family = GaugeMetricFamily("gemmax:model_info", "model, device and dtypes actually in use",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        yield family


class ServerMetrics:
    def __init__(self, get_engine: Callable[[], Any]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("gemmax:time_to_first_token_seconds", "request arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gemmax:inter_token_latency_seconds", "time between consecutive generated tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gemmax:e2e_request_latency_seconds", "request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("gemmax:request_queue_time_seconds", "time waiting for a decode slot",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("gemmax:requests", "finished API requests by endpoint and HTTP status "
                                "(499: client went away)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("gemmax:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("gemmax:generation_tokens", "generated tokens", registry=r)
        self.decode_tokens = Counter("gemmax:decode_tokens", "tokens generated after the first one", registry=r)
        self.decode_seconds = Counter("gemmax:decode_seconds", "seconds from first to last token, summed "
                                      "over requests (decode_tokens / decode_seconds: mean decode speed)", registry=r)
        self.last_decode_tps = Gauge("gemmax:last_request_decode_tokens_per_second",
                                     "decode speed of the most recently finished request", registry=r)
        self.degenerate = Counter("gemmax:degenerate_responses", "choices whose output the degeneracy check "
                                  "flagged", registry=r)
        self.uncompiled = Counter("gemmax:uncompiled_shape_requests", "requests a step of which compiled or "
                                  "loaded its program (a shape not warmed up)", registry=r)
        self.spec_accepted = Histogram("gemmax:spec_accepted_per_step", "proposals accepted per speculative "
                                       "verify step (each step also yields the target's own next token)",
                                       buckets=tuple(range(9)), registry=r)
        self.spec_proposed_tokens = Counter("gemmax:spec_proposed_tokens", "tokens proposed to speculative "
                                            "verify steps", registry=r)
        self.spec_accepted_tokens = Counter("gemmax:spec_accepted_tokens", "proposed tokens accepted",
                                            registry=r)
        r.register(EngineCollector(get_engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
