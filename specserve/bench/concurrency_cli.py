"""`specserve bench --concurrency`: its flags and the run (see `bench/concurrency.py`).

Each level serves that many requests at once for target only, the default hybrid speculation,
and the hybrid with `disable_by_batch_size` (the third configuration), one engine per
configuration; `--sustained S` keeps them in flight for S seconds instead of one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.bench import workloads
from specserve.bench.runner import Bench, BenchOptions, log, machine_info
from specserve.flags import add_flag, build, flag_errors
from specserve.sampling.params import SamplingParams
from specserve.speculative.config import SpeculativeConfig


def add_concurrency_args(p) -> None:
    g = p.add_argument_group("--concurrency")
    g.add_argument("--concurrency", default=None, metavar="LEVELS",
                   help="e.g. 1,2,4,8,16: serve that many requests at once per level, target "
                   "only vs cost-aware speculation with and without --disable-by-batch-size "
                   "(code_edit and creative unless --workloads says otherwise)")
    g.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="--concurrency: keep that many requests in flight for SECONDS per run "
                   "(distinct requests, tokens counted after the first sixth) instead of serving "
                   "one batch; see specserve.bench.concurrency")
    add_flag(g, SpeculativeConfig, "disable_by_batch_size", default=4)  # the third configuration's


def concurrency_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"--concurrency must be a comma-separated list of positive ints, "
                         f"got {text!r}")
    return levels


def cmd_concurrency(args, prompt_files: dict[str, Path]) -> int:
    """`--concurrency`: every flag checked before anything loads, then the levels run."""
    from specserve.bench import concurrency as cc
    from specserve.bench.request_pool import distinct_pool

    levels = concurrency_levels(args.concurrency)
    if args.sustained < 0:
        raise ValueError(f"--sustained must be >= 0 seconds, got {args.sustained}")
    with flag_errors(SpeculativeConfig, ("disable_by_batch_size",)):
        SpeculativeConfig(disable_by_batch_size=args.disable_by_batch_size)
    if args.sustained:
        names = ("request_pool:mixed-even",)
        texts = [text for _, text in distinct_pool("mixed-even")]
    else:
        names = tuple(args.workloads or ("code_edit", "creative"))
        texts = list(workloads.resolve(names, prompt_files, args.workload_dir).values())
    configs = cc.default_configs(args.disable_by_batch_size)
    bench, llms = _engines(args, configs, texts, max(levels))
    ids = [bench.prompt_ids(t) for t in texts]
    args.out.mkdir(parents=True, exist_ok=True)
    records, offset = [], 0
    for level in levels:
        for rep in range(args.repeats):
            for cfg, llm in zip(configs, llms):
                if args.sustained:  # the same requests for every configuration
                    run = cc.run_sustained(llm, ids, level, args.max_tokens, 0.0,
                                           args.sustained, args.sustained / 6)
                    if run["window_s"] < args.sustained:
                        log(f"# {cfg.name} x{level}: the {len(ids)} requests ran out after "
                            f"{run['window_s']:.2f} s; counted up to then")
                else:
                    prompts = cc.unique_prompts(bench, texts, level, offset)
                    offset += level
                    run = cc.run_level(llm, prompts, args.max_tokens, 0.0)
                rec = {"config": cfg.name, "concurrency": level, "repeat": rep, **run}
                records.append(rec)
                log(f"# {cfg.name} x{level} (repeat {rep}): {rec['tokens_per_s']:.1f} tok/s, "
                    f"p50 latency {rec['p50_latency_s']:.1f}s, p50 TTFT {rec['p50_ttft_s']:.2f}s")
    _write(args, bench, levels, names, records)
    return 0


def _engines(args, configs, texts: list[str], max_level: int):
    """The `Bench` (target and draft loaded) and one warmed-up `LLM` per configuration."""
    from specserve.llm import LLM
    from specserve.weights.loader import load_model

    target = load_model(args.model, args.dtype, args.weights)
    draft = load_model(args.draft_model, args.dtype, args.weights, draft=True)
    log(f"# loaded {target.path.name} ({target.load_seconds:.1f}s) and {draft.path.name} "
        f"({draft.load_seconds:.1f}s)")
    bench = Bench(target, draft, build(BenchOptions, args))
    longest = max(len(bench.prompt_ids(t)) for t in texts) + 16
    llms = []
    for cfg in configs:
        spec = dict(cfg.spec, model=str(draft.path)) if cfg.spec else None
        llms.append(LLM(target, draft=draft, speculative_config=spec, max_num_seqs=max_level,
                        max_model_len=longest + args.max_tokens + 24))
        llms[-1].generate(bench.prompt_ids(texts[0])[:32],
                          SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
    return bench, llms


def _write(args, bench, levels: list[int], names: tuple, records: list[dict]) -> None:
    """concurrency.json (every record, the summary, the machine) and concurrency.md."""
    from specserve.bench import concurrency as cc

    rows = cc.summarize_levels(records)
    machine = machine_info(args.dtype)
    machine.update(weights=args.weights, target_load_s=bench.target.load_seconds,
                   draft_load_s=bench.draft.load_seconds)
    payload = {"suite": "concurrency", "machine": machine, "levels": levels, "workloads": names,
               "sustained_s": args.sustained, "max_tokens": args.max_tokens,
               "records": records, "summary": rows}
    (args.out / "concurrency.json").write_text(json.dumps(payload, indent=1, default=str))
    table = cc.markdown(rows)
    short = [r for r in records if r.get("window_s", args.sustained) < args.sustained]
    cut = (f"the pool of requests ran out early in {len(short)} run(s), which counted up to then "
           f"(shortest {min(r['window_s'] for r in short):.2f} s); " if short else "")
    (args.out / "concurrency.md").write_text(
        f"# specserve bench --concurrency\n\nMachine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['threads']} threads, weights {args.weights} ({machine['time']}). Workloads "
        f"{', '.join(names)}, {args.max_tokens} tokens each, greedy, EOS ignored; "
        + (f"each level's requests kept in flight for {args.sustained:g} s, tokens counted after "
           f"{args.sustained / 6:g} s; {cut}" if args.sustained else "each level one batch; ")
        + f"median of {args.repeats} repeat(s).\n\n{table}\n")
    print(table)
    log(f"# wrote {args.out / 'concurrency.json'}, {args.out / 'concurrency.md'}")
