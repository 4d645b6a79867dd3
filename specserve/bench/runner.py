"""Runs benchmark configurations side by side in one process: target-only and speculative
runs share the loaded weights and the machine state, so their ratio is what we report.

Protocol (the seed's): one warm-up call per configuration, then `repeats` timed calls for each
of `seeds` seeds, `max_tokens` new tokens with EOS ignored, prompts through the chat template.
The timed calls of all configurations are interleaved (round robin), so slow drift of a shared
machine does not favour whichever configuration ran in a quiet minute.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import torch

from specserve.bench.quality import distinct_n, target_nll
from specserve.bench.suites import BenchConfig, uses_draft
from specserve.bench.workloads import Session, load_session, sessions
from specserve.llm import LLM
from specserve.weights.loader import LoadedModel
from specserve.options import option
from specserve.sampling.params import SamplingParams, require_bool, require_int
from specserve.speculative.metrics import SpecMetrics


WARMUP_PROMPT_TOKENS = 32
SESSION_MODEL_LEN = 4096  # a session's requests grow with the conversation


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """How each configuration is timed; every field is also a `bench` flag."""

    max_tokens: int = option(256, "new tokens per timed call (EOS ignored)")
    repeats: int = option(3, "timed calls per seed")
    seeds: int = option(3, "seeds per configuration and workload")
    warmup_tokens: int = option(8, "new tokens of each configuration's warm-up call")
    quality: bool = option(True, "score the NLL of each distinct output with the target")
    # off: every timed call prefills its whole prompt, as the peers' calls do (a repeated
    # prompt would otherwise come from the prefix cache and TTFT would measure nothing)
    prefix_caching: bool = option(False, "keep the prefix cache on between timed calls (off: "
                                  "every call prefills its whole prompt, as the peers do; a "
                                  "session's later requests still reuse its earlier ones)")
    chat: bool = option(True, "send the prompts through the chat template")
    prime_session: str = option("", "before every timed call of a session, run this shipped "
                                "session untimed on the same engine, after its caches are "
                                "emptied: the timed session meets a server that has served "
                                "another one (its answers in the shared suffix cache where that "
                                "is on, its prefixes in the prefix cache on every side)",
                                choices=("", *sessions()))

    def __post_init__(self) -> None:
        for name in ("max_tokens", "repeats", "seeds", "warmup_tokens"):
            require_int(name, getattr(self, name), minimum=1)
        for name in ("quality", "prefix_caching", "chat"):
            require_bool(name, getattr(self, name))
        if self.prime_session and self.prime_session not in sessions():
            raise ValueError(f"prime_session must be one of {list(sessions())}, "
                             f"got {self.prime_session!r}")


def machine_info(dtype: str) -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from specserve import kernels

    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "kernel_isa": kernels.isa(), "cpu_flags": sorted(
                f for f in kernels.cpu_flags() if f.startswith(("avx", "fma", "f16c"))),
            "threads": torch.get_num_threads(), "dtype": dtype, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


class Bench:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, options: BenchOptions,
                 progress=None, primer: Session | None = None) -> None:
        """`primer`: the session run before every timed session (default: the one
        `options.prime_session` names, if any)."""
        self.target, self.draft, self.opt = target, draft, options
        self.progress = progress
        if primer is None and options.prime_session:
            primer = load_session(options.prime_session)
        self.primer = primer
        self._nll_cache: dict[tuple, float] = {}

    def prompt_ids(self, text: "str | Session") -> list[int]:
        """The request's token ids (a session's: its first request's)."""
        tok = self.target.tokenizer
        if isinstance(text, Session):
            return tok.encode(tok.apply_chat_template(text.messages(0, [])))
        if self.opt.chat and tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(text)

    def _llm(self, cfg: BenchConfig, prompt_len: int, session: bool = False) -> LLM:
        spec = None
        if cfg.spec is not None:
            spec = dict(cfg.spec)
            if uses_draft(spec):
                spec["model"] = str(self.draft.path)
        max_len = prompt_len + self.opt.max_tokens + 24
        # a session's requests repeat its history, as a server's chat does: its prefix cache is
        # on, as the server's is, and emptied before each timed call
        return LLM(self.target, draft=self.draft, speculative_config=spec, max_num_seqs=1,
                   max_model_len=max_len,
                   enable_prefix_caching=self.opt.prefix_caching or session)

    def seeds_for(self, cfg: BenchConfig) -> list[int]:
        # greedy output does not depend on the seed: one seed, same number of timed calls
        return [0] if cfg.temperature == 0 else list(range(self.opt.seeds))

    def run_interleaved(self, jobs: list[tuple[BenchConfig, str, str]]
                        ) -> Iterator[tuple[int, dict]]:
        """Every (config, workload, prompt) job is built and warmed up first; then the timed
        calls go round robin (call i of every job, then call i + 1), so a machine that drifts
        while the benchmark runs slows every configuration alike and the ratios stay fair.
        Yields (job index, record) as each call finishes."""
        prepared = []
        for cfg, _, prompt in jobs:
            ids = self.prompt_ids(prompt)
            session = isinstance(prompt, Session)
            llm = self._llm(cfg, SESSION_MODEL_LEN if session else len(ids), session)
            warm = SamplingParams(temperature=cfg.temperature, max_tokens=self.opt.warmup_tokens,
                                  ignore_eos=True, seed=0)
            llm.generate(ids[:WARMUP_PROMPT_TOKENS], warm)  # kernels and allocations, not a full prefill
            calls = [(seed, rep) for seed in self.seeds_for(cfg) for rep in range(self.opt.repeats)]
            prepared.append((llm, ids, calls))
        for i in range(max(len(calls) for _, _, calls in prepared)):
            for j, ((cfg, workload, prompt), (llm, ids, calls)) in enumerate(zip(jobs, prepared)):
                if i >= len(calls):
                    continue
                seed, rep = calls[i]
                if llm.engine.spec is not None:  # every call starts with no earlier outputs
                    llm.engine.spec.clear_cache()
                if not self.opt.prefix_caching:  # nor with a session's earlier prefixes
                    llm.reset_prefix_cache()
                if isinstance(prompt, Session):
                    if self.primer is not None:  # untimed: a server that served another session
                        self._session(llm, self.primer, cfg.temperature, seed)
                    out = self._session(llm, prompt, cfg.temperature, seed)
                else:
                    params = SamplingParams(temperature=cfg.temperature, seed=seed,
                                            max_tokens=self.opt.max_tokens, ignore_eos=True)
                    out = llm.generate(ids, params)[0].outputs[0]
                if self.progress is not None:
                    self.progress.update(1)
                record = self._record(cfg, workload, seed, rep, ids, out)
                if out.spec is not None:  # what the engine's cost model believed after the call
                    record["cost_model"] = llm.engine.cost.snapshot()
                yield j, record

    def _session(self, llm: LLM, session: Session, temperature: float, seed: int) -> "SessionOutput":
        """Run a session's requests one after another (each answer ends at EOS or
        `max_tokens`); its figures are the sums over its requests."""
        answers, outs = [], []
        tok = self.target.tokenizer
        for turn in range(len(session.turns)):
            ids = tok.encode(tok.apply_chat_template(session.messages(turn, answers)))
            params = SamplingParams(temperature=temperature, max_tokens=self.opt.max_tokens,
                                    seed=seed)
            out = llm.generate(ids, params)[0].outputs[0]
            outs.append(out)
            answers.append(out.text)
        return SessionOutput(outs)

    def calls_for(self, cfg: BenchConfig) -> int:
        return len(self.seeds_for(cfg)) * self.opt.repeats

    def _record(self, cfg, workload, seed, rep, ids, out) -> dict:
        spec = out.spec.as_dict() if out.spec else None
        rec = {"config": cfg.name, "temperature": cfg.temperature, "workload": workload,
               "seed": seed, "repeat": rep, "prompt_tokens": len(ids), "e2e_s": out.e2e_time, "ttft_s": out.ttft,
               "decode_tokens_per_s": out.decode_tokens_per_s, "output_tokens": out.num_output_tokens,
               "speculative": spec, "distinct_2": distinct_n(out.token_ids, 2),
               "distinct_3": distinct_n(out.token_ids, 3)}
        if self.opt.quality and not isinstance(out, SessionOutput):
            key = (tuple(ids), tuple(out.token_ids))
            if key not in self._nll_cache:
                self._nll_cache[key] = target_nll(self.target.model, ids, out.token_ids)
            rec["nll"] = self._nll_cache[key]
        return rec

    def count_runs(self, configs: list[BenchConfig], workloads: dict) -> int:
        return sum(self.calls_for(c) for c in configs for w in c.workloads if w in workloads)


class SessionOutput:
    """A session's requests read as one output: times, tokens and speculation summed."""

    def __init__(self, outs: list) -> None:
        self.outs = outs
        self.token_ids = [t for o in outs for t in o.token_ids]
        self.num_output_tokens = sum(o.num_output_tokens for o in outs)
        self.e2e_time = sum(o.e2e_time for o in outs)
        self.ttft = statistics.mean(o.ttft for o in outs)
        decode = sum(o.decode_time or 0.0 for o in outs)
        self.decode_tokens_per_s = (self.num_output_tokens - len(outs)) / decode if decode else None
        self.spec = None
        if all(o.spec is not None for o in outs):
            self.spec = SpecMetrics()
            for o in outs:
                self.spec.merge(o.spec)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (config, temperature, workload), with speedups over the target-only row of
    the same temperature and workload: the ratio of the medians, and the paired speedup, the
    median over calls of the call's decode rate over the target-only call with the same seed
    and repeat, which ran in the same round of the round robin, minutes apart at most, so the
    drift of a shared machine between rounds cancels out."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["config"], r["temperature"], r["workload"]), []).append(r)
    rows = [_row(key, rs) for key, rs in groups.items()]
    base = {(r["temperature"], r["workload"]): r for r in rows if r["config"] == "target only"}
    base_calls = {(r["temperature"], r["workload"], r["seed"], r["repeat"]): r["decode_tokens_per_s"]
                  for r in records if r["config"] == "target only"}
    for r, rs in zip(rows, groups.values()):
        b = base.get((r["temperature"], r["workload"]))
        r["speedup_decode"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b else None
        r["speedup_e2e"] = b["median_e2e_s"] / r["median_e2e_s"] if b else None
        paired = [c["decode_tokens_per_s"] / base_calls[key] for c in rs
                  if (key := (c["temperature"], c["workload"], c["seed"], c["repeat"])) in base_calls]
        r["speedup_paired"] = statistics.median(paired) if paired else None
    return rows


def _row(key: tuple, rs: list[dict]) -> dict:
    config, temperature, workload = key
    e2e = sorted(r["e2e_s"] for r in rs)
    specs = [r["speculative"] for r in rs if r["speculative"]]
    drafted = sum(s["drafted"] for s in specs)
    hist: Counter = Counter()
    for s in specs:
        hist.update({int(k): v for k, v in s["k_histogram"].items()})
    tvs = [s["mean_tv"] for s in specs if s["mean_tv"] is not None]
    return {
        "config": config, "temperature": temperature, "workload": workload, "runs": len(rs),
        "median_e2e_s": statistics.median(e2e), "e2e_q1_s": _quantile(e2e, 0.25),
        "e2e_q3_s": _quantile(e2e, 0.75), "e2e_min_s": e2e[0], "e2e_max_s": e2e[-1],
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rs),
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
        "prompt_tokens": rs[0].get("prompt_tokens"),
        "acceptance": sum(s["accepted"] for s in specs) / drafted if drafted else None,
        "mean_acceptance_length": (sum(s["emitted"] for s in specs) / sum(s["rounds"] for s in specs)
                                   if specs else None),
        "rounds_per_request": statistics.mean(s["rounds"] for s in specs) if specs else None,
        "k_histogram": dict(sorted(hist.items())) if specs else None,
        "mean_tv": statistics.mean(tvs) if tvs else (0.0 if specs else None),
        "nll": _mean_of(rs, "nll"), "distinct_2": _mean_of(rs, "distinct_2"),
        "distinct_3": _mean_of(rs, "distinct_3"),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _mean_of(rs: list[dict], key: str) -> float | None:
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.mean(values) if values else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
