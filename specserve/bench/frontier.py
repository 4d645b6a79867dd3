"""The frontier suite: what each lossy verifier buys in end-to-end speed and what it costs in
quality a user would notice, measured against target-only decoding on the same items.

Configurations (`fidelity_configs`, the default set; `frontier_configs`, a wider grid): target
only; the lossless default (hybrid drafting, controller-chosen k), the reference; lossless
drafting with the draft model at a fixed k; mentored decoding with a flat TV budget D
(`sampling/rejection.py`) and with the entropy-aware budget D_i = D * h_k(p_i)
(`sampling/entropy.py`); FLy (`sampling/fly.py`), ours and as published (its k = 15, win_len
6, threshold 0.3 nats). The lossy settings draft with the draft model at a fixed k, so they
differ from the fixed-k lossless row only in the verifier.

Items: the tasks (`bench/tasks/`, HumanEval problems `bench/humaneval.py`; judged by
`bench/checkers.py`; replies stop at EOS or the task's stop strings) and the creative prompt
(EOS ignored; NLL and distinct-2). Every configuration makes `seeds` calls per item and
temperature, seeds 0..seeds-1, also where its output cannot depend on the seed: a
deterministic configuration's repeated outputs are collapsed into one in the summary
(`bench/frontier_summary.py`) and its calls still time its cells. Calls alternate: for each
(item, seed) every configuration runs once before the next, in the set's order on even items
and the reverse on odd ones, so the drift of a shared machine slows all configurations alike
and no configuration always runs first; the drafting caches are emptied before every call.
A run grows piece by piece (`bench/frontier_records.py`): cells already recorded are skipped,
and a piece stops starting items at its deadline.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from specserve.bench.checkers import check
from specserve.bench.humaneval import chat_ids
from specserve.bench.quality import distinct_n, target_nll
from specserve.bench.tasks import Task
from specserve.sampling.params import PUBLISHED_FLY_WINDOW, SamplingParams

CREATIVE = "creative"
WARMUP_TOKENS = 8
TARGET_ONLY = "target only"
REFERENCE = "lossless (default)"
PUBLISHED_FLY_K = 15  # the draft length of FLy's published configuration


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
    seeds: int = 3  # calls per (configuration, item, temperature): seeds 0..seeds-1
    max_tokens: int = 256
    quality: bool = True  # score the target's NLL of every distinct reply
    creative: bool = True  # the creative prompt beside the tasks

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")


def _draft(k: int) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k}


def reference_configs(k: int) -> list[FrontierConfig]:
    """Target only, the lossless default (the reference) and lossless drafting at fixed k."""
    return [FrontierConfig(TARGET_ONLY, TARGET_ONLY),
            FrontierConfig(REFERENCE, REFERENCE, {"method": "hybrid",
                                                  "num_speculative_tokens": -1}, {}, "default"),
            FrontierConfig(f"lossless k={k}", "lossless", _draft(k), {"tv_budget": 0.0},
                           f"k={k}")]


def fly_ours(window: int, tau: float, k: int) -> FrontierConfig:
    return FrontierConfig(f"FLy W={window} tau={tau:g} k={k}", "FLy (specserve)", _draft(k),
                          {"tv_budget": 0.0, "fly_window": window, "fly_entropy_threshold": tau},
                          f"W={window} τ={tau:g}")


def fly_published() -> FrontierConfig:
    """FLy's published configuration: k = 15 drafts, win_len 6, 0.3 nats over the top 3."""
    return FrontierConfig(f"FLy published k={PUBLISHED_FLY_K}", "FLy (published)",
                          _draft(PUBLISHED_FLY_K),
                          {"tv_budget": 0.0, "fly_variant": "published",
                           "fly_window": PUBLISHED_FLY_WINDOW, "fly_entropy_threshold": 0.3},
                          f"win={PUBLISHED_FLY_WINDOW} τ=0.3 nats k={PUBLISHED_FLY_K}")


def mentored(d: float, k: int, entropy_top_k: int | None = None) -> FrontierConfig:
    if entropy_top_k is None:
        return FrontierConfig(f"TV={d:g} k={k}", "mentored", _draft(k), {"tv_budget": d},
                              f"D={d:g}")
    return FrontierConfig(f"TV={d:g}·h{entropy_top_k} k={k}", "mentored (entropy)", _draft(k),
                          {"tv_budget": d, "tv_entropy_top_k": entropy_top_k}, f"D={d:g}")


def fidelity_configs(k: int = 6) -> list[FrontierConfig]:
    """The default set: references, flat budgets 0.25 and 0.5, the entropy-aware budget 1,
    our FLy W = 2 (tau 0.3) and FLy as published."""
    if k < 3:
        raise ValueError(f"k must be >= 3 (FLy W = 2 needs a window after a draft), got {k}")
    return (reference_configs(k) + [mentored(0.25, k), mentored(0.5, k), mentored(1.0, k, 8),
                                    fly_ours(2, 0.3, k), fly_published()])


def frontier_configs(k: int = 6) -> list[FrontierConfig]:
    """The wider grid: references, flat budgets 0.25-1, entropy-aware budgets 0.5 and 1, four
    settings of our FLy (those whose window fits in k) and FLy as published."""
    if k < 2:
        raise ValueError(f"k must be >= 2 (FLy needs a window after a draft), got {k}")
    out = reference_configs(k) + [mentored(d, k) for d in (0.25, 0.5, 0.75, 1.0)]
    out += [mentored(d, k, 8) for d in (0.5, 1.0)]
    out += [fly_ours(w, tau, k) for w, tau in ((1, 0.3), (2, 0.3), (4, 0.3), (2, 0.6)) if w < k]
    return out + [fly_published()]


def lossy_configs(k: int = 6) -> list[FrontierConfig]:
    """The set sized to fit 164 HumanEval problems at T = 0, one call per cell: target only,
    the lossless default (its text at T = 0 is target only's, so it is there for its speed,
    paired with target only item by item) and the five lossy settings of the fidelity set."""
    return [c for c in fidelity_configs(k) if c.method != "lossless"]


CONFIG_SETS = {"fidelity": fidelity_configs, "grid": frontier_configs, "lossy": lossy_configs}


def select_configs(configs: list[FrontierConfig], names: str | None) -> list[FrontierConfig]:
    """The configurations named in a comma-separated list (None: all); target only is always
    kept, as every comparison is against it."""
    if not names:
        return configs
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {c.name for c in configs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"frontier configs must be among {sorted(known)}, got {unknown}")
    return [c for c in configs if c.name in wanted or c.method == TARGET_ONLY]


class FrontierRun:
    """Holds one LLM per distinct speculative config (the verifier is per request) and runs
    the alternated calls; `records()` yields one dict per call."""

    def __init__(self, bench, configs: list[FrontierConfig], tasks: list[Task], creative: str,
                 options: FrontierOptions, progress=None, skip: frozenset = frozenset(),
                 deadline: float | None = None) -> None:
        self.bench, self.configs, self.tasks, self.opt = bench, configs, tasks, options
        self.progress = progress
        self.skip = skip  # cells (config, temperature, item, seed) already recorded
        self.deadline = deadline  # time.monotonic() after which no new item starts
        tok = bench.target.tokenizer
        self.prompts = [(t.id, t.kind, chat_ids(tok, t.prompt, t.response_prefix)
                         if t.response_prefix else bench.prompt_ids(t.prompt), t) for t in tasks]
        if options.creative:
            self.prompts.append((CREATIVE, CREATIVE, bench.prompt_ids(creative), None))
        longest = max(len(ids) for _, _, ids, _ in self.prompts)
        self._llms: dict[str, object] = {}
        self._nll: dict[tuple, float] = {}
        self._max_len = longest + options.max_tokens + 24

    def cells(self):
        """(temperature, item index, seed, config) of every call still to make, in run order."""
        for temperature in self.opt.temperatures:
            for index, (item, *_) in enumerate(self.prompts):
                for seed in range(self.opt.seeds):
                    order = self.configs if index % 2 == 0 else self.configs[::-1]
                    for cfg in order:
                        if (cfg.name, float(temperature), item, seed) not in self.skip:
                            yield temperature, index, seed, cfg

    def count(self) -> int:
        return sum(1 for _ in self.cells())

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
        """One record per call still to make; at the deadline, no new (item, temperature)
        starts, so a piece ends on whole items where it can."""
        if self.count() == 0:
            return
        self.warm_up()
        current = None
        for temperature, index, seed, cfg in self.cells():
            if (temperature, index) != current:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    return
                current = (temperature, index)
            item, kind, ids, task = self.prompts[index]
            yield self._call(cfg, temperature, item, kind, ids, task, seed)

    def _call(self, cfg, temperature, item, kind, ids, task, seed) -> dict:
        params = SamplingParams(temperature=temperature, max_tokens=self.opt.max_tokens,
                                ignore_eos=task is None, seed=seed,
                                stop=task.stop if task is not None else (), **cfg.sampling)
        llm = self.llm(cfg)
        if llm.engine.spec is not None:  # no call sees an earlier call's output
            llm.engine.spec.clear_cache()
        out = llm.generate(ids, params)[0].outputs[0]
        if self.progress is not None:
            self.progress.update(1)
        tokens = tuple(out.token_ids)
        rec = {"config": cfg.name, "method": cfg.method, "setting": cfg.setting,
               "temperature": temperature, "workload": item, "kind": kind, "seed": seed,
               "e2e_s": out.e2e_time, "output_tokens": out.num_output_tokens,
               "finish_reason": out.finish_reason,
               "output_hash": hashlib.sha1(repr(tokens).encode()).hexdigest()[:16],
               "decode_tokens_per_s": out.decode_tokens_per_s,
               "speculative": out.spec.as_dict() if out.spec else None,
               "distinct_2": distinct_n(out.token_ids, 2), "text": out.text}
        if self.opt.quality:
            key = (tuple(ids), tokens)
            if key not in self._nll:
                self._nll[key] = target_nll(self.bench.target.model, ids, out.token_ids)
            rec["nll"] = self._nll[key]
        if task is not None:
            verdict = check(task, out.text)
            rec.update(correct=verdict.correct, exact=verdict.exact, reason=verdict.reason)
        return rec
