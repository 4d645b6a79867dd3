# Run: python benchmarks/scripts/draft_head_time.py
"""Draft model step time, full vocabulary head vs the restricted head, interleaved call by call
(a one-row decode pass after a 256-token cached prefix; medians over repeats)."""
import statistics, time, torch
from specserve.speculative.calibration import pass_timer
from specserve.engine.runner import ModelRunner
from specserve.speculative.draft_head import restricted_head
from specserve.weights.loader import load_model
torch.set_num_threads(2)
d = load_model("qwen2.5-coder-0.5b")
tok = d.tokenizer
extra = [*tok.backend.get_added_tokens_decoder(), *tok.eos_token_ids]
full = ModelRunner(d.model, 64, 16)
cut = ModelRunner(d.model, 64, 16)
cut.head = restricted_head(d.model, 65536, extra)
res = {"full": [], "restricted": []}
with pass_timer(full, 256) as tf, pass_timer(cut, 256) as tc:
    for _ in range(3): tf(0); tc(0)
    for r in range(40):
        for name, f in (("full", tf), ("restricted", tc)) if r % 2 == 0 else (("restricted", tc), ("full", tf)):
            res[name].append(f(0))
for k, v in res.items():
    print(k, "median %.2f ms" % (1e3 * statistics.median(v)))
print("ratio restricted/full %.3f" % (statistics.median(res["restricted"]) / statistics.median(res["full"])))
