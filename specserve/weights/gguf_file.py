"""A fast reader for GGUF files: metadata, tensor index and memory-mapped tensor bytes.

`gguf.GGUFReader` builds a numpy view per metadata element, which takes seconds for a 150k-token
vocabulary; this parses the header with `struct` in one pass (string arrays in a tight loop,
numeric arrays with one `np.frombuffer` each) and maps tensor data only when it is asked for.
A long string array (a vocabulary, its merges) is only stepped over: it is read as text on
first use (`StringArray`), and a tokenizer built before from the same bytes is not built again
(`StringArray.digest`), so a warm load of a model pair reads its vocabulary once.

Layout (GGUF v2/v3, little-endian; llama.cpp's `docs/gguf.md`):

    magic b"GGUF" | version:u32 | tensor_count:u64 | kv_count:u64
    kv_count x    key:string | value_type:u32 | value
    tensor_count x name:string | n_dims:u32 | ne:u64[n_dims] | ggml_type:u32 | offset:u64
    padding to `general.alignment` (default 32), then the tensor data

A string is a u64 byte length followed by UTF-8 bytes; an array value is elem_type:u32 |
count:u64 | elements. `ne[0]` is the contiguous dimension, so PyTorch's shape is `ne` reversed,
and tensor offsets count from the start of the data section.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

LAZY_STRINGS = 4096  # string arrays of at least this many strings are read on first use
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_PREAMBLE = struct.Struct("<4sIQQ")  # magic, version, tensor_count, kv_count
_SCALARS = {
    V.UINT8: struct.Struct("<B"), V.INT8: struct.Struct("<b"), V.UINT16: struct.Struct("<H"),
    V.INT16: struct.Struct("<h"), V.UINT32: struct.Struct("<I"), V.INT32: struct.Struct("<i"),
    V.FLOAT32: struct.Struct("<f"), V.BOOL: struct.Struct("<?"), V.UINT64: struct.Struct("<Q"),
    V.INT64: struct.Struct("<q"), V.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES = {
    V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4",
    V.INT32: "<i4", V.FLOAT32: "<f4", V.BOOL: "<u1", V.UINT64: "<u8", V.INT64: "<i8",
    V.FLOAT64: "<f8",
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """Where one tensor's bytes lie in the file and how to read them."""

    name: str
    shape: tuple[int, ...]  # PyTorch order: GGUF's ne reversed, last dimension contiguous
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    def __post_init__(self) -> None:
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"shape of tensor {self.name} must be non-negative, got {self.shape}")
        if self.offset < 0 or self.nbytes < 0:
            raise ValueError(f"offset and nbytes of tensor {self.name} must be non-negative")


class _Cursor:
    """Reads header fields in order from a buffer; `struct.error` means it ran off the end."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos, self.size = buf, pos, len(buf)

    def unpack(self, fmt: struct.Struct) -> tuple:
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > self.size:
            raise struct.error(f"{n} bytes at offset {self.pos} run past the end")
        data, self.pos = self.buf[self.pos : end], end
        return data

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` consecutive strings: the vocabulary path, so kept to a tight loop."""
        if count * _U64.size > self.size - self.pos:
            raise struct.error(f"{count} strings at offset {self.pos} run past the end")
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = [""] * count
        for i in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                raise struct.error(f"string at offset {pos} runs past the end")
            out[i] = str(buf[pos : pos + n], "utf-8")
            pos += n
        self.pos = pos
        return out

    def skip_strings(self, count: int) -> None:
        """Step over `count` consecutive strings without reading them as text."""
        if count * _U64.size > self.size - self.pos:
            raise struct.error(f"{count} strings at offset {self.pos} run past the end")
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                raise struct.error(f"string ending at offset {pos} runs past the end")
        self.pos = pos

    def value(self, value_type: int) -> Any:
        kind = _value_type(value_type)
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == V.STRING:
            return self.string()
        return self.array()

    def array(self) -> list:
        kind, count = _value_type(self.u32()), self.u64()
        if kind == V.STRING:
            return self.strings(count)
        if kind == V.ARRAY:
            return [self.array() for _ in range(count)]
        dtype = np.dtype(_ARRAY_DTYPES[kind])
        values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)  # [count]
        return (values != 0).tolist() if kind == V.BOOL else values.tolist()


def _value_type(value: int) -> GGUFValueType:
    try:
        return GGUFValueType(value)
    except ValueError:
        raise ValueError(f"unknown GGUF value type {value}") from None


class StringArray(Sequence):
    """A long metadata string array, read from the file as text on first use; `digest` names
    its bytes without reading them (invalid UTF-8 is reported, naming the key, when read)."""

    def __init__(self, path: Path, key: str, start: int, end: int, count: int) -> None:
        self.path, self.key, self.start, self.end, self.count = path, key, start, end, count
        self._values: list[str] | None = None
        self._digest: str | None = None

    def _map(self):
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def values(self) -> list[str]:
        if self._values is None:
            with self._map() as buf:
                try:
                    self._values = _strings_at(buf, self.start, self.end, self.count)
                except UnicodeDecodeError as e:
                    raise ValueError(f"{self.path}: metadata key {self.key!r}: invalid UTF-8 "
                                     f"({e})") from None
                except struct.error as e:  # the file changed since its header was read
                    raise ValueError(f"{self.path}: metadata key {self.key!r}: {e}") from None
        return self._values

    @property
    def digest(self) -> str:
        """The sha256 of the array's bytes in the file."""
        if self._digest is None:
            with self._map() as buf:
                self._digest = hashlib.sha256(buf[self.start:self.end]).hexdigest()
        return self._digest

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self.values[i]

    def __iter__(self):
        return iter(self.values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self.values == other.values
        return isinstance(other, Sequence) and not isinstance(other, str) \
            and self.values == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({self.key!r}, {self.count} strings)"


class GGUFFile:
    """A parsed GGUF file: `metadata` (Python values), `tensors` (index) and `raw(tensor)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.file_size = os.fstat(f.fileno()).st_size
            self.version = _check_preamble(f.read(_PREAMBLE.size), self.path)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.metadata, infos, header_end = _parse_header(buf, self.path)
        self.alignment = _alignment(self.metadata, self.path)
        self.data_start = -(-header_end // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        return self._data[tensor.offset : tensor.offset + tensor.nbytes]  # [nbytes]

    @cached_property
    def _data(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.uint8, mode="r")  # [file_size]

    def _tensor(self, name: str, dims: tuple[int, ...], type_value: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(type_value)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name} has unknown GGML type {type_value}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if (dims[0] if dims else 1) % block_size:
            raise ValueError(f"{self.path}: tensor {name}: first GGUF dimension {dims[0]} is not a "
                             f"multiple of the {qtype.name} block size {block_size}")
        nbytes = int(np.prod(dims, dtype=object)) // block_size * type_size
        start = self.data_start + offset
        if start + nbytes > self.file_size:
            raise ValueError(f"{self.path}: corrupt or truncated file: tensor {name} needs bytes "
                             f"{start}..{start + nbytes} but the file has {self.file_size}")
        return GGUFTensor(name, tuple(reversed(dims)), qtype, start, nbytes)


def _check_preamble(head: bytes, path: Path) -> int:
    """The file's GGUF version, once its magic and version are known good."""
    if head[:4] != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {MAGIC!r})")
    if len(head) < _PREAMBLE.size:
        raise ValueError(f"{path}: truncated GGUF header ({len(head)} bytes)")
    _, version, _, _ = _PREAMBLE.unpack(head)
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"{path}: unsupported GGUF version {version}{hint}; "
                         f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    return version


def _parse_header(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], list[tuple], int]:
    """(metadata, (name, ne, ggml type, relative offset) per tensor, end of the tensor infos)."""
    _, _, tensor_count, kv_count = _PREAMBLE.unpack_from(buf, 0)
    cursor = _Cursor(buf, _PREAMBLE.size)
    try:
        metadata = _read_metadata(cursor, kv_count, path)
        infos = _read_tensor_infos(cursor, tensor_count, path)
    except struct.error:
        raise ValueError(f"{path}: truncated GGUF header: the file ({len(buf)} bytes) ends "
                         f"inside the metadata or tensor infos (near byte {cursor.pos})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: invalid UTF-8 in the GGUF header near byte {cursor.pos}: {e}") from None
    return metadata, infos, cursor.pos


def _read_metadata(cursor: _Cursor, kv_count: int, path: Path) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        value_type = cursor.u32()
        try:
            value = _lazy_strings(cursor, path, key) if value_type == V.ARRAY else None
            if value is None:
                value = cursor.value(value_type)
        except ValueError as e:  # an unknown value type or invalid UTF-8
            raise ValueError(f"{path}: metadata key {key!r}: {e}") from None
        if key in metadata:
            raise ValueError(f"{path}: duplicate metadata key {key!r}")
        if key == "general.alignment" and value_type != V.UINT32:
            raise ValueError(f"{path}: general.alignment must be UINT32, got {_value_type(value_type).name}")
        metadata[key] = value
    return metadata


def _lazy_strings(cursor: _Cursor, path: Path, key: str) -> StringArray | None:
    """At an array value: if it is a string array of at least `LAZY_STRINGS` strings, step over
    it and return it unread; else None, the cursor where it was."""
    elem, count = struct.unpack_from("<IQ", cursor.buf, cursor.pos)
    if elem != V.STRING or count < LAZY_STRINGS:
        return None
    cursor.pos += 12
    start = cursor.pos
    cursor.skip_strings(count)
    return StringArray(path, key, start, cursor.pos, count)


def _strings_at(buf: mmap.mmap, start: int, end: int, count: int) -> list[str]:
    """The `count` strings in `buf[start:end]`, decoded at once: each string's 8-byte length
    is dropped but for its top byte (0 for any length below 2^56), which then separates the
    strings, so one `decode` and one `split` do what a loop of `count` decodes would. A
    string holding a NUL byte (or a length of 2^56 or more) is read one by one."""
    unpack, pos, found = _U64.unpack_from, start, []
    note = found.append
    for _ in range(count):
        note(pos)
        pos += 8 + unpack(buf, pos)[0]
    if pos != end:
        raise struct.error(f"the strings at offset {start} no longer end at {end}")
    starts = np.array(found, dtype=np.int64)  # [count]
    # a copy, not a view: a view would keep the map from closing while an error unwinds
    region = np.frombuffer(buf[start:end], dtype=np.uint8)  # [end - start]
    keep = np.ones(end - start, dtype=bool)
    keep[((starts - start)[:, None] + np.arange(7)).ravel()] = False
    text = region[keep].tobytes().decode("utf-8")
    out = text.split("\0")[1:]
    if len(out) == count and not region[starts - start + 7].any():
        return out
    return _Cursor(buf, start).strings(count)


def _read_tensor_infos(cursor: _Cursor, tensor_count: int, path: Path) -> list[tuple]:
    infos, names = [], set()
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.u32()
        if n_dims > MAX_DIMS:
            raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions; GGUF allows {MAX_DIMS}")
        dims = cursor.unpack(struct.Struct(f"<{n_dims}Q"))
        type_value, offset = cursor.u32(), cursor.u64()
        if name in names:
            raise ValueError(f"{path}: duplicate tensor name {name!r}")
        names.add(name)
        infos.append((name, dims, type_value, offset))
    return infos


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {alignment}")
    return alignment
