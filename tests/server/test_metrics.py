"""/metrics text: vLLM's names for what vLLM also measures, help texts, values read from the
engine's stats, histograms observed from finished requests; it parses with prometheus' parser."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from specserve.server.metrics import ServerMetrics
from specserve.speculative.metrics import SpecMetrics


def _stats(spec: SpecMetrics, healthy: bool = True) -> EngineStats:
    return EngineStats(running=2, waiting=1, kv_usage=0.25, kv_blocks_used=4, kv_blocks_total=16,
                       preemptions=3, aborted=1, prefix_cache_hit_tokens=10, prompt_tokens_computed=50,
                       spec=spec, rolling_acceptance=0.5, healthy=healthy)


def _families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def _value(family, **labels) -> float:
    return next(s.value for s in family.samples
                if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created"))


def test_engine_counters_and_gauges_carry_vllm_names_and_values():
    spec = SpecMetrics()
    spec.record(k=3, accepted=2, emitted=3)
    spec.record(k=2, accepted=0, emitted=1)
    spec.record(k=0, accepted=0, emitted=1)
    families = _families(ServerMetrics(lambda: _stats(spec, healthy=False), "tiny"))
    assert _value(families["vllm:spec_decode_num_drafts"]) == 2  # the k = 0 round drafted nothing
    assert _value(families["vllm:spec_decode_num_draft_tokens"]) == 5
    assert _value(families["vllm:spec_decode_num_accepted_tokens"]) == 2
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert [_value(per_pos, position=str(i)) for i in range(3)] == [1, 1, 0]
    assert _value(families["vllm:num_requests_running"]) == 2
    assert _value(families["vllm:num_requests_waiting"]) == 1
    assert _value(families["vllm:kv_cache_usage_perc"]) == 0.25
    assert _value(families["vllm:num_preemptions"]) == 3
    assert _value(families["specserve:requests_aborted"]) == 1
    assert _value(families["specserve:spec_decode_healthy"]) == 0.0
    for family in families.values():
        assert family.documentation, family.name


def test_finished_requests_fill_the_latency_histograms_and_token_counters():
    metrics = ServerMetrics(lambda: _stats(SpecMetrics()), "tiny")
    outs = [CompletionOutput(index=i, text="x", token_ids=[1] * 5, finish_reason="length",
                             num_output_tokens=5, ttft=0.2, decode_time=0.4, e2e_time=0.6)
            for i in range(2)]
    metrics.observe(RequestOutput("r", None, [1, 2, 3], outs, finished=True, queue_time=0.01))
    families = _families(metrics)
    ttft = families["vllm:time_to_first_token_seconds"]
    assert _value(ttft, le="0.25") == 2 and _value(ttft, le="0.1") == 0
    tpot = families["vllm:time_per_output_token_seconds"]
    assert next(s.value for s in tpot.samples if s.name.endswith("_sum")) == pytest.approx(2 * 0.1)
    assert next(s.value for s in families["vllm:request_queue_time_seconds"].samples
                if s.name.endswith("_count")) == 1
    assert _value(families["vllm:prompt_tokens"]) == 3
    assert _value(families["vllm:generation_tokens"]) == 10
    assert _value(families["vllm:request_success"], finished_reason="length") == 2


def test_the_prefill_paths_choice_is_one_gauge_per_part():
    parts = (("qkv", True), ("o", False), ("gate_up", True), ("down", True), ("attention", False))
    stats = _stats(SpecMetrics())
    families = _families(ServerMetrics(
        lambda: EngineStats(**{**stats.__dict__, "prefill_onednn": parts,
                               "prefill_dense_bytes": 123}), "tiny"))
    assert {part: _value(families["specserve:prefill_onednn"], part=part) for part, _ in parts} \
        == {part: float(on) for part, on in parts}
    assert _value(families["specserve:prefill_dense_bytes"]) == 123
