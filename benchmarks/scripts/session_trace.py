"""Where a shipped session's time goes, request by request: prompt tokens, TTFT, decode time and
what each source drafted and got accepted, with the default speculation and without it (one
LLM each, loaded one after the other, each warmed up by one unrelated ~450-token request; greedy,
256 tokens at most per request, EOS ends a reply).

    python benchmarks/scripts/session_trace.py [--session agent_session] [--show]

`--show` prints each speculative reply with every token colored by its origin (green accepted,
cyan bonus, yellow recovered, plain uncolored)."""

from __future__ import annotations

import argparse
import json

from specserve.bench.workloads import load_session
from specserve.llm import LLM
from specserve.sampling.params import SamplingParams

COLORS = {"plain": "\x1b[0m", "accepted": "\x1b[32m", "recovered": "\x1b[33m", "bonus": "\x1b[36m"}


def trace(session, spec: dict | None, show: bool) -> dict:
    llm = LLM("qwen2.5-coder-1.5b", speculative_config=spec, enable_prefix_caching=True,
              max_model_len=4096)
    tok, turns, answers = llm.tokenizer, [], []
    # a warm-up request with a long prompt first, so that whatever a first request builds
    # lazily (the tokenizer's text-only copy cost the first turn 0.3 s until it moved to
    # start-up) does not fall on whichever side runs first; then both caches emptied
    llm.generate(tok.encode("Warm up. " * 150), SamplingParams(temperature=0.0, max_tokens=16))
    llm.reset_prefix_cache()
    if llm.engine.spec is not None:
        llm.engine.spec.clear_cache()
    for turn in range(len(session.turns)):  # as `specserve bench` runs a session
        ids = tok.encode(tok.apply_chat_template(session.messages(turn, answers)))
        out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=256))[0].outputs[0]
        answers.append(out.text)
        spec_stats = out.spec.as_dict() if out.spec else {}
        turns.append({"prompt_tokens": len(ids), "output_tokens": out.num_output_tokens,
                      "ttft_s": round(out.ttft, 3), "decode_s": round(out.decode_time, 3),
                      "e2e_s": round(out.e2e_time, 3), "by_source": spec_stats.get("by_source"),
                      "k_histogram": spec_stats.get("k_histogram")})
        if show and out.origins:
            print("".join(COLORS[o] + tok.decode([t]) for t, o in zip(out.token_ids, out.origins))
                  + "\x1b[0m")
    total = {k: round(sum(t[k] for t in turns), 3) for k in ("ttft_s", "decode_s", "e2e_s")}
    return {"turns": turns, "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--session", default="agent_session")
    p.add_argument("--show", action="store_true")
    args = p.parse_args()
    session = load_session(args.session)
    result = {"session": args.session,
              "default": trace(session, {"method": "hybrid", "num_speculative_tokens": -1}, args.show),
              "no_speculation": trace(session, None, False)}
    result["e2e_speedup"] = round(result["no_speculation"]["total"]["e2e_s"]
                                  / result["default"]["total"]["e2e_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
