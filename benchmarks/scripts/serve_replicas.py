"""Throughput and latency of `specserve serve` at C concurrent streaming clients: one engine in
the process, then `--replicas 1`, `--replicas 2`, ... (Ray Serve), same model and flags.

    .venv/bin/python benchmarks/scripts/serve_replicas.py --model qwen2.5-coder-0.5b \
        --replicas 0 1 2 --clients 8 --requests 3 --max-tokens 64

Replicas 0 = the single-process server (no Ray). Each client sends its requests one after the
other (streamed completions, greedy, ignore_eos, distinct prompts); per request we time the
first token and the whole stream, and the CPU seconds the server's whole process tree (HTTP
process, Ray's daemons, the replicas) spent per 1,000 generated tokens, a figure that holds up
on a busy machine where wall-clock figures do not. On one machine the replicas share its cores,
so more replicas show Ray's overhead, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, replicas: int, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", args.model, "--no-speculation",
           "--port", str(port), "--max-num-seqs", str(args.clients), "--kv-cache-memory", args.kv_cache_memory,
           "--no-access-log", "--log-level", "warning", "--served-model-name", "m"]
    if replicas:
        cmd += ["--replicas", str(replicas)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def one(base: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - t0, tokens


def tree_cpu_seconds(root: int) -> tuple[float, float]:
    """user + system CPU seconds of `root` and all its descendants, and of `root` alone (/proc)."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0.0) for p in tree), cpu.get(root, 0.0)


def run(args, base: str, pid: int) -> dict:
    one(base, "warm up", 8)
    cpu0 = tree_cpu_seconds(pid)
    lat, ttfts, tokens, errors = [], [], [0], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(args.requests):
            try:
                ttft, e2e, n = one(base, f"client {c} request {r}: write a function that", args.max_tokens)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                continue
            with lock:
                lat.append(e2e)
                ttfts.append(ttft)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu, http_cpu = (b - a for a, b in zip(cpu0, tree_cpu_seconds(pid)))
    q = statistics.quantiles(lat, n=20)
    return {"tokens_per_s": tokens[0] / wall, "requests_per_s": len(lat) / wall, "p50_s": statistics.median(lat),
            "p95_s": q[18], "ttft_p50_s": statistics.median(ttfts), "requests": len(lat), "errors": errors[:3],
            "wall_s": wall, "cpu_s_per_1k_tokens": 1000 * cpu / max(tokens[0], 1),
            "http_cpu_s_per_1k_tokens": 1000 * http_cpu / max(tokens[0], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--replicas", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every engine (the "
                   "replicas inherit it): the same threads per engine isolates Ray's overhead")
    p.add_argument("--log-dir", default="/tmp")
    args = p.parse_args()
    print(f"model {args.model}, {args.clients} clients x {args.requests} streamed requests of "
          f"{args.max_tokens} tokens, {os.cpu_count()} cores, OMP_NUM_THREADS {args.threads or 'unset'}")
    for n in args.replicas:
        proc, base = start(args, n, os.path.join(args.log_dir, f"serve-replicas-{n}.log"))
        try:
            res = run(args, base, proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        label = "single process (no Ray)" if n == 0 else f"{n} replica(s) (Ray Serve)"
        print(f"{label:26s} {res['tokens_per_s']:7.1f} tok/s {res['requests_per_s']:6.2f} req/s  "
              f"p50 {res['p50_s']:6.2f} s  p95 {res['p95_s']:6.2f} s  TTFT p50 {res['ttft_p50_s']:5.2f} s  "
              f"CPU {res['cpu_s_per_1k_tokens']:5.1f} s/1k tokens (HTTP process {res['http_cpu_s_per_1k_tokens']:4.1f})  "
              f"({res['requests']} requests, {res['wall_s']:.0f} s; errors {res['errors']})", flush=True)


if __name__ == "__main__":
    main()
