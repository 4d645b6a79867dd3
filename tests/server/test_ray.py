"""`specserve serve --replicas 2`: two engine replicas of a tiny model as Ray Serve deployments
on a local, bounded Ray (the machine's cores, a 128 MiB object store, no dashboard) behind the one
OpenAI endpoint; compared with the single-process server on the same model.

The module starts one replicated server and one single-process server. The replicated one also
runs a share of test_serve.py's own tests (imported below: same endpoints, streaming, bad input,
API key, page); its SIGTERM test runs last, after the replica-kill test.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from specserve.engine.outputs import EngineStats
from specserve.clients.async_engine import EngineDead, EngineError
from specserve.server.replicas.deployment import Failure
from specserve.server.replicas.pool import ReplicaPool, merge_stats, prefer
from specserve.server.replicas.prefix import PrefixIndex, block_hashes
from specserve.speculative.metrics import SpecMetrics
from tests.server.conftest import KEY, NAME, start_server
from tests.server.test_serve import metrics

REPLICAS = 2
MAX_NUM_SEQS = 2  # small, so requests wait inside a replica (no tokens streamed yet) under load
# (with n = 2 requests: each may take all of a replica's slots, --max-slot-share 1)
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("ray-log") / "server.log",
                       "--replicas", str(REPLICAS), "--max-num-seqs", str(MAX_NUM_SEQS),
                       "--max-slot-share", "1", startup_s=240)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("single-log") / "server.log",
                       "--max-num-seqs", str(MAX_NUM_SEQS), "--max-slot-share", "1")
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server)


def replica_figures(srv) -> tuple[dict[str, int], dict[str, float]]:
    """(replica id -> pid of the live replicas, replica id -> requests it served)."""
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    pids = {r: int(p) for p, r in re.findall(r'specserve:replica_info\{[^}]*pid="(\d+)",replica="([^"]+)"', text)}
    served = {r: float(v) for r, v in re.findall(r'specserve:replica_requests_total\{[^}]*replica="([^"]+)"\} (\S+)', text)}
    return pids, served


def wait_for_replicas(srv, count: int, without: int | None = None, timeout: float = 90) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = replica_figures(srv)[0]
        if len(pids) == count and without not in pids.values():
            return pids
        time.sleep(0.5)
    raise AssertionError(f"replicas did not come back: {pids}\n{srv.log[-4000:]}")


def completion(client, prompt, **kw) -> str:
    return client.completions.create(model=NAME, prompt=prompt, **kw).choices[0].text


# ----------------------------------------------------------------------------- no Ray without --replicas
def test_the_single_process_server_never_loads_ray(single):
    maps = Path(f"/proc/{single.process.pid}/maps").read_text()
    assert "_raylet" not in maps and "/ray/" not in maps  # `import ray` maps ray/_raylet.so
    code = ("import sys, specserve.cli, specserve.server.cli, specserve.server.app, specserve.llm; "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--ray-address", "auto"], "--ray-address needs --replicas")])
def test_bad_replica_flags_are_one_line_errors_before_anything_starts(flags, message):
    r = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", *flags], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- pure parts
def test_prefix_index_answers_the_replica_with_the_longest_recorded_run_of_blocks():
    index = PrefixIndex(block=4, capacity=100)
    index.record(list(range(12)), "a")  # blocks [0:4] [4:8] [8:12]
    index.record(list(range(8)) + [50, 51, 52, 53], "b")  # overwrites [0:4] [4:8] with b
    assert index.lookup(list(range(12)) + [99]).replica == "a" and index.lookup(list(range(12))).tokens == 12
    assert index.lookup(list(range(8)) + [50, 51, 52, 53, 7]) == index.lookup(list(range(8)) + [50, 51, 52, 53])
    assert index.lookup(list(range(8)) + [50, 51, 52, 53]).replica == "b"
    assert index.lookup([1, 2, 3, 4, 5]).replica is None  # a different first block: nothing
    assert index.lookup(list(range(3))).tokens == 0  # shorter than a block
    assert index.lookup(list(range(12)), alive={"b"}).replica == "b"  # a is gone: b's 8 tokens
    index.forget("b")
    assert index.lookup(list(range(12))).tokens == 0  # the chain's first blocks went with b
    small = PrefixIndex(block=2, capacity=3)
    small.record(list(range(10)), "x")
    assert len(small) == 3 and len(block_hashes(list(range(10)), 2)) == 5


def test_merged_stats_add_counts_and_divide_blocks():
    def stats(running, used, total, accepted, rolling, healthy):
        spec = SpecMetrics(rounds=2, drafted=4, accepted=accepted, drafted_per_position=[2, 2],
                           accepted_per_position=[accepted, 0])
        return EngineStats(running, 1, used / total, used, total, 1, 0, 3, 10, spec, rolling, healthy)

    m = merge_stats([stats(2, 10, 100, 1, 0.9, True), stats(1, 30, 100, 2, None, False)])
    assert (m.running, m.waiting, m.kv_blocks_used, m.kv_blocks_total, m.kv_usage) == (3, 2, 40, 200, 0.2)
    assert (m.spec.accepted, m.spec.accepted_per_position, m.prefix_cache_hit_tokens) == (3, [3, 0], 6)
    assert m.rolling_acceptance == 0.9 and m.healthy is False
    assert merge_stats([]).kv_usage == 0.0 and merge_stats([]).healthy is False  # no replica


def test_a_dead_replica_engine_crosses_the_wire_as_engine_dead():
    failure = Failure.of(EngineDead("the engine is dead: a step ran for more than 300 s"))
    error = failure.exception("r1")
    assert isinstance(error, EngineDead) and str(error).startswith("replica r1: the engine is dead")
    assert type(Failure.of(EngineError("x")).exception("r1")) is EngineError


def test_a_pool_with_no_live_replica_is_dead_and_refuses_requests_with_engine_dead():
    pool = ReplicaPool.__new__(ReplicaPool)  # its state only: no Ray behind it
    pool.replicas, pool._closing, pool._refreshed = {}, False, time.monotonic()
    assert "no live engine replica" in pool.dead_reason

    async def first():
        return await anext(pool.stream([1, 2, 3], None))

    with pytest.raises(EngineDead, match="no live engine replica"):
        asyncio.run(first())
    pool.replicas = {"r0": object()}
    assert pool.dead_reason is None


class _Call:
    """A streaming replica call that sends `items` and then nothing more (a replica that stopped
    answering), or ends after them when `hang` is False."""

    def __init__(self, items, hang=True):
        self.items, self.hang, self.cancelled = list(items), hang, False

    async def _gen(self):
        for item in self.items:
            yield "r0", item
        if self.hang:
            await asyncio.sleep(3600)

    def __aiter__(self):
        return self._gen().__aiter__()

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self, calls):
        self.calls, self.sent = list(calls), []
        self.stream = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        call = self.calls.pop(0)
        self.sent.append(call)
        self.kwargs = kwargs
        return call


def _bare_pool(calls, timeout_s):
    pool = ReplicaPool.__new__(ReplicaPool)  # its state only: the handle is a stand-in
    pool.handle, pool.retries, pool.call_timeout_s = _Handle(calls), 1, timeout_s
    pool.index, pool.replicas, pool._closing = PrefixIndex(16), {"r0": object()}, False
    pool._refreshed = time.monotonic()
    pool.routed, pool.retried, pool.failed, pool._inflight = collections.Counter(), 0, 0, {}
    pool.busy = collections.Counter()
    return pool


class _Delta:
    finished, output = False, None


def _drain(pool):
    async def go():
        return [item async for item in pool.stream([1, 2, 3], None)]
    return asyncio.run(go())


def test_a_replica_that_stops_answering_mid_stream_fails_its_request_within_the_call_timeout():
    hung = _Call([_Delta()])
    pool = _bare_pool([hung], timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="after streaming part of it: TimeoutError"):
        _drain(pool)
    assert time.monotonic() - t0 < 5
    assert hung.cancelled and pool.failed == 1 and pool.retried == 0 and not pool._inflight
    assert not pool.busy


def test_a_replica_silent_before_its_first_delta_is_timed_out_and_the_request_sent_again():
    done = _Delta()
    done.finished = True
    silent, answer = _Call([]), _Call([_Delta(), done], hang=False)
    pool = _bare_pool([silent, answer], timeout_s=0.3)
    items = _drain(pool)
    assert len(items) == 2 and items[-1].finished
    assert silent.cancelled and not answer.cancelled
    assert pool.retried == 1 and pool.failed == 0 and pool.routed["r0"] == 1 and not pool.busy


@pytest.mark.parametrize("busy, alive, wanted", [
    ({}, {"r0", "r1"}, "r0"),
    ({"r0": 4}, {"r0", "r1"}, "r0"),  # IMBALANCE beyond the idle one: still preferred
    ({"r0": 5}, {"r0", "r1"}, None),  # one more: any replica
    ({"r0": 7, "r1": 3}, {"r0", "r1"}, "r0"),
    ({"r0": 5, "r2": 0}, {"r0"}, "r0"),  # only live replicas set the least
])
def test_the_prefix_holder_is_preferred_unless_much_busier_than_the_least_busy(busy, alive, wanted):
    assert prefer("r0", collections.Counter(busy), alive) == wanted
    assert prefer(None, collections.Counter(busy), alive) is None


def test_a_request_counts_against_one_replica_until_it_ends():
    """Sent preferring the prefix's holder, it counts there; its first delta moves the count to
    the replica that took it; its end clears it. (Ray's queue-length cache, which the router
    weighed before, kept a burst's counts for seconds after it ended.)"""
    done = _Delta()
    done.finished = True
    seen = []

    class _Seen(_Call):
        async def _gen(self):
            seen.append(dict(pool.busy))  # sent, no delta yet
            yield "r1", _Delta()  # r0 was full: Ray's router sent it to r1
            seen.append(dict(pool.busy))
            yield "r1", done

    pool = _bare_pool([_Seen([])], timeout_s=5)
    pool.replicas = {"r0": object(), "r1": object()}
    prompt = list(range(40))
    pool.index.record(prompt, "r0")

    async def go():
        return [item async for item in pool.stream(prompt, None)]

    assert len(asyncio.run(go())) == 2
    assert pool.handle.kwargs["preferred_replica"] == "r0"
    assert seen == [{"r0": 1}, {"r1": 1}] and not pool.busy


# ----------------------------------------------------------------------------- the replicated endpoint
def test_both_replicas_are_up_and_listed_in_metrics(server, client):
    pids = wait_for_replicas(server, REPLICAS)
    assert len(set(pids.values())) == REPLICAS and server.process.pid not in pids.values()
    assert [m.id for m in client.models.list().data] == [NAME]


def test_greedy_outputs_equal_the_single_process_servers(server, client, single):
    solo = _client(single)
    prompts = ["the cat sat", "a b c d e", [5, 6, 7, 8, 9], "request 3: dddd"]
    for p in prompts:
        assert completion(client, p, **GREEDY) == completion(solo, p, **GREEDY)
    messages = [{"role": "user", "content": "tell me"}]
    mine = client.chat.completions.create(model=NAME, messages=messages, n=2, logprobs=True, top_logprobs=2, **GREEDY)
    theirs = solo.chat.completions.create(model=NAME, messages=messages, n=2, logprobs=True, top_logprobs=2, **GREEDY)
    assert [c.message.content for c in mine.choices] == [c.message.content for c in theirs.choices]
    assert [[t.token for t in c.logprobs.content] for c in mine.choices] == \
        [[t.token for t in c.logprobs.content] for c in theirs.choices]
    assert mine.usage.model_dump() == theirs.usage.model_dump()
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=messages, stream=True, **GREEDY) if c.choices)
    assert streamed == theirs.choices[0].message.content


def test_concurrent_requests_reach_both_replicas(server, client):
    before = replica_figures(server)[1]
    prompts = [f"spread {i}: " + "xyzw"[i % 4] * (i + 3) for i in range(8)]
    outs: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, completion(
        client, prompts[i], temperature=0, max_tokens=24, extra_body={"ignore_eos": True}))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = replica_figures(server)[1]
    moved = {r: after[r] - before.get(r, 0) for r in after}
    assert len(outs) == 8 and sum(moved.values()) == 8
    assert sum(1 for n in moved.values() if n > 0) == REPLICAS, moved


def test_a_conversations_next_turns_land_on_the_replica_holding_its_prefix(server, client):
    """Sequential turns (so load never outweighs the preference): each turn's prompt repeats the
    previous prompt and its answer; every turn goes where the first one went."""
    prompt = "a conversation about " + " ".join(f"w{i}" for i in range(30))
    landed = []
    for turn in range(6):
        before = replica_figures(server)[1]
        answer = completion(client, prompt, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
        after = replica_figures(server)[1]
        landed += [r for r in after if after[r] > before.get(r, 0)]
        prompt = f"{prompt}{answer} and then {turn}"
    assert len(landed) == 6 and len(set(landed)) == 1, landed  # by chance: 1 in 32


# ----------------------------------------------------------------------------- a replica dies
def test_killing_a_replica_mid_load_loses_no_request_that_had_not_started_streaming(server, client):
    solo_after = completion(client, "after the crash", **GREEDY)
    pids = wait_for_replicas(server, REPLICAS)
    results: dict[int, tuple[str, int, int | None]] = {}  # i -> (outcome, chunks before the end, tokens)

    def run(i: int) -> None:
        chunks, tokens = 0, None
        try:
            for c in client.completions.create(model=NAME, prompt=f"load {i}", temperature=0, max_tokens=300,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True, "speculative": False}):
                chunks += bool(c.choices and c.choices[0].text)
                tokens = c.usage.completion_tokens if c.usage else tokens
            results[i] = ("ok", chunks, tokens)
        except openai.APIError as e:
            results[i] = (f"error: {e.message}", chunks, None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:  # a replica with requests running and waiting
        figures = metrics(server)
        busy = [r for r in pids if figures.get(f"specserve:replica_num_requests_waiting[replica={r}]", 0) >= 1
                and figures.get(f"specserve:replica_num_requests_running[replica={r}]", 0) >= 1]
        victim = pids[busy[0]] if busy else None
        time.sleep(0.1)
    assert victim is not None, figures
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert len(results) == 12
    for i, (outcome, chunks, tokens) in results.items():
        if outcome == "ok":
            assert tokens == 300, results[i]
        else:  # only requests that had streamed tokens may fail: a 500 naming the request id,
            # whose cause (the replica that failed) is in the server's log
            assert chunks > 0 and "request id" in outcome, results[i]
            request_id = outcome.split("request id ")[1].split(";")[0]
            assert any(request_id in line and "replica" in line and "failed" in line
                       for line in server.log.splitlines()), outcome
    assert any(o != "ok" for o, _, _ in results.values())  # the victim was busy
    figures = metrics(server)
    assert figures["specserve:replica_retried_requests_total"] >= 1  # its waiting requests moved
    assert figures["specserve:replica_failed_requests_total"] == sum(o != "ok" for o, _, _ in results.values())
    back = wait_for_replicas(server, REPLICAS, without=victim)
    assert victim not in back.values()
    assert completion(client, "after the crash", **GREEDY) == solo_after


# ----------------------------------------------------------------------------- the single server's own tests, replicated
from tests.server.test_serve import (  # noqa: E402, F401  (collected here, against the replicated server)
    test_bad_input_gets_its_status_and_an_openai_error_body, test_chat_stream_equals_the_non_streamed_greedy_text_with_exact_usage,
    test_completion_usage_counts_prompt_ids_and_generated_tokens_exactly,
    test_missing_or_wrong_api_key_gets_401_on_the_api_and_metrics_and_health_stays_open, test_models_and_health_list_the_served_model,
    test_oversized_bodies_are_refused_with_413_with_or_without_content_length,
    test_per_request_speculation_settings_and_their_statistics, test_seeds_reproduce_sampled_outputs_and_distinct_seeds_differ,
    test_sixteen_concurrent_streams_each_equal_their_solo_greedy_output,
    test_stop_string_cuts_the_text_in_plain_and_streamed_responses,
    test_stream_carries_origins_in_deltas_and_statistics_in_its_last_chunk, test_unknown_routes_and_methods_get_error_bodies)
from tests.server.test_page import (  # noqa: E402, F401
    test_the_page_and_its_assets_are_served_from_the_package_without_outside_urls)
from tests.server.test_serve import (  # noqa: E402, F401  (last: it stops the server)
    test_sigterm_lets_in_flight_requests_finish_aborts_the_rest_and_exits_0)


def test_a_replica_start_failure_is_the_single_process_servers_one_line_error(model_dir):
    """Every replica fails to build its engine (a draft that does not exist): the error comes
    back once, in the single-process server's one line and exit code, with no restart loop and
    no traceback from a replica's destructor."""
    flags = ["serve", "--model", str(model_dir), "--draft-model", "/nonexistent/draft.gguf",
             "--dtype", "float32", "--weights", "bf16"]
    results = [subprocess.run([sys.executable, "-m", "specserve.cli", *flags, *extra],
                              capture_output=True, text=True, timeout=300)
               for extra in ([], ["--replicas", str(REPLICAS)])]
    errors = [[line for line in (r.stdout + r.stderr).splitlines()
               if line.startswith("specserve serve: error: ")] for r in results]
    single, replicated = results
    assert single.returncode == replicated.returncode == 2, replicated.stderr[-4000:]
    assert len(errors[0]) == 1 and errors[1] == errors[0], replicated.stderr[-4000:]
    assert "/nonexistent/draft.gguf" in errors[0][0]
    for r in results:
        assert "Traceback" not in r.stdout + r.stderr and "AttributeError" not in r.stderr


def test_a_replica_whose_engine_never_started_is_destroyed_quietly():
    from specserve.server.replicas.deployment import EngineReplica

    EngineReplica.__new__(EngineReplica).__del__()  # as Ray does after a failed constructor
