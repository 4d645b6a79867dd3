"""The native quantized weights (`NativeWeights`, layout v3 for 4 and 6 bits: 16 outputs in
the lanes, 8-bit block scale and offset multipliers; 8 bits in rows) and the kernel
(`specserve/kernels/qmatmul.c`) against the bit-exact reference in tests/native_reference.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specserve import kernels
from specserve.weights import quant
from specserve.weights.quant import NativeLinear, quantize_native
from tests import native_reference as ref
from tests.conftest import real_model_path

SC_MAX = {4: 255, 6: 255, 8: 4095}  # the layout's block scale limits (uint8; int16 for 8 bits)
TOP = {4: 15, 6: 63}


def test_kernel_builds_here_and_its_scale_limits_are_the_layouts():
    """CI runs on x86-64 with AVX2 and a C compiler: the native path must be the one tested."""
    assert kernels.cpu_supported()
    for isa in kernels.available_isas():
        lib = kernels.qmatmul(isa)
        assert [lib.q_sc_max(b) for b in (4, 6, 8)] == [SC_MAX[4], SC_MAX[6], SC_MAX[8]]
    assert quant.NATIVE_LAYOUT_VERSION == "4"


# ---- the reference's own arithmetic ----

def round_to_float32(exact: Fraction) -> np.float32:
    """`exact` rounded once to the nearest float32, ties to even (by exact comparison)."""
    near = np.float32(float(exact))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    dist = [abs(Fraction(float(c)) - exact) for c in candidates]
    best = min(dist)
    ties = [c for c, d in zip(candidates, dist) if d == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.int32)) & 1)


def test_reference_fma_rounds_once_where_rounding_through_float64_would_round_twice():
    # a·b = 1 + 2⁻¹¹ + 2⁻²⁴ is a float32 midpoint; + 2⁻⁶⁰ is above it: one rounding goes up,
    # float64 then float32 goes down (the tie rounds to even)
    a = b = np.array([1 + 2.0 ** -12], dtype=np.float32)
    c = np.array([2.0 ** -60], dtype=np.float32)
    naive = (a.astype(np.float64) * b + c).astype(np.float32)
    assert naive[0] == np.float32(1 + 2.0 ** -11)
    assert ref.fma32(a, b, c)[0] == np.float32(1 + 2.0 ** -11 + 2.0 ** -23)
    assert ref.fma32(a, b, -c)[0] == np.float32(1 + 2.0 ** -11)
    g = np.random.default_rng(0)
    a = (g.standard_normal(3000) * 2.0 ** g.integers(-20, 20, 3000)).astype(np.float32)
    b = (g.standard_normal(3000) * 2.0 ** g.integers(-20, 20, 3000)).astype(np.float32)
    c = (g.standard_normal(3000) * 2.0 ** g.integers(-40, 40, 3000)).astype(np.float32)
    c[:1000] = -(a[:1000].astype(np.float64) * b[:1000]).astype(np.float32)  # cancellations
    got = ref.fma32(a, b, c)
    exact = [round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
             for x, y, z in zip(a, b, c)]
    assert np.array_equal(got, np.array(exact, dtype=np.float32))


# ---- layout ----

def grid_weights(n: int, k: int, bits: int, seed: int):
    """Weights exactly on a v3 grid: (w [n, k], codes q, sc, mins per block, dsup, dmin)
    with dsup = 2⁻¹⁰, dmin = 2⁻⁸, every block spanning codes 0..top and each super-block one
    block at sc 255 and one at mins −127: quantize_native must find exactly these (every
    float step here is exact)."""
    g = torch.Generator().manual_seed(seed)
    top, nb, per = TOP[bits], k // 32, quant.super_block(k) // 32
    q = torch.randint(0, top + 1, (n, k), generator=g)
    q[:, ::32], q[:, 1::32] = 0, top
    sc = torch.randint(1, 256, (n, nb), generator=g)
    mins = torch.randint(-127, 128, (n, nb), generator=g)
    sc[:, ::per], mins[:, 1::per] = 255, -127
    dsup, dmin = 2.0 ** -10, 2.0 ** -8
    w = dsup * (sc.repeat_interleave(32, 1) * q).float() + dmin * mins.repeat_interleave(32, 1).float()
    return w, q, sc, mins, dsup, dmin


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("n, k", [(1, 256), (15, 256), (17, 128), (40, 192), (33, 512)])
def test_layout_puts_every_code_and_field_where_the_spec_says(bits, n, k):
    """Every code, block multiplier and step read back byte by byte as V3 places them (output
    o = tile o // 16, lane o % 16; the lanes past n all zero), and `codes`/`dequantize` agree."""
    w, q, sc, mins, dsup, dmin = grid_weights(n, k, bits, seed=n * k + bits)
    nw = quantize_native(w, bits, SC_MAX[bits])
    tiles, nb, ns = -(-n // 16), k // 32, k // quant.super_block(k)
    assert nw.out_features == n and nw.in_features == k
    assert nw.qs.shape == (tiles, nb, 4, 64) and nw.qs.dtype == torch.uint8
    assert nw.sc.shape == nw.mins.shape == (tiles, nb, 16)
    assert (nw.sc.dtype, nw.mins.dtype) == (torch.uint8, torch.int8)
    assert nw.dsup.shape == nw.dmin.shape == (tiles, ns, 16)
    assert (nw.qh is None) == (bits == 4)
    if bits == 6:
        assert nw.qh.shape == (tiles, nb, 2, 64) and nw.qh.dtype == torch.uint8
    f = ref.fields(nw)
    assert np.array_equal(f["q"], q.numpy())
    assert np.array_equal(f["sc"], sc.numpy()) and np.array_equal(f["mins"], mins.numpy())
    assert (f["dsup"] == dsup).all() and (f["dmin"] == dmin).all()
    assert (f["padding"] == 0).all()
    assert torch.equal(nw.codes().long(), q)
    assert torch.equal(nw.dequantize(), w)
    # one weight by hand: output n − 1, input 32·(nb − 1) + 16 + 4·2 + 3 (high nibble, chunk 2)
    o, b = n - 1, nb - 1
    t, lane = divmod(o, 16)
    byte = int(nw.qs[t, b, 2, 4 * lane + 3])
    assert byte >> 4 == int(q[o, 32 * b + 27]) & 15 and byte & 15 == int(q[o, 32 * b + 11]) & 15
    if bits == 6:  # input 27 of the block: group 6 = chunk 1, bits 2·2
        assert (int(nw.qh[t, b, 1, 4 * lane + 3]) >> 4) & 3 == int(q[o, 32 * b + 27]) >> 4


def test_8_bit_weights_keep_the_row_layout():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(17, 192, generator=g)
    nw = quantize_native(w, 8, SC_MAX[8])
    assert nw.qs.shape == (17, 192) and nw.qs.dtype == torch.int8
    assert nw.sc.shape == (17, 6) and nw.sc.dtype == torch.int16 and nw.dsup.shape == (17, 3)
    assert nw.mins is None and nw.dmin is None and nw.qh is None and nw.out_features == 17
    assert torch.equal(nw.codes().long(), nw.qs.long())
    scale = nw.dsup.repeat_interleave(2, 1) * nw.sc.float()  # [out, blocks]
    assert torch.equal(nw.dequantize(), (nw.qs.float().reshape(17, 6, 32) * scale[..., None]).reshape(17, 192))


# ---- quantization ----

def spec_quantize(w: np.ndarray, bits: int, sb: int) -> dict[str, np.ndarray]:
    """V3.md's quantization written out block by block in float32 scalars."""
    f32, top = np.float32, TOP[bits]
    n, k = w.shape
    out = {name: np.zeros((n, k // 32), dtype=np.int64) for name in ("sc", "mins")}
    out.update(dsup=np.zeros((n, k // sb), np.float32), dmin=np.zeros((n, k // sb), np.float32),
               q=np.zeros((n, k), np.int64))
    for o in range(n):
        for s in range(k // sb):
            blocks = [w[o, i:i + 32] for i in range(s * sb, (s + 1) * sb, 32)]
            dmin = f32(max(abs(blk.min()) for blk in blocks) / f32(127))
            mins = [0 if dmin == 0 else int(np.clip(np.floor(blk.min() / dmin), -127, 127))
                    for blk in blocks]
            rs = [blk - f32(dmin * f32(m)) for blk, m in zip(blocks, mins)]
            scales = [f32(max(r.max(), f32(0)) / f32(top)) for r in rs]
            dsup = f32(max(scales) / f32(255))
            for j, (r, scale) in enumerate(zip(rs, scales)):
                b = s * sb // 32 + j
                sc = 0 if dsup == 0 else int(np.clip(np.ceil(scale / dsup - f32(1e-3)), 0, 255))
                eff = f32(dsup * f32(sc))
                q = np.zeros(32) if eff == 0 else np.clip(np.round(r / eff), 0, top)
                out["sc"][o, b], out["mins"][o, b] = sc, mins[j]
                out["q"][o, 32 * b:32 * b + 32] = q
            out["dsup"][o, s], out["dmin"][o, s] = dsup, dmin
    return out


@pytest.mark.parametrize("bits", [4, 6])
def test_quantization_is_the_specs_step_by_step(bits):
    """Every field equal to V3.md's algorithm done one block at a time: rows with a zero
    block, an all-positive block, a block 100× its neighbours and an all-zero row."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(19, 256, generator=g)
    w[2, 32:64] = 0
    w[3, 64:96] = w[3, 64:96].abs() + 0.5
    w[4, :32] *= 100
    w[5] = 0
    nw = quantize_native(w, bits, SC_MAX[bits])
    want, got = spec_quantize(w.numpy(), bits, 256), ref.fields(nw)
    for name in ("q", "sc", "mins", "dsup", "dmin"):
        assert np.array_equal(got[name], want[name]), name
    assert (got["q"][5] == 0).all() and (nw.dequantize()[5] == 0).all()


def applied(nw: quant.NativeWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per weight [n, k]: the applied step dsup·sc, the offset dmin·m, dsup and dmin."""
    f, per = ref.fields(nw), nw.sb // 32
    dsup = torch.from_numpy(f["dsup"]).repeat_interleave(per, 1)  # [n, nb]
    dmin = torch.from_numpy(f["dmin"]).repeat_interleave(per, 1)
    eff = dsup * torch.from_numpy(f["sc"]).float()
    offset = dmin * torch.from_numpy(f["mins"]).float()
    return tuple(t.repeat_interleave(32, 1) for t in (eff, offset, dsup, dmin))


def slack(w: torch.Tensor, eff: torch.Tensor, offset: torch.Tensor, top: int) -> torch.Tensor:
    """float32 rounding of r = w − offset, r / step and step·q + offset: a few units in the
    last place of the largest magnitude involved (2⁻²⁰ relative; the exact rounding is ≤ 3·2⁻²⁴)."""
    return 2.0 ** -20 * (w.abs() + offset.abs() + top * eff)


@pytest.mark.parametrize("bits", [4, 6])
def test_quantized_weights_are_within_half_their_blocks_applied_step(bits):
    """Derivation: the offset dmin·m = dmin·floor(lo/dmin) is at or below the block minimum
    lo, so r = w − offset ≥ 0; sc = ceil(scale/dsup − 10⁻³) makes the applied step
    dsup·sc ≥ scale − 10⁻³·dsup, so r/step ≤ top·(1 + 10⁻³) < top + ½ and no code clamps:
    |error| ≤ step/2 (sc = 0 only when scale < 10⁻³·dsup: |error| ≤ top·10⁻³·dsup). The step
    is the block's own up to one dsup: step < (range + dmin)/top + dsup."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 512, generator=g)
    w[5, 64:96] *= 1000  # dsup 1000× most blocks' scale
    w[6, 256:288] = 0  # a zero block: sc 0, no code
    w[7, :32] = w[7, :32].abs() + 3  # all positive: a positive offset
    nw = quantize_native(w, bits, SC_MAX[bits])
    top = TOP[bits]
    codes = nw.codes()
    assert codes.min() >= 0 and codes.max() <= top
    eff, offset, dsup, dmin = applied(nw)
    err = (nw.dequantize() - w).abs()
    assert (err <= torch.maximum(eff / 2, top * 1e-3 * dsup) + slack(w, eff, offset, top)).all()
    blocks = w.reshape(48, -1, 32)
    lo = blocks.amin(-1).repeat_interleave(32, 1)
    spread = (blocks.amax(-1) - blocks.amin(-1)).repeat_interleave(32, 1)  # [out, in]
    tiny = slack(w, eff, offset, top)
    assert (offset <= lo + tiny).all()  # at or below the minimum
    assert (lo - offset <= dmin + tiny).all()  # ... by at most one offset step
    assert (eff <= (spread + dmin) / top + dsup + tiny).all()  # not coarser than needed
    assert (eff[6, 256:288] == 0).all() and (codes[6, 256:288] == 0).all()


def test_8_bit_weights_are_within_half_a_step_plus_the_scale_rounding():
    """8 bits round sc to nearest: step ≥ scale − dsup/2, so the top code may clamp at 127:
    |error| ≤ step/2 + 127·dsup/2."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g)
    w[5, 64:96] *= 1000
    nw = quantize_native(w, 8, SC_MAX[8])
    assert nw.codes().abs().max() <= 127
    dsup = nw.dsup.repeat_interleave(8, 1)  # [out, blocks]
    step = (dsup * nw.sc.float()).repeat_interleave(32, 1)
    err = (nw.dequantize() - w).abs()
    assert (err <= step / 2 + 127 * dsup.repeat_interleave(32, 1) / 2 + 2.0 ** -20 * w.abs().amax()).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="in_features divisible by 64"):
        quantize_native(torch.randn(4, 96), 4, 100)
    with pytest.raises(ValueError, match="bits"):
        quantize_native(torch.randn(4, 64), 5, 100)
    with pytest.raises(ValueError, match="sc_max"):
        quantize_native(torch.randn(4, 64), 4, 256)  # an 8-bit multiplier holds at most 255
    with pytest.raises(ValueError, match="bits"):
        NativeLinear(torch.randn(4, 64), None, 3)
    lib = kernels.qmatmul()
    assert lib.q_matmul(5, None, 1, 64, 64, 64, 0, None, None, None, None, None, None, 1, None,
                        1, 0) == -2
    w = quantize_native(torch.randn(4, 64), 6, SC_MAX[6])  # 6 bits without qh, mins or dmin
    x, y = torch.randn(1, 64), torch.empty(1, 4)
    ptrs = {f: getattr(w, f).data_ptr() for f in ("qs", "qh", "sc", "dsup", "mins", "dmin")}

    def call(**missing):
        p = {**ptrs, **missing}
        return lib.q_matmul(6, x.data_ptr(), 1, 64, 64, 64, 0, p["qs"], p["qh"], p["sc"],
                            p["dsup"], p["mins"], p["dmin"], 4, y.data_ptr(), 4, 0)

    assert call(qh=None) == -2 and call(mins=None) == -2 and call(dmin=None) == -2
    assert call() == 0
    assert torch.equal(y, ref.matmul(x, w))


# ---- the kernel against the reference ----

SHAPES = [(1, 256), (8, 64), (17, 128), (33, 192), (40, 128), (24, 576), (16, 1536)]


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("out_f, in_f", SHAPES)
def test_kernel_equals_the_bit_exact_reference_on_every_path_and_row_count(isa, bits, out_f, in_f):
    """Every row count 1..13 and 40, each path (0: the kernel's choice, 1: decode, 2:
    prefill), every instruction set this CPU runs: the same bits as the reference."""
    g = torch.Generator().manual_seed(out_f * 1000 + in_f + bits)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, :32] *= 50  # one block far larger than the others of its super-block
    w[-1, -32:] = 0  # a zero block
    x = torch.randn(40, in_f, generator=g)
    x[:, 3] *= 20  # an activation outlier
    x[2] = 0  # an all-zero row
    x[4] *= 1e-4  # a tiny row
    lin = NativeLinear(w, None, bits, isa)
    want = ref.matmul(x, lin.w)  # [40, out]
    assert want.shape == (40, out_f)
    for path in (0, 1, 2):
        for rows in [*range(1, 14), 40]:
            assert torch.equal(lin(x[:rows], path), want[:rows]), (path, rows)
    # and close to the float product with the quantized weights (activation rounding only)
    x[:, 3] /= 20
    got, exact = lin(x).double(), x.double() @ lin.w.dequantize().double().t()
    assert (got - exact).norm() <= 0.03 * exact.norm()


def test_bias_and_leading_dims_and_dtype():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 64, generator=g), torch.randn(20, generator=g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    for bits in (4, 6, 8):
        lin = NativeLinear(w, b, bits)
        y = lin(x)
        assert y.shape == (2, 3, 20) and y.dtype == torch.bfloat16
        want = (ref.matmul(x.float().reshape(6, 64), lin.w) + b).bfloat16()
        assert torch.equal(y.reshape(6, 20), want)


def test_into_writes_the_same_bits_into_the_buffer_given_and_refuses_a_wrong_one():
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 128, generator=g), torch.randn(40, generator=g)
    x = torch.randn(5, 128, generator=g)
    for bits in (4, 6, 8):
        lin = NativeLinear(w, b, bits)
        out = torch.full((5, 40), float("nan"))
        assert lin.into(x, out) is out and torch.equal(out, lin(x))
        for bad in (torch.empty(5, 41), torch.empty(40, 5).t(), torch.empty(5, 40).double()):
            with pytest.raises(ValueError, match="out must be"):
                lin.into(x, bad)
        with pytest.raises(ValueError, match="out must be"):  # a non-plain input
            lin.into(x.bfloat16(), out)


# ---- GGUF tensors repacked ----

def q4_k_bytes(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
               dmin: torch.Tensor) -> np.ndarray:
    """GGUF Q4_K bytes [rows, cols/256·144] (ggml's block_q4_K: fp16 d, fp16 dmin, 12 bytes of
    6-bit scales and mins, qs[128]) of codes q [rows, cols] in 0..15, sub-block scales sc and
    mins m [rows, cols/32] in 0..63, steps d, dmin [rows, cols/256]: w = d·sc·q − dmin·m
    (qs[32p + l]: low nibble weight l of sub-block 2p, high nibble of 2p + 1)."""
    rows, cols = q.shape
    supers = cols // 256
    u = q.numpy().astype(np.uint8).reshape(rows, supers, 4, 2, 32)
    qs = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).reshape(rows, supers, 128)
    s = sc.numpy().astype(np.uint8).reshape(rows, supers, 8)
    mm = m.numpy().astype(np.uint8).reshape(rows, supers, 8)
    scales = np.concatenate([s[..., :4] | ((s[..., 4:] >> 4) << 6),
                             mm[..., :4] | ((mm[..., 4:] >> 4) << 6),
                             (s[..., 4:] & 15) | ((mm[..., 4:] & 15) << 4)], axis=-1)
    halfs = [t.numpy().astype(np.float16).view(np.uint8).reshape(rows, supers, 2) for t in (d, dmin)]
    return np.concatenate([*halfs, scales, qs], axis=-1).reshape(rows, -1)


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


def assert_within_the_files_step(w: torch.Tensor, file_step: torch.Tensor, levels: int,
                                 bits: int, product: float) -> None:
    """Requantized to `bits`, each weight within (levels·file_step + dmin)/(2·top) + dsup/2
    (+ float slack) of the file's value: a block of the file spans at most `levels` of its
    steps, our step is at most (that span + dmin)/top + dsup and the error at most half our
    step (see test_quantized_weights_are_within_half_their_blocks_applied_step); and the
    kernel's product is within `product` (relative, Frobenius) of the file's: about 1.5× the
    figure measured once, weight rounding (the v2 layout gave about the same) plus activation
    rounding."""
    nw = quantize_native(w, bits, SC_MAX[bits])
    top = TOP[bits]
    eff, offset, dsup, dmin = applied(nw)
    bound = (levels * file_step + dmin) / (2 * top) + dsup / 2 + slack(w, eff, offset, top)
    assert ((nw.dequantize() - w).abs() <= bound).all()
    x = torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(0))
    want = x @ w.t()
    assert (NativeLinear.from_weights(nw, None)(x) - want).norm() <= product * want.norm()


def test_q4_k_tensor_repacked_to_4_bits_stays_within_half_its_step(two_threads):
    from specserve.weights.dequant import dequantize

    g = torch.Generator().manual_seed(10)
    rows, cols = 64, 1024
    q = torch.randint(0, 16, (rows, cols), generator=g)
    sc = torch.randint(20, 64, (rows, cols // 32), generator=g)
    m = torch.randint(0, 64, (rows, cols // 32), generator=g)
    d = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 5e-4).half()
    dmin = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 5e-4).half()
    w = dequantize(q4_k_bytes(q, sc, m, d, dmin), T.Q4_K, (rows, cols))
    step = d.float().repeat_interleave(256, 1) * sc.float().repeat_interleave(32, 1)
    offset = dmin.float().repeat_interleave(256, 1) * m.float().repeat_interleave(32, 1)
    assert torch.allclose(w, step * q - offset, rtol=0, atol=1e-6)  # the bytes say what we meant
    assert_within_the_files_step(w, step, 15, 4, product=0.025)  # measured 0.017


def test_q6_k_tensor_repacked_to_6_bits_stays_within_half_its_step(two_threads):
    """A block of 32 holds two Q6_K sub-blocks: it spans at most 63 of the coarser step."""
    from specserve.weights.dequant import dequantize

    g = torch.Generator().manual_seed(11)
    rows, cols = 64, 1024
    q = torch.randint(-32, 32, (rows, cols), generator=g)
    sub = torch.randint(16, 41, (rows, cols // 16), generator=g)  # like a real file's: one range
    d = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 5e-4).half()
    w = dequantize(q6_k_bytes(q, sub, d), T.Q6_K, (rows, cols))
    step = d.float().repeat_interleave(256, 1) * sub.float().repeat_interleave(16, 1)
    assert torch.equal(w, step * q)  # the bytes say what we meant
    coarse = step.reshape(rows, -1, 32).amax(-1).repeat_interleave(32, 1)
    assert_within_the_files_step(w, coarse, 63, 6, product=0.03)  # measured 0.019


def test_q5_0_tensor_repacked_to_6_bits_stays_within_a_quarter_of_its_step(two_threads):
    """Q5_0 (codes −16..15 × d per block of 32) spans at most 31·d: 63 steps of 6 bits put
    every weight within 31·d/126 (+ dmin/126 + dsup/2) of the file's value."""
    from specserve.weights.dequant import dequantize

    g = torch.Generator().manual_seed(12)
    rows, cols = 64, 1024
    raw = quants.quantize(torch.randn(rows, cols, generator=g).numpy(), T.Q5_0)
    w = dequantize(raw, T.Q5_0, (rows, cols))
    d = raw.reshape(rows, -1, 22)[:, :, :2].copy().view(np.float16)  # [rows, blocks, 1]
    d = torch.from_numpy(d.astype(np.float32)).abs().reshape(rows, -1).repeat_interleave(32, 1)
    assert_within_the_files_step(w, d, 31, 6, product=0.03)  # measured 0.022


@pytest.mark.parametrize("model, name, qtype, product", [  # product: measured 0.047, 0.020, 0.024
    ("qwen2.5-coder-1.5b", "blk.3.attn_q.weight", T.Q4_K, 0.07),
    ("qwen2.5-coder-0.5b", "blk.3.ffn_down.weight", T.Q6_K, 0.03),
    ("qwen2.5-coder-0.5b", "blk.2.attn_q.weight", T.Q5_0, 0.035)])
def test_real_gguf_tensors_repacked_stay_within_their_files_step(model, name, qtype, product,
                                                                 two_threads):
    """The first 256 rows of real Q4_K, Q6_K and Q5_0 tensors of the shipped models, each
    block's file step read from its bytes, under the bound of the synthetic tests above."""
    from specserve.weights.dequant import dequantize
    from specserve.weights.gguf_loader import open_gguf

    f = open_gguf(real_model_path(model))
    tensor = next(t for t in f.tensors if t.name == name)
    assert tensor.qtype == qtype
    out_f, in_f = tensor.shape
    rows = 256
    raw = np.asarray(f.raw(tensor)).reshape(out_f, -1)[:rows]
    w = dequantize(raw, qtype, (rows, in_f))
    if qtype == T.Q4_K:
        blocks = raw.reshape(-1, 144)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [supers, 1]
        sc, _ = quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [supers, 8]
        step, levels, bits = np.abs(d * sc).reshape(rows, -1), 15, 4
    elif qtype == T.Q6_K:
        blocks = raw.reshape(-1, 210)
        d = blocks[:, 208:].copy().view(np.float16).astype(np.float32)
        sub = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [supers, 16]
        # d and sub are signed: two halves of opposite sign span −32..32, 64 steps
        step, levels, bits = np.abs(d * sub).reshape(rows, -1, 2).max(-1), 64, 6
    else:
        d = raw.reshape(-1, 22)[:, :2].copy().view(np.float16).astype(np.float32)
        step, levels, bits = np.abs(d).reshape(rows, -1), 31, 6
    step = torch.from_numpy(np.ascontiguousarray(step)).repeat_interleave(32, 1)  # [rows, in]
    assert_within_the_files_step(w, step, levels, bits, product)


# ---- models ----

def test_int4_keeps_wide_source_tensors_at_6_or_8_bits_and_falls_back_without_the_kernel(
        tiny_hf, monkeypatch):
    from specserve.weights.loader import load_model
    from specserve.weights.quant import Int4Linear, quantize_linears
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
    from specserve.weights.gguf_loader import (config_from_gguf, open_gguf, read_metadata,
                                               read_tensor, tensor_index)

    gguf_file = open_gguf(real_model_path("smollm2-135m"))
    cfg, index = config_from_gguf(gguf_file, read_metadata(gguf_file)), tensor_index(gguf_file)
    g = torch.Generator().manual_seed(4)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.5.self_attn.q_proj.weight",
                 "model.embed_tokens.weight"):
        w = read_tensor(gguf_file, cfg, index[name], torch.float32)  # dequantized from the file
        x = torch.randn(5, w.shape[1], generator=g)
        got = NativeLinear(w, None, bits)(x)
        want = x @ w.t()
        rel = (got - want).norm() / want.norm()
        assert rel < tolerance, (name, rel)
