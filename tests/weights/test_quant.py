"""Quantized matmuls against a float reference, on random and real weights."""

from __future__ import annotations

import pytest
import torch

from specserve.weights.quant import (INT4_GROUP, Int4Linear, Int8Linear, quantize_int4,
                                    quantize_linears)
from tests.slots import new_cache as slot_cache


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Float reference of what the int4 kernel computes with: (q - 8) * scale + zero."""
    scale = sz[..., 0].t().repeat_interleave(group, dim=1)  # [out, in]
    zero = sz[..., 1].t().repeat_interleave(group, dim=1)  # [out, in]
    return (q.float() - 8) * scale.float() + zero.float()


def test_int4_quantization_round_trip_error_is_within_half_a_step():
    w = torch.randn(64, 128)
    q, sz = quantize_int4(w)
    assert q.min() >= 0 and q.max() <= 15
    back = dequantize_int4(q, sz)
    step = sz[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    assert ((back - w).abs() <= step / 2 + 1e-6).all()


def test_int4_weights_on_a_4bit_grid_are_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 64), generator=g)
    q[:, ::INT4_GROUP] = 0
    q[:, 1::INT4_GROUP] = 15  # every group spans the full range
    scale = torch.rand(32, 64 // INT4_GROUP, generator=g).repeat_interleave(INT4_GROUP, dim=1) + 0.1
    w = q * scale - 0.3
    q2, sz = quantize_int4(w)
    assert torch.allclose(dequantize_int4(q2, sz), w, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 9, 40])
def test_int4_kernel_matches_float_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    lin = Int4Linear(w, b)
    q, sz = quantize_int4(w)
    ref = x.float() @ dequantize_int4(q, sz.bfloat16()).t() + b.bfloat16().float()
    got = lin(x).float()
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_int8_kernel_matches_float_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(2, rows, 128, generator=g).bfloat16()
    lin = Int8Linear(w, None)
    ref = x.float() @ (lin.weight.float() * lin.scales.float()[:, None]).t()
    got = lin(x).float()
    assert got.shape == (2, rows, 64)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (got - x.float() @ w.t()).abs().max() <= 0.05 * ref.abs().max()


def test_quantized_tiny_model_logits_correlate_with_the_bf16_ones(tiny_hf):
    from specserve.weights.loader import load_model

    _, path = tiny_hf
    ids = [5, 17, 33, 8, 90, 41, 3]
    ref = load_model(path, "bfloat16")
    cache = slot_cache(ref.model, 1, 16)
    base = ref.model.forward(cache.batch([ids], [0], [0]), cache.pool)[0]
    for fmt in ("int8", "int4"):
        m = load_model(path, "bfloat16", weights=fmt)
        fresh = slot_cache(m.model, 1, 16)
        got = m.model.forward(fresh.batch([ids], [0], [0]), fresh.pool)[0]
        corr = torch.corrcoef(torch.stack([base.flatten(), got.flatten()]))[0, 1]
        assert corr > (0.99 if fmt == "int8" else 0.9), (fmt, corr)


def test_quantized_formats_need_bfloat16_and_a_known_name():
    from specserve.weights.loader import load_model

    with pytest.raises(ValueError, match="weights"):
        quantize_linears(None, "int3")
    with pytest.raises(ValueError, match="weights"):
        load_model("/nonexistent", "float32", weights="fp8")
