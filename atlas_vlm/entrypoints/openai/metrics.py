"""``/metrics``: Prometheus metrics of the server (``prometheus_client``), named like vLLM's
(``vllm:`` -> ``atlas:``; see vLLM's ``vllm/v1/metrics/loggers.py``).

Gauges are read from ``AsyncLLM.stats`` (the engine snapshot after each step) at scrape
time; counters and histograms are fed by ``AsyncLLM`` from the engine thread through the
``PrometheusStatLogger`` callbacks. Prefix-cache hits and queries are counted in tokens,
at each request's first token (its admission), disk-tier hits included; the disk tier's own
hits and misses are counted in blocks. Each app has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created samples (as vLLM)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _EngineCollector:
    """Engine gauges (and the preemption counter) from the latest snapshot."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        used = s.num_blocks - s.num_free_blocks
        rows = [
            ("atlas:num_requests_running", "Requests in the running batch.", s.num_running),
            ("atlas:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("atlas:kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (0..1).",
             used / s.num_blocks if s.num_blocks else 0.0),
            ("atlas:num_kv_blocks_total", "KV-cache blocks in total.", s.num_blocks),
            ("atlas:num_kv_blocks_free", "KV-cache blocks free (cached-but-evictable included).", s.num_free_blocks),
            ("atlas:num_kv_blocks_used", "KV-cache blocks held by requests.", used),
            ("atlas:kv_cache_disk_bytes", "Bytes of KV blocks stored in the disk tier (kv_cache_dir).",
             s.disk_kv_bytes),
        ]
        for name, doc, value in rows:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        counters = [
            ("atlas:num_preemptions", "Requests preempted (recompute) since start.", s.num_preemptions),
            # speculative decoding (vLLM's vllm:spec_decode_* counters); 0 with speculation off
            ("atlas:spec_decode_num_drafts", "Decode steps of a request that carried drafts.",
             s.spec_decode_num_drafts),
            ("atlas:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_decode_num_draft_tokens),
            ("atlas:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens),
            ("atlas:kv_cache_disk_hits", "KV blocks loaded from the disk tier (kv_cache_dir).", s.disk_kv_hits),
            ("atlas:state_snapshot_queries", "Admissions of a hybrid model's request (Qwen3.5) that looked up a "
             "recurrent-state snapshot (prefix caching).", s.state_snapshot_queries),
            ("atlas:state_snapshot_hits", "Of those, admissions resumed from a snapshot (a prefix-cache hit).",
             s.state_snapshot_hits),
            ("atlas:kv_cache_disk_misses", "Disk-tier lookups (one per admission that reached it) that found "
             "no valid block.", s.disk_kv_misses),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class PrometheusStatLogger:
    """Counters and histograms fed by ``AsyncLLM`` (see its ``stat_logger`` argument)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("atlas:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("atlas:generation_tokens", "Tokens generated.", registry=r)
        self.prefix_queries = Counter("atlas:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("atlas:prefix_cache_hits", "Prompt tokens served by the prefix cache.", registry=r)
        self.success = Counter("atlas:request_success", "Finished requests by finish reason.", ["finished_reason"],
                               registry=r)
        self.ttft = Histogram("atlas:time_to_first_token_seconds", "Time to first token (seconds, from arrival).",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("atlas:inter_token_latency_seconds", "Time between generated tokens (seconds).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("atlas:num_requests_per_step", "Requests in one engine step (batch size).",
                               buckets=BATCH_BUCKETS, registry=r)

    def attach(self, engine_front) -> None:
        """Register the gauges of ``engine_front`` (an ``AsyncLLM``)."""
        self.registry.register(_EngineCollector(engine_front))

    # ---- AsyncLLM callbacks (engine thread) ---------------------------------------------------
    def on_step(self, stats, batch_size: int) -> None:
        self.batch.observe(batch_size)

    def on_first_token(self, seconds: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_queries.inc(num_prompt_tokens)
        self.prefix_hits.inc(num_cached_tokens)

    def on_new_tokens(self, n: int, seconds_per_token: float | None) -> None:
        self.generation_tokens.inc(n)
        if seconds_per_token is not None:
            for _ in range(n):
                self.itl.observe(seconds_per_token)

    def on_finish(self, output) -> None:
        self.success.labels(finished_reason=output.finish_reason or "unknown").inc()
