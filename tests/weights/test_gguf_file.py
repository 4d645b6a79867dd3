"""Tests for specserve.weights.gguf_file: metadata, tensor index and bytes equal `gguf.GGUFReader`'s
on files written by `gguf.GGUFWriter` and on a real model; malformed files fail with clear errors.

Hand-packed files (see `gguf_bytes`) cover what `GGUFWriter` refuses to write: empty arrays,
duplicate keys, unknown types, bad alignment.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from specserve.weights.gguf_file import LAZY_STRINGS, GGUFFile, GGUFTensor, StringArray
from specserve.weights.gguf_loader import open_gguf, read_metadata
from tests.conftest import real_model_path
from tests.tiny import finish_gguf

Q, V = GGMLQuantizationType, GGUFValueType
F32_TENTH = float(np.float32(0.1))
# (key, value written, value type, array element type, value read back)
VALUES = [
    ("t.uint8", 255, V.UINT8, None, 255),
    ("t.int8", -128, V.INT8, None, -128),
    ("t.uint16", 65535, V.UINT16, None, 65535),
    ("t.int16", -32768, V.INT16, None, -32768),
    ("t.uint32", 2**32 - 1, V.UINT32, None, 2**32 - 1),
    ("t.int32", -(2**31), V.INT32, None, -(2**31)),
    ("t.float32", 0.1, V.FLOAT32, None, F32_TENTH),
    ("t.bool_true", True, V.BOOL, None, True),
    ("t.bool_false", False, V.BOOL, None, False),
    ("t.string", "héllo ✓ 世界", V.STRING, None, "héllo ✓ 世界"),
    ("t.empty_string", "", V.STRING, None, ""),
    ("t.uint64", 2**64 - 1, V.UINT64, None, 2**64 - 1),
    ("t.int64", -(2**63), V.INT64, None, -(2**63)),
    ("t.float64", 0.1, V.FLOAT64, None, 0.1),
    ("t.uint8s", [0, 7, 255], V.ARRAY, V.UINT8, [0, 7, 255]),
    ("t.int8s", [-128, 0, 127], V.ARRAY, V.INT8, [-128, 0, 127]),
    ("t.uint16s", [1, 65535], V.ARRAY, V.UINT16, [1, 65535]),
    ("t.int16s", [-32768, 5], V.ARRAY, V.INT16, [-32768, 5]),
    ("t.uint32s", [3, 2**32 - 1], V.ARRAY, V.UINT32, [3, 2**32 - 1]),
    ("t.int32s", [-(2**31), 1, 2], V.ARRAY, V.INT32, [-(2**31), 1, 2]),
    ("t.float32s", [0.1, -2.5], V.ARRAY, V.FLOAT32, [F32_TENTH, -2.5]),
    ("t.bools", [True, False, True], V.ARRAY, V.BOOL, [True, False, True]),
    ("t.strings", ["a", "", "ü ✓", " two words "], V.ARRAY, V.STRING, ["a", "", "ü ✓", " two words "]),
    ("t.uint64s", [2**64 - 1, 0], V.ARRAY, V.UINT64, [2**64 - 1, 0]),
    ("t.int64s", [-(2**63), 9], V.ARRAY, V.INT64, [-(2**63), 9]),
    ("t.float64s", [0.1, 1e300], V.ARRAY, V.FLOAT64, [0.1, 1e300]),
]


def typed(value: object) -> object:
    """`value` with the Python type of every element attached (1 == 1.0 == True otherwise)."""
    if isinstance(value, list):
        return ["list", [typed(v) for v in value]]
    return [type(value).__name__, value]


def reference_metadata(reader: GGUFReader) -> dict:
    """Every key/value field as Python values, read through `GGUFReader` (its GGUF.* entries
    are the preamble, not metadata)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == V.ARRAY and field.types[-1] != V.STRING:
            meta[key] = [v for i in field.data for v in field.parts[i].tolist()]
        else:
            meta[key] = field.contents()
    return meta


def assert_same_as_gguf_reader(path: Path) -> GGUFFile:
    ours, reader = GGUFFile(path), GGUFReader(path)
    assert [(t.name, t.shape, t.qtype, t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type, t.data_offset, t.n_bytes)
        for t in reader.tensors
    ]
    assert ours.data_start == reader.data_offset
    assert typed(ours.metadata) == typed(reference_metadata(reader))
    for mine, theirs in zip(ours.tensors, reader.tensors):
        np.testing.assert_array_equal(ours.raw(mine), theirs.data.reshape(-1).view(np.uint8))
    return ours


def write_tiny(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A file with every metadata value type and tensors of several types and ranks; returns
    the bytes written for each tensor."""
    rng = np.random.default_rng(0)
    tensors = {
        "odd.f32": rng.standard_normal(7).astype(np.float32),  # 28 bytes: needs padding
        "mat.f16": rng.standard_normal((3, 5)).astype(np.float16),
        "cube.i32": rng.integers(-1000, 1000, (2, 3, 4)).astype(np.int32),
        "four.f32": rng.standard_normal((1, 2, 3, 4)).astype(np.float32),
    }
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)  # [2, 68] bytes
    writer = GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, value_type, sub_type, _ in VALUES:
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.add_tensor("rows.q8_0", q8, raw_dtype=Q.Q8_0)
    finish_gguf(writer)
    return {name: array.view(np.uint8).reshape(-1) for name, array in {**tensors, "rows.q8_0": q8}.items()}


def pack_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def pack_kv(key: str, value_type: int, payload: bytes) -> bytes:
    return pack_string(key) + struct.pack("<I", value_type) + payload


def pack_tensor_info(name: str, ne: tuple[int, ...], ggml_type: int, offset: int = 0) -> bytes:
    return pack_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)


def gguf_bytes(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", version: int = 3,
               alignment: int = 32) -> bytes:
    header = struct.pack("<4sIQQ", b"GGUF", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + b"\0" * (-len(header) % alignment) + data


def write_bytes(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("alignment", [None, 1, 64])
def test_tiny_file_equals_gguf_reader_for_every_value_type(tmp_path: Path, alignment: int | None) -> None:
    written = write_tiny(tmp_path / "tiny.gguf", alignment)
    ours = assert_same_as_gguf_reader(tmp_path / "tiny.gguf")
    assert ours.alignment == (alignment or 32)
    assert ours.data_start % ours.alignment == 0
    for tensor in ours.tensors:
        assert tensor.offset % ours.alignment == 0
        np.testing.assert_array_equal(ours.raw(tensor), written[tensor.name])


def test_values_come_back_as_written_with_python_types(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny.gguf")
    meta = GGUFFile(tmp_path / "tiny.gguf").metadata
    assert meta["general.architecture"] == "llama"
    for key, _, _, _, expected in VALUES:
        assert typed(meta[key]) == typed(expected), key


def test_shapes_are_in_pytorch_order(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny.gguf")
    tensors = {t.name: t for t in GGUFFile(tmp_path / "tiny.gguf").tensors}
    assert tensors["cube.i32"].shape == (2, 3, 4) and tensors["cube.i32"].qtype == Q.I32
    assert tensors["four.f32"].shape == (1, 2, 3, 4)
    assert tensors["rows.q8_0"].shape == (2, 64) and tensors["rows.q8_0"].nbytes == 2 * 34 * 2


def test_raw_is_a_read_only_view_of_the_file(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny.gguf")
    gguf_file = GGUFFile(tmp_path / "tiny.gguf")
    tensor = gguf_file.tensors[0]
    first, second = gguf_file.raw(tensor), gguf_file.raw(tensor)
    assert first.dtype == np.uint8 and not first.flags.writeable
    assert np.shares_memory(first, second)


def test_nested_and_empty_arrays(tmp_path: Path) -> None:
    kvs = [
        pack_kv("nested", V.ARRAY, struct.pack("<IQ", V.ARRAY, 2) + struct.pack("<IQ2h", V.INT16, 2, -1, 2)
                + struct.pack("<IQ", V.STRING, 1) + pack_string("x")),
        pack_kv("empty_ints", V.ARRAY, struct.pack("<IQ", V.INT32, 0)),
        pack_kv("empty_strings", V.ARRAY, struct.pack("<IQ", V.STRING, 0)),
    ]
    meta = GGUFFile(write_bytes(tmp_path, gguf_bytes(kvs))).metadata
    assert meta == {"nested": [[-1, 2], ["x"]], "empty_ints": [], "empty_strings": []}


def test_real_model_equals_gguf_reader() -> None:
    ours = assert_same_as_gguf_reader(real_model_path("smollm2-135m"))
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


def test_large_vocabulary_header_is_read_whole() -> None:
    """The 151936-entry vocabulary of the default target, every tensor listed."""
    path = real_model_path("qwen2.5-coder-1.5b")
    gguf_file = GGUFFile(path)
    tokens = gguf_file.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(gguf_file.metadata["tokenizer.ggml.token_type"]) == 151936
    assert tokens[:3] == ["!", '"', "#"]
    assert len(gguf_file.tensors) == 339


def test_loader_functions_use_the_reader(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny.gguf")
    gguf_file = open_gguf(tmp_path / "tiny.gguf")
    assert isinstance(gguf_file, GGUFFile)
    assert read_metadata(gguf_file) == gguf_file.metadata


def test_missing_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absent.gguf"):
        open_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("data", [b"", b"GG", b"GGML" + b"\0" * 40, b"<!DOCTYPE html>"], ids=["empty", "short", "ggml", "html"])
def test_bad_magic_is_not_a_gguf_file(tmp_path: Path, data: bytes) -> None:
    path = write_bytes(tmp_path, data)
    with pytest.raises(ValueError, match=r"crafted\.gguf: not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("version, message", [(1, "unsupported GGUF version 1;"), (3 << 24, "big-endian")])
def test_unsupported_version_is_refused(tmp_path: Path, version: int, message: str) -> None:
    path = write_bytes(tmp_path, gguf_bytes([], version=version))
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def test_version_2_is_read(tmp_path: Path) -> None:
    path = write_bytes(tmp_path, gguf_bytes([pack_kv("k", V.UINT8, b"\x05")], version=2))
    assert GGUFFile(path).metadata == {"k": 5}


def test_truncation_anywhere_is_reported(tmp_path: Path) -> None:
    """Cut a file at every byte of its preamble and first key, then every 7th byte up to the end
    of its last tensor: inside the header it is a truncated header, after it a tensor running
    past the end of the file. (Past the last tensor lies only padding, which may be cut.)"""
    write_tiny(tmp_path / "tiny.gguf")
    whole = (tmp_path / "tiny.gguf").read_bytes()
    reader = GGUFReader(tmp_path / "tiny.gguf")
    last_info = reader.tensors[-1].field
    header_end = last_info.offset + sum(int(part.nbytes) for part in last_info.parts)
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert data_end <= len(whole)
    for size in [*range(4, 64), *range(64, data_end, 7), data_end - 1]:
        path = write_bytes(tmp_path, whole[:size])
        expected = r"crafted\.gguf: truncated GGUF header" if size < header_end else \
            r"crafted\.gguf: corrupt or truncated file: tensor \S+ needs bytes"
        with pytest.raises(ValueError, match=expected):
            GGUFFile(path)


def test_huge_string_length_is_truncation_not_memory_error(tmp_path: Path) -> None:
    kv = pack_string("k") + struct.pack("<IQ", V.STRING, 2**62)
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([kv])))
    kv = pack_string("k") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**62)
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([kv])))


@pytest.mark.parametrize("value_type, payload", [
    (V.STRING, pack_string("abcdef")), (V.ARRAY, struct.pack("<IQ", V.STRING, 2) + pack_string("x") + pack_string("yz")),
], ids=["string", "string-array"])
def test_last_string_cut_short_is_truncation(tmp_path: Path, value_type: int, payload: bytes) -> None:
    """With no tensor info after it, nothing else would notice a short final string."""
    data = gguf_bytes([pack_kv("k", value_type, payload)], alignment=1)
    assert GGUFFile(write_bytes(tmp_path, data)).metadata["k"] in ("abcdef", ["x", "yz"])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(write_bytes(tmp_path, data[:-1]))


@pytest.mark.parametrize("payload, message", [
    (struct.pack("<I", 13), r"metadata key 'bad': unknown GGUF value type 13"),
    (struct.pack("<IIQ", V.ARRAY, 42, 1), r"metadata key 'bad': unknown GGUF value type 42"),
], ids=["scalar", "array-element"])
def test_unknown_value_type_is_named(tmp_path: Path, payload: bytes, message: str) -> None:
    path = write_bytes(tmp_path, gguf_bytes([pack_string("bad") + payload + b"\0" * 16]))
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def test_invalid_utf8_names_the_key(tmp_path: Path) -> None:
    path = write_bytes(tmp_path, gguf_bytes([pack_kv("name", V.STRING, pack_string(b"\xff\xfe"))]))
    with pytest.raises(ValueError, match=r"metadata key 'name'.*utf-8"):
        GGUFFile(path)


def test_duplicates_are_refused(tmp_path: Path) -> None:
    kv = pack_kv("k", V.UINT8, b"\x01")
    with pytest.raises(ValueError, match="duplicate metadata key 'k'"):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([kv, kv])))
    info = pack_tensor_info("w", (4,), Q.F32)
    with pytest.raises(ValueError, match="duplicate tensor name 'w'"):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([], [info, info], data=b"\0" * 16)))


@pytest.mark.parametrize("kv, message", [
    (pack_kv("general.alignment", V.UINT32, struct.pack("<I", 48)), "power of two, got 48"),
    (pack_kv("general.alignment", V.UINT32, struct.pack("<I", 0)), "power of two, got 0"),
    (pack_kv("general.alignment", V.UINT64, struct.pack("<Q", 64)), "must be UINT32, got UINT64"),
], ids=["48", "zero", "uint64"])
def test_bad_alignment_is_refused(tmp_path: Path, kv: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([kv])))


def test_custom_alignment_places_the_data(tmp_path: Path) -> None:
    kv = pack_kv("general.alignment", V.UINT32, struct.pack("<I", 128))
    values = np.arange(4, dtype=np.float32)
    path = write_bytes(tmp_path, gguf_bytes([kv], [pack_tensor_info("w", (4,), Q.F32)], values.tobytes(), alignment=128))
    gguf_file = GGUFFile(path)
    assert gguf_file.data_start == 128
    np.testing.assert_array_equal(gguf_file.raw(gguf_file.tensors[0]).view(np.float32), values)


@pytest.mark.parametrize("info, message", [
    (pack_tensor_info("w", (32,), 99), "tensor w has unknown GGML type 99"),
    (pack_tensor_info("w", (1, 1, 1, 1, 1), Q.F32), "tensor w has 5 dimensions"),
    (pack_tensor_info("w", (48, 2), Q.Q8_0), "tensor w: first GGUF dimension 48 is not a multiple of the Q8_0 block size 32"),
    (pack_tensor_info("w", (32,), Q.F32, offset=2**40), r"corrupt or truncated file: tensor w"),
], ids=["unknown-type", "five-dims", "partial-block", "offset-past-end"])
def test_bad_tensor_info_is_refused_by_name(tmp_path: Path, info: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GGUFFile(write_bytes(tmp_path, gguf_bytes([], [info], data=b"\0" * 256)))


def test_tensor_record_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="shape of tensor w"):
        GGUFTensor("w", (-1, 4), Q.F32, offset=0, nbytes=16)
    with pytest.raises(ValueError, match="offset and nbytes of tensor w"):
        GGUFTensor("w", (4,), Q.F32, offset=-8, nbytes=16)


# ---- long string arrays (vocabularies): stepped over at open, read on first use
LONG = LAZY_STRINGS + 5


def long_strings(extra: str = "") -> list[str]:
    """`LONG` strings of 0 to 4 UTF-8 bytes per character, some empty."""
    return [("" if i % 97 == 0 else f"t{i}ü✓{extra}") for i in range(LONG)]


def string_array_file(directory: Path, strings: list[bytes | str]) -> Path:
    """A file in `directory` (made if missing) holding `strings` under "tokens", then a key."""
    directory.mkdir(exist_ok=True)
    payload = struct.pack("<IQ", V.STRING, len(strings)) + b"".join(map(pack_string, strings))
    return write_bytes(directory, gguf_bytes([pack_kv("tokens", V.ARRAY, payload),
                                                    pack_kv("after", V.UINT8, b"\x07")]))


def test_long_string_array_is_read_on_first_use(tmp_path: Path) -> None:
    strings = long_strings()
    meta = GGUFFile(string_array_file(tmp_path / "a", strings)).metadata
    tokens = meta["tokens"]
    assert isinstance(tokens, StringArray) and tokens._values is None
    assert len(tokens) == LONG and meta["after"] == 7  # the key after it was found unread
    assert tokens._values is None
    assert tokens == strings and tokens[:3] == strings[:3] and list(tokens) == strings
    # the digest names the bytes: the same strings in another file, the same digest
    same = GGUFFile(string_array_file(tmp_path / "b", strings)).metadata["tokens"]
    other = GGUFFile(string_array_file(tmp_path / "c", long_strings("!"))).metadata["tokens"]
    assert same.digest == tokens.digest != other.digest


def test_short_string_arrays_stay_lists(tmp_path: Path) -> None:
    strings = [f"s{i}" for i in range(LAZY_STRINGS - 1)]
    assert type(GGUFFile(string_array_file(tmp_path, strings)).metadata["tokens"]) is list


def test_long_string_array_holding_nul_reads_the_same(tmp_path: Path) -> None:
    """The one-decode path separates strings by NUL; a string holding one is read one by one."""
    strings = long_strings()
    strings[10] = "a\0b"
    assert GGUFFile(string_array_file(tmp_path, strings)).metadata["tokens"] == strings


def test_invalid_utf8_in_a_long_array_names_the_key_when_read(tmp_path: Path) -> None:
    strings = [s.encode() for s in long_strings()]
    strings[7] = b"\xff\xfe"
    tokens = GGUFFile(string_array_file(tmp_path, strings)).metadata["tokens"]
    with pytest.raises(ValueError, match=r"crafted\.gguf: metadata key 'tokens': invalid UTF-8"):
        tokens[0]


def test_long_string_array_cut_short_is_truncation(tmp_path: Path) -> None:
    data = string_array_file(tmp_path, long_strings()).read_bytes()
    cut = data.index(pack_string("after"))  # inside the array's last string
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(write_bytes(tmp_path, data[:cut - 2]))
