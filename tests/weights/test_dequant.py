"""Tests for specserve.weights.dequant: GGUF blocks to float32, checked against gguf.quants.

Synthetic blocks cover every bit pattern of the quantized fields (scale fields are kept
finite); real blocks come from the model files that `specserve download` puts in the cache.
"""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specserve.hub.registry import models_dir
from specserve.weights import dequant
from specserve.weights.dequant import SUPPORTED_TYPES, dequantize
from specserve.weights.gguf_file import GGUFFile, GGUFTensor

Q = GGMLQuantizationType
QUANTIZED_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Types that gguf.quants can also quantize (the K types it only dequantizes).
GGUF_QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Byte offsets of the float16 scale fields inside one block of each type.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
REAL_MODELS = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": (Q.Q4_K, Q.Q6_K, Q.F32),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": (Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.Q4_K),
    "smollm2-135m-instruct-q4_1.gguf": (Q.Q4_1, Q.Q8_0),
}
REAL_CASES = [(file, qtype) for file, types in REAL_MODELS.items() for qtype in types]
REAL_ROWS = 64




@pytest.fixture(scope="module")
def model_file() -> Callable[[str], GGUFFile]:
    """A cached model file, its header parsed once per module; fails, never skips, when the
    file is absent."""
    files: dict[str, GGUFFile] = {}

    def open_file(filename: str) -> GGUFFile:
        path = models_dir() / filename  # the package's own rule: $SPECSERVE_CACHE, $XDG_CACHE_HOME
        if not path.is_file():
            pytest.fail(f"model file {path} not found: run `specserve download` first")
        if filename not in files:
            files[filename] = GGUFFile(path)
        return files[filename]

    return open_file


def tensor_rows(gguf_file: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's bytes as [rows, bytes per row] (a view of the file)."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.qtype]
    return gguf_file.raw(tensor).reshape(-1, tensor.shape[-1] // block_size * type_size)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes [rows, bytes per row] whose float16 scale fields are finite."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        scales[::7] = 0.0  # a zero scale now and then
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def assert_matches_gguf(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    """Our output is bit-identical to gguf's reference dequantization of the same bytes."""
    ours = dequantize(raw, qtype, shape)
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == shape
    reference = gguf.quants.dequantize(np.asarray(raw), qtype).reshape(shape)
    np.testing.assert_array_equal(ours.numpy(), reference)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_reference_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, rows=24, cols=1024, seed=qtype.value)
    assert_matches_gguf(raw, qtype, (24, 1024))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_quantized_weights_match_gguf_reference(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(100 + qtype.value)
    weights = (rng.standard_normal((16, 512)) * np.logspace(-3, 1, 16)[:, None]).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    assert raw.dtype == np.uint8
    assert_matches_gguf(raw, qtype, (16, 512))
    # Sanity: a quantization round trip stays close to the original weights.
    ours = dequantize(raw, qtype, (16, 512)).numpy()
    row_scale = np.abs(weights).max(axis=1, keepdims=True)
    assert np.all(np.abs(ours - weights) <= 0.2 * row_scale)


def test_q8_0_block_is_scale_times_signed_bytes() -> None:
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    qs = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    raw = np.concatenate([d, qs])
    out = dequantize(raw, Q.Q8_0, (32,))
    torch.testing.assert_close(out, torch.arange(-16, 16, dtype=torch.float32) * 0.5, rtol=0, atol=0)


def test_q4_0_low_nibbles_are_first_half_of_block() -> None:
    d = np.array([2.0], dtype=np.float16).view(np.uint8)
    low, high = np.arange(16, dtype=np.uint8), np.full(16, 9, dtype=np.uint8)
    raw = np.concatenate([d, low | (high << 4)])
    out = dequantize(raw, Q.Q4_0, (1, 32))
    expected = torch.cat([torch.arange(16) - 8.0, torch.full((16,), 1.0)]) * 2.0
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)


def test_chunked_decoding_matches_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_blocks(Q.Q6_K, rows=10, cols=768, seed=7)
    whole = dequantize(raw, Q.Q6_K, (10, 768))
    monkeypatch.setattr(dequant, "_CHUNK_WEIGHTS", 256 * 7)  # 30 blocks: 4 chunks of 7, then 2
    torch.testing.assert_close(dequantize(raw, Q.Q6_K, (10, 768)), whole, rtol=0, atol=0)


@pytest.mark.parametrize("np_dtype, qtype", [(np.float32, Q.F32), (np.float16, Q.F16)], ids=["F32", "F16"])
def test_float_tensors_typed_or_as_bytes(np_dtype: type, qtype: GGMLQuantizationType) -> None:
    values = np.random.default_rng(3).standard_normal((6, 10)).astype(np_dtype)
    expected = torch.from_numpy(values.astype(np.float32))
    torch.testing.assert_close(dequantize(values, qtype, (6, 10)), expected, rtol=0, atol=0)
    as_bytes = values.view(np.uint8)
    torch.testing.assert_close(dequantize(as_bytes, qtype, (6, 10)), expected, rtol=0, atol=0)


def test_bf16_matches_gguf_reference() -> None:
    values = np.random.default_rng(4).standard_normal((5, 12)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.BF16)  # [5, 24] bytes
    assert_matches_gguf(raw, Q.BF16, (5, 12))


def first_tensor(gguf_file: GGUFFile, qtype: GGMLQuantizationType) -> GGUFTensor:
    return next(t for t in gguf_file.tensors if t.qtype == qtype)


@pytest.mark.parametrize("filename, qtype", REAL_CASES, ids=lambda v: getattr(v, "name", v))
def test_real_model_rows_match_gguf_reference(
    model_file: Callable[[str], GGUFFile], filename: str, qtype: GGMLQuantizationType
) -> None:
    gguf_file = model_file(filename)
    tensor = first_tensor(gguf_file, qtype)
    raw = tensor_rows(gguf_file, tensor)[:REAL_ROWS]  # [rows, bytes per row]
    shape = (raw.shape[0], tensor.shape[-1])
    assert_matches_gguf(raw, qtype, shape)
    weights = dequantize(raw, qtype, shape)
    # Real weights: finite, modest and not all zero (a wrong offset would decode garbage).
    assert torch.isfinite(weights).all() and weights.abs().max() < 100 and weights.abs().sum() > 0


@pytest.mark.parametrize("filename", list(REAL_MODELS))
def test_real_model_smallest_quantized_tensor_decodes_whole(
    model_file: Callable[[str], GGUFFile], filename: str
) -> None:
    gguf_file = model_file(filename)
    quantized = [t for t in gguf_file.tensors if t.qtype in QUANTIZED_TYPES]
    tensor = min(quantized, key=lambda t: t.nbytes)
    out = dequantize(gguf_file.raw(tensor), tensor.qtype, tensor.shape, name=tensor.name)
    assert tuple(out.shape) == tensor.shape
    reference = gguf.quants.dequantize(np.array(tensor_rows(gguf_file, tensor)), tensor.qtype)
    np.testing.assert_array_equal(out.numpy(), reference.reshape(out.shape))


def test_supported_types_cover_the_model_formats() -> None:
    required = {Q.F32, Q.F16, Q.BF16, *QUANTIZED_TYPES}
    assert SUPPORTED_TYPES == frozenset(required)


def test_unsupported_type_is_rejected_by_name() -> None:
    raw = np.zeros(84, dtype=np.uint8)  # one Q2_K block
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type Q2_K for tensor blk\.0\.w"):
        dequantize(raw, Q.Q2_K, (256,), name="blk.0.w")


def test_truncated_bytes_are_reported_with_expected_and_actual_counts() -> None:
    raw = random_blocks(Q.Q4_K, rows=2, cols=256, seed=1).reshape(-1)[:-1]  # 287 of 288 bytes
    with pytest.raises(ValueError, match=r"corrupt or truncated tensor w: .*needs 288 bytes, got 287"):
        dequantize(raw, Q.Q4_K, (2, 256), name="w")


def test_extra_bytes_are_rejected() -> None:
    raw = np.zeros(8 * 4 + 4, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"needs 32 bytes, got 36"):
        dequantize(raw, Q.F32, (2, 4))


def test_row_length_not_a_multiple_of_the_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"last dimension 100 is not a multiple of the Q8_0 block size 32"):
        dequantize(np.zeros(34 * 3, dtype=np.uint8), Q.Q8_0, (1, 100))


def test_the_model_files_are_looked_for_where_xdg_cache_home_says(monkeypatch, tmp_path):
    """The cached model files come from the package's cache rule, so XDG_CACHE_HOME counts."""
    monkeypatch.delenv("SPECSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models_dir() == tmp_path / "specserve" / "models"
