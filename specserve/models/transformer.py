"""The decoder-only transformer behind `llama`, `qwen2`, `qwen3` and `gemma3` checkpoints.

RMSNorm → attention with rotary position embeddings (rotate-half layout, as in Hugging Face
checkpoints) and grouped-query heads → RMSNorm → SwiGLU MLP, with a paged KV cache.
References: Touvron et al. 2023 (LLaMA); Qwen2 technical report 2407.10671; Su et al. 2104.09864
(RoPE). Qwen3 (2505.09388) adds an RMSNorm of each query and key head before the rotary
embedding; Gemma 3 (2503.19786) adds those too, scales the embeddings by sqrt(hidden), norms the
attention's and the MLP's outputs, gates with GELU (tanh) and alternates sliding-window layers
(their own rope base) with global ones (`ModelConfig` names each trait).

One `forward` serves every shape of generation: prefill chunks, decode steps and verify
passes, mixed in one batch. The batch is flat: each row is one token of one sequence at one
position, there is no padding, and every row takes the same path (row-wise projections,
`ragged_attention` on the sequence's own blocks), so a row's result does not depend on what
else is in the pass.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.kernels.decoder import Buffers, DecoderPlan, Dims, KVIndex
from specserve.models import rope
from specserve.models.attention import ragged_attention
from specserve.models.config import ModelConfig
from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, resolve_kv_cache_dtype
from specserve.models.layer import FLOAT32_GEMM_ROWS, Layer, Linear, rms_norm, rotate_half  # noqa: F401
from specserve.models.prefill import PrefillPath
from specserve.models.prefill_pass import prefill_layers


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Which tokens a pass feeds and where their keys and values go.

    E.g. a verify pass of 3 tokens for a sequence with 10 cached tokens next to a decode step
    of a sequence with 4: tokens [a, b, c, d], positions [10, 11, 12, 4], row_seq [0, 0, 0, 1],
    lengths [3, 1], and each sequence's block table.
    """

    tokens: torch.Tensor  # [rows] long
    positions: torch.Tensor  # [rows] long
    row_seq: torch.Tensor  # [rows] int32: which sequence of the batch each row belongs to
    lengths: list[int]  # [num_seqs] rows of each sequence (0 allowed)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    # [num_seqs] each sequence's identity (the engine's BlockTable): models with per-sequence
    # recurrent state key it by this; None where the caller names none (attention-only models)
    seq_keys: tuple | None = None
    starts: tuple[int, ...] = ()  # [num_seqs] the position of each sequence's first row
    # [num_seqs] how many of each sequence's leading rows are prompt rows, which take the
    # prefill path where the model has one (`models/prefill.py`); empty: none
    prefill: tuple[int, ...] = ()

    @staticmethod
    def paged(rows: list[list[int]], starts: list[int], block_tables: list[list[int]],
              keys: list | None = None, prefill: list[int] | None = None) -> "ForwardBatch":
        """`rows[i]` fed at positions `starts[i]...` of the sequence whose blocks are
        `block_tables[i]` (every block the rows' positions reach must be listed) and whose
        identity is `keys[i]` (optional); the first `prefill[i]` of them are prompt rows
        (default: none)."""
        width = max(1, max(len(t) for t in block_tables))
        tables = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return ForwardBatch._flat(rows, starts, tables, keys, prefill)

    @staticmethod
    def _flat(rows, starts, tables, keys=None, prefill=None) -> "ForwardBatch":
        lengths = [len(r) for r in rows]
        tokens = torch.tensor([t for r in rows for t in r], dtype=torch.long)  # [rows]
        positions = torch.tensor([s + j for s, n in zip(starts, lengths) for j in range(n)],
                                 dtype=torch.long)  # [rows]
        row_seq = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                          torch.tensor(lengths))  # [rows]
        if prefill is not None and any(not 0 <= p <= n for p, n in zip(prefill, lengths)):
            raise ValueError(f"prefill counts {list(prefill)} exceed the rows {lengths}")
        return ForwardBatch(tokens, positions, row_seq, lengths, tables,
                            None if keys is None else tuple(keys), tuple(starts),
                            tuple(prefill) if prefill is not None and any(prefill) else ())

    def prefill_rows(self) -> torch.Tensor:
        """The indices of the prompt rows (`prefill`), ascending: `[num prompt rows]` long."""
        firsts = [0]
        for n in self.lengths[:-1]:
            firsts.append(firsts[-1] + n)
        return torch.tensor([f + j for f, p in zip(firsts, self.prefill) for j in range(p)],
                            dtype=torch.long)


def _check_rc(rc: int, name: str) -> None:
    if rc == -3:
        raise ValueError(f"{name}: a sequence, position or block id out of range")
    if rc != 0:
        raise RuntimeError(f"native {name} failed (code {rc})")


ATTN_DTYPE = torch.float32


def _project(linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`linear(x)` (contiguous), written into `out` where the layer can (`into`: the quantized
    `NativeLinear` and the float `Linear`; PyTorch's packed fallbacks have none)."""
    into = getattr(linear, "into", None)
    return into(x, out) if into is not None else linear(x).contiguous()


@dataclass(frozen=True, slots=True)
class PassBuffers:
    """A native pass's float32 work buffers (one each, reused by every layer)."""

    h: torch.Tensor  # [rows, hidden]: a norm's output
    qkv: torch.Tensor  # [rows, (heads + 2 kv_heads) * hd]
    attn: torch.Tensor  # [rows, heads * hd]
    gu: torch.Tensor  # [rows, 2 * intermediate]
    act: torch.Tensor  # [rows, intermediate]
    proj: torch.Tensor  # [rows, hidden]: o's output, then down's

    @staticmethod
    def empty(rows: int, c: ModelConfig) -> "PassBuffers":
        def new(width: int) -> torch.Tensor:
            return torch.empty((rows, width), dtype=torch.float32)

        q_dim = c.num_heads * c.head_dim
        return PassBuffers(new(c.hidden_size), new(q_dim + 2 * c.num_kv_heads * c.head_dim),
                           new(q_dim), new(2 * c.intermediate_size), new(c.intermediate_size),
                           new(c.hidden_size))

    def struct(self) -> Buffers:
        return Buffers(*(t.data_ptr() for t in (self.h, self.qkv, self.attn, self.gu, self.act,
                                                self.proj)))


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
        # to float32 (the kernels take float32). Attention always computes in float32: on CPUs
        # without native bfloat16, bfloat16 attention is several times slower than float32. The KV cache
        # holds float32 unless asked otherwise (`kv_cache_dtype`); narrow caches read widened.
        self.act_dtype = self.dtype
        # GGUF files of Llama 3.x carry their rope scaling as per-pair factors (`rope.py`)
        self._inv_freq = rope.inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                       weights.get("rope_freqs.weight"))  # [head_dim / 2]
        local = cfg.rope_local_theta if cfg.sliding_layers else None
        self._local_inv_freq = None if local is None else rope.inv_freq(cfg.head_dim, local)
        self._windows = [cfg.sliding_window if i in cfg.sliding_layers else None
                         for i in range(cfg.num_layers)]  # [num_layers] int | None
        self._plan: tuple | None = None  # (the projections' ids, their DecoderPlan | None)
        # float64 [len(decoder.STEPS)] or None: where set (a benchmark), the fused pass adds
        # its seconds per kind of step into it
        self.pass_profile: torch.Tensor | None = None
        # (layer index, projection attribute) → that projection's float weights [out, in] as
        # the source file dequantizes them (set by the loader for quantized models; None: the
        # projections are what they are): what a prefill path is made from
        self.dense_weights = None

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype = ATTN_DTYPE) -> KVCache:
        """Per-layer pools of `num_blocks` blocks, addressed by block tables (`ForwardBatch.paged`)."""
        c = self.cfg
        return KVCache(c.num_layers, num_blocks, c.num_kv_heads, block_size, c.head_dim, dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype = ATTN_DTYPE) -> int:
        c = self.cfg
        return KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype)

    def kv_cache_dtype(self, kv_cache_dtype: str = "auto") -> torch.dtype:
        """The cache dtype the option `kv_cache_dtype` gives this model ("auto": float16 where
        its layers run on the native glue, its activations' dtype elsewhere)."""
        native = kernels.attention() is not None and self._native_layers(
            torch.empty(0, dtype=self.act_dtype))
        return resolve_kv_cache_dtype(kv_cache_dtype, native, self.act_dtype)

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * inv_freq  # [rows, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [rows, 1, head_dim]
        return emb.cos(), emb.sin()

    def _layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) `[rows, 1, head_dim]` of each layer: sliding layers with their own base."""
        full = self._rope(positions, self._inv_freq)
        if self._local_inv_freq is None:
            return [full] * self.cfg.num_layers
        local = self._rope(positions, self._local_inv_freq)
        return [full if w is None else local for w in self._windows]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed).to(self.act_dtype)  # [rows, hidden]
        if self.cfg.embed_scale != 1.0:  # gemma3: the scale rounded to the weights' dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=self.embed.dtype).to(x.dtype)
        return x

    def hidden_states(self, batch: ForwardBatch, cache: KVCache,
                      prefill: PrefillPath | None = None) -> torch.Tensor:
        """Run the decoder over `batch`, writing its keys/values into `cache`. Returns the final
        normalised hidden states `[rows, hidden]`. `prefill`: the path the batch's prompt rows
        (`ForwardBatch.prefill`) take on the native glue (None: the int4 kernels', as every
        other row's)."""
        c = self.cfg
        tables = batch.block_tables  # [num_seqs, max_blocks]
        ropes = self._layer_ropes(batch.positions)
        x = self._embed(batch.tokens)  # [rows, hidden]
        lib = kernels.attention() if self._native_layers(x) else None
        if lib is not None:
            if prefill is not None and prefill.choice.active and batch.prefill:
                return self._native_pass(lib, x, batch, tables, *ropes[0], cache, prefill)
            return self._native_pass(lib, x, batch, tables, *ropes[0], cache)
        block_of = tables[batch.row_seq.long(), batch.positions // cache.block_size]  # [rows]
        slot_mapping = block_of.long() * cache.block_size + batch.positions % cache.block_size
        # the attention kernel takes int32 indices: convert once per pass, not once per layer
        where = (slot_mapping, tables.to(torch.int32), batch.row_seq.to(torch.int32),
                 batch.positions.to(torch.int32))
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, ropes[i], where, cache)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def _layer(self, i: int, layer: Layer, x: torch.Tensor, cos_sin: tuple, where: tuple,
               cache: KVCache) -> torch.Tensor:
        """Layer `i` on the PyTorch path: `x` `[rows, hidden]` → the next residual stream."""
        c = self.cfg
        rows = x.shape[0]
        slot_mapping, tables32, row_seq32, positions32 = where
        cos, sin = cos_sin  # [rows, 1, head_dim]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
        q, k, v = layer.qkv(h).to(ATTN_DTYPE).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(rows, c.num_heads, c.head_dim)  # [rows, heads, hd]
        k = k.view(rows, c.num_kv_heads, c.head_dim)  # [rows, kv, hd]
        v = v.view(rows, c.num_kv_heads, c.head_dim)  # [rows, kv, hd]
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.write(i, slot_mapping, k, v)
        attn = ragged_attention(q, cache.keys[i], cache.values[i], tables32, row_seq32,
                                positions32, c.attn_scale, self._windows[i])  # [rows, heads, hd]
        out = layer.o(attn.reshape(rows, q_dim).to(x.dtype))  # [rows, hidden]
        if layer.attn_post_norm is not None:
            out = rms_norm(out, layer.attn_post_norm, c.rms_norm_eps)
        x = x + out
        h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        act = F.silu(gate) if c.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        out = layer.down(act * up)  # [rows, hidden]
        if layer.mlp_post_norm is not None:
            out = rms_norm(out, layer.mlp_post_norm, c.rms_norm_eps)
        return x + out

    def _native_layers(self, x: torch.Tensor) -> bool:
        """Whether the layers' glue (norms, rotary embedding, cache writes, attention, SwiGLU)
        can run natively: float32 activations and norm weights, head_dim a multiple of 8, and
        none of what the glue lacks (sliding-window layers, GELU, norms after attention and
        MLP: `gemma3`, and Mistral-style windowed files, run on the PyTorch path)."""
        c = self.cfg
        return (x.dtype == torch.float32 and c.head_dim % 8 == 0
                and not c.sliding_layers and not c.sandwich_norms and c.hidden_act == "silu"
                and self.norm.dtype == torch.float32
                and all(n.dtype == torch.float32 for l in self.layers for n in l.norms()))

    def _decoder_plan(self) -> DecoderPlan | None:
        """The fused pass's view of the layers (`kernels/decoder.py`), built on first use and
        again if a projection was replaced (weights quantized after construction); None where
        a projection has no native form (PyTorch's packed int4/int8 fallbacks)."""
        projections = [p for l in self.layers for p in (l.qkv, l.o, l.gate_up, l.down)]
        key = tuple(id(p) for p in projections)
        if self._plan is None or self._plan[0] != key:
            makers = [getattr(p, "native_proj", None) for p in projections]
            projs = [make() if make is not None else None for make in makers]
            plan = None
            if all(p is not None for p in projs):
                plan = DecoderPlan(kernels.qmatmul(), self.layers, projs)
            self._plan = (key, plan)
        return self._plan[1]

    def _native_pass(self, lib, x: torch.Tensor, batch: ForwardBatch, tables: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                     prefill: PrefillPath | None = None) -> torch.Tensor:
        """`hidden_states` on the native glue (`specserve/kernels/attention.c`): the same
        arithmetic per row as the PyTorch path's rotary embedding and attention, its own
        fixed-order RMSNorm and SiLU. The whole pass is one call (`decoder_pass`) where every
        projection has a native form, else each layer's glue is three calls around the
        projections (`_layer_calls`); both give the same bits."""
        c = self.cfg
        rows, hidden = x.shape
        heads, kv_heads, hd = c.num_heads, c.num_kv_heads, c.head_dim
        tables32 = tables.to(torch.int32).contiguous()  # [num_seqs, max_blocks]
        seq32 = batch.row_seq.to(torch.int32).contiguous()  # [rows]
        pos32 = batch.positions.to(torch.int32).contiguous()  # [rows]
        cos = cos.reshape(rows, hd).contiguous()  # [rows, hd]
        sin = sin.reshape(rows, hd).contiguous()  # [rows, hd]
        x = x.contiguous()
        bufs = PassBuffers.empty(rows, c)
        scale = 1 / math.sqrt(hd) if c.attn_scale is None else c.attn_scale
        num_seqs, max_blocks = tables32.shape
        index = KVIndex(kernels.KV_KINDS[cache.keys.dtype], cache.num_blocks, cache.block_size,
                        tables32.data_ptr(), num_seqs, max_blocks, seq32.data_ptr(),
                        pos32.data_ptr())
        step = cache.keys[0].numel() * cache.keys.element_size()  # bytes of one layer's pool
        out = torch.empty_like(x)  # [rows, hidden]
        if prefill is not None:
            prefill_layers(self, prefill, lib, x, batch, bufs, cos, sin, cache, step, index,
                           scale)
            return self._final_norm(lib, x, out)
        plan = self._decoder_plan()
        if plan is not None:
            dims = Dims(hidden, heads, kv_heads, hd, c.intermediate_size, c.rms_norm_eps, scale)
            rc = lib.decoder_pass(plan.proj_fn, plan.layers, len(self.layers), ctypes.byref(dims),
                                  x.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
                                  cache.keys.data_ptr(), cache.values.data_ptr(), step,
                                  ctypes.byref(index), ctypes.byref(bufs.struct()),
                                  self.norm.data_ptr(), out.data_ptr(),
                                  None if self.pass_profile is None
                                  else self.pass_profile.data_ptr())
            _check_rc(rc, "decoder_pass")
            return out
        self._layer_calls(lib, x, bufs, cos, sin, cache, step, index, scale)
        return self._final_norm(lib, x, out)

    def _final_norm(self, lib, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows, hidden = x.shape
        _check_rc(lib.rms_norm(x.data_ptr(), rows, hidden, self.norm.data_ptr(),
                               ctypes.c_float(self.cfg.rms_norm_eps), out.data_ptr()),
                  "rms_norm")
        return out

    def _layer_calls(self, lib, x: torch.Tensor, bufs: "PassBuffers", cos: torch.Tensor,
                     sin: torch.Tensor, cache: KVCache, step: int, index: KVIndex,
                     scale: float) -> None:
        """Every layer over the residual stream `x` (in place), a native call per step."""
        c = self.cfg
        rows, hidden = x.shape
        eps = ctypes.c_float(c.rms_norm_eps)
        keys, values = cache.keys.data_ptr(), cache.values.data_ptr()
        where = (index.kv_kind, index.num_blocks, index.block_size, index.block_tables,
                 index.num_seqs, index.max_blocks, index.row_seq, index.row_pos,
                 ctypes.c_float(scale), bufs.attn.data_ptr())
        for i, layer in enumerate(self.layers):
            _check_rc(lib.rms_norm(x.data_ptr(), rows, hidden, layer.attn_norm.data_ptr(), eps,
                                   bufs.h.data_ptr()), "rms_norm")
            qkv = _project(layer.qkv, bufs.h, bufs.qkv)  # [rows, (heads + 2 kv_heads) * hd]
            if layer.q_norm is not None:
                self._native_qk_norm(lib, layer, qkv, eps)
            _check_rc(lib.rope_store_attend(qkv.data_ptr(), rows, c.num_heads, c.num_kv_heads,
                                            c.head_dim, cos.data_ptr(), sin.data_ptr(),
                                            keys + i * step, values + i * step, *where),
                      "rope_store_attend")
            x += _project(layer.o, bufs.attn, bufs.proj)
            _check_rc(lib.rms_norm(x.data_ptr(), rows, hidden, layer.mlp_norm.data_ptr(), eps,
                                   bufs.h.data_ptr()), "rms_norm")
            gate_up = _project(layer.gate_up, bufs.h, bufs.gu)  # [rows, 2 * intermediate]
            _check_rc(lib.silu_mul(gate_up.data_ptr(), rows, c.intermediate_size,
                                   bufs.act.data_ptr()), "silu_mul")
            x += _project(layer.down, bufs.act, bufs.proj)

    def _native_qk_norm(self, lib, layer: Layer, qkv: torch.Tensor, eps: ctypes.c_float) -> None:
        """`qkv` `[rows, (heads + 2 kv_heads) * hd]` with each query and key head RMS-normed in
        place (`rms_norm` of `attention.c` over rows × heads vectors of hd)."""
        c = self.cfg
        rows, hd = qkv.shape[0], c.head_dim
        for norm, lo, n in ((layer.q_norm, 0, c.num_heads),
                            (layer.k_norm, c.num_heads * hd, c.num_kv_heads)):
            part = qkv[:, lo:lo + n * hd].contiguous()  # [rows, n * hd]
            _check_rc(lib.rms_norm(part.data_ptr(), rows * n, hd, norm.data_ptr(), eps,
                                   part.data_ptr()), "rms_norm")
            qkv[:, lo:lo + n * hd] = part

    def logits(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        """`[..., hidden]` → float32 logits `[..., vocab]` through `head` (default the model's
        own), soft-capped where the config says."""
        logits = (head if head is not None else self.lm_head)(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, batch: ForwardBatch, cache: KVCache, last_n: list[int] | None = None,
                head=None, prefill: PrefillPath | None = None) -> list[torch.Tensor]:
        """Logits of the last `last_n[seq]` rows of each sequence (default: all its rows;
        0: none): a list of `[n_seq, vocab]` float32 tensors (`head`: see `logits`;
        `prefill`: see `hidden_states`)."""
        hidden = self.hidden_states(batch, cache, prefill)  # [rows, hidden]
        wanted = last_n if last_n is not None else batch.lengths
        picks, end = [], 0
        for n, m in zip(batch.lengths, wanted):
            end += n
            picks += range(end - m, end)
        if not picks:  # a pass that only fills the cache (prefill chunks)
            return [hidden.new_zeros((0, self.cfg.vocab_size), dtype=torch.float32)] * len(wanted)
        logits = self.logits(hidden[torch.tensor(picks, dtype=torch.long)], head)  # [sum(wanted), vocab]
        return list(logits.split(list(wanted)))
