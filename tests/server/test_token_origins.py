"""The per-token origin extension (`return_token_origins`): for greedy requests with a draft that
the target accepts only part of the time, the origins add up exactly to the request's own
`speculative_stats`, streamed and not; clients that do not ask get standard OpenAI bodies."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from tests.server.sse_client import parse
from tests.server.conftest import NAME
from tests.server.draft_pair import rounds_of, start_pair_server

MAX_TOKENS = 48
MESSAGES = [{"role": "user", "content": "count the cats"}]
SETTINGS = {
    "cost_aware": {"num_speculative_tokens": -1},
    "fixed_k1": {"num_speculative_tokens": 1},
    "fixed_k3": {"num_speculative_tokens": 3},
    "off": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_pair_server(tmp_path_factory.mktemp("origins"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def ask(http, stream: bool, **extra) -> httpx.Response:
    body = {"model": NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": stream, **extra}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


def streamed(http, **extra) -> tuple[str, list[str], list[dict]]:
    chunks = [p for p in parse(ask(http, True, **extra).text) if p != "[DONE]"]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    origins = [o for c in chunks for ch in c["choices"] for o in ch["delta"].get("origins", [])]
    return text, origins, chunks


def check_origins_add_up(origins: list[str], stats: dict, setting: str) -> None:
    count = Counter(origins)
    rounds = rounds_of(origins)
    assert len(origins) == MAX_TOKENS
    assert origins[0] == "plain"  # the prefill's token, not a round's
    assert all(r[-1] in ("recovered", "bonus", "plain") for r in rounds)  # no stop cut a round
    assert stats["rounds"] == len(rounds)
    assert stats["accepted"] == count["accepted"]
    assert stats["emitted"] == len(origins) - 1 == sum(map(len, rounds))
    assert stats["rounds"] == count["recovered"] + count["bonus"] + count["plain"] - 1
    # a rejected draft is followed by its recovered token; drafts after it are not verified
    assert stats["drafted"] >= stats["accepted"] + count["recovered"]
    if stats["drafted"]:
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"])
    assert stats["mean_acceptance_length"] == pytest.approx(stats["emitted"] / stats["rounds"])
    assert stats["realised_tv"] in (None, 0.0)  # lossless

    if setting == "off":
        assert set(origins) == {"plain"} and stats["drafted"] == 0 and stats["enabled"] is False
    elif setting != "cost_aware":  # (the cost-aware policy may find drafting not worth it here)
        # the draft agrees with the target only part of the time: every kind of token shows
        assert count["accepted"] and count["recovered"] and stats["enabled"] is True
    if setting == "fixed_k1":  # k = 1 every round: drafted counts exactly
        assert count["bonus"] and stats["drafted"] == count["accepted"] + count["recovered"]
        assert all(len(r) <= 2 for r in rounds)
    if setting == "fixed_k3":
        assert max(map(len, rounds)) <= 4 and len(stats["per_position_acceptance"]) == 3


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_origins_add_up_to_the_requests_speculative_statistics(http, setting):
    body = ask(http, False, speculative=SETTINGS[setting], return_token_origins=True).json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    check_origins_add_up(body["choices"][0]["origins"], body["speculative_stats"], setting)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_streamed_origins_add_up_to_the_last_chunks_statistics(http, setting):
    text, origins, chunks = streamed(http, speculative=SETTINGS[setting], return_token_origins=True)
    check_origins_add_up(origins, chunks[-1]["speculative_stats"], setting)
    if setting != "cost_aware":  # fixed k and greedy: the very same rounds as without streaming
        whole = ask(http, False, speculative=SETTINGS[setting], return_token_origins=True).json()
        assert text == whole["choices"][0]["message"]["content"]
        assert origins == whole["choices"][0]["origins"]
        assert chunks[-1]["speculative_stats"] == whole["speculative_stats"]


def test_clients_that_do_not_ask_get_standard_chunks_and_bodies(http):
    text, origins, chunks = streamed(http)
    assert origins == [] and text
    for c in chunks:
        assert set(c) <= {"id", "object", "created", "model", "choices", "speculative_stats"}
        for ch in c["choices"]:
            assert set(ch) == {"index", "delta", "logprobs", "finish_reason"}
            assert set(ch["delta"]) <= {"role", "content"}
    # the request's statistics ride on the last chunk only (issue 14), nothing per token
    assert ["speculative_stats" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]
    body = ask(http, False).json()
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert set(body["choices"][0]["message"]) == {"role", "content"}
    assert body["choices"][0]["message"]["content"] == text
