"""What a draft rejected by the verifier costs on a Gated DeltaNet layer against a full-attention
layer of the same tiny Qwen3.5 (float32, PyTorch path): the per-row time of each kind of layer
in a verify pass of k + 1 rows after a cached prefix (what a rejected row wastes), the part of
a linear layer's time spent keeping the per-row state snapshots (what makes its rollback free),
and the bytes of one snapshot. Rollback itself is choosing a snapshot: no copy, no recompute.

    python benchmarks/scripts/hybrid_rollback_cost.py [k] [repeats] [wide]

`wide`: two layers (one of each kind) of a real model's width instead (hidden 1024, 16 key and
value heads of 128 in the linear layer: a 1 MiB state), random weights.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from specserve.models.hybrid import DEFAULT_STATE_HISTORY, HybridModel
from specserve.models.transformer import ForwardBatch
from specserve.weights.hf_loader import load_hf_dir

torch.set_num_threads(1)
K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
CONFIG = dict(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              full_attention_interval=2, max_position_embeddings=1024)
if len(sys.argv) > 3 and sys.argv[3] == "wide":
    CONFIG = CONFIG | dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                           linear_num_key_heads=16, linear_num_value_heads=16,
                           linear_key_head_dim=128, linear_value_head_dim=128)


class Timed:
    """`fn` (a layer's mixer, a method) with the seconds of each call appended to `log`."""

    def __init__(self, fn, log: list[float]) -> None:
        self.fn, self.log = fn, log

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.log.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def measure(cfg, weights, rows: int) -> tuple[dict[str, float], int]:
    """Median seconds per pass of `rows` rows (the same rows again and again from the same
    position: rejected rounds) of each kind of layer and of the snapshot store; and the bytes
    of one snapshot."""
    model = HybridModel(cfg, weights)
    logs = {"linear": [], "attention": [], "store": []}
    for block in model.layers:
        block.mixer = Timed(block.mixer, logs["linear" if block.linear else "attention"])
    pool = model.new_pool(8, 16)
    pool.states.store = Timed(pool.states.store, logs["store"])
    prefix = torch.randint(0, CONFIG["vocab_size"], (64,), generator=torch.Generator()
                           .manual_seed(1)).tolist()
    tables = [list(range(8))]
    with torch.inference_mode():
        model.forward(ForwardBatch.paged([prefix], [0], tables, ["s"]), pool)
        for log in logs.values():
            log.clear()
        for _ in range(REPEATS):
            model.forward(ForwardBatch.paged([prefix[:rows]], [len(prefix)], tables, ["s"]),
                          pool)
    return {kind: statistics.median(log) for kind, log in logs.items()}, \
        pool.states.snapshot_bytes


def main() -> None:
    torch.manual_seed(0)
    path = Path(tempfile.mkdtemp()) / "qwen35"
    transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG)).save_pretrained(
        str(path))
    cfg, _, weights = load_hf_dir(path, torch.float32)
    print(f"tiny Qwen3.5, {len(cfg.linear_layers)} linear and "
          f"{cfg.num_layers - len(cfg.linear_layers)} attention layers, after a 64-token "
          f"prefix; median of {REPEATS} passes (per layer: median over the layers of a kind)")
    for rows in (1, K + 1):
        t, snapshot = measure(cfg, weights, rows)
        print(f"{rows} row(s): linear {t['linear'] / rows * 1e6:6.1f} us/row, attention "
              f"{t['attention'] / rows * 1e6:6.1f} us/row; snapshot store "
              f"{t['store'] / rows * 1e6:5.1f} us/row; one snapshot {snapshot} B "
              f"({snapshot // len(cfg.linear_layers)} B per linear layer), "
              f"{DEFAULT_STATE_HISTORY} kept per sequence")


if __name__ == "__main__":
    main()
