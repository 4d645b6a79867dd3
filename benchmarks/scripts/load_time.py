"""Cold and warm load times of the default pair with the default `weights="auto"` (int4-style
on the native kernels), each load in a fresh process as a user's command would run it.

Cold: the weight cache is empty (a temporary `$SPECSERVE_CACHE` whose `models` and `kernels`
link to the real ones, so only the repacked weights are missing); the load repacks and writes
the cache. Warm: the loads after it, which map the cache. Each figure is the wall time of the
`load_model` call (imports excluded), and the CPU time it used (user + system, all threads: on
a machine busy with other work, a steadier figure than the wall time); warm figures are
medians of `--repeats` processes, the two models' processes taking turns. Then the pair as
the engine loads it: both models, one after the other, in one process
(`one_process_warm_median_s`).

    python benchmarks/scripts/load_time.py [--repeats 5] [--models qwen2.5-coder-1.5b ...]
    python benchmarks/scripts/load_time.py --warm-only   # the real cache, as it is

`--warm-only` skips the cold loads and times loads against the real `$SPECSERVE_CACHE` (a first,
untimed load fills the weight cache if it lacks an entry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.paths import cache_dir

CHILD = """
import json, resource, sys, time, torch
torch.set_num_threads(2)
from specserve import kernels
from specserve.weights.loader import load_model
kernels.qmatmul()  # built once per kernel source (and flags), not per load: kept out of the figure
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
for name, role in zip(sys.argv[1::2], sys.argv[2::2]):  # in order, as the engine loads a pair
    start, start_cpu = time.perf_counter(), cpu()
    m = load_model(name, draft=role == "draft")
    print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": cpu() - start_cpu,
                      "cache_hit": m.cache_hit, "weights": m.weights}))
"""


def load_in_one_process(names: list[str], env: dict, drafts: list[str]) -> list[dict]:
    """Load `names` one after another in one fresh process: one record per model."""
    argv = [a for name in names for a in (name, "draft" if name in drafts else "target")]
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, check=True,
                         capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(names):]]


def load_once(name: str, env: dict, draft: bool) -> dict:
    return load_in_one_process([name], env, [name] if draft else [])[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[DEFAULT_TARGET, DEFAULT_DRAFT])
    p.add_argument("--drafts", nargs="*", default=[DEFAULT_DRAFT],
                   help="those of --models loaded as a draft model (int4-all), as the engine does")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm-only", action="store_true")
    args = p.parse_args()
    real = cache_dir()
    with tempfile.TemporaryDirectory(prefix="specserve-load-") as tmp:
        cache = real if args.warm_only else Path(tmp)
        if not args.warm_only:
            for sub in ("models", "kernels"):
                os.symlink(real / sub, cache / sub)
        env = dict(os.environ, SPECSERVE_CACHE=str(cache))
        cold = {name: load_once(name, env, name in args.drafts) for name in args.models}
        warm: dict[str, list[dict]] = {name: [] for name in args.models}
        together = []  # the models loaded in one process, as `LLM(...)` and `serve` load a pair
        for _ in range(args.repeats):
            for name in args.models:
                warm[name].append(load_once(name, env, name in args.drafts))
            together.append(load_in_one_process(args.models, env, args.drafts))
        sizes = {f.name: f.stat().st_size for f in (cache / "weights").glob("*.weights")}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {"models": {}, "cache_files_bytes": sizes, "loadavg": load}
    for name in args.models:
        assert (args.warm_only or not cold[name]["cache_hit"]) and all(w["cache_hit"] for w in warm[name])
        secs = [w["seconds"] for w in warm[name]]
        result["models"][name] = {
            "weights": cold[name]["weights"], "first_load_cache_hit": cold[name]["cache_hit"],
            "cold_s": round(cold[name]["seconds"], 2),
            "cold_cpu_s": round(cold[name]["cpu_seconds"], 2),
            "warm_median_s": round(statistics.median(secs), 2),
            "warm_median_cpu_s": round(statistics.median(w["cpu_seconds"] for w in warm[name]), 2),
            "warm_s": [round(s, 2) for s in secs]}
    result["pair_warm_median_s"] = round(sum(m["warm_median_s"]
                                             for m in result["models"].values()), 2)
    # in one process the second model reuses the first's tokenizer when their vocabularies
    # are the same bytes (gguf_file.StringArray.digest)
    result["one_process_warm_s"] = [round(sum(r["seconds"] for r in run), 2) for run in together]
    result["one_process_warm_median_s"] = statistics.median(result["one_process_warm_s"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
