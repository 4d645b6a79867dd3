"""Decode and prefill speed of two checkouts, measured alternately in one run.

Each round runs `prefill_ttft.py` (time to first token of the ~900-token code_edit prompt, and
a 64-token greedy decode, target only, default weights) once per checkout, in a fresh process
whose `PYTHONPATH` is that checkout, the order alternating round by round; the first call of
each process warms up and is dropped. Each record keeps the process's log lines about its
prefill path (`prefill_path` auto chooses one by timing at start-up). The host drifts by more than a kernel change is worth
between minutes, so only sides measured side by side are compared. Writes one JSON line per
process and prints medians: prefill tokens/s (prompt tokens / TTFT) and decode tokens/s.

Two checkouts whose weight caches differ (another `CACHE_VERSION`) would each remove the
other's entry and repack at every start (the cache keeps one entry per file and format);
`--caches DIR` gives each side its own cache, `DIR/a` and `DIR/b` (`SPECSERVE_CACHE`), whose
`models` folder is a link to this cache's (the model files are shared, not copied).

    flock -x /tmp/specserve-cpu.lock python benchmarks/scripts/checkout_ab.py \\
        --a /tmp/base --b . --rounds 6 --caches ~/.cache/specserve-ab --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specserve import LLM
from specserve.bench import workloads

SCRIPT = Path(__file__).with_name("prefill_ttft.py")
DECODE_TOKENS = 64


def prompt_tokens() -> int:
    """The code_edit prompt's length under the default target's chat template (as timed)."""
    llm = LLM("qwen2.5-coder-1.5b", speculative_config=None)
    text = workloads.load("code_edit")
    return len(llm.tokenizer.encode_chat([{"role": "user", "content": f"[a0-1] {text}"}]))


def models_dir() -> Path:
    """This cache's model files (the cache root as specserve finds it: $SPECSERVE_CACHE, else
    $XDG_CACHE_HOME/specserve, else ~/.cache/specserve; scripts use the public API only)."""
    root = os.environ.get("SPECSERVE_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "specserve"
    return Path(root).expanduser() / "models"


def side_cache(root: Path, side: str) -> Path:
    """`root/side`, a cache of its own whose `models` links to this cache's model files."""
    cache = root.expanduser() / side
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    link = cache / "models"
    if not link.is_symlink():
        link.symlink_to(models_dir().resolve(), target_is_directory=True)
    return cache


def run(tree: Path, calls: int, tag: str, cache: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    if cache is not None:
        env["SPECSERVE_CACHE"] = str(cache)
    done = subprocess.run([sys.executable, str(SCRIPT), str(calls), tag], env=env, check=True,
                          capture_output=True, text=True)
    # what the process said of its prefill path (auto: chosen by timing at start-up)
    said = [line for line in done.stderr.splitlines() if "prefill" in line.lower()]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "prefill_log": said}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--a", type=Path, required=True, help="the first checkout (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="the second checkout")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=4, help="calls per process (the first dropped)")
    p.add_argument("--caches", type=Path, default=None,
                   help="a weight cache per side under this folder (see the module doc)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    caches = ({side: side_cache(args.caches, side) for side in ("a", "b")}
              if args.caches is not None else {"a": None, "b": None})
    tokens = prompt_tokens()
    samples = {"a": {"ttft": [], "decode": []}, "b": {"ttft": [], "decode": []}}
    with open(args.out, "w") as f:
        for r in range(args.rounds):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                tree = args.a if side == "a" else args.b
                got = run(tree, args.calls, f"{side}{r}", caches[side])
                f.write(json.dumps({"side": side, "tree": str(tree), "round": r,
                                    "prompt_tokens": tokens, **got}) + "\n")
                f.flush()
                for key in ("ttft", "decode"):
                    samples[side][key] += got[key][1:]
    for side in ("a", "b"):
        ttft = statistics.median(samples[side]["ttft"])
        decode = statistics.median(samples[side]["decode"])
        print(f"{side}: prefill {tokens / ttft:.1f} tok/s (TTFT {ttft:.3f} s), decode "
              f"{DECODE_TOKENS / decode:.2f} tok/s ({decode:.3f} s per {DECODE_TOKENS})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
