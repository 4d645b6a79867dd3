"""The hybrid decoders: Qwen3.5 (text) and Gemma 4 (text), on the PyTorch path.

A layer is RMSNorm → mixer → [post-norm] → residual → RMSNorm → gated MLP → [post-norm] →
residual, where the mixer is Gated DeltaNet linear attention (`gated_deltanet.py`) or
attention over a paged KV pool (`hybrid_attention.py`). Gemma 4 then adds a per-layer input:
a per-layer token embedding mixed with a projection of the input embedding (Gemma 3n's "PLE"),
gated by the residual stream, projected, normed and added; and scales the stream by the
layer's `layer_scalar`. References: Qwen3.5 / Qwen3-Next model cards; Gemma 4 model card;
`transformers`' `modeling_qwen3_5.py`, `modeling_gemma4.py` (the parity oracles).

`forward` has the contract of `transformer.Transformer.forward` (prefill chunks, decode steps
and verify passes in one ragged batch). A model with linear layers keeps per-sequence
recurrent state (`recurrent_state.py`): its batches must name each sequence (`seq_keys`), a
sequence's pass must start at 0 or where one of its recent passes had a row, and the engine's
prefix cache cannot restore that state from KV blocks (`ModelRunner.block_manager` turns it
off for such a model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specserve.models.config import ModelConfig
from specserve.models.gated_deltanet import GatedDeltaNet
from specserve.models.hybrid_attention import (ATTN_DTYPE, HybridAttention, kv_sources,
                                               layer_geometry, layer_inv_freq)
from specserve.models.hybrid_cache import HybridCache
from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE, resolve_kv_cache_dtype
from specserve.models.layer import Linear, rms_norm
from specserve.models.recurrent_state import RecurrentStates

# Snapshots kept per sequence: a verify pass of up to 16 drafts (MAX_SPECULATIVE_TOKENS) keeps
# its 17 rows' states, any of which the next pass may start from, and the position it started
# at (a round redone from the same place, as the engine's calibration does). A draft model's
# next pass starts at most k positions before its newest state, whatever its catch-up length.
DEFAULT_STATE_HISTORY = 18


def activation(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if cfg.hidden_act == "silu" else F.gelu(x, approximate="tanh")


class HybridBlock:
    """Decoder layer `index` (tensors under `prefix`); `kv_source`: see `kv_sources`."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, index: int,
                 kv_source: int | None) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.{name}"]

        self.cfg = cfg
        self.linear = kv_source is None
        self.mixer = GatedDeltaNet(cfg, w, prefix) if self.linear \
            else HybridAttention(cfg, w, prefix, index, kv_source)
        self.attn_norm = get("input_layernorm.weight")  # [hidden]
        self.attn_post_norm = self.mlp_post_norm = None
        if cfg.sandwich_norms:
            self.attn_post_norm = get("post_attention_layernorm.weight")
            self.mlp_norm = get("pre_feedforward_layernorm.weight")
            self.mlp_post_norm = get("post_feedforward_layernorm.weight")
        else:
            self.mlp_norm = get("post_attention_layernorm.weight")
        self.gate_up = Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
        self.down = Linear(get("mlp.down_proj.weight"))
        self.pl_gate = self.pl_proj = self.pl_norm = None
        if cfg.per_layer_input:
            self.pl_gate = Linear(get("per_layer_input_gate.weight"))
            self.pl_proj = Linear(get("per_layer_projection.weight"))
            self.pl_norm = get("post_per_layer_input_norm.weight")
        self.scale = w.get(f"{prefix}.layer_scalar")  # [1] (gemma4) | None

    def finish(self, x: torch.Tensor, mixed: torch.Tensor, per_layer: torch.Tensor | None
               ) -> torch.Tensor:
        """The residual stream after this layer, from `x` before it and its mixer's output."""
        eps = self.cfg.rms_norm_eps
        if self.attn_post_norm is not None:
            mixed = rms_norm(mixed, self.attn_post_norm, eps)
        x = x + mixed
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, eps)).chunk(2, dim=-1)
        out = self.down(activation(self.cfg, gate) * up)  # [rows, hidden]
        if self.mlp_post_norm is not None:
            out = rms_norm(out, self.mlp_post_norm, eps)
        x = x + out
        if self.pl_gate is not None:
            t = activation(self.cfg, self.pl_gate(x)) * per_layer  # [rows, per_layer_input]
            x = x + rms_norm(self.pl_proj(t), self.pl_norm, eps)
        return x if self.scale is None else x * self.scale


class HybridModel:
    """Weights as plain tensors, Hugging Face names (`model.layers.0.linear_attn.A_log`, ...);
    the same interface as `Transformer` (`new_pool`, `forward`, `logits`, ...)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 state_history: int = DEFAULT_STATE_HISTORY, mtp=None) -> None:
        """`mtp`: the checkpoint's multi-token-prediction head (`mtp_head.MTPHead`), if any."""
        self.cfg, self.state_history, self.mtp = cfg, state_history, mtp
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.norm = weights["model.norm.weight"]
        head = weights.get("lm_head.weight")
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings or head is None else head)
        self.dtype = self.act_dtype = self.embed.dtype
        self.kv_source = kv_sources(cfg)  # [num_layers] int | None
        self.layers = [HybridBlock(cfg, weights, f"model.layers.{i}", i, s)
                       for i, s in enumerate(self.kv_source)]
        self.recurrent = bool(cfg.linear_layers)
        self._inv_freq = {i: layer_inv_freq(cfg, i) for i, s in enumerate(self.kv_source)
                          if s is not None}
        if cfg.per_layer_input:
            self.ple_embed = weights["model.embed_tokens_per_layer.weight"]  # [vocab, L * P]
            self.ple_proj = Linear(weights["model.per_layer_model_projection.weight"])
            self.ple_norm = weights["model.per_layer_projection_norm.weight"]  # [P]
        self.pass_profile = None  # the fused native pass's profile: none here

    # ------------------------------------------------------------------ caches
    def _geometry(self) -> list[tuple[int, int] | None]:
        return [layer_geometry(self.cfg, i) if s == i else None
                for i, s in enumerate(self.kv_source)]

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype = ATTN_DTYPE) -> HybridCache:
        """KV pools of `num_blocks` blocks for the attention layers, and (with linear layers)
        the per-sequence recurrent states."""
        states = None
        la = self.cfg.linear_attention
        if self.recurrent:
            states = RecurrentStates(len(self.cfg.linear_layers),
                                     (la.conv_dim, la.conv_kernel - 1),
                                     (la.num_v_heads, la.v_head_dim, la.k_head_dim),
                                     self.state_history)
        return HybridCache(self._geometry(), num_blocks, block_size, dtype, states)

    def kv_bytes_per_token(self, dtype: torch.dtype = ATTN_DTYPE) -> int:
        return HybridCache.bytes_per_token(self._geometry(), dtype)

    def kv_cache_dtype(self, kv_cache_dtype: str = "auto") -> torch.dtype:
        """The cache dtype for the option (these layers have no native glue)."""
        return resolve_kv_cache_dtype(kv_cache_dtype, False, self.act_dtype)

    # ------------------------------------------------------------------ passes
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed).to(self.act_dtype)  # [rows, hidden]
        if self.cfg.embed_scale != 1.0:  # gemma: the scale rounded to the weights' dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=self.embed.dtype).to(x.dtype)
        return x

    def _per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer inputs `[rows, layers, P]`, or None."""
        c = self.cfg
        if not c.per_layer_input:
            return None
        rows, p = x.shape[0], c.per_layer_input
        scale = torch.tensor(math.sqrt(p), dtype=self.ple_embed.dtype)
        token_part = (F.embedding(tokens, self.ple_embed) * scale).view(rows, c.num_layers, p)
        context = (self.ple_proj(x) * c.hidden_size ** -0.5).view(rows, c.num_layers, p)
        context = rms_norm(context, self.ple_norm, c.rms_norm_eps)
        return (context + token_part.to(x.dtype)) * 2 ** -0.5

    def _initial_states(self, batch, cache: HybridCache) -> list:
        """Per sequence of the batch, the linear layers' states before its first row."""
        if not self.recurrent:
            return []
        if batch.seq_keys is None:
            raise ValueError("a model with linear-attention layers needs each sequence named "
                             "(ForwardBatch seq_keys): it keeps recurrent state per sequence")
        return [cache.states.initial(key, start) if n else [None] * cache.states.num_layers
                for key, start, n in zip(batch.seq_keys, batch.starts, batch.lengths)]

    def hidden_states(self, batch, cache: HybridCache) -> torch.Tensor:
        """Run the decoder over `batch`, writing keys/values into `cache` and (once the whole
        pass succeeded) the sequences' new recurrent states. Returns the final normalised
        hidden states `[rows, hidden]`."""
        c = self.cfg
        tables = batch.block_tables  # [num_seqs, max_blocks]
        x = self.embed_tokens(batch.tokens)  # [rows, hidden]
        per_layer = self._per_layer_inputs(batch.tokens, x)
        block_of = tables[batch.row_seq.long(), batch.positions // cache.block_size]  # [rows]
        slot_mapping = block_of.long() * cache.block_size + batch.positions % cache.block_size
        where = (slot_mapping, tables.to(torch.int32), batch.row_seq.to(torch.int32),
                 batch.positions.to(torch.int32))
        ropes = {}
        for i, inv in self._inv_freq.items():
            freqs = batch.positions.float()[:, None] * inv  # [rows, rotated / 2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [rows, 1, rotated]
            ropes[i] = (emb.cos(), emb.sin())
        states = self._initial_states(batch, cache)
        kept = []  # per linear layer, per sequence: (conv, ssm) snapshots
        for i, block in enumerate(self.layers):
            h = rms_norm(x, block.attn_norm, c.rms_norm_eps)
            if block.linear:
                out, snaps = block.mixer(h, batch.lengths, [s[len(kept)] for s in states],
                                         self.state_history)
                kept.append(snaps)
            else:
                out = block.mixer(h, ropes[i], where, cache.pools[block.mixer.kv_source])
            x = block.finish(x, out, None if per_layer is None else per_layer[:, i])
        for s, (key, start, n) in enumerate(zip(batch.seq_keys or (), batch.starts,
                                                batch.lengths)):
            if n and kept:
                cache.states.store(key, start, n, [k[s][0] for k in kept],
                                   [k[s][1] for k in kept])
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        """`[..., hidden]` → float32 logits `[..., vocab]`, soft-capped where configured."""
        logits = (head if head is not None else self.lm_head)(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, batch, cache: HybridCache, last_n: list[int] | None = None,
                head=None) -> list[torch.Tensor]:
        """Logits of the last `last_n[seq]` rows of each sequence (default all; 0: none), as
        `Transformer.forward`."""
        return pick_logits(self, self.hidden_states(batch, cache), batch.lengths, last_n, head)


def pick_logits(model, hidden: torch.Tensor, lengths: list[int], last_n: list[int] | None,
                head=None) -> list[torch.Tensor]:
    """The logits `[n_seq, vocab]` of the last `last_n[seq]` rows of each sequence."""
    wanted = last_n if last_n is not None else lengths
    picks, end = [], 0
    for n, m in zip(lengths, wanted):
        end += n
        picks += range(end - m, end)
    if not picks:
        return [hidden.new_zeros((0, model.cfg.vocab_size), dtype=torch.float32)] * len(wanted)
    logits = model.logits(hidden[torch.tensor(picks, dtype=torch.long)], head)
    return list(logits.split(list(wanted)))
