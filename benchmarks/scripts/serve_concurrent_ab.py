# Run: specserve serve --port 8201 & specserve serve --port 8202 --no-speculation &, then
#      python benchmarks/scripts/serve_concurrent_ab.py 8201,8202 128 3
"""Two running servers, streamed chat completions from 4 clients at once (each prompt with a
fresh prefix, so no cache serves it), the two servers
alternated batch by batch: total output tokens/s per server (median of batches)."""
import json, sys, time, statistics, http.client, threading
from specserve.bench import workloads
ports = [int(p) for p in sys.argv[1].split(",")]; n = int(sys.argv[2]); reps = int(sys.argv[3])
prompts = [workloads.load("code_edit"), workloads.load("creative"), workloads.load("summarize"), workloads.load("chat_short")]
def call(port, text, out, i, salt):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = json.dumps({"model": "qwen2.5-coder-1.5b", "messages": [{"role": "user", "content": f"[{salt}] " + text}],
                       "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); toks = 0
    for line in r:
        line = line.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            d = json.loads(line[5:])
            if d.get("usage"): toks = d["usage"]["completion_tokens"]
    out[i] = toks
res = {p: [] for p in ports}
for r in range(reps + 1):
    for p in (ports if r % 2 == 0 else ports[::-1]):
        out = {}; th = [threading.Thread(target=call, args=(p, t, out, i, f"{time.time_ns()}-{i}")) for i, t in enumerate(prompts)]
        t0 = time.perf_counter(); [t.start() for t in th]; [t.join() for t in th]
        if r: res[p].append(sum(out.values()) / (time.perf_counter() - t0))
for p in ports: print(p, "total tok/s median %.1f" % statistics.median(res[p]), [round(x, 1) for x in res[p]])
print("ratio %.3f" % (statistics.median(res[ports[0]]) / statistics.median(res[ports[1]])))
