"""`specserve serve` end to end: a real server process on a tiny random model (its own draft),
driven by the official `openai` client and by raw HTTP.

One server process serves the whole module (starting one takes most of the time here); the
last test sends it SIGTERM, so it must stay last.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.sse_client import parse
from tests.server.conftest import KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES, NAME, SHUTDOWN_TIMEOUT

GREEDY = {"temperature": 0, "max_tokens": 12}
ORIGINS = {"plain", "accepted", "recovered", "bonus"}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, text: str, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], **kw)


def streamed_chat(client, text: str, **kw) -> tuple[dict[int, str], list]:
    chunks = list(chat(client, text, stream=True, **kw))
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


def metrics(server) -> dict:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[key] = s.value
    return values


# ----------------------------------------------------------------------------- generation
def test_models_and_health_list_the_served_model(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(f"{server.base_url}/health").json()
    assert health["status"] == "ok" and health["speculative_acceptance_healthy"] is True


def test_chat_stream_equals_the_non_streamed_greedy_text_with_exact_usage(client):
    full = chat(client, "the cat sat", n=2, **GREEDY)
    texts, chunks = streamed_chat(client, "the cat sat", n=2, stream_options={"include_usage": True},
                                  **GREEDY)
    assert texts == {0: full.choices[0].message.content, 1: full.choices[1].message.content}
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy
    assert chunks[0].choices[0].delta.role == "assistant"
    # the counts are exact; the second request finds the first's prompt in the prefix cache
    tokens = {"prompt_tokens_details"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude=tokens) == \
        full.usage.model_dump(exclude=tokens)
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert full.usage.prompt_tokens_details.cached_tokens <= cached < full.usage.prompt_tokens
    assert full.usage.completion_tokens == 2 * 12 or any(c.finish_reason == "stop" for c in full.choices)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completion_usage_counts_prompt_ids_and_generated_tokens_exactly(client):
    out = client.completions.create(model=NAME, prompt=[5, 6, 7, 8, 9], max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True}, logprobs=2)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 7
    choice = out.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 7
    assert "".join(choice.logprobs.tokens) == choice.text
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert len(top) == 2 and lp == pytest.approx(max(top.values()))  # greedy: the top token
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=[5, 6, 7, 8, 9], max_tokens=7, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == choice.text


def test_completions_with_several_prompts_number_choices_prompt_major(client):
    out = client.completions.create(model=NAME, prompt=["the cat", "a dog"], n=2, max_tokens=4,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    single = client.completions.create(model=NAME, prompt="a dog", max_tokens=4, temperature=0)
    assert out.choices[2].text == out.choices[3].text == single.choices[0].text


def test_chat_logprobs_have_one_entry_per_token_with_top_alternatives(client):
    out = chat(client, "hello", logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content) == out.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
               for e in content)


def test_seeds_reproduce_sampled_outputs_and_distinct_seeds_differ(client):
    # a fixed k: the cost-aware policy picks k from timings, and the draws a round consumes
    # depend on k, so only a fixed k (or no speculation) makes a seed reproduce tokens exactly
    kw = {"temperature": 1.0, "max_tokens": 16,
          "extra_body": {"ignore_eos": True, "speculative": {"num_speculative_tokens": 2}}}
    a = chat(client, "tell me", seed=11, **kw).choices[0].message.content
    b = chat(client, "tell me", seed=11, **kw).choices[0].message.content
    others = {chat(client, "tell me", seed=s, **kw).choices[0].message.content for s in (12, 13, 14)}
    assert a == b
    assert others != {a}


def test_stop_string_cuts_the_text_in_plain_and_streamed_responses(client):
    text = chat(client, "stop here", temperature=0, max_tokens=20,
                extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text.index(text[i:i + 2]) >= 2)
    cut = text[:text.index(stop)]
    out = chat(client, "stop here", temperature=0, max_tokens=20, stop=[stop],
               extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    texts, chunks = streamed_chat(client, "stop here", temperature=0, max_tokens=20, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert texts[0] == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


# ----------------------------------------------------------------------------- speculation
def test_per_request_speculation_settings_and_their_statistics(client):
    prompt, kw = "speculate", {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    default = chat(client, prompt, **kw)
    off = chat(client, prompt, **{**kw, "extra_body": {"ignore_eos": True, "speculative": False,
                                                        "return_token_origins": True}})
    fixed = chat(client, prompt, **{**kw, "extra_body": {
        "ignore_eos": True, "speculative": {"num_speculative_tokens": 2},
        "return_token_origins": True}})
    texts = {r.choices[0].message.content for r in (default, off, fixed)}
    assert len(texts) == 1  # greedy speculation is lossless
    s_off, s_fixed = off.speculative_stats, fixed.speculative_stats
    assert s_off["enabled"] is False and s_off["drafted"] == 0
    assert off.choices[0].origins == ["plain"] * 24
    assert s_fixed["enabled"] is True and s_fixed["drafted"] > 0
    assert len(s_fixed["per_position_acceptance"]) <= 2  # k never above 2
    assert s_fixed["accepted"] == s_fixed["drafted"]  # the draft is the target
    assert s_fixed["acceptance_rate"] == 1.0 and s_fixed["mean_acceptance_length"] > 1
    assert s_fixed["realised_tv"] == 0.0
    origins = fixed.choices[0].origins
    assert len(origins) == 24 and set(origins) <= ORIGINS and "accepted" in origins
    for stats in (default.speculative_stats, s_off, s_fixed):
        assert set(stats) >= {"drafted", "accepted", "acceptance_rate", "mean_acceptance_length",
                              "realised_tv"}


def test_stream_carries_origins_in_deltas_and_statistics_in_its_last_chunk(client):
    texts, chunks = streamed_chat(client, "origins", temperature=0, max_tokens=10, extra_body={
        "ignore_eos": True, "return_token_origins": True, "speculative": {"tv_budget": 0.3}})
    origins = [o for c in chunks for ch in c.choices for o in (ch.delta.model_extra.get("origins") or [])]
    assert len(origins) == 10 and set(origins) <= ORIGINS
    last = chunks[-1].model_extra["speculative_stats"]
    assert last["enabled"] is True and last["emitted"] == 10 - 1  # the first token is the prefill's
    assert all("speculative_stats" not in c.model_extra for c in chunks[:-1])
    plain, plain_chunks = streamed_chat(client, "origins", temperature=0, max_tokens=10,
                                        extra_body={"ignore_eos": True})
    assert all("origins" not in (ch.delta.model_extra or {}) for c in plain_chunks for ch in c.choices)
    assert plain == texts


def test_sixteen_concurrent_streams_each_equal_their_solo_greedy_output(client):
    prompts = [f"request {i}: " + "abcdefgh"[i % 8] * (i + 1) for i in range(16)]
    solo = [chat(client, p, **GREEDY).choices[0].message.content for p in prompts]
    results: dict[int, str] = {}
    errors = []

    def run(i: int) -> None:
        try:
            results[i] = streamed_chat(client, prompts[i], **GREEDY)[0][0]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [results.get(i) for i in range(16)] == solo


# ----------------------------------------------------------------------------- bad input
def _post(http: httpx.Client, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return http.post(path, content=content, headers={"content-type": "application/json",
                                                     **kw.pop("headers", {})}, **kw)


BAD_INPUTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("body not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                            "temperature": "hot"}, 400, "temperature"),
    ("out of range", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "top_p": 1.5}, 400, "top_p"),
    ("unknown field", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4", "messages": [
        {"role": "user", "content": "x"}]}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("prompt longer than the context", "/v1/completions", {"prompt": "ab " * MAX_MODEL_LEN}, 400, "prompt"),
    ("chat longer than the context", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "ab " * MAX_MODEL_LEN}]}, 400, "messages"),
    ("max_tokens beyond what fits", "/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
     400, "max_tokens"),
    ("token id beyond the vocabulary", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("speculation k out of range", "/v1/completions", {"prompt": "x", "speculative": {
        "num_speculative_tokens": 99}}, 400, "speculative"),
    ("lone surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("seed out of range", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("negative penalty beyond -2", "/v1/completions", {"prompt": "x", "presence_penalty": -3},
     400, "presence_penalty"),
    ("top_k beyond its bound", "/v1/completions", {"prompt": "x", "top_k": 1025}, 400, "top_k"),
    ("an entropy gate's k beyond its bound", "/v1/completions", {"prompt": "x", "speculative": {
        "fly_top_k": 65}}, 400, "speculative"),
    ("more messages than the server takes", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"}] * 1025}, 400, "messages"),
    ("a prompt of token ids beyond the context", "/v1/completions", {"prompt": [1] * MAX_MODEL_LEN},
     400, "prompt"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_status_and_an_openai_error_body(server, case):
    _, path, body, status, param = case
    if isinstance(body, dict):
        body = {"model": NAME, **body}
    with server.client() as http:
        response = _post(http, path, body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
        good = _post(http, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
        assert good.status_code == 200


def test_oversized_bodies_are_refused_with_413_with_or_without_content_length(server):
    big = {"model": NAME, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    with server.client() as http:
        assert _post(http, "/v1/completions", big).status_code == 413
        chunked = http.post("/v1/completions", content=iter([json.dumps(big).encode()]),
                            headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        assert _post(http, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_missing_or_wrong_api_key_gets_401_on_the_api_and_metrics_and_health_stays_open(server):
    body = {"model": NAME, "prompt": "x", "max_tokens": 1}
    missing = httpx.post(f"{server.base_url}/v1/completions", json=body)
    wrong = httpx.post(f"{server.base_url}/v1/completions", json=body,
                       headers={"Authorization": "Bearer nope"})
    bare_metrics = httpx.get(f"{server.base_url}/metrics")
    for r in (missing, wrong, bare_metrics):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_unknown_routes_and_methods_get_error_bodies(server):
    with server.client() as http:
        assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
        assert http.get("/v1/completions").status_code == 405


# ----------------------------------------------------------------------------- metrics
def test_metrics_parse_and_counters_move_by_one_requests_figures(server, client):
    before = metrics(server)
    out = chat(client, "count me", temperature=0, max_tokens=9, extra_body={
        "ignore_eos": True, "speculative": {"num_speculative_tokens": 3}})
    after = metrics(server)
    stats = out.speculative_stats

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("vllm:spec_decode_num_draft_tokens_total") == stats["drafted"] > 0
    assert moved("vllm:spec_decode_num_accepted_tokens_total") == stats["accepted"]
    assert moved("vllm:generation_tokens_total") == 9
    assert moved("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("vllm:request_success_total[finished_reason=length]") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:request_queue_time_seconds_count") == 1
    assert after["specserve:spec_decode_healthy"] == 1.0
    assert after["vllm:num_requests_running"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_the_kv_cache(server):
    before = metrics(server)
    body = {"model": NAME, "prompt": "go on", "max_tokens": MAX_MODEL_LEN - 10, "stream": True,
            "ignore_eos": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk arrived: the request is running
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = metrics(server)
        if now["specserve:requests_aborted_total"] == before["specserve:requests_aborted_total"] + 1 \
                and now["vllm:kv_cache_usage_perc"] == 0 and now["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert now["specserve:requests_aborted_total"] == before["specserve:requests_aborted_total"] + 1
    assert now["vllm:kv_cache_usage_perc"] == 0 and now["vllm:num_requests_running"] == 0


# ----------------------------------------------------------------------------- fuzz
def test_openapi_schema_documents_the_routes_and_the_speculation_extensions(server):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schema["components"]["schemas"][name]["properties"]
        assert {"speculative", "return_token_origins", "top_k", "stop_token_ids"} <= set(props)
        assert "num_speculative_tokens" in json.dumps(props["speculative"]) or "SpeculativeOptions" in json.dumps(
            props["speculative"])
    assert "SpeculativeStats" in schema["components"]["schemas"]
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413"} <= set(responses) and "422" not in responses


def test_fuzzing_the_openapi_schema_finds_no_server_error(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    headers = {"Authorization": f"Bearer {KEY}"}
    failures = []
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(mode))
        def run(case):
            if mode.is_positive and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = NAME  # reach generation, not just the model check
            response = case.call(base_url=server.base_url, headers=headers, timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text))

        run()
    assert not failures, (json.dumps(failures[:2], default=str, indent=1)
                          + f"\n--- server log:\n{server.log[-6000:]}")
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def our_tracebacks(log: str) -> list[str]:
    """The tracebacks of a server log, but for those wholly inside Ray's own code (with
    --replicas, Ray Serve's router may log the queue-length probe of a replica that is
    shutting down)."""
    found = []
    for block in log.split("Traceback (most recent call last):")[1:]:
        files = re.findall(r'File "([^"]+)"', block)
        if not files or not all("/ray/" in f or "/asyncio/" in f for f in files):
            found.append(block[:2000])
    return found


# ----------------------------------------------------------------------------- shutdown (last)
def test_sigterm_lets_in_flight_requests_finish_aborts_the_rest_and_exits_0(server):
    """SIGTERM comes while a short request is streaming (its first tokens are in, its finish is
    not): it still finishes ("length"), with tokens streamed after the signal; 24 sequences of
    ~1,000 plain-decoded tokens (8 run at a time) cannot finish within the bound and end with
    "abort"; every stream still ends in [DONE]; the process exits 0 without a traceback."""
    finals: dict[int, tuple[str | None, bool]] = {}
    connected = {i: threading.Event() for i in range(7)}  # response headers in: the request is in
    short_started = threading.Event()
    signalled = threading.Event()
    after_signal: dict[int, int] = {}  # pieces each stream received after the signal

    def stream(i: int, max_tokens: int, n: int) -> None:
        body = {"model": NAME, "prompt": f"long {i}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "n": n, "speculative": False}
        text, after = "", 0
        try:
            with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
                connected[i].set()
                for piece in r.iter_text():
                    text += piece
                    after += signalled.is_set()
                    if n == 1:
                        short_started.set()
        except httpx.HTTPError as e:
            finals[i] = (repr(e), False)
            return
        payloads = parse(text)
        reasons = [c["finish_reason"] for p in payloads if isinstance(p, dict) for c in p["choices"]]
        finals[i] = (reasons[-1] if reasons else None, payloads[-1] == "[DONE]")
        after_signal[i] = after

    # the short one first (so it runs, not waits), 120 tokens: still streaming once the long
    # ones are in, done well within the bound
    short = threading.Thread(target=stream, args=(0, 120, 1))
    short.start()
    assert short_started.wait(30)
    threads = [short] + [threading.Thread(target=stream, args=(i, MAX_MODEL_LEN - 16, 4)) for i in range(1, 7)]
    for t in threads[1:]:
        t.start()
    assert all(connected[i].wait(30) for i in range(7))
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    signalled.set()
    assert 0 not in finals  # the short request was still streaming when the signal went
    rc = server.process.wait(SHUTDOWN_TIMEOUT + 20)
    took = time.monotonic() - sent
    for t in threads:
        t.join(10)
    assert rc == 0 and took < SHUTDOWN_TIMEOUT + 10
    assert not our_tracebacks(server.log), our_tracebacks(server.log)
    assert finals[0] == ("length", True)
    assert after_signal[0] > 0  # it went on streaming after the signal
    assert all(done for _, done in finals.values()) and len(finals) == 7, finals
    assert "abort" in {reason for reason, _ in finals.values()}
