"""The frontier suite: what each lossy verifier buys in end-to-end speed and what it costs in
quality a user would notice, side by side.

Methods (one curve each): target only; lossless speculation (`sampling/rejection.py`, D = 0);
mentored decoding with a flat TV budget D; mentored decoding with the entropy-aware budget
D_i = D * h_k(p_i) (`sampling/entropy.py`); FLy (`sampling/fly.py`) at several windows and
thresholds. Every speculative configuration drafts k tokens a round with the same draft
model, so the methods differ only in the verifier. They run on the task set
(`bench/tasks/`, judged by `bench/checkers.py`; replies stop at EOS) and on the creative
workload (EOS ignored), at each temperature, for several seeds; greedy target-only and
lossless runs, which do not depend on the seed, run once.

Calls are interleaved: for each (prompt, seed), every configuration runs once before the
next, so the drift of a shared machine slows all configurations alike. Per configuration
and temperature the summary gives
- accuracy on the tasks with a Wilson 95% interval over the task calls (calls of one task
  under different seeds are not independent, so at T > 0 the interval is optimistic);
- the target's NLL per token and distinct-2 of the creative text (`bench/quality.py`);
- acceptance (accepted / drafted drafts) and the mean realised TV per verified position;
- E2E speedup: target-only seconds per generated token over this configuration's, both
  summed over the same (prompt, seed) calls (prefill included; per token, because replies
  that stop at EOS differ in length between configurations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specserve.bench.checkers import check
from specserve.bench.quality import distinct_n, target_nll
from specserve.bench.tasks import Task
from specserve.sampling.params import SamplingParams

CREATIVE = "creative"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class FrontierConfig:
    name: str
    method: str  # the curve it belongs to
    spec: dict | None = None  # speculative_config without "model"; None: target only
    sampling: dict = field(default_factory=dict)  # the verifier's SamplingParams fields
    setting: str = ""  # its point's label on the curve


@dataclass(frozen=True)
class FrontierOptions:
    temperatures: tuple[float, ...] = (0.0, 0.7)
    seeds: int = 3
    max_tokens: int = 256
    quality: bool = True  # score the target's NLL of every reply

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")


def frontier_configs(k: int = 6) -> list[FrontierConfig]:
    """Target only, lossless, flat TV budgets, entropy-aware budgets and FLy settings, all
    drafting k tokens a round."""
    if k < 2:
        raise ValueError(f"k must be >= 2 (FLy needs a window after a draft), got {k}")
    spec = {"method": "draft_model", "num_speculative_tokens": k}
    out = [FrontierConfig("target only", "target only"),
           FrontierConfig(f"lossless k={k}", "lossless", spec, {"tv_budget": 0.0}, "D=0")]
    out += [FrontierConfig(f"TV={d:g} k={k}", "mentored", spec, {"tv_budget": d}, f"D={d:g}")
            for d in (0.25, 0.5, 0.75, 1.0)]
    out += [FrontierConfig(f"TV={d:g}·h8 k={k}", "mentored (entropy)", spec,
                           {"tv_budget": d, "tv_entropy_top_k": 8}, f"D={d:g}")
            for d in (0.5, 1.0)]
    fly = [(w, tau) for w, tau in ((1, 0.3), (2, 0.3), (4, 0.3), (2, 0.6)) if w < k]
    out += [FrontierConfig(f"FLy W={w} tau={tau:g} k={k}", "FLy", spec,
                           {"tv_budget": 0.0, "fly_window": w, "fly_entropy_threshold": tau},
                           f"W={w} τ={tau:g}") for w, tau in fly]
    return out


def seeds_for(cfg: FrontierConfig, temperature: float, seeds: int) -> list[int]:
    """Greedy target-only and lossless output does not depend on the seed: one call."""
    if temperature == 0 and cfg.method in ("target only", "lossless"):
        return [0]
    return list(range(seeds))


class FrontierRun:
    """Holds one LLM per distinct speculative config (the verifier is per request) and runs
    the interleaved calls; `records()` yields one dict per call."""

    def __init__(self, bench, configs: list[FrontierConfig], tasks: list[Task], creative: str,
                 options: FrontierOptions, progress=None) -> None:
        self.bench, self.configs, self.tasks, self.opt = bench, configs, tasks, options
        self.progress = progress
        self.prompts = [(t.id, t.kind, bench.prompt_ids(t.prompt), t) for t in tasks]
        self.prompts.append((CREATIVE, CREATIVE, bench.prompt_ids(creative), None))
        longest = max(len(ids) for _, _, ids, _ in self.prompts)
        self._llms: dict[str, object] = {}
        self._max_len = longest + options.max_tokens + 24

    def count(self) -> int:
        return sum(len(seeds_for(c, t, self.opt.seeds)) * len(self.prompts)
                   for t in self.opt.temperatures for c in self.configs)

    def llm(self, cfg: FrontierConfig):
        """The LLM for cfg's speculative config, built (and warmed up once on the longest
        prompt, so its KV blocks are mapped before any timed call) on first use."""
        from specserve.llm import LLM

        key = repr(sorted((cfg.spec or {}).items()))
        if key not in self._llms:
            spec = dict(cfg.spec, model=str(self.bench.draft.path)) if cfg.spec else None
            llm = LLM(self.bench.target, draft=self.bench.draft, speculative_config=spec,
                      max_num_seqs=1, max_model_len=self._max_len, enable_prefix_caching=False)
            longest = max((p[2] for p in self.prompts), key=len)
            llm.generate(longest, SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True,
                                                 temperature=0.0))
            self._llms[key] = llm
        return self._llms[key]

    def warm_up(self) -> None:
        """One short untimed call per configuration and temperature (the verifier's code
        path), on the first 32 tokens of the first prompt."""
        ids = self.prompts[0][2][:32]
        for temperature in self.opt.temperatures:
            for cfg in self.configs:
                params = SamplingParams(temperature=temperature, max_tokens=WARMUP_TOKENS,
                                        ignore_eos=True, seed=0, **cfg.sampling)
                self.llm(cfg).generate(ids, params)

    def records(self):
        self.warm_up()
        for temperature in self.opt.temperatures:
            for workload, kind, ids, task in self.prompts:
                for seed in range(self.opt.seeds):
                    for cfg in self.configs:
                        if seed in seeds_for(cfg, temperature, self.opt.seeds):
                            yield self._call(cfg, temperature, workload, kind, ids, task, seed)

    def _call(self, cfg, temperature, workload, kind, ids, task, seed) -> dict:
        params = SamplingParams(temperature=temperature, max_tokens=self.opt.max_tokens,
                                ignore_eos=task is None, seed=seed, **cfg.sampling)
        out = self.llm(cfg).generate(ids, params)[0].outputs[0]
        if self.progress is not None:
            self.progress.update(1)
        rec = {"config": cfg.name, "method": cfg.method, "setting": cfg.setting,
               "temperature": temperature, "workload": workload, "kind": kind, "seed": seed,
               "e2e_s": out.e2e_time, "output_tokens": out.num_output_tokens,
               "decode_tokens_per_s": out.decode_tokens_per_s,
               "speculative": out.spec.as_dict() if out.spec else None,
               "distinct_2": distinct_n(out.token_ids, 2), "text": out.text}
        if self.opt.quality:
            rec["nll"] = target_nll(self.bench.target.model, ids, out.token_ids)
        if task is not None:
            verdict = check(task, out.text)
            rec.update(correct=verdict.correct, exact=verdict.exact, reason=verdict.reason)
        return rec


# ---------------------------------------------------------------- summary

def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (n = 0: (0, 1))."""
    if n == 0:
        return 0.0, 1.0
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize_frontier(records: list[dict]) -> list[dict]:
    """One row per (config, temperature), in the order the records first name them."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["config"], r["temperature"]), []).append(r)
    base = {(r["temperature"], r["workload"], r["seed"]): r for r in records
            if r["method"] == "target only"}
    return [_row(rs, base) for rs in groups.values()]


def _row(rs: list[dict], base: dict) -> dict:
    first = rs[0]
    tasks = [r for r in rs if r["kind"] != CREATIVE]
    creative = [r for r in rs if r["kind"] == CREATIVE]
    right = sum(bool(r["correct"]) for r in tasks)
    lo, hi = wilson(right, len(tasks))
    specs = [r["speculative"] for r in rs if r["speculative"]]
    drafted = sum(s["drafted"] for s in specs)
    tvs = [s["mean_tv"] for s in specs if s["mean_tv"] is not None]
    kinds = sorted({r["kind"] for r in tasks})
    return {
        "config": first["config"], "method": first["method"], "setting": first["setting"],
        "temperature": first["temperature"], "calls": len(rs), "task_calls": len(tasks),
        "accuracy": right / len(tasks) if tasks else None,
        "accuracy_lo": lo if tasks else None, "accuracy_hi": hi if tasks else None,
        "accuracy_by_kind": {k: _mean([bool(r["correct"]) for r in tasks if r["kind"] == k])
                             for k in kinds},
        "code_exact": _mean([bool(r["exact"]) for r in tasks if r["kind"] == "code_edit"]),
        "nll_tasks": _mean([r.get("nll") for r in tasks]),
        "nll": _mean([r.get("nll") for r in creative]),
        "distinct_2": _mean([r["distinct_2"] for r in creative]),
        "acceptance": sum(s["accepted"] for s in specs) / drafted if drafted else None,
        "mean_tv": _mean(tvs) if tvs else (0.0 if specs else None),
        "speedup_e2e": _speedup(rs, base),
        "speedup_e2e_creative": _speedup(creative, base),
    }


def _speedup(rs: list[dict], base: dict) -> float | None:
    """Target-only seconds per token over this row's, summed over the same (prompt, seed)
    calls; a greedy target-only call (one seed) stands for every seed."""
    mine_s = mine_n = theirs_s = theirs_n = 0.0
    for r in rs:
        b = base.get((r["temperature"], r["workload"], r["seed"])) or \
            base.get((r["temperature"], r["workload"], 0))
        if b is None or r["e2e_s"] is None or b["e2e_s"] is None:
            continue
        mine_s, mine_n = mine_s + r["e2e_s"], mine_n + r["output_tokens"]
        theirs_s, theirs_n = theirs_s + b["e2e_s"], theirs_n + b["output_tokens"]
    if not (mine_s and mine_n and theirs_s and theirs_n):
        return None
    return (theirs_s / theirs_n) / (mine_s / mine_n)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def pareto(rows: list[dict], x: str, y: str, higher_y: bool = True) -> list[dict]:
    """Rows no other row beats on both x (higher is better) and y; sorted by x."""
    pts = [r for r in rows if r.get(x) is not None and r.get(y) is not None]

    def better(a: dict, b: dict) -> bool:  # a dominates b
        ya, yb = (a[y], b[y]) if higher_y else (-a[y], -b[y])
        return a[x] >= b[x] and ya >= yb and (a[x] > b[x] or ya > yb)

    return sorted((r for r in pts if not any(better(o, r) for o in pts)), key=lambda r: r[x])
