"""`specserve bench --suite frontier`: its options and the run (see `bench/frontier.py`).

E.g. a small run: `specserve bench --suite frontier --tasks-per-kind 2 --seeds 1
--max-tokens 32 --temperatures 0,0.7`.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from specserve.bench import frontier, frontier_report, workloads
from specserve.bench.runner import Bench, BenchOptions, log, machine_info
from specserve.bench.tasks import KINDS, load_tasks


def add_frontier_args(p) -> None:
    g = p.add_argument_group("--suite frontier")
    g.add_argument("--tasks-per-kind", type=int, default=None,
                   help="frontier: the first N tasks of each kind (default: all)")
    g.add_argument("--task-kinds", default=",".join(KINDS),
                   help=f"frontier: comma-separated task kinds (default {','.join(KINDS)})")
    g.add_argument("--frontier-k", type=int, default=6,
                   help="frontier: draft tokens per round for every speculative configuration")
    g.add_argument("--temperatures", default="0,0.7",
                   help="frontier: comma-separated temperatures (default 0,0.7)")


def temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--temperatures must be comma-separated numbers >= 0, got {text!r}")
    return values


def cmd_frontier(args, prompt_files: dict) -> int:
    from tqdm import tqdm

    from specserve.weights.loader import load_model

    options = frontier.FrontierOptions(temperatures(args.temperatures), args.seeds,
                                       args.max_tokens, args.quality)
    tasks = load_tasks(tuple(k for k in args.task_kinds.split(",") if k), args.tasks_per_kind)
    creative = workloads.resolve((frontier.CREATIVE,), prompt_files, args.workload_dir)
    configs = frontier.frontier_configs(args.frontier_k)
    plots = _has_matplotlib()
    target = load_model(args.model, args.dtype, args.weights)
    draft = load_model(args.draft_model, args.dtype, args.weights, draft=True)
    log(f"# loaded {target.path.name} ({target.load_seconds:.1f}s) and {draft.path.name} "
        f"({draft.load_seconds:.1f}s); {len(tasks)} tasks + {frontier.CREATIVE}, "
        f"{len(configs)} configurations")
    bench = Bench(target, draft, BenchOptions(max_tokens=args.max_tokens))
    run = frontier.FrontierRun(bench, configs, tasks, creative[frontier.CREATIVE], options)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "frontier.records.jsonl"  # every call as it comes
    partial.write_text("")
    records = []
    with tqdm(total=run.count(), desc="frontier", unit="call") as bar:
        run.progress = bar
        for rec in run.records():
            records.append(rec)
            with partial.open("a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
    rows = frontier.summarize_frontier(records)
    machine = machine_info(args.dtype)
    machine.update(weights=args.weights, target=target.path.name, draft=draft.path.name)
    opts = dict(asdict(options), tasks=len(tasks), k=args.frontier_k,
                tasks_per_kind=args.tasks_per_kind)
    out = frontier_report.write_frontier(args.out, machine, opts, records, rows, plots)
    print(frontier_report.table(rows))
    print()
    print(frontier_report.frontier_table(rows))
    log(f"# wrote {', '.join(str(p) for p in out.values())}")
    return 0


def _has_matplotlib() -> bool:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        log("# matplotlib is not installed: the frontier PNG is skipped")
        return False
    return True
