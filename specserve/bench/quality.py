"""What a lossy setting gave up: the target's negative log-likelihood of the generated text,
and repetition (distinct-n). The realised TV per step comes from the speculative metrics."""

from __future__ import annotations

import torch

from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE
from specserve.models.transformer import ForwardBatch, Transformer


def target_nll(model: Transformer, prompt_ids: list[int], output_ids: list[int]) -> float:
    """Mean −log p_target(token | prefix) over `output_ids`, scored in one pass, raw logits (no
    temperature or truncation)."""
    if not output_ids:
        return float("nan")
    ids = list(prompt_ids) + list(output_ids)
    cache, table = _one_sequence(model, len(ids))
    with torch.inference_mode():
        (logits,) = model.forward(ForwardBatch.paged([ids[:-1]], [0], [table]), cache,
                                  last_n=[len(output_ids)])  # [n_out, vocab]
    return token_nll(logits, output_ids)


def token_nll(logits: torch.Tensor, tokens: list[int]) -> float:
    """Mean −log softmax(logits[i])[tokens[i]]; logits `[n, vocab]`."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # [n, vocab]
    picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)]  # [n]
    return float(-picked.mean())


def distinct_n(tokens: list, n: int) -> float:
    """Unique n-grams / all n-grams (1.0 = no repetition); NaN when shorter than n."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def perplexity(model: Transformer, ids: list[int], chunk: int = 512) -> float:
    """exp(mean −log p(ids[i] | ids[:i])) over i ≥ 1, fed in `chunk`-token passes through one
    KV cache (raw logits)."""
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    cache, table = _one_sequence(model, len(ids))
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:min(start + chunk, len(ids) - 1)]
            (logits,) = model.forward(ForwardBatch.paged([piece], [start], [table]), cache)
            targets = ids[start + 1:start + 1 + len(piece)]
            total += token_nll(logits, targets) * len(targets)
    return float(torch.exp(torch.tensor(total / (len(ids) - 1))))


def _one_sequence(model: Transformer, length: int, block_size: int = DEFAULT_BLOCK_SIZE):
    """A KV pool for one sequence of `length` positions and its block table (all blocks)."""
    blocks = -(-length // block_size)
    return model.new_pool(blocks, block_size), list(range(blocks))
