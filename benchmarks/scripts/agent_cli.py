"""A coding agent people run (Codex CLI, Claude Code) doing a small task against running servers.

    specserve serve --port 8201 &  specserve serve --port 8202 --no-speculation &
    python benchmarks/scripts/agent_cli.py --agent codex --ports 8201,8202 \\
        --names default,no-spec --out benchmarks/results/agent-cli-zen4/codex.jsonl

Each run makes a scratch git repository with a small module whose one function is wrong and a
test file (`calc.py`, `test_calc.py`; every run its own names and bug, so no prompt repeats on
a server), asks the agent to read the module, fix it and run the tests, and judges the run by
running the tests itself afterwards. The agent reaches the server through a recording proxy in
this process, which reads each streamed answer as it passes: per request the prompt tokens and
the prefix cache's share of them (the wire's usage), the time to the first generated text or
tool-call byte (TTFT), the whole time, and the tool calls in it.

Codex CLI (`codex exec`) speaks the Responses API; its provider is written to a temporary
`CODEX_HOME`. Claude Code (`claude -p`) speaks the Messages API through `ANTHROPIC_BASE_URL`
with non-essential traffic off. The binaries are found on PATH or with `--bin`. Servers take
the runs in turn, `--runs` per server. One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from specserve.bench import sse

# (module function, wrong body, right body, test line): one per run, in turn
TASKS = [
    ("add", "return a - b", "return a + b", "assert {m}.add(2, 3) == 5"),
    ("mean", "return sum(xs) / (len(xs) + 1)", "return sum(xs) / len(xs)",
     "assert {m}.mean([1, 2, 3]) == 2"),
    ("clamp", "return max(hi, min(lo, x))", "return max(lo, min(hi, x))",
     "assert {m}.clamp(5, 0, 3) == 3"),
    ("last", "return xs[0]", "return xs[-1]", "assert {m}.last([1, 2, 3]) == 3"),
]
ARGS = {"add": "a, b", "mean": "xs", "clamp": "x, lo, hi", "last": "xs"}
MODULES = ["calc", "stats", "numbers", "helpers"]
PROMPT = ("The tests in test_{m}.py fail. Read {m}.py, fix the bug in it, then run the tests "
          "with `python -m pytest -q test_{m}.py` and tell me the result.")
TEXT_EVENTS = ("response.output_item.added", "response.output_text.delta",
               "response.function_call_arguments.delta", "content_block_start",
               "content_block_delta")  # the first of these: the first output


def make_repo(root: Path, index: int) -> tuple[Path, str]:
    """A scratch repository for run `index`: a module with one wrong function and its test."""
    name, wrong, _, check = TASKS[index % len(TASKS)]
    module = f"{MODULES[index // len(TASKS) % len(MODULES)]}{index}"
    repo = root / f"task{index}"
    repo.mkdir()
    (repo / f"{module}.py").write_text(
        f"def {name}({ARGS[name]}):\n    {wrong}\n\n\ndef double(x):\n    return 2 * x\n")
    (repo / f"test_{module}.py").write_text(
        f"import {module}\n\n\ndef test_{name}():\n    {check.format(m=module)}\n\n\n"
        f"def test_double():\n    assert {module}.double(4) == 8\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "task"],
                   cwd=repo, check=True)
    return repo, module


def _events(text: str):
    """The JSON objects of a recorded stream's events (`sse.events`), to a torn last line."""
    try:
        for event in sse.events(text.splitlines()):
            if isinstance(event, dict):
                yield event
    except ValueError:  # the stream was cut inside an event (its client left)
        return


def summarize(path: str, body: bytes, chunks: list[tuple[float, bytes]], total: float) -> dict:
    """One request's record from its streamed answer (Responses or Messages events)."""
    text = b"".join(c for _, c in chunks).decode("utf-8", "replace")
    ttft, tail = None, ""
    for t, chunk in chunks:  # the first chunk that completes an output event's type
        seen = (tail + chunk.decode("utf-8", "replace")).replace(" ", "")
        if any(f'"type":"{e}"' in seen for e in TEXT_EVENTS):
            ttft = t
            break
        tail = seen[-100:]  # a type split between two chunks
    record = {"path": path, "seconds": round(total, 2), "ttft": ttft and round(ttft, 2),
              "request_bytes": len(body)}
    for event in _events(text):
        kind = event.get("type")
        if kind == "response.completed":
            usage = event["response"].get("usage") or {}
            record["prompt"] = usage.get("input_tokens")
            record["cached"] = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            record["completion"] = usage.get("output_tokens")
            record["calls"] = [o.get("name") for o in event["response"]["output"]
                               if o.get("type") == "function_call"]
        elif kind == "message_start":
            usage = event["message"].get("usage") or {}
            record["cached"] = usage.get("cache_read_input_tokens", 0)
            record["prompt"] = usage.get("input_tokens", 0) + record["cached"]
        elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            record.setdefault("calls", []).append(event["content_block"]["name"])
        elif kind == "message_delta":
            record["completion"] = (event.get("usage") or {}).get("output_tokens")
            record.setdefault("calls", [])
    if text.startswith("{"):  # not streamed: the whole object
        whole = json.loads(text)
        usage = whole.get("usage") or {}
        record["prompt"] = usage.get("input_tokens")
        record["completion"] = usage.get("output_tokens")
        record["body"] = text[:300]
    return record


class Proxy:
    """A recording proxy on a free port in a thread: forwards everything to `upstream`."""

    def __init__(self, upstream: str):
        self.upstream, self.records = upstream, []
        self.client = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = Starlette(routes=[Route("/{path:path}", self.handle,
                                      methods=["GET", "POST", "HEAD"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    async def handle(self, request: Request):
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.upstream, timeout=None)
        body, start = await request.body(), time.perf_counter()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "accept-encoding")}
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        response = await self.client.send(
            self.client.build_request(request.method, url, content=body, headers=headers),
            stream=True)

        async def relay():
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append((time.perf_counter() - start, chunk))
                yield chunk
            await response.aclose()
            record = summarize(request.url.path, body, chunks, time.perf_counter() - start)
            record["status"] = response.status_code
            self.records.append(record)

        keep = {k: v for k, v in response.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")}
        return StreamingResponse(relay(), status_code=response.status_code, headers=keep)

    def close(self):
        self.server.should_exit = True
        self.thread.join(5)


def command(agent: str, binary: str, repo: Path, base: str, home: Path, model: str, key: str):
    """The agent's command line and environment, pointed at `base` (the proxy)."""
    env = dict(os.environ)
    if agent == "codex":
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\n'
            f'name = "local"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
            f'env_key = "LOCAL_KEY"\n')
        env.update(CODEX_HOME=str(home), LOCAL_KEY=key)
        return [binary, "exec", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "-C", str(repo)], env
    env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=key, ANTHROPIC_MODEL=model,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=model, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               IS_SANDBOX="1", HOME=str(home))
    home.mkdir(exist_ok=True)
    return [binary, "-p", "--dangerously-skip-permissions"], env


def run_one(agent: str, binary: str, port: int, index: int, root: Path, timeout: float,
            model: str, key: str) -> dict:
    repo, module = make_repo(root, index)
    proxy = Proxy(f"http://127.0.0.1:{port}")
    argv, env = command(agent, binary, repo, f"http://127.0.0.1:{proxy.port}",
                        root / f"home{index}", model, key)
    prompt = PROMPT.format(m=module)
    start = time.perf_counter()
    try:
        done = subprocess.run(argv + [prompt], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
        exit_code, out = done.returncode, done.stdout[-2000:] + done.stderr[-1000:]
    except subprocess.TimeoutExpired as stop:
        exit_code, out = "timeout", str(stop.stdout or "")[-2000:]
    seconds = time.perf_counter() - start
    time.sleep(1)
    proxy.close()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", f"test_{module}.py"], cwd=repo,
                           capture_output=True, text=True)
    diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True).stdout
    return {"agent": agent, "port": port, "task": index, "module": module,
            "seconds": round(seconds, 1), "exit": exit_code, "tests_pass": tests.returncode == 0,
            "diff": diff, "requests": proxy.records, "output_tail": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agent", choices=("codex", "claude"), required=True)
    parser.add_argument("--ports", required=True)
    parser.add_argument("--names", required=True)
    parser.add_argument("--runs", type=int, default=1, help="runs per server")
    parser.add_argument("--first-task", type=int, default=0)
    parser.add_argument("--bin", default=None)
    parser.add_argument("--model", default="qwen-coder")
    parser.add_argument("--key", default="x", help="the servers' --api-key, if any")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    binary = args.bin or shutil.which(args.agent)
    ports = [int(p) for p in args.ports.split(",")]
    names = args.names.split(",")
    root = Path(tempfile.mkdtemp(prefix="agent-cli-"))
    index = args.first_task
    for _ in range(args.runs):
        for port, name in zip(ports, names):  # sides in turn
            record = run_one(args.agent, binary, port, index, root, args.timeout, args.model,
                             args.key)
            record["server"] = name
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            calls = sum(len(r.get("calls") or []) for r in record["requests"])
            print(f"{name}: task {index} {record['seconds']} s, tests pass "
                  f"{record['tests_pass']}, {len(record['requests'])} requests, {calls} calls",
                  flush=True)
            index += 1


if __name__ == "__main__":
    main()
