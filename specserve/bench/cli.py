"""`specserve bench`: run a suite, print its table as it goes, write JSON/Markdown/PNG."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from specserve.bench import concurrency_cli, frontier_cli, peers, report, suites, workloads
from specserve.bench.runner import Bench, BenchOptions, log, machine_info, summarize
from specserve.flags import add_flag, add_flags, build
from specserve.hub.registry import DEFAULT_DRAFT
from specserve.speculative.config import SpeculativeConfig
from specserve.weights.config import LoadConfig

# what each optional part of the benchmark imports, and the extra that brings it
OPTIONAL = {"plots": (("matplotlib",), "matplotlib"),
            "transformers": (("transformers", "accelerate"), "transformers accelerate"),
            "llama.cpp": (("llama_cpp",), "llama-cpp-python"),
            "openvino": (("openvino_genai",), "openvino-genai")}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark suites: speed, acceptance and what was given up")
    p.add_argument("--suite", default="seed-table",
                   help=f"one of {sorted(suites.SUITES) + ['fidelity', 'frontier']} (fidelity: "
                   "the weight paths' log-probabilities against the file's float32 model; "
                   "`python -m specserve.bench.fidelity --help` for its options)")
    p.add_argument("--configs", default=None,
                   help="JSON list of {name, spec, temperature, workloads} (or a file holding "
                   "one) instead of a suite")
    add_flags(p, LoadConfig)
    add_flag(p, SpeculativeConfig, "model", default=DEFAULT_DRAFT)
    add_flags(p.add_argument_group("timing"), BenchOptions)
    p.add_argument("--workloads", nargs="*", default=None, help="restrict to these workload names")
    p.add_argument("--list-workloads", action="store_true",
                   help="list the shipped workloads and exit")
    p.add_argument("--workload-dir", type=Path, default=None,
                   help="read every workload NAME from DIR/NAME.txt instead of the shipped set")
    p.add_argument("--prompt-file", action="append", default=[], metavar="NAME=PATH",
                   help="a workload of your own, or a replacement for a shipped one (repeatable); "
                   "a suite runs every config on it, a --configs list only where a config names it")
    p.add_argument("--no-bonus-rows", action="store_true",
                   help="seed-table: skip the no-bonus rows")
    p.add_argument("--compare", action="append", default=[],
                   choices=["transformers", "llama.cpp", "openvino"],
                   help="also time this engine on the same weights (repeatable)")
    p.add_argument("--no-assisted", action="store_true",
                   help="--compare transformers: skip assisted generation (no draft model)")
    p.add_argument("--verify-cost", type=int, default=0, metavar="MAX_K",
                   help="also measure T_verify(k)/T_decode for k = 1..MAX_K on the target")
    concurrency_cli.add_concurrency_args(p)
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="the folder the reports are written to (default: bench-out)")
    frontier_cli.add_frontier_args(p)
    p.set_defaults(func=cmd_bench)


def prompt_files(args) -> dict[str, Path]:
    """`--prompt-file NAME=PATH` flags as name → path."""
    files = {}
    for flag in args.prompt_file:
        name, sep, path = flag.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--prompt-file must be NAME=PATH, got {flag!r}")
        files[name] = Path(path)
    return files


def load_configs(args) -> list[suites.BenchConfig]:
    """The configurations to run. A `--configs` list keeps each config's own workloads (a
    `--prompt-file` only supplies prompts for the names it lists); a suite also runs every
    config on each `--prompt-file` workload it does not already have. `--workloads` then
    keeps only the names it gives."""
    extra = tuple(prompt_files(args))
    if args.configs:
        text = args.configs
        if not text.lstrip().startswith("["):  # a file holding the JSON list
            text = Path(text).read_text()
        raw = json.loads(text)
        configs = [suites.BenchConfig(c["name"], c.get("spec"), c.get("temperature", 0.0),
                                      tuple(c.get("workloads", ["creative"]))) for c in raw]
    else:
        configs = (suites.seed_table(bonus=not args.no_bonus_rows) if args.suite == "seed-table"
                   else suites.get_suite(args.suite))
        configs = [replace(c, workloads=tuple(dict.fromkeys(c.workloads + extra))) for c in configs]
    if args.workloads:
        configs = [replace(c, workloads=tuple(w for w in c.workloads if w in args.workloads))
                   for c in configs]
    return [c for c in configs if c.workloads]


def missing_optional(args) -> tuple[list[str], list[str]]:
    """What this run wants but cannot import: (error lines for requested peers, notes for
    parts that are skipped). Checked before anything loads or runs."""
    import importlib.util

    def absent(part: str) -> str | None:
        modules, package = OPTIONAL[part]
        if all(importlib.util.find_spec(m) is not None for m in modules):
            return None
        return package

    errors = [f"--compare {peer} needs `pip install {pkg}`" for peer in dict.fromkeys(args.compare)
              if (pkg := absent(peer))]
    notes = [f"matplotlib is not installed: the PNG plots are skipped (`pip install {pkg}` or "
             f"`pip install specserve[bench]` to get them)"] if (pkg := absent("plots")) else []
    return errors, notes


def list_workloads() -> int:
    for name in workloads.names():
        text = workloads.load(name)
        first = text.strip().splitlines()[0]
        print(f"{name:<12} {len(text):>6} chars  {first[:70]}{'…' if len(first) > 70 else ''}")
    return 0


def cmd_bench(args) -> int:
    if args.list_workloads:
        return list_workloads()
    if args.concurrency:
        return concurrency_cli.cmd_concurrency(args, prompt_files(args))
    if args.suite == "fidelity" and not args.configs:
        from specserve.bench import fidelity
        return fidelity.main(["--model", str(args.model), "--out", str(args.out)])
    if args.suite == "frontier" and not args.configs:
        return frontier_cli.cmd_frontier(args, prompt_files(args))
    configs = load_configs(args)
    if not configs:
        raise ValueError("no configuration has a workload left to run (check --workloads)")
    names = tuple(dict.fromkeys(w for c in configs for w in c.workloads))
    prompts = workloads.resolve(names, prompt_files(args), args.workload_dir)
    errors, notes = missing_optional(args)
    if errors:
        raise ValueError("; ".join(errors))
    for note in notes:
        log(f"# {note}")

    from tqdm import tqdm

    from specserve.weights.loader import load_model

    options = build(BenchOptions, args)
    target = load_model(args.model, args.dtype, args.weights)
    needs_draft = any(c.spec and suites.uses_draft(c.spec) for c in configs)
    wants_draft = needs_draft or ("transformers" in args.compare and not args.no_assisted)
    draft = (load_model(args.draft_model, args.dtype, args.weights, draft=True) if wants_draft
             else None)
    log(f"# loaded {target.path.name} ({target.load_seconds:.1f}s)"
        + (f" and {draft.path.name} ({draft.load_seconds:.1f}s)" if draft else ""))
    bench = Bench(target, draft, options)
    verify = _verify_cost(args, target)
    records = []
    suite = args.suite if not args.configs else "custom"
    args.out.mkdir(parents=True, exist_ok=True)
    # every record as it comes: an interrupted run keeps them
    partial = args.out / f"{suite}.records.jsonl"
    partial.write_text("")
    with tqdm(total=bench.count_runs(configs, prompts), desc="bench", unit="run") as bar:
        bench.progress = bar
        jobs = [(cfg, w, prompts[w]) for cfg in configs for w in cfg.workloads]
        done = Counter()
        for j, rec in bench.run_interleaved(jobs):
            records.append(rec)
            with partial.open("a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            cfg, w, _ = jobs[j]
            done[j] += 1
            if done[j] == bench.calls_for(cfg):  # its row is complete
                row = next(r for r in summarize(records) if r["config"] == cfg.name
                           and r["workload"] == w and r["temperature"] == cfg.temperature)
                bar.write(" | ".join(report.cell(row, k, f) for _, k, f in report.COLUMNS))
    rows = summarize(records)
    peer_rows = _peers(args, target, draft, bench, prompts, configs, options)
    peers.attach_ratios(peer_rows, rows)
    machine = machine_info(args.dtype)
    machine["weights"] = args.weights
    machine["target_load_s"] = target.load_seconds
    machine["draft_load_s"] = draft.load_seconds if draft else None
    machine["verify_cost_s"] = verify
    machine["memory"] = memory_ceiling(target, rows, options.max_tokens)
    out = report.write_report(args.out, suite, machine, asdict(options), records, rows, peer_rows,
                              plots=not notes)
    print(report.markdown_table(rows))
    if peer_rows:
        print()
        print(report.peer_table(peer_rows))
    log(f"# wrote {', '.join(str(p) for p in out.values())}")
    return 0


def memory_ceiling(target, rows: list[dict], max_tokens: int) -> dict:
    """This machine's read bandwidth and the target's memory-bound decode ceiling; each
    target-only row gains `fraction_of_ceiling`: its decode rate over the ceiling at its mean
    context (prompt + half the output)."""
    from specserve.bench.bandwidth import ceiling, read_bandwidth

    bw = read_bandwidth()
    kv_dtype = target.model.kv_cache_dtype()  # the engine's default ("auto") cache dtype
    for row in rows:
        if row["config"] == "target only" and row.get("prompt_tokens") is not None:
            at = ceiling(target.model, bw, row["prompt_tokens"] + max_tokens // 2, kv_dtype)
            row["fraction_of_ceiling"] = row["decode_tokens_per_s"] / at["ceiling_tokens_per_s"]
    return ceiling(target.model, bw)


def _verify_cost(args, target) -> dict | None:
    if not args.verify_cost:
        return None
    from specserve.bench.verify_cost import format_verify_cost, verify_cost
    from specserve.engine.runner import ModelRunner

    times = verify_cost(ModelRunner(target.model, num_blocks=512 // 16),
                        list(range(1, args.verify_cost + 1)))
    print(format_verify_cost(times))
    return times


def _peers(args, target, draft, bench, prompts, configs, options) -> list[dict]:
    """The peers' rows; a peer that fails is reported and skipped, never losing our results.
    The peers run single prompts: a session (several requests) has no peer row, rather than
    one that times its first request against our whole session."""
    import torch

    sessions = [w for w, p in prompts.items() if isinstance(p, workloads.Session)]
    if sessions:
        log(f"# the peers run single prompts: no peer rows for the sessions {', '.join(sessions)}")
    ids = {w: bench.prompt_ids(p) for w, p in prompts.items() if w not in sessions}
    temps = sorted({c.temperature for c in configs})
    runs = {
        "transformers": lambda: peers.run_transformers(
            target.path, draft.path if draft else None, args.dtype, ids, temps, options.max_tokens,
            options.repeats, options.seeds),
        "llama.cpp": lambda: peers.run_llama_cpp(
            target.path, ids, options.max_tokens, options.repeats, torch.get_num_threads(),
            target.tokenizer.eos_token_ids),
        "openvino": lambda: peers.run_openvino(
            target.path, ids, options.max_tokens, options.repeats, torch.get_num_threads()),
    }
    rows = []
    for name in dict.fromkeys(args.compare):
        log(f"# running {name} on the same GGUF weights ...")
        try:
            rows += runs[name]()
        except ImportError as e:
            log(f"# {name} is not installed ({e}): skipping that comparison")
        except Exception as e:  # a peer's failure must not lose our measurements
            log(f"# {name} failed: {type(e).__name__}: {e}; its rows are left out")
    return rows
