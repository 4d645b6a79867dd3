"""The native quantized kernels (`specserve/kernels/qmatmul.c`) against float references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specserve import kernels
from specserve.models import quant
from specserve.models.quant import NativeLinear, quantize_native
from tests.conftest import real_model_path


def test_kernel_builds_here():
    """CI runs on x86-64 with AVX2 and a C compiler: the native path must be the one tested."""
    assert kernels.cpu_supported()
    assert kernels.qmatmul() is not None


def sc_max(bits: int) -> int:
    return kernels.qmatmul().q_sc_max(bits)


def codes(w: quant.NativeWeights) -> torch.Tensor:
    """The integer weights [out, in] read from `w` as qmatmul.c's layout comment says (not
    by `NativeWeights.codes`, which is checked against this)."""
    out_f = w.qs.shape[0]
    if w.bits == 8:
        return w.qs.long()
    qs = w.qs.long()  # [out, pairs, 32]
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(out_f, -1, 64)  # [out, pairs, 64]
    if w.bits == 6:
        i = torch.arange(64)  # weight i of a pair: byte i % 16, bits 2·(i // 16)
        q = q | (((w.qh.long()[:, :, i % 16] >> (2 * (i // 16))) & 3) << 4)
    return q.reshape(out_f, -1)


def reference(x: torch.Tensor, w: quant.NativeWeights) -> torch.Tensor:
    """What the kernel computes, in float64: activations quantized to int8 per super-block
    as the kernel does (x·(127/max) in float32, round half to even: a tie rounded otherwise
    moves a whole activation step), integer block dot products, then the scales and the
    minimum term."""
    rows, k = x.shape
    xs = x.float().reshape(rows, k // w.sb, w.sb)
    amax = xs.abs().amax(-1, keepdim=True)  # [rows, supers, 1] float32
    qa = torch.round(xs * torch.where(amax > 0, 127 / amax, 0)).double().reshape(rows, k)
    amax = amax.double()
    wq = codes(w).double()
    per, blocks = w.sb // 32, k // 32
    scale = w.dsup.double().repeat_interleave(per, 1) * w.sc.double()  # [out, blocks]
    dots = torch.einsum("rbi,obi->rob", qa.reshape(rows, blocks, 32),
                        wq.reshape(-1, blocks, 32))  # [rows, out, blocks]
    da = (amax / 127).reshape(rows, -1).repeat_interleave(per, 1)  # [rows, blocks]
    y = (dots * (scale[None] * da[:, None])).sum(-1)
    if w.mins is not None:
        y = y + (da * qa.reshape(rows, blocks, 32).sum(-1)) @ w.mins.double().t()
    return y


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("out_f, in_f", [(8, 64), (33, 192), (40, 128), (24, 576), (16, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 40, 100])
def test_kernel_equals_integer_reference(isa, bits, out_f, in_f, rows):
    """On every instruction set this CPU runs (relative error ≤ 1e-4 of the largest output
    against the float64 integer reference)."""
    g = torch.Generator().manual_seed(out_f * 1000 + in_f + rows + bits)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, :32] *= 50  # one block far larger than the others of its super-block
    x = torch.randn(rows, in_f, generator=g)
    x[:, 3] *= 20  # an activation outlier
    lin = NativeLinear(w, None, bits, isa)
    got = lin(x).double()
    ref = reference(x, lin.w)
    assert got.shape == (rows, out_f)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    # without the outliers, close to the float product (only activation rounding differs)
    x[:, 3] /= 20
    got, exact = lin(x).double()[:, 1:], (x.double() @ lin.w.dequantize().double().t())[:, 1:]
    assert (got - exact).norm() <= 0.03 * exact.norm()


@pytest.mark.parametrize("bits, levels", [(4, 15), (6, 63), (8, 254)])
def test_quantized_weights_are_within_half_a_step(bits, levels):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g)
    w[5, 64:96] *= 1000
    q = quantize_native(w, bits, sc_max(bits))
    assert torch.equal(q.codes().long(), codes(q))
    assert codes(q).min() >= (-127 if bits == 8 else 0) and codes(q).max() <= levels // (
        2 if bits == 8 else 1)
    step = (q.dsup.repeat_interleave(q.sb // 32, 1) * q.sc.float()).repeat_interleave(32, 1)
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-3 * w.abs().amax(1, keepdim=True)).all()  # + fp16 minimum
    spread = w.reshape(48, -1, 32)
    spread = (spread.amax(-1) - spread.amin(-1)).repeat_interleave(32, 1)  # [out, in]
    assert (step <= spread / levels * 2.01 + 1e-6).all()  # the step is the block's, not coarser


def test_4bit_grid_comes_back_up_to_the_scale_step():
    """Q4_K-like input (every block on its own 4-bit grid) is recovered up to the integer
    scale's resolution, 1/16383 of the super-block's largest scale."""
    g = torch.Generator().manual_seed(2)
    qv = torch.randint(0, 16, (16, 128), generator=g)
    qv[:, ::32], qv[:, 1::32] = 0, 15  # every block spans the full range
    scale = torch.tensor([0.25, 0.5, 0.125, 1.0]).repeat(16, 1).repeat_interleave(32, 1)
    w = qv * scale - 2.0
    q = quantize_native(w, 4, sc_max(4))
    assert (q.dequantize() - w).abs().max() <= 15 * 1.0 / 16383 + 1e-6


def test_6bit_layout_puts_each_weight_where_the_kernel_reads_it():
    """Codes 0..63 in a known pattern: the low nibbles as the 4-bit layout's, the top 2 bits
    of pair weight 16g + j at bits 2g..2g + 1 of qh byte j."""
    k = 128
    q = (torch.arange(k)[None] * 7 + torch.arange(3)[:, None] * 5) % 64  # [3, k] codes
    q[:, ::32] = 0
    q[:, 1::32] = 63  # every block spans 0..63, so the codes come back exactly
    w = q.float() * 0.01 - 0.3
    nw = quantize_native(w, 6, sc_max(6))
    assert torch.equal(codes(nw), q)
    pair = q.reshape(3, 2, 64)  # [out, pairs, 64]
    assert torch.equal(nw.qs.long(), (pair[:, :, :32] & 15) | ((pair[:, :, 32:] & 15) << 4))
    assert int(nw.qh[1, 0, 5]) == sum(((int(pair[1, 0, 16 * g + 5]) >> 4) << (2 * g))
                                      for g in range(4))
    assert (nw.dequantize() - w).abs().max() <= 63 * 0.01 / sc_max(6) + 1e-3 * 0.3


def test_6bit_scale_is_rounded_up_so_no_code_clamps():
    """A block with a scale far below its super-block's largest: with the integer scale
    rounded to nearest, its top codes would clamp at 63 (error up to 63·dsup/2); rounded up,
    every weight is within half the applied step."""
    g = torch.Generator().manual_seed(9)
    w = torch.rand(16, 256, generator=g)
    w[:, :32] *= 300  # one large block per super-block: dsup = its scale / SC_MAX6
    q = quantize_native(w, 6, sc_max(6))
    step = (q.dsup.repeat_interleave(8, 1) * q.sc.float()).repeat_interleave(32, 1)  # [out, in]
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6).all()
    own = (w.reshape(16, 8, 32).amax(-1) - q.mins.float()) / 63  # [out, blocks] (fp16 minimum)
    assert (step.reshape(16, 8, 32)[..., 0] >= own * (1 - 1e-5)).all()
    assert (step.reshape(16, 8, 32)[..., 0] <= own + q.dsup.repeat_interleave(8, 1)).all()


def q6_k_bytes(q: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """GGUF Q6_K bytes [rows, cols/256·210] (ggml's block_q6_K: ql[128], qh[64], int8
    scales[16], fp16 d) of codes q [rows, cols] in −32..31, sub-block scales sub [rows,
    cols/16] and steps d [rows, cols/256]: w = d·sub·q (weight 128h + 32m + l of a block:
    low nibble of ql[64h + 32·(m % 2) + l] (m ≥ 2: high), bits 2m of qh[32h + l])."""
    rows, cols = q.shape
    supers = cols // 256
    u = (q + 32).numpy().astype(np.uint8).reshape(rows, supers, 2, 4, 32)  # [.., h, m, l]
    low, high = u & 15, u >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4),
                         low[:, :, :, 1] | (low[:, :, :, 3] << 4)], axis=-1)  # [.., h, 64]
    qh = (high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4)
          | (high[:, :, :, 3] << 6))  # [.., h, 32]
    blocks = np.concatenate(
        [ql.reshape(rows, supers, 128), qh.reshape(rows, supers, 64),
         sub.numpy().astype(np.int8).view(np.uint8).reshape(rows, supers, 16),
         d.numpy().astype(np.float16).view(np.uint8).reshape(rows, supers, 2)], axis=-1)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("aligned", [False, True], ids=["Q6_K", "Q6_K-on-a-6-bit-grid"])
def test_q6_k_tensor_repacked_to_6_bits_matches_the_files_weights(aligned, two_threads):
    """Requantized from the file's dequantized weights: each within half the coarser of its
    block's two Q6_K sub-block steps (+ dsup, + the fp16 minimum's rounding); blocks whose
    halves share a step and span all 64 codes come back up to the integer scale's resolution
    (63·dsup) and the fp16 minimum."""
    from specserve.models.dequant import dequantize

    g = torch.Generator().manual_seed(11)
    rows, cols = 64, 1024
    q = torch.randint(-32, 32, (rows, cols), generator=g)
    sub = torch.randint(16, 41, (rows, cols // 16), generator=g)  # like a real file's: one range
    if aligned:
        sub = sub[:, ::2].repeat_interleave(2, 1)
        q[:, ::32], q[:, 1::32] = -32, 31
    d = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 5e-4).half()
    w = dequantize(q6_k_bytes(q, sub, d), T.Q6_K, (rows, cols))
    step = d.float().repeat_interleave(256, 1) * sub.float().repeat_interleave(16, 1)
    # step: [rows, cols], each weight's Q6_K step
    assert torch.equal(w, step * q)  # the bytes say what we meant
    nw = quantize_native(w, 6, sc_max(6))
    err = (nw.dequantize() - w).abs()
    dsup = nw.dsup.repeat_interleave(256, 1)  # [rows, cols]
    fp16 = 2.0 ** -11 * nw.mins.float().abs().repeat_interleave(32, 1)
    if aligned:
        assert (err <= 63 * dsup + fp16).all()
    else:
        coarse = step.reshape(rows, -1, 32).amax(-1).repeat_interleave(32, 1)
        assert (err <= coarse / 2 + dsup + fp16).all()
    x = torch.randn(7, cols, generator=g)
    ref = x @ w.t()
    assert (NativeLinear(w, None, 6)(x) - ref).norm() <= 0.025 * ref.norm()


def test_q5_0_tensor_repacked_to_6_bits_stays_within_a_quarter_of_its_step(two_threads):
    """Q5_0 (codes −16..15 × d per block of 32, the 0.5B draft's 4-bit fallback) spans at
    most 31·d, so 63 steps of 6 bits put every weight within 31·d/126 (+ dsup/2 and the fp16
    minimum's share) of the file's value: a quarter of the file's own step."""
    from specserve.models.dequant import dequantize

    g = torch.Generator().manual_seed(12)
    rows, cols = 64, 1024
    raw = quants.quantize(torch.randn(rows, cols, generator=g).numpy(), T.Q5_0)
    w = dequantize(raw, T.Q5_0, (rows, cols))
    d = raw.reshape(rows, -1, 22)[:, :, :2].copy().view(np.float16)  # [rows, blocks, 1]
    d = torch.from_numpy(d.astype(np.float32)).abs().reshape(rows, -1).repeat_interleave(32, 1)
    nw = quantize_native(w, 6, sc_max(6))
    err = (nw.dequantize() - w).abs()
    dsup = nw.dsup.repeat_interleave(256, 1)
    fp16 = 2.0 ** -11 * nw.mins.float().abs().repeat_interleave(32, 1)
    assert (err <= 31 / 126 * d + dsup / 2 + fp16 / 63 + 1e-7).all()
    x = torch.randn(7, cols, generator=g)
    ref = x @ w.t()
    assert (NativeLinear(w, None, 6)(x) - ref).norm() <= 0.03 * ref.norm()


def test_bias_and_leading_dims_and_dtype():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 64, generator=g), torch.randn(20, generator=g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    for bits in (4, 6, 8):
        lin = NativeLinear(w, b, bits)
        y = lin(x)
        assert y.shape == (2, 3, 20) and y.dtype == torch.bfloat16
        ref = x.float().reshape(6, 64) @ lin.w.dequantize().t() + b
        assert (y.float().reshape(6, 20) - ref).norm() <= 0.03 * ref.norm()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="in_features divisible by 64"):
        quantize_native(torch.randn(4, 96), 4, 100)
    with pytest.raises(ValueError, match="bits"):
        NativeLinear(torch.randn(4, 64), None, 3)
    lib = kernels.qmatmul()
    assert lib.q_matmul(5, None, 1, 64, 64, None, None, None, None, None, 1, None, 0) == -2
    w = quantize_native(torch.randn(4, 64), 6, sc_max(6))  # 6 bits without qh, or without mins
    x, y = torch.randn(1, 64), torch.empty(1, 4)
    args = (x.data_ptr(), 1, 64, 64, w.qs.data_ptr())
    assert lib.q_matmul(6, *args, None, w.sc.data_ptr(), w.dsup.data_ptr(), w.mins.data_ptr(),
                        4, y.data_ptr(), 0) == -2
    assert lib.q_matmul(6, *args, w.qh.data_ptr(), w.sc.data_ptr(), w.dsup.data_ptr(), None,
                        4, y.data_ptr(), 0) == -2
    assert lib.q_matmul(6, *args, w.qh.data_ptr(), w.sc.data_ptr(), w.dsup.data_ptr(),
                        w.mins.data_ptr(), 4, y.data_ptr(), 0) == 0
    with pytest.raises(ValueError, match="bits"):
        quantize_native(torch.randn(4, 64), 5, 100)


def test_int4_keeps_wide_source_tensors_at_6_or_8_bits_and_falls_back_without_the_kernel(
        tiny_hf, monkeypatch):
    from specserve.models.loader import load_model
    from specserve.models.quant import Int4Linear, quantize_linears
    from specserve.models.transformer import Transformer

    _, path = tiny_hf
    m = load_model(path, "bfloat16", weights="int4").model
    assert isinstance(m.layers[0].qkv, NativeLinear) and m.layers[0].qkv.w.bits == 4
    assert m.act_dtype == torch.float32
    fresh = load_model(path, "bfloat16").model
    assert isinstance(fresh, Transformer)
    quantize_linears(fresh, "int4", {"model.layers.0.self_attn.v_proj.weight": 6.5625,  # Q6_K
                                     "model.layers.1.mlp.down_proj.weight": 4.5,  # Q4_K
                                     "model.layers.1.self_attn.q_proj.weight": 8.5,  # Q8_0
                                     "model.layers.1.self_attn.k_proj.weight": 5.5,  # Q5_0
                                     "model.layers.0.mlp.down_proj.weight": 5.5,
                                     "lm_head.weight": 6.5625})
    assert fresh.layers[0].qkv.w.bits == 6 and fresh.layers[0].gate_up.w.bits == 4
    assert fresh.layers[1].down.w.bits == 4 and fresh.layers[0].down.w.bits == 6
    assert fresh.layers[1].qkv.w.bits == 8  # fused q, k, v: the widest of the three
    assert fresh.lm_head.w.bits == 6 and fresh.lm_head.w.qh is not None
    assert quant.projection_width("int8", ["lm_head.weight"], {"lm_head.weight": 4.5}) == 8
    assert quant.projection_width("int4", ["x"], {"x": 16.0}) == 8
    monkeypatch.setattr(kernels, "qmatmul", lambda *isa: None)
    m = load_model(path, "bfloat16", weights="int4").model
    assert isinstance(m.layers[0].qkv, Int4Linear) and m.act_dtype == torch.bfloat16


@pytest.mark.parametrize("bits, tolerance", [(4, 0.12), (6, 0.04), (8, 0.02)])
def test_real_weights_against_float(bits, tolerance, two_threads):
    """Projections of the real SmolLM2 file: the kernel's output stays close to the float
    product with the original (dequantized GGUF) weights."""
    from specserve.models.gguf_loader import load_gguf

    _, _, tensors = load_gguf(real_model_path("smollm2-135m"), torch.float32)
    g = torch.Generator().manual_seed(4)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.5.self_attn.q_proj.weight",
                 "model.embed_tokens.weight"):
        w = tensors[name]
        x = torch.randn(5, w.shape[1], generator=g)
        got = NativeLinear(w, None, bits)(x)
        ref = x @ w.t()
        rel = (got - ref).norm() / ref.norm()
        assert rel < tolerance, (name, rel)
