"""Prometheus metrics with vLLM's meanings under a ``deepinfer:`` prefix.

Each server owns its registry (no module globals), so several servers (or tests)
in one process do not share counters.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ("model_name",)
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"deepinfer:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"deepinfer:{name}", doc, labels, registry=r).labels(model_name)

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"deepinfer:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch (sequences; n > 1 counts each choice).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV pages in use, 0 to 1.")
        self.kv_pages_used = gauge("kv_pages_used", "KV pages held by requests (all pools).")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recompute) so far.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens the prefix cache let requests skip.")
        self.kv_pages_cached = gauge("kv_pages_cached", "KV pages only the prefix cache holds (evictable).")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative rows verified (one per request per step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = Counter(
            "deepinfer:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            ("model_name", "position"), registry=r,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens sent to clients.")
        self._success = Counter(
            "deepinfer:request_success", "Finished requests by finish reason.", ("model_name", "finished_reason"), registry=r
        )
        self.model_name = model_name
        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first generated token.")
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between successive generated tokens.")
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to the last token.")
        self.request_queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.step_host_time = hist("step_host_seconds", "Host time per engine step (schedule, pack, dispatch, process).", _STEP_BUCKETS)
        self.step_wait_time = hist("step_wait_seconds", "Per step, time the host waited for device results.", _STEP_BUCKETS)
        self.num_steps = counter("engine_steps", "Engine steps run.")
        self.grammar_compile_time = hist("grammar_compile_seconds", "Compile time of structured-output grammars "
                                         "(cache misses).", _STEP_BUCKETS + (5.0, 10.0, 30.0))
        self.grammar_cache_hits = counter("grammar_cache_hits", "Structured-output requests whose grammar was cached.")
        self.mask_fill_time = hist("grammar_mask_fill_seconds", "Per step with constrained rows, host time filling "
                                   "their token bitmasks.", _STEP_BUCKETS)
        self.device_busy_fraction = gauge("device_busy_fraction", "Device busy time / wall time over the last 256 steps.")
        self.step_device_time = gauge("step_device_seconds_mean", "Mean device time per step over the last 256 steps.")

    def accepted_at(self, position: int):
        return self._accepted_per_pos.labels(self.model_name, str(position))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
