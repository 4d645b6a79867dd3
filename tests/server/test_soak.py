"""`specserve.server.soak`, briefly, against a real server on a tiny model: streaming clients
mixed with malformed and oversized bodies, disconnects and a slow reader lose nothing, get no
5xx, and leave no KV block in use."""

from __future__ import annotations

from collections import Counter

from specserve.server import soak
from tests.server.conftest import KEY


def test_a_short_soak_serves_everyone_with_no_5xx_no_loss_and_frees_the_kv_cache(server):
    figures = soak.run(server.base_url, KEY, clients=4, duration=6, max_tokens=16,
                       pid=server.process.pid)
    assert figures["served"] > 0 and figures["answers_5xx"] == 0 and figures["lost"] == 0, figures
    assert figures["kv_blocks_in_use_after"] == 0
    assert figures["rss_start_kib"] > 0 and figures["rss_end_kib"] > 0
    assert 0 < figures["kv_touched_mib_end"] and figures["rss_change_excluding_kv"] is not None
    bad = {k: v for k, v in figures["outcomes"].items() if k.startswith(("malformed", "oversized"))}
    assert bad and all(k.endswith(":4xx") for k in bad), figures["outcomes"]


def test_the_summary_sorts_outcomes_into_served_errors_and_losses():
    outcomes = Counter({"stream:ok": 5, "slow:ok": 1, "stream:5xx": 2, "malformed:4xx": 3,
                        "disconnect:left": 4, "stream:lost": 1})
    figures = soak.summary(outcomes, 16, 600, 1000, 1040, 0)
    assert (figures["served"], figures["answers_5xx"], figures["answers_4xx"], figures["lost"],
            figures["left_early"], figures["rss_change"]) == (6, 2, 3, 1, 4, 0.04)
    # 1000 → 1040 KiB resident, of which the KV pools' touched blocks 0 → 40 KiB: flat
    touched = soak.summary(outcomes, 16, 600, 1000, 1040, 0, 0.0, 40 * 1024.0)
    assert touched["rss_change"] == 0.04 and touched["rss_change_excluding_kv"] == 0.0
