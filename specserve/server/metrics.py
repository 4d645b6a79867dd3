"""Prometheus metrics for `/metrics`.

Names: where a metric means what vLLM's does, it has vLLM's name (`vllm:` prefix), so
dashboards built for vLLM read it unchanged: the speculative counters
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos` (label `position`), the latency histograms
`vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`, the gauges
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, and the
counters `vllm:num_preemptions`, `vllm:prompt_tokens`, `vllm:generation_tokens`,
`vllm:request_success`. Ours carry `specserve:` (acceptance health, aborted requests,
sequences held for their readers, ...).
Counters are exposed with Prometheus' `_total` suffix.

Engine-wide figures are read from `EngineStats` when scraped (one source of truth, no copies);
per-request latencies are observed by the server when a request finishes.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specserve.engine.outputs import EngineStats, RequestOutput
from specserve.speculative.metrics import HEALTHY_ACCEPTANCE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector:
    """Reads the engine's counters and gauges at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats, self._model = stats, model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        spec = s.spec
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield self._gauge("specserve:num_sequences_held", "Sequences held because their "
                          "readers are behind (counted in running or waiting: not scheduled "
                          "until their clients read).", s.held)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache budget in use "
                          "(1 = 100%).", s.kv_usage)
        yield self._gauge("specserve:kv_cache_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield self._gauge("specserve:kv_cache_blocks_total", "KV cache blocks in the budget.",
                          s.kv_blocks_total)
        yield self._gauge("specserve:kv_cache_touched_bytes", "Bytes of the KV pools whose "
                          "blocks were ever taken (resident: the pools are mapped lazily; at "
                          "most the budget).", s.kv_touched_bytes)
        yield self._counter("vllm:num_preemptions", "Requests preempted (their KV cache freed, "
                            "to be recomputed) because the KV budget was full.", s.preemptions)
        yield self._counter("specserve:requests_aborted", "Requests aborted: the client went away, "
                            "or the server shut down before they finished.", s.aborted)
        yield self._counter("specserve:prefix_cache_hit_tokens", "Prompt tokens served from the "
                            "prefix cache instead of being computed.", s.prefix_cache_hit_tokens)
        yield self._counter("specserve:prompt_tokens_computed", "Prompt tokens run through the "
                            "target model (prefill).", s.prompt_tokens_computed)
        path = GaugeMetricFamily("specserve:prefill_onednn", "1 where prompt rows run this part "
                                 "of a pass (a projection, or attention) on oneDNN, 0 on the "
                                 "int4 kernels (chosen at start-up, --prefill-path).",
                                 labels=["model_name", "part"])
        for part, onednn in s.prefill_onednn:
            path.add_metric([self._model, part], float(onednn))
        yield path
        yield self._gauge("specserve:prefill_dense_bytes", "Bytes of the bf16 weights the "
                          "prefill path keeps beside the int4 ones.", s.prefill_dense_bytes)
        drafts = spec.drafted_per_position[0] if spec.drafted_per_position else 0
        yield self._counter("vllm:spec_decode_num_drafts", "Speculative rounds that drafted at "
                            "least one token.", drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.drafted)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by the "
                            "target.", spec.accepted)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0 = first).",
                                      labels=["model_name", "position"])
        for i, n in enumerate(spec.accepted_per_position):
            per_pos.add_metric([self._model, str(i)], n)
        yield per_pos
        yield self._counter("specserve:spec_decode_rounds", "Decoding rounds (plain decoding steps "
                            "count as rounds with k = 0).", spec.rounds)
        yield self._counter("specserve:spec_decode_emitted_tokens", "Tokens emitted by decoding rounds "
                            "(accepted + recovered or bonus).", spec.emitted)
        yield self._counter("specserve:spec_decode_draft_seconds", "Time spent drafting.", spec.draft_time)
        yield self._counter("specserve:spec_decode_verify_seconds", "Time spent in target passes "
                            "(verify and plain decode).", spec.verify_time)
        rolling = s.rolling_acceptance
        yield self._gauge("specserve:spec_decode_rolling_acceptance", "Acceptance rate over the "
                          "recent window of rounds (NaN before any draft).",
                          float("nan") if rolling is None else rolling)
        yield self._gauge("specserve:spec_decode_healthy", f"1 while the rolling acceptance is >= "
                          f"{HEALTHY_ACCEPTANCE} (or nothing was drafted yet), else 0.", float(s.healthy))


class ServerMetrics:
    """The registry behind `/metrics`: engine figures plus per-request histograms."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]
        reg.register(EngineCollector(stats, model_name))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token: from "
                              "arrival to the first generated token.", labels, registry=reg,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per completion.", labels, registry=reg,
                              buckets=TPOT_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency: from "
                             "arrival to the last token.", labels, registry=reg, buckets=E2E_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival until first "
                               "scheduled.", labels, registry=reg, buckets=TTFT_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for "
                                         "finished requests.", labels, registry=reg)
        self.success = Counter("vllm:request_success", "Finished completions by finish reason.",
                               labels + ["finished_reason"], registry=reg)
        self.http_errors = Counter("specserve:http_errors", "Requests refused with an error "
                                   "status.", labels + ["status"], registry=reg)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request's latencies and token counts."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(output.num_prompt_tokens)
        if output.queue_time is not None:
            self.queue.labels(m).observe(output.queue_time)
        for c in output.outputs:
            self.generation_tokens.labels(m).inc(c.num_output_tokens)
            self.success.labels(m, c.finish_reason or "abort").inc()
            if c.ttft is not None and c.num_output_tokens:
                self.ttft.labels(m).observe(c.ttft)
            if c.e2e_time is not None:
                self.e2e.labels(m).observe(c.e2e_time)
            if c.decode_time is not None and c.num_output_tokens > 1:
                self.tpot.labels(m).observe(c.decode_time / (c.num_output_tokens - 1))

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
