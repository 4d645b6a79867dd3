"""Toy models whose exact continuation distribution is computable: bigram tables behind the
model interface (`cfg.vocab_size`, `new_pool`, `forward`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.kv_cache import KVCache
from specserve.models.transformer import ForwardBatch


@dataclass(frozen=True)
class _Cfg:
    vocab_size: int
    max_position: int = 1 << 16


class BigramModel:
    """Next-token distribution depends only on the current token: `table[token]`."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table / table.sum(-1, keepdim=True)  # [vocab, vocab]
        self.cfg = _Cfg(table.shape[0])

    def new_pool(self, num_blocks: int, block_size: int = 16) -> KVCache:
        return KVCache(1, num_blocks, 1, block_size, 1, torch.float32)

    def kv_bytes_per_token(self) -> int:
        return 8

    def forward(self, batch: ForwardBatch, cache: KVCache, last_n=None) -> list[torch.Tensor]:
        wanted = last_n if last_n is not None else batch.lengths
        out = []
        for row, n, m in zip(batch.tokens.split(batch.lengths), batch.lengths, wanted):
            out.append(self.table[row[n - m:n]].log())  # [m, vocab]
        return out


def random_table(vocab: int, seed: int, concentration: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((vocab, vocab), generator=g).pow(1.0 / concentration) + 0.02


def tempered(table: torch.Tensor, temperature: float) -> torch.Tensor:
    """The bigram law a sampler at `temperature` draws from: rows ∝ table^(1 / T)."""
    rows = table / table.sum(-1, keepdim=True)
    sharpened = rows.double().pow(1.0 / temperature)
    return sharpened / sharpened.sum(-1, keepdim=True)


def mentored(p: torch.Tensor, q: torch.Tensor, budget: float) -> torch.Tensor:
    d = 0.5 * (p - q).abs().sum()
    theta = 1.0 if d == 0 else min(1.0, budget / float(d))
    return (1 - theta) * p + theta * q


def exact_continuations(P: torch.Tensor, Q: torch.Tensor, first: int, n: int, k: int,
                        budget, bonus: bool = True) -> dict[tuple[int, ...], float]:
    """Exact law of the n generated tokens after prompt token `first`: the first from the
    target (prefill), then speculative rounds of min(k, tokens left - bonus) drafts sampled
    from Q, verified with TV budget `budget` (a number, or a function of the target's row p
    giving that position's budget), bonus from P when all are accepted."""
    P, Q = P.double(), Q.double()
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    law: dict[tuple[int, ...], float] = {}

    def new_round(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == n:
            law[seq] = law.get(seq, 0.0) + prob
            return
        left = n - len(seq)
        kk = min(k, left - (1 if bonus else 0))
        if kk <= 0:
            for y in range(P.shape[0]):
                new_round(seq + (y,), prob * float(P[seq[-1], y]))
            return
        draft_pos(seq, prob, 1, kk)

    def draft_pos(seq, prob, i, kk):
        p, q = P[seq[-1]], Q[seq[-1]]
        pi = mentored(p, q, budget(p) if callable(budget) else budget)
        for y in range(P.shape[0]):
            acc = float(torch.minimum(q[y], pi[y]))
            rec = float((pi[y] - q[y]).clamp_min(0))
            if rec > 0:
                new_round(seq + (y,), prob * rec)
            if acc > 0:
                nxt = seq + (y,)
                if len(nxt) == n:
                    law[nxt] = law.get(nxt, 0.0) + prob * acc
                elif i < kk:
                    draft_pos(nxt, prob * acc, i + 1, kk)
                elif bonus:
                    for b in range(P.shape[0]):
                        new_round(nxt + (b,), prob * acc * float(P[y, b]))
                else:
                    new_round(nxt, prob * acc)

    for y in range(P.shape[0]):
        new_round((y,), float(P[first, y]))
    total = sum(law.values())
    assert abs(total - 1) < 1e-9, total
    return law


class ToyTokenizer:
    """Token i is the character chr(ord('a') + i); `eos` (if any) decodes to nothing."""

    def __init__(self, eos: int | None = None) -> None:
        self.eos_token_ids = frozenset() if eos is None else frozenset({eos})

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i not in self.eos_token_ids)


def toy_engine(P, Q, k: int, budget: float = 0.0, bonus: bool = True, max_num_seqs: int = 64,
               eos: int | None = None, max_len: int = 64, method: str = "draft_model",
               num_blocks: int = 1024, spec_fields: dict | None = None, **config):
    from specserve.engine.engine import EngineConfig, LLMEngine
    from specserve.engine.runner import ModelRunner
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.sources import build_controller

    runner = ModelRunner(BigramModel(P), num_blocks)
    engine_config = EngineConfig(max_num_seqs, max_len, **config)
    controller, spec_fields = None, spec_fields or {}
    if method != "draft_model" or Q is not None:
        spec = SpeculativeConfig(method=method, model="toy" if Q is not None else None,
                                 num_speculative_tokens=k, tv_budget=budget, bonus_token=bonus,
                                 **spec_fields)
        draft_runner = ModelRunner(BigramModel(Q), num_blocks) if Q is not None else None
        controller = build_controller(spec, draft_runner, P.shape[0],
                                      engine_config.max_num_batched_tokens, max_len,
                                      engine_config.enable_prefix_caching)
    return LLMEngine(runner, runner.block_manager(engine_config.enable_prefix_caching),
                     ToyTokenizer(eos), engine_config, controller)


def run_all(engine) -> list:
    """Step until idle; the final RequestOutputs in the order they finished."""
    outs = []
    while engine.has_unfinished():
        outs += [delta.output for delta in engine.step() if delta.finished]
    return outs
