"""`specserve.bench.soak`, briefly, against a real server on a tiny model with small bounds
(2 sequence slots, 6 waiting places: room for the stream nobody reads between the bursts;
2 s timeouts, a 64 KiB send buffer): well-behaved
streaming clients mixed with malformed, oversized and too deeply nested bodies, disconnects,
a slow reader, streams never read (one at a time and in floods), trickled and endless bodies,
half-open connections and bursts beyond capacity, agents on /v1/responses and /v1/messages and
tool-call-shaped output lose nothing, get no 5xx, reach 429, leave no connection held and no KV
block in use, /health and fresh clients are answered, and the server's memory (its KV pools
aside) stays flat."""

from __future__ import annotations

from collections import Counter

import pytest

import httpx

from specserve.bench import soak, soak_agents
from tests.server.conftest import KEY, NAME, start_server

TIMEOUT_S = 2


@pytest.fixture(scope="module")
def bounded(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("soak") / "server.log",
                       "--max-num-seqs", "2", "--max-waiting", "6", "--write-timeout",
                       str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--header-timeout",
                       str(TIMEOUT_S), "--send-buffer-bytes", str(64 << 10))
    yield srv
    srv.stop()


def test_a_short_soak_with_hostile_clients_serves_everyone_and_stays_flat(bounded):
    figures = soak.run(bounded.base_url, KEY, clients=4, duration=12, max_tokens=16,
                       pid=bounded.process.pid, warmup=4, stall_s=TIMEOUT_S + 3,
                       stall_tokens=600, burst=16, flood=2, flood_tokens=600, fresh_every=2,
                       agents=1, storm_repeats=10)
    outcomes = figures["outcomes"]
    assert figures["served"] > 0 and figures["answers_5xx"] == 0 and figures["lost"] == 0, figures
    assert figures["held"] == 0 and figures["answers_429"] > 0, outcomes
    assert figures["clients_unended"] == 0, figures
    assert figures["kv_blocks_in_use_after"] == 0
    for kind, expected in (("malformed", {"4xx"}), ("oversized", {"4xx"}), ("deep", {"4xx"}),
                           ("trickled", {"timed_out"}), ("half_open", {"closed"}),
                           ("stalled", {"dropped", "completed", "refused"}),
                           ("flood", {"dropped", "completed", "refused", "timed_out"}),
                           ("health", {"ok"}), ("fresh", {"ok", "429"}),
                           ("responses", {"ok", "429"}), ("messages", {"ok", "429"}),
                           ("storm", {"ok", "429"})):
        seen = {k.split(":")[1] for k in outcomes if k.startswith(kind + ":")}
        assert seen and seen <= expected, (kind, outcomes)
    stalled = {k: n for k, n in outcomes.items() if k.startswith("stalled:")}
    assert "stalled:dropped" in stalled, stalled  # the write timeout closed a stream nobody read
    assert figures["latency_p99_s"] is not None and figures["health_worst_s"] is not None
    assert figures["fresh_worst_s"] is not None
    assert abs(figures["rss_change_excluding_kv"]) < 0.1, figures


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_call_storm_comes_back_as_its_text_and_the_agent_wires_end_their_streams(
        bounded, stream):
    """The soak's new clients on their own: the forced `` ```{ `` output is content, whole,
    with no call (streamed and not); each agent wire's stream ends with its last event."""
    with httpx.Client(base_url=bounded.base_url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as http:
        assert soak_agents.tool_storm(http, NAME, 12, stream) == "ok"
        body = soak_agents.storm_body(NAME, 12, stream=False)
        texts = [c["message"]["content"] for c in http.post("/v1/chat/completions",
                                                             json=body).json()["choices"]]
        assert texts == ["```{" * 12] * 2, texts
        assert soak_agents.tool_storm(http, NAME, 13, stream) == "ok"  # not any length
        for wire in soak_agents.WIRES:
            assert soak_agents.agent_request(http, wire, NAME, "hi", 8) == "ok", wire


def test_the_summary_sorts_outcomes_into_served_errors_and_losses():
    outcomes = Counter({"stream:ok": 5, "slow:ok": 1, "stream:5xx": 2, "malformed:4xx": 3,
                        "disconnect:left": 4, "stream:lost": 1, "burst:429": 6,
                        "stalled:refused": 1, "half_open:held": 2, "burst:ok": 1})
    figures = soak.summary(outcomes, 16, 600, 1000, 1040, 0)
    assert (figures["served"], figures["answers_5xx"], figures["answers_4xx"], figures["lost"],
            figures["left_early"], figures["rss_change"], figures["answers_429"],
            figures["held"]) == (7, 2, 3, 1, 4, 0.04, 7, 2)
    # 1000 → 1040 KiB resident, of which the KV pools' touched blocks 0 → 40 KiB: flat
    touched = soak.summary(outcomes, 16, 600, 1000, 1040, 0, 0.0, 40 * 1024.0)
    assert touched["rss_change"] == 0.04 and touched["rss_change_excluding_kv"] == 0.0
