"""The file's own blocks (`weights/file_blocks.py`): every quantized type the loader accepts
reaches the kernels as its own codes and scales. Per type: the weights the kernel's layout
holds (read byte by byte as the specification places them, tests/native_reference.py, and
through `NativeWeights.dequantize`) equal the `gguf` package's dequantization bit for bit, and
the kernel computes with exactly those (its product equals the bit-exact reference on every
instruction set, row count and path). A re-quantizing repack fails the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specserve import kernels
from specserve.weights.file_blocks import KINDS, native_blocks
from specserve.weights.gguf_loader import open_gguf
from specserve.weights.quant import NativeLinear, quantize_native
from tests import native_reference as ref
from tests.conftest import real_model_path
from tests.tiny import quantize_raw

TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0]


def file_tensor(qtype: T, rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(bytes [rows, row bytes], the gguf package's dequantization [rows, cols]) of a tensor of
    `qtype`: the legacy types quantized by the gguf package from Gaussian values (an outlier
    block, a zero block), the K types random blocks (every code, scale and min the format can
    hold, small finite float16 steps; Q6_K's scales and steps of either sign)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    values[0, :32] *= 40
    values[-1, -32:] = 0
    raw = np.asarray(quantize_raw(values, qtype, rng)).reshape(rows, -1)
    want = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
    return raw, torch.from_numpy(want)


def from_fields(f: dict, nw) -> np.ndarray:
    """The weights the specification's fields (read byte by byte) give, in float32 arithmetic
    in the order the gguf package rounds in."""
    q = f["q"].astype(np.float32)  # [n, k]
    n, k = q.shape
    if nw.kind in (44, 46, 48):  # B: d·(q − zero) (+ m)
        d, w = f["dsup"].repeat(32, 1), (q - np.float32(nw.zero))
        out = d * w
        return out + f["dmin"].repeat(32, 1) if f["dmin"] is not None else out
    dsup = f["dsup"].repeat(nw.sb, 1)
    if nw.kind == 36:  # S6: fl(d·sc)·(q − zero), a scale per 16
        return (dsup * f["sc"].astype(np.float32).repeat(16, 1)) * (q - np.float32(nw.zero))
    eff = dsup * f["sc"].astype(np.float32).repeat(32, 1)
    return eff * q + f["dmin"].repeat(nw.sb, 1) * f["mins"].astype(np.float32).repeat(32, 1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_weights_equal_the_gguf_packages_dequantization_bit_for_bit(qtype):
    rows, cols = 37, 512  # 37: a partial tile, its padding lanes zero
    raw, want = file_tensor(qtype, rows, cols, seed=int(qtype))
    nw = native_blocks(raw, qtype, rows, cols)
    assert (nw.kind, nw.zero) == KINDS[qtype]
    f = ref.fields(nw)
    assert (f["padding"] == 0).all()
    assert np.array_equal(from_fields(f, nw).view(np.int32), want.numpy().view(np.int32))
    assert torch.equal(nw.dequantize().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", kernels.available_isas())
def test_the_kernel_computes_with_the_files_weights_on_every_path(qtype, isa):
    """The kernel's product equals the reference's bits (exact integer sums over the file's
    codes, its scales as the float steps) for 1..13 and 40 rows on every path, at every
    activation block; and is within activation rounding of the float product."""
    raw, want = file_tensor(qtype, 40, 768, seed=100 + int(qtype))
    nw = native_blocks(raw, qtype, 40, 768)
    g = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(40, 768, generator=g)
    x[:, 3] *= 20  # an activation outlier
    x[2] = 0  # an all-zero row
    for block in (256, 64, 32):
        lin = NativeLinear.from_weights(nw, None, isa, act_block=block)
        expected = ref.matmul(x, nw, ab=block)
        for path in (0, 1, 2):
            for rows in [*range(1, 14), 40]:
                assert torch.equal(lin(x[:rows], path), expected[:rows]), (block, path, rows)
    exact = x.double() @ want.double().t()
    assert (expected.double() - exact).norm() <= 0.05 * exact.norm()  # measured ≤ 0.031


def test_a_requantizing_repack_fails_the_same_check():
    """The must-fail twin: the Q4_K tensor's float values quantized again (the layout's own
    4-bit grid, as the loader once did) are not the file's weights."""
    raw, want = file_tensor(T.Q4_K, 37, 512, seed=int(T.Q4_K))
    again = quantize_native(want, 4, kernels.qmatmul().q_sc_max(4)).dequantize()
    assert not torch.equal(again, want)
    assert (again - want).abs().max() > 1e-4 * want.abs().max()


@pytest.mark.parametrize("model, qtype", [
    ("qwen2.5-coder-1.5b", T.Q4_K), ("qwen2.5-coder-1.5b", T.Q6_K),
    ("qwen2.5-coder-0.5b", T.Q5_0), ("qwen2.5-coder-0.5b", T.Q8_0),
    ("smollm2-135m", T.Q4_1)], ids=lambda v: getattr(v, "name", v))
def test_real_tensors_are_carried_bit_for_bit(model, qtype):
    """The first 272 rows (17 tiles) of each 2-D tensor of `qtype` in a shipped file."""
    f = open_gguf(real_model_path(model))
    tensors = [t for t in f.tensors if t.qtype == qtype and len(t.shape) == 2]
    assert tensors
    for tensor in tensors[:6]:
        out_f, in_f = tensor.shape
        rows = min(out_f, 272)
        raw = np.asarray(f.raw(tensor)).reshape(out_f, -1)[:rows]
        want = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, in_f)
        nw = native_blocks(raw, qtype, rows, in_f)
        assert (nw.kind, nw.zero) == KINDS[qtype]
        assert torch.equal(nw.dequantize().view(torch.int32),
                           torch.from_numpy(want).view(torch.int32)), tensor.name
