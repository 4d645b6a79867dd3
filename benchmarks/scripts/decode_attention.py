"""Target passes over k + 1 rows after a long cached prefix, with the decode attention as it is
(`attend_one`: query heads folded onto their KV head, keys read in place) and as it was
(`enable_gqa`, which expands keys and values to every query head first). Both run in turn,
round after round, on the same cache; medians of 7.

    python benchmarks/scripts/decode_attention.py qwen2.5-coder-1.5b 1100
"""

from __future__ import annotations

import statistics
import sys

import torch.nn.functional as F

import specserve.models.transformer as transformer
from specserve.engine.runner import ModelRunner
from specserve.models.loader import load_model


def expanded(q, keys, values):
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def main(name: str, prefix: int, ks=(0, 3, 8), repeats: int = 7) -> None:
    runner = ModelRunner(load_model(name, "bfloat16", "int4").model, 1, prefix + 64)
    impls = {"enable_gqa": expanded, "folded": transformer.attend_one}
    samples = {(label, k): [] for label in impls for k in ks}
    with runner.pass_timer(prefix) as time_pass:
        for _ in range(repeats):
            for label, impl in impls.items():
                transformer.attend_one = impl
                for k in ks:
                    samples[(label, k)].append(time_pass(k))
    for label in impls:
        cells = " ".join(f"k={k}: {statistics.median(samples[(label, k)]) * 1000:.1f} ms" for k in ks)
        print(f"{name}, prefix {prefix}, {label}: {cells}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
