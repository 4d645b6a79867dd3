"""The decoder-only transformer behind `llama` and `qwen2` checkpoints.

RMSNorm → attention with rotary position embeddings (rotate-half layout, as in Hugging Face
checkpoints) and grouped-query heads → RMSNorm → SwiGLU MLP, with a KV cache in slots.
References: Touvron et al. 2023 (LLaMA); Qwen2 technical report 2407.10671; Su et al. 2104.09864
(RoPE).

One `forward` serves the three shapes of generation: prefill (many tokens), decode (one token)
and verify (k + 1 tokens against a cached prefix). Rows of a batch may start at different cache
lengths and carry different numbers of tokens (right-padded to the longest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.engine.kv_cache import KVCache
from specserve.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Where each row's tokens go in the cache.

    E.g. a verify pass of 3 tokens for a sequence with 10 cached tokens next to a decode step
    of a sequence with 4: tokens [[a, b, c], [d, 0, 0]], starts [10, 4], lengths [3, 1].
    """

    tokens: torch.Tensor  # [batch, T] long, right-padded
    starts: list[int]  # [batch] cached positions before this pass
    lengths: list[int]  # [batch] real tokens in each row
    slots: list[int]  # [batch] KV cache slot of each row

    @staticmethod
    def from_lists(rows: list[list[int]], starts: list[int], slots: list[int]) -> "ForwardBatch":
        width = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return ForwardBatch(tokens, list(starts), [len(r) for r in rows], list(slots))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# From this many rows on, a bfloat16 matmul is computed in float32: CPUs without native
# bfloat16 (AVX2) run bf16 GEMMs ~10x slower than converting the weight and calling sgemm.
FLOAT32_GEMM_ROWS = 32
ATTN_DTYPE = torch.float32
# Passes of up to this many tokens (verify passes, batched decode steps) attend position by
# position, the way a single decode step does: with batch-invariant matmuls (the native
# quantized kernels) a verify pass then reproduces plain decoding's logits bit for bit, so
# greedy speculative decoding returns exactly the target-only text. Longer passes (prefill)
# use one masked attention call.
BATCH_INVARIANT_ROWS = 64


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of one query position on every key given: q `[1, heads, 1, hd]`, keys and
    values `[1, kv_heads, n, hd]` → `[1, heads, 1, hd]`. The query heads that share a KV head
    become that head's rows (head h reads KV head h // (heads / kv_heads), as grouped-query
    attention defines), so the keys are read in place: `enable_gqa` would first copy them
    for every query head, which at a context of a thousand tokens cost a decode step of the
    1.5B target more than its whole attention arithmetic (and a verify pass that, per row)."""
    _, heads, _, hd = q.shape
    grouped = q.reshape(1, keys.shape[1], heads // keys.shape[1], hd)  # [1, kv, group, hd]
    return F.scaled_dot_product_attention(grouped, keys, values).reshape(1, heads, 1, hd)


class Linear:
    """A weight (and optional bias) applied as `x @ W.T + b`; quantized formats replace it.

    Float32 activations with float32 or bfloat16 weights run on the native float kernel
    (`f_matmul` in `specserve/kernels/qmatmul.c`) where it is available: each row's result is
    then the same bits whatever the other rows of the pass (batch invariance, as the quantized
    kernels). Elsewhere, and for bfloat16 activations, PyTorch's matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16):
            lib = kernels.qmatmul()
            if lib is not None:
                return self._native(lib, x)
        if w.dtype == torch.bfloat16 and x.numel() >= FLOAT32_GEMM_ROWS * x.shape[-1]:
            b = self.bias.float() if self.bias is not None else None
            return F.linear(x.float(), w.float(), b).to(x.dtype)
        return F.linear(x, w, self.bias)

    def _native(self, lib, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.contiguous()  # [out, in]
        out_f, in_f = w.shape
        flat = x.reshape(-1, in_f).contiguous()  # [rows, in]
        y = torch.empty((flat.shape[0], out_f), dtype=torch.float32)  # [rows, out]
        bias = self.bias.float().contiguous() if self.bias is not None else None
        rc = lib.f_matmul(flat.data_ptr(), flat.shape[0], in_f, w.data_ptr(),
                          int(w.dtype == torch.bfloat16),
                          bias.data_ptr() if bias is not None else None, out_f, y.data_ptr())
        if rc != 0:
            raise RuntimeError("f_matmul: bad arguments")
        return y.reshape(*x.shape[:-1], out_f)


class Layer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.{name}"]

        qkv = torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"),
                         get("self_attn.v_proj.weight")])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"),
                              get("self_attn.v_proj.bias")])
        self.qkv = Linear(qkv, bias)
        self.o = Linear(get("self_attn.o_proj.weight"))
        self.gate_up = Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
        self.down = Linear(get("mlp.down_proj.weight"))
        self.attn_norm = get("input_layernorm.weight")
        self.mlp_norm = get("post_attention_layernorm.weight")


class Transformer:
    """Weights as plain tensors; no autograd. Build with `Transformer(cfg, state_dict)` where the
    state dict uses Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.layers = [Layer(cfg, weights, f"model.layers.{i}") for i in range(cfg.num_layers)]
        self.norm = weights["model.norm.weight"]
        head = weights.get("lm_head.weight")
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings or head is None else head)
        self.dtype = self.embed.dtype  # the weights' dtype
        # The residual stream's dtype; the int8/int4 formats on the native kernels switch it
        # to float32 (the kernels take float32). Attention and the KV cache always run in float32: on CPUs without
        # native bfloat16, bfloat16 attention is 5-8x slower than float32.
        self.act_dtype = self.dtype
        inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        self._inv_freq = inv_freq  # [head_dim / 2]

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim, ATTN_DTYPE)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self._inv_freq  # [batch, T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [batch, 1, T, head_dim]
        return emb.cos(), emb.sin()

    def _mask(self, batch: ForwardBatch, width: int, end: int) -> torch.Tensor:
        starts = torch.tensor(batch.starts)[:, None, None]  # [batch, 1, 1]
        q_pos = starts + torch.arange(width)[None, :, None]  # [batch, T, 1]
        k_pos = torch.arange(end)[None, None, :]  # [1, 1, end]
        return (k_pos <= q_pos)[:, None]  # [batch, 1, T, end]

    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the decoder over `batch`, writing its keys/values into `cache`. Returns the final
        normalised hidden states `[batch, T, hidden]` (padded positions hold garbage)."""
        c = self.cfg
        bsz, width = batch.tokens.shape
        positions = torch.tensor(batch.starts)[:, None] + torch.arange(width)  # [batch, T]
        cos, sin = self._rope(positions)
        end = max(s + n for s, n in zip(batch.starts, batch.lengths))
        per_position = bsz * width <= BATCH_INVARIANT_ROWS  # decode steps and verify passes
        mask = None if per_position else self._mask(batch, width, end)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = F.embedding(batch.tokens, self.embed).to(self.act_dtype)  # [batch, T, hidden]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            q, k, v = layer.qkv(h).to(ATTN_DTYPE).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(bsz, width, c.num_heads, c.head_dim).transpose(1, 2)  # [batch, heads, T, hd]
            k = k.view(bsz, width, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [batch, kv, T, hd]
            v = v.view(bsz, width, c.num_kv_heads, c.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache.write(i, batch.slots, batch.starts, batch.lengths, k, v)
            if per_position:
                attn = self._attend_per_position(i, batch, q, cache)
            else:
                keys, values = cache.read(i, batch.slots, end)  # [batch, kv, end, hd]
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                      enable_gqa=True)
            x = x + layer.o(attn.transpose(1, 2).reshape(bsz, width, q_dim).to(x.dtype))
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def _attend_per_position(self, layer: int, batch: ForwardBatch, q: torch.Tensor,
                             cache: KVCache) -> torch.Tensor:
        """Attention of each real position on its own, exactly as a one-token decode step
        computes it (same call, same shapes, no mask), so a verify pass gives the same logits
        as decoding its tokens one by one. `q` [batch, heads, T, hd] → [batch, heads, T, hd]."""
        out = torch.zeros_like(q)
        for row, (slot, start, n) in enumerate(zip(batch.slots, batch.starts, batch.lengths)):
            for t in range(n):
                keys, values = cache.read(layer, [slot], start + t + 1)  # [1, kv, pos + 1, hd]
                out[row:row + 1, :, t:t + 1] = attend_one(q[row:row + 1, :, t:t + 1], keys, values)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` → float32 logits `[..., vocab]`."""
        return self.lm_head(hidden).float()

    def forward(self, batch: ForwardBatch, cache: KVCache, last_n: list[int] | None = None
                ) -> list[torch.Tensor]:
        """Logits of the last `last_n[row]` real positions of each row (default: all real
        positions): a list of `[n_row, vocab]` float32 tensors."""
        hidden = self.hidden_states(batch, cache)  # [batch, T, hidden]
        wanted = last_n if last_n is not None else batch.lengths
        rows = [hidden[r, n - m:n] for r, (n, m) in enumerate(zip(batch.lengths, wanted))]
        logits = self.logits(torch.cat(rows))  # [sum(wanted), vocab]
        return list(logits.split(list(wanted)))
