"""An engine whose start-up calibration over-priced every verify row beyond the first, served
side by side with one calibrated right: do its probes (`controller.py`, step 3) find the
prices again, and how soon?

    python benchmarks/scripts/miscalibrated.py [--requests 24] [--factor 2.2] [--max-tokens 128]

Three engines of the default pair (hybrid speculation) in one process, seeded from one
calibration: "right" as timed, "disturbed" with passes of two or more rows priced `--factor`
times their timed cost (what `calibration.py` measured when two engines timed their passes
at once), and the same with probes off. Each request of the mixed pool (code edits,
arithmetic, extraction, stories, every text distinct: `serve_ab.prompt_pool`) goes to the
three in turn, the order rotated request by request; greedy. Prints, per engine and per
half of the run: output tokens/s (decode and end to end), tokens drafted and accepted."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_ab import prompt_pool  # noqa: E402

from specserve.llm import LLM  # noqa: E402
from specserve.sampling.params import SamplingParams  # noqa: E402

SIDES = ("right", "disturbed", "disturbed, no probes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--factor", type=float, default=2.2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    llms = {side: LLM() for side in SIDES}
    snap = llms["right"].engine.spec.cost.snapshot()
    for side, llm in llms.items():
        factor = 1.0 if side == "right" else args.factor
        verify = {k: s * (factor if k else 1.0) for k, s in snap["verify_s"].items()}
        llm.engine.spec.cost.seed(snap["draft_s"][1], verify)
        if side.endswith("no probes"):
            llm.engine.spec.probe_every = 1 << 30
    tok = llms["right"].tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # whatever a first request builds lazily, before timing
        llm.generate(tok.encode("Warm up."), SamplingParams(temperature=0.0, max_tokens=8))
    records = {side: [] for side in SIDES}
    for i, (kind, text) in enumerate(prompt_pool("mixed")[:args.requests]):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        order = SIDES[i % 3:] + SIDES[:i % 3]
        for side in order:
            out = llms[side].generate(ids, params)[0].outputs[0]
            spec = out.spec.as_dict() if out.spec else {}
            records[side].append({"kind": kind, "tokens": out.num_output_tokens,
                                  "decode_s": out.decode_time, "e2e_s": out.e2e_time,
                                  "drafted": spec.get("drafted", 0),
                                  "accepted": spec.get("accepted", 0)})
    summary = {}
    for side, recs in records.items():
        halves = (recs[:len(recs) // 2], recs[len(recs) // 2:])
        summary[side] = [{
            "decode_tok_s": round(sum(r["tokens"] - 1 for r in h) / sum(r["decode_s"] for r in h), 2),
            "e2e_tok_s": round(sum(r["tokens"] for r in h) / sum(r["e2e_s"] for r in h), 2),
            "drafted": sum(r["drafted"] for r in h), "accepted": sum(r["accepted"] for r in h),
            "probes": llms[side].engine.spec.probes} for h in halves]
    print(json.dumps({"factor": args.factor, "requests": args.requests,
                      "max_tokens": args.max_tokens, "summary": summary, "records": records},
                     indent=1))


if __name__ == "__main__":
    main()
