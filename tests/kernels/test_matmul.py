"""The native matmul kernels (`specserve/kernels/qmatmul.c`) on every instruction set this CPU
runs: batch invariance (a row's bits never depend on the other rows of its call, on how many
there are, or on the loop order the call took), agreement between the instruction sets, and
the float kernel against PyTorch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.weights.quant import NativeLinear, NativeWeights
from specserve.models.transformer import Linear
from tests import native_reference as ref

ISAS = kernels.available_isas()  # this CPU's, widest first; CI has at least avx2


def test_every_instruction_set_this_cpu_has_is_built_and_the_widest_is_chosen():
    assert "avx2" in ISAS  # CI runs on x86-64 with AVX2: the native path must be tested
    for name in ISAS:
        assert kernels.qmatmul(name).q_isa() == kernels.ISA_CODES[name]
    assert kernels.isa() == ISAS[0]
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"} <= kernels.cpu_flags():
        assert ISAS[0] == "avx512_vnni"


def batches(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [x[i:i + size] for i in range(0, x.shape[0], size)]


def assert_row_invariant(call, x: torch.Tensor, singles: int) -> torch.Tensor:
    """`call` on all of x at once, in batches of 3, 4, 17, 33 and 64, and on its first `singles` rows
    one at a time: every row's output identical. Returns the whole-batch output."""
    whole = call(x)
    for size in (3, 4, 17, 33, 64):
        assert torch.equal(torch.cat([call(b) for b in batches(x, size)]), whole), size
    for i in range(singles):
        assert torch.equal(call(x[i:i + 1]), whole[i:i + 1]), i
    return whole


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30  # an outlier column
    x[7] *= 1e-3  # a row far smaller than the others
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quantized_rows_are_identical_alone_in_any_batch_and_on_every_path(isa, bits,
                                                                            two_threads):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(37, 512, generator=g) * 0.05
    lin = NativeLinear(w, torch.randn(37, generator=g), bits, isa)
    x = activations(900, 512, seed=10 + bits)  # 900 rows: the prefill tiles by default
    x[11] = 0.0  # an all-zero row
    whole = assert_row_invariant(lin, x, singles=40)
    for path in (0, 1, 2):  # the kernel's choice, the decode loop and the prefill tiles
        assert torch.equal(lin(x, path), whole), path
        for rows in range(1, 14):
            assert torch.equal(lin(x[:rows], path), whole[:rows]), (path, rows)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("out_f, in_f", [(33, 192), (24, 576), (16, 1536), (40, 8960)])
def test_every_instruction_set_gives_the_reference_bits(bits, out_f, in_f, two_threads):
    """The AVX-512 build folds its 16 integer lanes into the AVX2 build's 8 (exact integer
    sums) and keeps its float accumulation order: each build gives the bits of the
    independent reference (tests/native_reference.py), so they agree with each other too,
    and a CPU with one build still checks it. At 8960 inputs (the down projection's) 70 rows
    are several blocks of rows (`lane_row_block`), so the 4- and 6-bit sweeps change block."""
    g = torch.Generator().manual_seed(out_f + in_f + bits)
    w = torch.randn(out_f, in_f, generator=g)
    w[0, :32] *= 50
    x = activations(70, in_f, seed=bits)
    for isa in ISAS:
        lin = NativeLinear(w, None, bits, isa)
        assert torch.equal(lin(x), ref.matmul(x, lin.w)), isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f, in_f", [(37, 512), (7, 13), (1, 100), (64, 8)])
def test_float_rows_are_identical_alone_and_in_any_batch(isa, wdtype, out_f, in_f, monkeypatch,
                                                         two_threads):
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", isa)
    g = torch.Generator().manual_seed(out_f * in_f)
    lin = Linear(torch.randn(out_f, in_f, generator=g).to(wdtype), torch.randn(out_f, generator=g))
    assert_row_invariant(lin, activations(300, in_f, seed=3), singles=25)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_float_kernel_gives_the_same_bits_on_every_instruction_set(wdtype, monkeypatch):
    """Every build within float32 rounding of the exact product (the float kernel has no
    bit-exact reference; a CPU with one build still checks that), and all builds equal."""
    g = torch.Generator().manual_seed(5)
    lin = Linear(torch.randn(29, 200, generator=g).to(wdtype))
    x = activations(21, 200, seed=5)
    w = lin.weight.double()  # [out, in]
    exact = x.double() @ w.t()  # [rows, out]
    scale = x.double().abs() @ w.abs().t()  # [rows, out]
    outs = []
    for isa in ISAS:
        monkeypatch.setenv("SPECSERVE_KERNEL_ISA", isa)
        outs.append(lin(x))
        assert ((outs[-1].double() - exact).abs() <= 202 * 2.0 ** -24 * scale).all(), isa
    assert all(torch.equal(o, outs[-1]) for o in outs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_f, in_f", [(37, 512), (7, 13), (50, 1536)])
def test_float_kernel_is_within_float32_rounding_of_the_exact_product(isa, out_f, in_f,
                                                                      monkeypatch):
    """|y − y_exact| ≤ k·2⁻²⁴·Σ|x·w| + |bias|·2⁻²⁴ (the textbook bound of a float32 dot
    product of length k in any order), and close to F.linear (rtol 1e-5 of that scale)."""
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", isa)
    g = torch.Generator().manual_seed(in_f)
    w, b = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    x = activations(9, in_f, seed=in_f)
    y = Linear(w, b)(x)
    exact = x.double() @ w.double().t() + b.double()
    scale = x.double().abs() @ w.double().abs().t() + b.double().abs()  # [rows, out]
    assert ((y.double() - exact).abs() <= (in_f + 2) * 2.0 ** -24 * scale).all()
    assert ((y - F.linear(x, w, b)).double().abs() <= 1e-5 * scale).all()


def test_bfloat16_weights_give_exactly_the_float32_result_on_the_widened_weights():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(23, 333, generator=g).bfloat16()
    x = activations(11, 333, seed=6)
    assert torch.equal(Linear(w)(x), Linear(w.float())(x))


def test_float_linear_into_writes_the_same_bits_into_the_buffer_given(monkeypatch):
    g = torch.Generator().manual_seed(8)
    w, b = torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    x = torch.randn(5, 64, generator=g)
    lin = Linear(w, b)
    out = torch.full((5, 16), float("nan"))
    assert lin.into(x, out) is out and torch.equal(out, lin(x))
    for bad in (torch.empty(5, 17), torch.empty(16, 5).t(), torch.empty(5, 16).double()):
        with pytest.raises(ValueError, match="out must be"):
            lin.into(x, bad)
    monkeypatch.setenv("SPECSERVE_NO_NATIVE", "1")  # PyTorch's result, copied in
    out = torch.full((5, 16), float("nan"))
    assert lin.into(x, out) is out and torch.equal(out, F.linear(x, w, b))


def test_float_linear_keeps_pytorch_without_the_native_kernel_and_for_bfloat16_activations(
        monkeypatch):
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    native = Linear(w, b)(x)
    assert native.shape == (2, 3, 16)
    monkeypatch.setenv("SPECSERVE_NO_NATIVE", "1")
    assert kernels.qmatmul() is None and kernels.isa() is None
    assert torch.equal(Linear(w, b)(x), F.linear(x, w, b))
    monkeypatch.delenv("SPECSERVE_NO_NATIVE")
    xb, wb = x.bfloat16(), w.bfloat16()
    y = Linear(wb)(xb)  # bf16 activations: PyTorch's bf16 matmul, as before
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.linear(xb, wb))


def test_the_instruction_set_can_be_forced_and_a_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", "avx2")
    assert kernels.isa() == "avx2" and kernels.qmatmul().q_isa() == 1
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", "sse2")
    with pytest.raises(ValueError, match="SPECSERVE_KERNEL_ISA"):
        kernels.isa()
    # a CPU with AVX2 only: avx2 by default, and AVX-512 cannot be forced
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", "avx512")
    with pytest.raises(ValueError, match="SPECSERVE_KERNEL_ISA='avx512'"):
        kernels.isa()
    monkeypatch.delenv("SPECSERVE_KERNEL_ISA")
    assert kernels.available_isas() == ("avx2",) and kernels.isa() == "avx2"
    # an older CPU: no native kernels, PyTorch's
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert kernels.isa() is None and kernels.qmatmul() is None and not kernels.cpu_supported()


def test_bad_arguments_are_refused_by_the_kernels():
    lib = kernels.qmatmul()
    assert lib.q_matmul(4, None, 1, 64, 64, 64, 0, None, None, None, None, None, None, 1, None,
                        1, 3) == -2
    assert lib.f_matmul(None, -1, 8, None, 0, None, 1, None) == -2
    assert lib.f_matmul(None, 1, 8, None, 2, None, 1, None) == -2


def extreme_weights(bits: int, out_f: int, k: int, sign: int, min_sign: int) -> NativeWeights:
    """Every code at its largest magnitude (4: 15, 6: 63, 8: ±127 as `sign`), every block
    scale multiplier at the kernel's limit (4, 6: 255; 8: 4095) and every offset multiplier
    at ±127 (`min_sign`), steps 1, super-blocks of 256 (8 blocks: the most terms one sum
    takes): the integer sums at the bounds of the layout's "Range" (V3: 32·63·127·255·8 for
    I_s, 127·32·127·8 for M_s), which any int16/int32 overflow on the way would wreck. 4 and
    6 bits: `out_f` not a multiple of 16, the padding lanes zero as the layout requires."""
    sc_max = kernels.qmatmul().q_sc_max(bits)
    blocks, supers = k // 32, k // 256
    if bits == 8:
        return NativeWeights(8, out_f, 256, torch.full((out_f, k), 127 * sign, dtype=torch.int8),
                             torch.full((out_f, blocks), sc_max, dtype=torch.int16),
                             torch.ones(out_f, supers))
    tiles = -(-out_f // 16)
    real = (torch.arange(tiles * 16) < out_f).reshape(tiles, 1, 16)  # [T, 1, lanes]

    def lanes(shape: tuple, value: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, *shape, 64] (4 bytes per lane) or [T, x, 16]: `value` in the real lanes."""
        full = torch.full((tiles, *shape), value, dtype=dtype)
        mask = real if shape[-1] == 16 else real.repeat_interleave(4, -1).reshape(
            tiles, *([1] * (len(shape) - 1)), 64)
        return torch.where(mask, full, torch.zeros((), dtype=dtype))

    qh = lanes((blocks, 2, 64), 0xFF, torch.uint8) if bits == 6 else None
    return NativeWeights(bits, out_f, 256, lanes((blocks, 4, 64), 0xFF, torch.uint8),
                         lanes((blocks, 16), sc_max, torch.uint8),
                         lanes((supers, 16), 1, torch.float32),
                         lanes((blocks, 16), 127 * min_sign, torch.int8),
                         lanes((supers, 16), 1, torch.float32), qh)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits, min_sign", [(4, 1), (4, -1), (6, 1), (6, -1), (8, 0)])
def test_the_largest_codes_and_scales_do_not_overflow_on_any_path(isa, bits, min_sign):
    """Activations of one magnitude quantize to ±127: each super-block's integer sums are
    then ±8·32·127·(sc_max·qmax) and ±8·32·127·127: the kernel gives the reference's bits
    (exact int64 sums) and the exact product within float32 rounding."""
    k, out_f = 512, 20
    sign = -1 if bits == 8 else 1
    nw = extreme_weights(bits, out_f, k, sign, min_sign)
    lin = NativeLinear.from_weights(nw, None, isa)
    qmax = {4: 15, 6: 63, 8: 127}[bits]
    per_weight = sign * qmax * lin._lib.q_sc_max(bits) + 127 * min_sign  # sc·q + m (steps 1)
    x = torch.ones(40, k)
    x[1::2] *= -1  # rows alternating +1, −1
    x[3, 256:] *= -1  # a row whose two super-blocks cancel
    exact = (x.double().sign() * 127).reshape(40, 2, 256).sum(-1) / 127  # [rows, 2]: Σ qa·da
    magnitude = 2 * 256 * abs(per_weight)  # both super-blocks' |sum|
    exact = exact.sum(-1) * per_weight  # [rows]
    want = ref.matmul(x, nw)  # [rows, out]
    assert ((want.double() - exact[:, None]).abs() <= 1e-6 * magnitude).all()
    for path in (0, 1, 2):  # the kernel's choice, the decode loop and the prefill tiles
        for rows in (1, 7, 13, 40):
            assert torch.equal(lin(x[:rows], path), want[:rows]), (path, rows)
