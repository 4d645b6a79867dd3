"""The fused decoder pass (`decoder_pass` in `attention.c`): its C structures and the call.

A native pass runs every layer of the model in one call and one OpenMP region (see the
comment above `decoder_pass`), instead of a dozen calls per layer from Python. Its inputs are
built once per model (`DecoderPlan`: each layer's norms and projections as the C side takes
them) and per pass (the buffers and the cache index). The projections run in the matmul
library (`proj_team` in `qmatmul.c`), reached through a function pointer, so the two libraries
stay separate builds and every projection keeps the bits of its per-call kernel.
"""

from __future__ import annotations

import ctypes

import torch

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KIND_F32, KIND_BF16 = 32, 16  # `proj_t.kind` of float weights
# the quantized kinds (qmatmul.c's KIND_*; `weights/quant.py` says what each carries)
KIND_K4, KIND_K6, KIND_R8, KIND_S6, KIND_B4, KIND_B6, KIND_B8 = 4, 6, 8, 36, 44, 46, 48
# the kinds of step `decoder_pass` profiles, in its order (attention.c's ST_*)
STEPS = ("norm", "qkv", "rope", "attend", "o", "gate_up", "silu", "down")


class Proj(ctypes.Structure):
    """`proj_t` (qmatmul.c): a projection's weights as `q_matmul` or `f_matmul` take them; a
    projection of several parts chains them by `next` (the address of the next part's)."""

    _fields_ = [("kind", I64), ("k", I64), ("n", I64), ("sb", I64), ("qs", P), ("qh", P),
                ("sc", P), ("dsup", P), ("mins", P), ("dmin", P), ("bias", P), ("ab", I64),
                ("zero", I64), ("path", I64), ("next", P)]


class LayerDesc(ctypes.Structure):
    """`layer_t` (attention.c): a layer's norm weights and its four projections."""

    _fields_ = [("attn_norm", P), ("q_norm", P), ("k_norm", P), ("mlp_norm", P), ("qkv", P),
                ("o", P), ("gate_up", P), ("down", P)]


class Dims(ctypes.Structure):
    """`dims_t` (attention.c)."""

    _fields_ = [("hidden", I64), ("heads", I64), ("kv_heads", I64), ("hd", I64), ("inter", I64),
                ("eps", F32), ("scale", F32)]


class KVIndex(ctypes.Structure):
    """`kv_index_t` (attention.c): where each row reads and writes the cache."""

    _fields_ = [("kv_kind", I64), ("num_blocks", I64), ("block_size", I64),
                ("block_tables", P), ("num_seqs", I64), ("max_blocks", I64), ("row_seq", P),
                ("row_pos", P)]


class Buffers(ctypes.Structure):
    """`buffers_t` (attention.c): a pass's float32 work buffers."""

    _fields_ = [("h", P), ("qkv", P), ("attn", P), ("gu", P), ("act", P), ("proj", P)]


def bind_matmul(matmul: ctypes.CDLL) -> None:
    """Declare the fused pass's entry points in the matmul library (`qmatmul.c`)."""
    matmul.proj_check.argtypes = [ctypes.POINTER(Proj)]
    matmul.proj_check.restype = ctypes.c_int
    matmul.proj_run.argtypes = [ctypes.POINTER(Proj), P, I64, P]
    matmul.proj_run.restype = ctypes.c_int


def bind_glue(glue: ctypes.CDLL) -> None:
    """Declare `decoder_pass` in the attention library (`attention.c`)."""
    glue.decoder_pass.argtypes = [P, ctypes.POINTER(LayerDesc), I64, ctypes.POINTER(Dims), P,
                                  I64, P, P, P, P, I64, ctypes.POINTER(KVIndex),
                                  ctypes.POINTER(Buffers), P, P, P]
    glue.decoder_pass.restype = ctypes.c_int


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address, or None (NULL) for None: an optional argument of a native call."""
    return None if t is None else t.data_ptr()


class DecoderPlan:
    """A model's layers as `decoder_pass` takes them, built once: it holds every tensor and
    structure it points to, so the pointers stay valid while it lives. `projs` are the
    projections' `Proj`s, in layer order (qkv, o, gate_up, down per layer)."""

    def __init__(self, matmul: ctypes.CDLL, layers: list, projs: list[Proj]) -> None:
        self.projs = projs
        for proj in projs:
            if matmul.proj_check(ctypes.byref(proj)) != 0:
                raise ValueError("a projection the fused pass cannot run")
        self.proj_fn = ctypes.cast(matmul.proj_team, P).value
        self.layers = (LayerDesc * len(layers))()
        for i, layer in enumerate(layers):
            q = projs[4 * i:4 * i + 4]
            self.layers[i] = LayerDesc(data_ptr(layer.attn_norm), data_ptr(layer.q_norm),
                                       data_ptr(layer.k_norm), data_ptr(layer.mlp_norm),
                                       *(ctypes.addressof(p) for p in q))
