"""The measurement behind the grammar library: xgrammar 0.2.8 against llguidance 1.9.1 on
Qwen2.5's vocabulary (151,936 logits), the specs of `grammar_cost.py`, each library's own
packed bitmask (the unpacking to bool, the same for both, left out).

For each spec and library: compile time (process CPU time: xgrammar compiles on 2 threads;
no cache), then `--walks` walks of the valid output on each compiled grammar, the first left
out (llguidance builds lexer states lazily during it), timing each mask (thread CPU time) and
rollbacks of 1, 4 and 16 tokens. llguidance gets exactly the grammar `sampling/grammar.py`
compiles; xgrammar the same constraint in its own API (JSON with the same compact separators).

Needs xgrammar, which specserve does not depend on: install it aside, e.g.
    pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr python benchmarks/scripts/grammar_library_choice.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import llguidance as llg
import llguidance.torch as llgt
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).parent))
from grammar_cost import CASES, LOGITS, pct  # noqa: E402

from specserve.hub.registry import resolve_model  # noqa: E402
from specserve.models.tokenizer import from_gguf_metadata  # noqa: E402
from specserve.sampling.grammar_source import JSON_FORMAT, grammar_text  # noqa: E402
from specserve.sampling.token_bytes import token_bytes  # noqa: E402
from specserve.weights.gguf_loader import open_gguf, read_metadata  # noqa: E402

SEPARATORS = (JSON_FORMAT["item_separator"], JSON_FORMAT["key_separator"])


def xgrammar_compiler(tok):
    table = [b if b is not None else b"" for b in token_bytes(tok, LOGITS)]
    info = xgr.TokenizerInfo(table, xgr.VocabType.RAW, vocab_size=LOGITS,
                             stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile_(spec):
        if spec.json is not None:
            return compiler.compile_json_schema(spec.json, any_whitespace=False,
                                                separators=SEPARATORS)
        if spec.json_object:
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                separators=SEPARATORS, strict_mode=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex("|".join(re.escape(c) for c in spec.choice))
        s = spec.structural
        return compiler.compile_structural_tag({"type": "structural_tag", "format": {
            "type": "sequence", "elements": [
                {"type": "const_string", "value": s.begin},
                {"type": "json_schema", "json_schema": s.schema, "style": "json"},
                {"type": "const_string", "value": s.end}]}})
    return compile_


class XgrammarWalker:
    def __init__(self, compiled):
        self.m, self.mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, LOGITS)

    def fill(self):
        self.m.fill_next_token_bitmask(self.mask)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, n: int) -> None:
        self.m.rollback(n)


class Vocabulary:
    """What llguidance's TokenizerWrapper reads, as `sampling/grammar.py` gives it."""

    def __init__(self, tok):
        table = token_bytes(tok, LOGITS)
        self.tokens = [b if b is not None else b"" for b in table]
        self.special_token_ids = [i for i, b in enumerate(table) if b is None]
        self.eos_token_id, self.bos_token_id = min(tok.eos_token_ids), tok.bos_token_id
        self.tok = tok

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self.tok.encode(text, parse_special=False)


def llguidance_compiler(tok):
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary(tok)), n_vocab=LOGITS,
                            eos_token=sorted(tok.eos_token_ids))

    def compile_(spec):
        m = llg.LLMatcher(lltok, grammar_text(spec), log_level=0)
        assert not m.is_error(), m.get_error()
        return m
    return compile_


class LlguidanceWalker:
    def __init__(self, template):
        self.m, self.mask = template.deep_copy(), llgt.allocate_token_bitmask(1, LOGITS)

    def fill(self):
        llgt.fill_next_token_bitmask(self.m, self.mask)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        self.m.rollback(n)


def measure(compile_, walker, spec, ids, reps, walks, out):
    for _ in range(reps):
        start = time.process_time()
        compiled = compile_(spec)
        out["compile"].append(time.process_time() - start)
        for walk in range(walks):
            w = walker(compiled)
            for token in ids:
                start = time.thread_time()
                w.fill()
                if walk:
                    out["mask"].append(time.thread_time() - start)
                assert (int(w.mask[0, token // 32]) >> (token % 32)) & 1 and w.accept(token)
            for n in (1, 4, 16):
                n = min(n, len(ids))
                start = time.thread_time()
                w.rollback(n)
                out["rollback"].append(time.thread_time() - start)
                assert all(w.accept(t) for t in ids[len(ids) - n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--walks", type=int, default=4)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    tok = from_gguf_metadata(read_metadata(open_gguf(resolve_model("qwen2.5-coder-1.5b"))))
    libraries = {"xgrammar": (xgrammar_compiler(tok), XgrammarWalker),
                 "llguidance": (llguidance_compiler(tok), LlguidanceWalker)}
    totals = {lib: {"compile": [], "mask": [], "rollback": []} for lib in libraries}
    rows = {}
    for name, spec, text in CASES:
        ids = tok.encode(text)
        for lib, (compile_, walker) in libraries.items():
            out = {"compile": [], "mask": [], "rollback": []}
            measure(compile_, walker, spec, ids, args.reps, args.walks, out)
            row = {"compile_ms_p50": 1e3 * pct(out["compile"], 50),
                   "mask_us_p50": 1e6 * pct(out["mask"], 50),
                   "mask_us_p99": 1e6 * pct(out["mask"], 99)}
            rows[f"{name} {lib}"] = row
            print(f"{name:15s} {lib:10s}", {k: round(v, 2) for k, v in row.items()})
            for key, xs in out.items():
                totals[lib][key] += xs
    summary = {lib: {f"{key} p50/p99 {'ms' if key == 'compile' else 'us'}":
                     [(1e3 if key == "compile" else 1e6) * pct(xs, p) for p in (50, 99)]
                     for key, xs in t.items()} for lib, t in totals.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "per_spec": rows}, indent=1))


if __name__ == "__main__":
    main()
