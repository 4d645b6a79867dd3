"""How far each prefill path's logits are from the file's own float32 dequantization.

    python -m specserve.bench.prefill_fidelity [--model qwen2.5-coder-1.5b] [--tokens 512]

Prompts: the shipped workloads (`code_edit`, `creative`, `summarize`, `chat_short`) as chat
requests, cut at `--tokens`. Each prompt is scored at every position by one pass of each
side over the same tokens: the reference (`weights="float32"`: every tensor dequantized by
`weights/dequant.py`, which equals the `gguf` package's `gguf.quants.dequantize` bit for bit,
on float32 kernels), the int4 kernels (`prefill_path` native), oneDNN's bf16 prefill path
(onednn) and the int4 projections with oneDNN's attention alone (attention). At each
position, the reference's 5 most likely tokens; per side, |Δ log p| of those tokens against
the reference over every (position, token) pair: mean, 99th percentile and maximum, and how
often the side's most likely token is the reference's. One JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from specserve.bench import workloads
from specserve.engine.runner import ModelRunner
from specserve.models.prefill import NATIVE, ONEDNN, PrefillChoice
from specserve.weights.loader import load_model

PROMPTS = ("code_edit", "creative", "summarize", "chat_short")
TOP = 5


def prompt_ids(tokenizer, name: str, limit: int) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": workloads.load(name)}])
    return tokenizer.encode(text)[:limit]


def scorer(model, choice: PrefillChoice, max_len: int) -> ModelRunner:
    """A runner of `model` with room for one prompt of `max_len`, its prompt rows on `choice`."""
    runner = ModelRunner(model, -(-max_len // 16), 16)
    runner.use_prefill(choice)
    return runner


def log_probs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of `ids` (prompt rows): `[len(ids), vocab]`
    float64."""
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    assert blocks.reserve(table, len(ids))
    (logits,) = runner.forward([ids], [0], [table], prefill=[len(ids)])
    blocks.free(table)
    return torch.log_softmax(logits.double(), dim=-1)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """|Δ log p| over the reference's top tokens at every position, and top-1 agreement."""
    top = ref.topk(TOP, dim=-1).indices  # [n, TOP]
    delta = (got.gather(1, top) - ref.gather(1, top)).abs().flatten()
    return {"delta": delta, "top1": (got.argmax(-1) == top[:, 0]).float()}


def summary(parts: list[dict]) -> dict:
    delta = torch.cat([p["delta"] for p in parts])
    top1 = torch.cat([p["top1"] for p in parts])
    return {"mean": delta.mean().item(), "p99": delta.quantile(0.99).item(),
            "max": delta.max().item(), "top1_agreement": top1.mean().item(),
            "pairs": delta.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens at most")
    args = parser.parse_args()
    reference = load_model(args.model, "float32", weights="float32")
    prompts = {n: prompt_ids(reference.tokenizer, n, args.tokens) for n in PROMPTS}
    with torch.inference_mode():
        runner = scorer(reference.model, NATIVE, args.tokens)
        refs = {n: log_probs(runner, ids) for n, ids in prompts.items()}
        del reference, runner
        gc.collect()
        int4 = load_model(args.model)
        sides = {"int4 (native)": NATIVE, "onednn bf16": ONEDNN,
                 "int4, onednn attention": PrefillChoice((), 0)}
        result = {"model": args.model, "weights": int4.weights,
                  "prompts": {n: len(ids) for n, ids in prompts.items()}}
        for side, choice in sides.items():
            runner = scorer(int4.model, choice, args.tokens)
            parts = [compare(refs[n], log_probs(runner, ids)) for n, ids in prompts.items()]
            result[side] = summary(parts)
            del runner
    print(json.dumps(result))


if __name__ == "__main__":
    main()
