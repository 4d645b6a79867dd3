"""`specserve bench --concurrency 1,2,4,8,16`: throughput and latency with many requests at once.

For each concurrency level c, every configuration serves c requests submitted together (the
shipped workloads in turn, each prompt made unique by a numbered first line so no request
reuses another's cached prefix), `max_tokens` new tokens each with EOS ignored. Levels run in
order and, within a level, the configurations take turns (round robin over repeats), so a
shared machine's drift hits each alike. Reported per (configuration, level): total output
tokens/s (all requests' tokens over the wall time of the batch), p50/p95 per-request latency
and time to first token, and the number of requests that drafted at all.

Such a batch ends with its slowest request, and before that it shrinks as the others finish:
its tokens/s is partly the latency of its slowest request. When speculation makes some
requests finish early (the copying ones) and slows the others a little (they share passes with
drafts), the batch's wall time can grow while every request but one got faster. `--sustained
SECONDS` measures what a busy server sees instead: `c` requests kept in flight (one that
finishes is replaced at once by the next) for SECONDS, distinct requests from
`request_pool` ("mixed-even": answer-checked tasks among open-text requests, no answer
repeated), and only the tokens made after a ramp count. Every run starts with empty caches
(the target's prefix cache and the suffix drafter's cache of earlier outputs), so no run drafts
from an earlier run's answers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class ConcurrencyConfig:
    name: str
    spec: dict | None  # speculative_config without "model" (None: target only)


def default_configs(disable_by_batch_size: int) -> list[ConcurrencyConfig]:
    hybrid = {"method": "hybrid", "num_speculative_tokens": -1}
    return [ConcurrencyConfig("target only", None),
            ConcurrencyConfig("hybrid (default)", hybrid),
            ConcurrencyConfig(f"hybrid, off at {disable_by_batch_size}",
                              dict(hybrid, disable_by_batch_size=disable_by_batch_size))]


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of `values` (q in [0, 1])."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def unique_prompts(bench, texts: list[str], count: int, offset: int) -> list[list[int]]:
    """`count` prompts cycling through `texts`, each opened by its own numbered line."""
    return [bench.prompt_ids(f"(Request {offset + i}.)\n{texts[i % len(texts)]}")
            for i in range(count)]


def fresh(llm) -> None:
    """Empty the caches an earlier run filled: the target's prefix cache and the suffix
    drafter's cache of earlier outputs (its answers would be drafted back)."""
    llm.reset_prefix_cache()
    if llm.engine.spec is not None:
        llm.engine.spec.clear_cache()


def run_level(llm, prompts: list[list[int]], max_tokens: int, temperature: float) -> dict:
    """Serve `prompts` together through one `generate` call; the level's figures."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    fresh(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return _figures([o.outputs[0] for o in outs], wall, wall)


def run_sustained(llm, prompts: list[list[int]], level: int, max_tokens: int,
                  temperature: float, seconds: float, ramp: float,
                  clock=time.perf_counter) -> dict:
    """`level` of `prompts` in flight at once, each that finishes replaced by the next, for
    `seconds`; tokens/s counts the tokens of the steps that ended between `ramp` and
    `seconds` (the requests still running then are aborted, uncounted). Latencies are those of
    the requests that finished in time. A pool that runs out after the ramp ends the window
    there (a fast machine, a small model: `window_s` says how long it lasted); before the
    ramp it is an error. `clock`: seconds (a test's own)."""
    if seconds <= ramp:
        raise ValueError(f"a sustained run must last longer than its ramp ({ramp} s), got {seconds}")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    engine, queue = llm.engine, iter(prompts)
    fresh(llm)

    def submit(now: float) -> bool:
        """The next prompt in flight; False when the pool is spent (an error before the ramp)."""
        ids = next(queue, None)
        if ids is None and now <= ramp:
            raise ValueError(f"{len(prompts)} prompts ran out after {now:.2f} s, before the "
                             f"ramp ({ramp:g} s) of a {seconds:g}-s run at {level} in flight")
        if ids is not None:
            engine.add_request(ids, params)
        return ids is not None

    for _ in range(level):
        submit(0.0)
    counted, done, window = 0, [], None  # window: when the pool ran out, if it did
    start = clock()
    while window is None:
        deltas = engine.step()
        now = clock() - start
        if now >= seconds:
            break
        if now >= ramp:
            counted += sum(len(c.token_ids) for d in deltas for c in d.completions)
        for d in deltas:
            if d.error is not None:
                raise d.error
            if d.finished:
                done.append(d.output.outputs[0])
                if window is None and not submit(now):
                    window = now
    for request_id in engine.request_ids():
        engine.abort_request(request_id)
    while engine.has_unfinished():
        engine.step()
    if not done:
        raise ValueError(f"no request finished within {seconds} s: make the run longer")
    window = seconds if window is None else window
    return dict(_figures(done, window - ramp, window, counted), window_s=window)


def _figures(comps: list, seconds: float, wall: float, tokens: int | None = None) -> dict:
    """A run's figures: `tokens` (default: all of `comps`' output tokens) over `seconds`."""
    if tokens is None:
        tokens = sum(c.num_output_tokens for c in comps)
    e2e = [c.e2e_time for c in comps]
    ttft = [c.ttft for c in comps]
    drafted = [c.spec.drafted for c in comps if c.spec is not None]
    return {"requests": len(comps), "wall_s": wall, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "p50_latency_s": quantile(e2e, 0.5),
            "p95_latency_s": quantile(e2e, 0.95), "p50_ttft_s": quantile(ttft, 0.5),
            "p95_ttft_s": quantile(ttft, 0.95),
            "requests_drafting": sum(d > 0 for d in drafted) if drafted else None}


def summarize_levels(records: list[dict]) -> list[dict]:
    """Median over repeats of each (config, level); speedup over target only at that level."""
    keys = list(dict.fromkeys((r["config"], r["concurrency"]) for r in records))
    rows = []
    for config, level in keys:
        rs = [r for r in records if r["config"] == config and r["concurrency"] == level]
        row = {"config": config, "concurrency": level, "repeats": len(rs)}
        for field in ("tokens_per_s", "p50_latency_s", "p95_latency_s", "p50_ttft_s", "p95_ttft_s"):
            row[field] = statistics.median(r[field] for r in rs)
        rows.append(row)
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == "target only"}
    single = base.get(1)
    for r in rows:
        b = base.get(r["concurrency"])
        r["vs_target_only"] = r["tokens_per_s"] / b if b else None
        r["vs_single_target_only"] = r["tokens_per_s"] / single if single else None
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| config | concurrent | total tok/s | vs target only | vs 1 request target only "
             "| p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_target_only']:.2f}x" if r["vs_target_only"] else "–"
        single = f"{r['vs_single_target_only']:.2f}x" if r["vs_single_target_only"] else "–"
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{single} | {r['p50_latency_s']:.1f} | {r['p95_latency_s']:.1f} | "
                     f"{r['p50_ttft_s']:.2f} | {r['p95_ttft_s']:.2f} |")
    return "\n".join(lines)
