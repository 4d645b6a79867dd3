"""Qwen3.5's multi-token-prediction (MTP) head: one extra full-attention layer that predicts the
token after next from the target's hidden state and the next token (DeepSeek-V3 2412.19437,
§2.2; Qwen3-Next / Qwen3.5 checkpoints carry one such layer under `mtp.*`).

Row j of an MTP pass sits at position p: it reads the target's final (normed) hidden state
h_p, which predicted token x_{p+1}, and the embedding of x_{p+1}:

    x = fc([RMSNorm_e(embed(x_{p+1})), RMSNorm_h(h_p)]);   x = layer(x at position p);
    out = RMSNorm(x);   logits = lm_head(out) → a distribution of x_{p+2}.

The layer keeps its own paged KV cache (one pool), written at position p. Drafting several
tokens feeds `out` back as the next row's hidden state with the drafted token. The embedding
and the output head are the target's own.
"""

from __future__ import annotations

import torch

from specserve.models.config import ModelConfig
from specserve.models.hybrid import HybridBlock
from specserve.models.hybrid_attention import ATTN_DTYPE, layer_geometry, layer_inv_freq
from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from specserve.models.layer import Linear, rms_norm


class MTPHead:
    """The `mtp.*` tensors of a Qwen3.5 checkpoint (`cfg.mtp_layers` == 1)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
        if cfg.mtp_layers != 1:
            raise ValueError(f"an MTP head of {cfg.mtp_layers} layers is not supported "
                             f"(Qwen3.5 checkpoints carry 1)")
        self.cfg = cfg
        self.fc = Linear(w["mtp.fc.weight"])  # [hidden, 2 hidden]
        self.embed_norm = w["mtp.pre_fc_norm_embedding.weight"]  # [hidden]
        self.hidden_norm = w["mtp.pre_fc_norm_hidden.weight"]  # [hidden]
        self.norm = w["mtp.norm.weight"]  # [hidden]
        # index past the decoder's layers: a full-attention layer (not linear, not sliding)
        self.index = cfg.num_layers
        self.block = HybridBlock(cfg, w, "mtp.layers.0", self.index, self.index)
        self._inv_freq = layer_inv_freq(cfg, self.index)

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype = ATTN_DTYPE) -> KVCache:
        kv_heads, head_dim = layer_geometry(self.cfg, self.index)
        return KVCache(1, num_blocks, kv_heads, block_size, head_dim, dtype)

    def hidden_states(self, model, batch, prev_hidden: torch.Tensor, pool: KVCache
                      ) -> torch.Tensor:
        """`batch`'s rows (tokens x_{p+1} at positions p) with `prev_hidden` `[rows, hidden]`
        (h_p) → the head's normed output `[rows, hidden]` (`model.logits` of it predicts
        x_{p+2}); writes the layer's keys and values into `pool`."""
        eps = self.cfg.rms_norm_eps
        tables = batch.block_tables  # [num_seqs, max_blocks]
        e = rms_norm(model.embed_tokens(batch.tokens), self.embed_norm, eps)
        h = rms_norm(prev_hidden.to(e.dtype), self.hidden_norm, eps)
        x = self.fc(torch.cat([e, h], dim=-1))  # [rows, hidden]
        block_of = tables[batch.row_seq.long(), batch.positions // pool.block_size]  # [rows]
        slot_mapping = block_of.long() * pool.block_size + batch.positions % pool.block_size
        where = (slot_mapping, tables.to(torch.int32), batch.row_seq.to(torch.int32),
                 batch.positions.to(torch.int32))
        freqs = batch.positions.float()[:, None] * self._inv_freq  # [rows, rotated / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [rows, 1, rotated]
        normed = rms_norm(x, self.block.attn_norm, eps)
        x = self.block.finish(x, self.block.mixer(normed, (emb.cos(), emb.sin()), where, pool),
                              None)
        return rms_norm(x, self.norm, eps)
