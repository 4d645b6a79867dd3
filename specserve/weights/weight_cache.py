"""An on-disk cache of repacked weights, so that every load after the first maps them in.

Repacking a quantized GGUF file for the native kernels (dequantize, requantize into the
kernel's blocks) takes seconds to tens of seconds; the result is stored once under
``weights_dir()`` (``$SPECSERVE_CACHE/weights``) and later loads memory-map it.

One entry is one file, ``<source file name>.<label>.<key digest>.weights``:

    preamble (64 bytes): magic b"SSWCACHE" | version:u32 | 0:u32 | index_offset:u64 |
                         index_length:u64 | sha256 of the index:32 bytes
    zero padding to DATA_START (4096)
    tensor data: each tensor's bytes at a 64-byte aligned offset, zero padding between,
                 the whole region padded to a multiple of CHUNK_BYTES
    index: JSON {key, tensors: {name: {dtype, shape, offset, nbytes}}, meta, data_end, checksum}

What makes a stale or damaged entry impossible to use:
- The key (the source file's sha256, the format, the kernel layout version, ... : whatever the
  caller says the content depends on) is stored in the index and must equal the caller's;
  the file name carries a digest of it, so a changed source gets its own entry (and the old
  one is removed when the new one is written).
- The index is checked against its sha256 in the preamble; the tensor data against a
  checksum in the index: the int64 sum of each 1 MiB chunk (read as 64-bit words), combined
  as (Σ sums, Σ i·sums) modulo 2^64. Any change to one word changes the first term (a word
  changes by a nonzero amount below 2^64), and the second catches chunks swapped or moved.
  It runs at memory speed (with the page faults of the first touch, which the model's first
  pass would pay anyway), faster than crc32 or sha256 over the same bytes.
  A failed check deletes the entry and the caller rebuilds it; nothing of it is used.
- Entries are written under a temporary name in the same directory, flushed to disk, then
  renamed over the final name, so a reader sees a whole file or none.
- An entry is read only if this user owns it and its folder, no one else can write them, and
  no folder above could let someone else replace them (`paths.untrusted`,
  `paths.untrusted_folder`, as OpenSSH's StrictModes). An entry that fails this is a cache
  miss: removed (where this user may), logged, and rebuilt; a folder that fails it is not
  used at all (every load repacks, with a warning). The cache's folders are created writable
  by this user only, whatever the umask (`paths.make_dirs`).

The source's sha256 is computed once per file: the model registry's verification stamp is
trusted while it matches ``os.stat`` of the file; other files get a stamp of the same kind
(size, mtime, ctime, inode) under ``weights_dir()/stamps``, read only when it and its folders
are trusted (otherwise the file is hashed again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.hub.registry import verified_sha256
from specserve.paths import make_dirs, untrusted, untrusted_folder

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: the file's own blocks (layout v4), projections of several parts
MAGIC = b"SSWCACHE"
_PREAMBLE = struct.Struct("<8sIIQQ32s")  # magic, version, 0, index offset, index length, sha256
DATA_START = 4096
ALIGN = 64
CHUNK_BYTES = 1 << 20
HASH_CHUNK_BYTES = 8 << 20
SUFFIX = ".weights"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A verified entry: its tensors (views of the memory-mapped file) and the caller's meta."""

    tensors: dict[str, torch.Tensor]
    meta: dict
    path: Path


def progress_bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A bar on stderr, shown only when stderr is a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


def say(message: str) -> None:
    """A progress line on stderr (the slow, first-load path only)."""
    print(f"specserve: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ source identity
def _stamp(st: os.stat_result, sha256: str, path: Path) -> dict:
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "sha256": sha256}


def source_sha256(path: Path, directory: Path) -> str:
    """The sha256 of the file at `path`, hashed once per version of the file (see the module
    docstring); stamps live under `directory`/stamps."""
    path = path.resolve()
    trusted = verified_sha256(path)
    if trusted is not None:
        return trusted
    stamp_file = directory / "stamps" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    st = path.stat()
    try:
        trusted = untrusted_folder(stamp_file.parent) is None and untrusted(stamp_file) is None
        record = json.loads(stamp_file.read_text()) if trusted else None
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and isinstance(record.get("sha256"), str) \
            and record == _stamp(st, record["sha256"], path):
        return record["sha256"]
    say(f"hashing {path.name} ({st.st_size / 1e6:.0f} MB, once) to key its weight cache")
    digest = hashlib.sha256()
    with open(path, "rb") as f, progress_bar(st.st_size, f"hash {path.name}", "B") as bar:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    sha256 = digest.hexdigest()
    if _stamp(path.stat(), sha256, path) == _stamp(st, sha256, path):  # unchanged while hashed
        try:
            _write_atomically(stamp_file, json.dumps(_stamp(st, sha256, path)).encode())
        except OSError as e:
            log.warning("cannot keep a hash stamp in %s (%s); the file is hashed on each load",
                        stamp_file.parent, e)
    return sha256


def _write_atomically(path: Path, data: bytes) -> None:
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------ entries
def entry_path(directory: Path, source: Path, label: str, key: dict) -> Path:
    """Where the entry for `source` under `key` lives; `label` (e.g. "int4-float32") names it
    for people and groups the entries that replace one another."""
    digest = hashlib.sha256(_canonical(key)).hexdigest()[:20]
    return directory / f"{source.name}.{label}.{digest}{SUFFIX}"


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def checksum(data: torch.Tensor) -> list[int]:
    """(Σ s_i, Σ (i + 1)·s_i) mod 2^64 (as signed int64), where s_i is the wrapping int64 sum
    of chunk i of `data` ([n] uint8, n a multiple of CHUNK_BYTES)."""
    words = data.view(torch.int64).view(-1, CHUNK_BYTES // 8)  # [chunks, words]
    sums = words.sum(dim=1)  # [chunks] int64, wrapping
    weights = torch.arange(1, sums.shape[0] + 1, dtype=torch.int64)  # [chunks]
    return [int(sums.sum()), int((sums * weights).sum())]


def write(path: Path, key: dict, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Store `tensors` and `meta` (JSON-serializable) under `key`, atomically; then remove the
    other entries of the same source and label. `UntrustedEntry` (writing nothing) where the
    folder is not trusted: an entry there would never be read."""
    make_dirs(path.parent)
    if (problem := untrusted_folder(path.parent)) is not None:
        raise UntrustedEntry(f"weight cache folder {problem}")
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the entry is as readable as the models
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        with os.fdopen(fd, "w+b") as f, progress_bar(total, "write weight cache", "B") as bar:
            index: dict[str, dict] = {}
            offset = DATA_START
            f.seek(offset)
            for name, t in tensors.items():
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
                index[name] = {"dtype": str(t.dtype).removeprefix("torch."),
                               "shape": list(t.shape), "offset": offset, "nbytes": raw.numel()}
                f.write(memoryview(raw.numpy()))
                offset += raw.numel()
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                bar.update(raw.numel())
            data_end = offset + (-(offset - DATA_START) % CHUNK_BYTES)
            f.truncate(data_end)
            f.flush()
            data = torch.from_file(str(tmp), shared=False, size=data_end, dtype=torch.uint8)
            body = _canonical({"key": key, "tensors": index, "meta": meta, "data_end": data_end,
                               "checksum": checksum(data[DATA_START:data_end])})
            del data
            f.seek(data_end)
            f.write(body)
            f.seek(0)
            f.write(_PREAMBLE.pack(MAGIC, CACHE_VERSION, 0, data_end, len(body),
                                   hashlib.sha256(body).digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    label_prefix = path.name[: path.name.rindex(".", 0, -len(SUFFIX))]
    for other in path.parent.glob(f"{label_prefix}.*{SUFFIX}"):
        if other != path:
            other.unlink(missing_ok=True)


def read(path: Path, key: dict) -> CacheEntry | None:
    """The entry at `path` if it exists, was written under `key` and passes its checks; None
    otherwise (a miss). A damaged entry, or one that another user owns or that group or others
    may write, is deleted (and logged); in a folder that is not trusted nothing is read."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if (problem := untrusted_folder(path.parent)) is not None:
        log.warning("weight cache folder %s; not using it (make it and the folders above it "
                    "this user's or root's, writable by no one else: chmod go-w)", problem)
        return None
    if (problem := untrusted(path)) is not None:
        log.warning("weight cache %s is %s; removing it and rebuilding it", path, problem)
        path.unlink(missing_ok=True)
        return None
    try:
        entry = _read_checked(path, size, key)
    except (OSError, ValueError, KeyError, TypeError, struct.error, RuntimeError) as e:
        entry, problem = None, str(e)
    else:
        problem = None if entry is not None else "its key differs"
    if entry is None:
        log.warning("weight cache %s is unusable (%s); rebuilding it", path, problem)
        path.unlink(missing_ok=True)
    return entry


class CorruptEntry(ValueError):
    """An entry that fails one of its checks."""


class UntrustedEntry(PermissionError):
    """An entry that someone other than this user could have written."""


def _read_checked(path: Path, size: int, key: dict) -> CacheEntry | None:
    with open(path, "rb") as f:
        head = f.read(_PREAMBLE.size)
        if len(head) < _PREAMBLE.size:
            raise CorruptEntry("truncated preamble")
        magic, version, _, index_offset, index_length, index_sha = _PREAMBLE.unpack(head)
        if magic != MAGIC or version != CACHE_VERSION:
            raise CorruptEntry(f"magic {magic!r}, version {version}")
        if index_offset + index_length != size or index_offset < DATA_START:
            raise CorruptEntry(f"index at {index_offset}+{index_length} in a {size}-byte file")
        f.seek(index_offset)
        body = f.read(index_length)
    if hashlib.sha256(body).digest() != index_sha:
        raise CorruptEntry("index checksum mismatch")
    index = json.loads(body)
    if index["key"] != json.loads(_canonical(key)):
        return None
    data_end = index["data_end"]
    if data_end != index_offset or (data_end - DATA_START) % CHUNK_BYTES:
        raise CorruptEntry("data region does not match the index")
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # [size]
    if checksum(data[DATA_START:data_end]) != index["checksum"]:
        raise CorruptEntry("tensor data checksum mismatch")
    tensors = {}
    for name, t in index["tensors"].items():
        start, nbytes = t["offset"], t["nbytes"]
        dtype = getattr(torch, t["dtype"])
        numel = 1
        for dim in t["shape"]:
            numel *= dim
        if not (DATA_START <= start and start + nbytes <= data_end and start % ALIGN == 0) \
                or numel * dtype.itemsize != nbytes:
            raise CorruptEntry(f"tensor {name} lies outside the data or has a wrong size")
        tensors[name] = data[start:start + nbytes].view(dtype).view(t["shape"])
    return CacheEntry(tensors, index["meta"], path)
