"""The native quantized kernels (`specserve/kernels/qmatmul.c`) against float references."""

from __future__ import annotations

import pytest
import torch

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


def reference(x: torch.Tensor, w: quant.NativeWeights) -> torch.Tensor:
    """What the kernel computes, in float64: activations quantized to int8 per super-block
    (round half to even), integer block dot products, then the scales and the minimum term."""
    rows, k = x.shape
    xs = x.double().reshape(rows, k // w.sb, w.sb)
    amax = xs.abs().amax(-1, keepdim=True)  # [rows, supers, 1]
    qa = torch.round(xs * torch.where(amax > 0, 127 / amax, 0)).reshape(rows, k)
    if w.bits == 4:
        wq = torch.stack([w.qs & 0x0F, w.qs >> 4], dim=2).reshape(-1, k).double()
    else:
        wq = w.qs.double()
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
@pytest.mark.parametrize("bits", [4, 8])
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


@pytest.mark.parametrize("bits, levels", [(4, 15), (8, 254)])
def test_quantized_weights_are_within_half_a_step(bits, levels):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g)
    w[5, 64:96] *= 1000
    q = quantize_native(w, bits, sc_max(bits))
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


def test_bias_and_leading_dims_and_dtype():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 64, generator=g), torch.randn(20, generator=g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    for bits in (4, 8):
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
    assert lib.q_matmul(5, None, 1, 64, 64, None, None, None, None, 1, None, 0) == -2


def test_int4_keeps_wide_source_tensors_at_8_bits_and_falls_back_without_the_kernel(
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
    quantize_linears(fresh, "int4", {"model.layers.0.self_attn.v_proj.weight": 6.5625,
                                     "model.layers.1.mlp.down_proj.weight": 4.5})
    assert fresh.layers[0].qkv.w.bits == 8 and fresh.layers[0].gate_up.w.bits == 4
    assert fresh.layers[1].down.w.bits == 4
    monkeypatch.setattr(kernels, "qmatmul", lambda *isa: None)
    m = load_model(path, "bfloat16", weights="int4").model
    assert isinstance(m.layers[0].qkv, Int4Linear) and m.act_dtype == torch.bfloat16


@pytest.mark.parametrize("bits, tolerance", [(4, 0.12), (8, 0.02)])
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
