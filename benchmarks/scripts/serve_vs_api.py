"""`specserve serve` against the Python API on one prompt, alternated call by call: decode rate
of a streamed chat completion (target only, greedy, EOS ignored) beside `LLM.generate`'s.

    python benchmarks/scripts/serve_vs_api.py

The server keeps its prefix cache (its default), so its TTFT after the first call is a cache
hit; the decode rates are what to compare (tokens after the first over the time after it).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from specserve.bench import workloads
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
N = 128
msg = workloads.load("creative")
srv = subprocess.Popen([str(Path(sys.executable).with_name("specserve")), "serve", "--no-speculation", "--port", "8765", "--no-access-log"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:8765/v1/models", timeout=1); break
    except Exception: time.sleep(1)
def via_server():
    body = json.dumps({"model": "qwen2.5-coder-1.5b", "messages": [{"role": "user", "content": msg}], "max_tokens": N,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:8765/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter(); times = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content"' in line: times.append(time.perf_counter())
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]), len(times)
torch.set_num_threads(2)
t = load_model("qwen2.5-coder-1.5b"); tok = t.tokenizer
llm = LLM(t, enable_prefix_caching=False)
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))
def via_api():
    o = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0].outputs[0]
    return o.ttft, o.decode_tokens_per_s, len(o.token_ids)
via_server(); via_api()
for r in range(3):
    s = via_server(); a = via_api()
    print(r, "server ttft %.2f dec %.2f (%d chunks) | api ttft %.2f dec %.2f" % (s[0], s[1], s[2], a[0], a[1]), flush=True)
srv.send_signal(signal.SIGTERM); srv.wait(30)
