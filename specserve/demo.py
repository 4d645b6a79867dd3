"""`specserve demo`: the default speculation against target-only decoding on two workloads.

A code edit (the answer repeats most of the prompt's code: drafts are accepted and speculation
pays) and a short open question (free text: the controller drafts little or steps aside).
Each runs greedily with the target alone and with the default speculation (hybrid: suffix
drafting and the draft model, source and k chosen by the speculation controller each round),
on one loaded pair; the report gives decode speed, the speedup, whether the greedy outputs are
identical, where the speculative answer's tokens came from (accepted drafts, recovered,
bonus, plain decoding), what each source drafted, and why rounds drafted nothing.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

CODE_EDIT = ("Rename the variable `total` to `running_sum` in this function and reply with the "
             "whole function only:\n\n```python\ndef average(values):\n    total = 0\n"
             "    count = 0\n    for v in values:\n        if v is None:\n            continue\n"
             "        total += v\n        count += 1\n    if count == 0:\n        return 0.0\n"
             "    return total / count\n```")
OPEN_QUESTION = "In two sentences: why do programmers write tests?"
WORKLOADS = (("code edit", CODE_EDIT), ("open question", OPEN_QUESTION))
ORIGINS = ("accepted", "recovered", "bonus", "plain")
IDLE_WORDS = {"no_match": "with no earlier text to continue", "did_not_pay":
              "where drafting did not pay (expected gain below cost)",
              "batch_limit": "at the batch limit", "draft_starting": "while the draft started",
              "no_room": "with no room left", "off": "with speculation off",
              "backed_off": "between looks at text that rarely repeated",
              "probe": "on plain steps that keep the price of drafting right"}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One workload's two runs (`CompletionOutput`s)."""

    name: str
    plain: object
    spec: object

    def lines(self) -> list[str]:
        p, s = self.plain, self.spec
        counts = Counter(s.origins or [])
        hist = " ".join(f"k={k}:{n}" for k, n in sorted(s.spec.k_histogram.items()))
        out = [f"## {self.name}: {s.num_output_tokens} tokens",
               f"   target-only  {_tps(p)} tokens/s",
               f"   hybrid       {_tps(s)} tokens/s"]
        if p.decode_tokens_per_s and s.decode_tokens_per_s:
            same = "identical" if p.token_ids == s.token_ids else "DIFFERENT"
            out.append(f"   speedup {s.decode_tokens_per_s / p.decode_tokens_per_s:.2f}x "
                       f"(greedy outputs {same})")
        out.append("   tokens by source: " + ", ".join(f"{counts[o]} {o}" for o in ORIGINS))
        drafted = s.spec.drafted
        out.append(f"   rounds {s.spec.rounds}, k chosen [{hist}]" + (
            f", acceptance {s.spec.acceptance_rate:.0%}" if drafted else
            ": nothing was drafted"))
        for name, v in s.spec.by_source.items():
            out.append(f"   {name}: {v['drafted']} drafted in {v['rounds']} rounds, "
                       f"{v['accepted']} accepted")
        if s.spec.idle:
            out.append("   rounds without drafts: " + ", ".join(
                f"{n} {IDLE_WORDS.get(k, k)}" for k, n in sorted(s.spec.idle.items())))
        return out


def _tps(out) -> str:
    tps = out.decode_tokens_per_s
    return "-" if tps is None else f"{tps:6.2f}"


def run(target_name: str, draft_name: str, dtype: str, weights: str, max_tokens: int,
        num_speculative_tokens: int, prompts=WORKLOADS) -> list[Comparison]:
    """Load the pair once, then each workload target-only and speculative."""
    from specserve.llm import LLM
    from specserve.sampling.params import SamplingParams
    from specserve.weights.loader import load_model

    target = load_model(target_name, dtype, weights)
    draft = load_model(draft_name, dtype, weights, draft=True)
    print(f"# target {target.path.name} loaded in {target.load_seconds:.1f}s; "
          f"draft {draft.path.name} in {draft.load_seconds:.1f}s", file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain_llm = LLM(target)
    spec_llm = LLM(target, draft=draft, speculative_config={
        "method": "hybrid", "model": draft_name,
        "num_speculative_tokens": num_speculative_tokens})
    results = []
    for name, prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        plain = plain_llm.chat(messages, params)[0].outputs[0]
        spec = spec_llm.chat(messages, params)[0].outputs[0]
        results.append(Comparison(name, plain, spec))
    return results
