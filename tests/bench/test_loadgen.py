"""The load generator's summary: only successful requests count, percentiles, tokens per second."""

from specserve.bench.loadgen import Record, summary


def test_summary_counts_errors_apart_and_takes_percentiles_of_successes():
    records = [Record(ttft=0.1 * i, latency=1.0 * i, tokens=10) for i in range(1, 11)]
    records.append(Record(ttft=None, latency=0.5, tokens=0, error="HTTP 500"))
    s = summary(records, wall=10.0, concurrency=4)
    assert (s["requests"], s["errors"], s["first_errors"]) == (10, 1, ["HTTP 500"])
    assert s["latency_p50_s"] == 5.5 and s["ttft_p50_s"] == 0.55
    assert s["tokens_per_s"] == 10.0 and s["generated_tokens"] == 100
