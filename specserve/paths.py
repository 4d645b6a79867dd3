"""Where specserve keeps what it builds and fetches: one root for every cache, and whether a
cached file may be trusted.

Trust, as OpenSSH's StrictModes checks a key file: a cached file and the folder holding it
must belong to this user and be writable by no one else (`untrusted`), and every folder above
that, up to `/`, must belong to this user or to root and be writable by no one else unless its
sticky bit keeps others from renaming what is not theirs, as in /tmp (`untrusted_ancestry`):
otherwise someone else could replace the folder, and what is in it, after it was checked.
`open_trusted` opens a file without following a link and checks the descriptor it opened, so
what is read is what was checked. `make_dirs` creates cache folders writable by this user
only, whatever the umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedPath(PermissionError):
    """A cached file or folder that someone other than this user could have written."""


def cache_dir() -> Path:
    """Root of specserve's cache: $SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specserve"


def weights_dir(cache: Path | None = None) -> Path:
    """Where repacked (quantized) weights are cached: ``<cache>/weights`` (weight_cache.py)."""
    return (cache if cache is not None else cache_dir()) / "weights"


def untrusted(path: Path) -> str | None:
    """Why the cached file or folder at `path` must not be used, or None when it may: it must
    belong to this user and be writable by no one else (group and others could otherwise put
    their code or data in it)."""
    return _problem(path.stat())


def _problem(st: os.stat_result) -> str | None:
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by user id {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"writable by {who} (mode {st.st_mode & 0o777:o})"
    return None


def untrusted_ancestry(folder: Path) -> str | None:
    """Why a folder above `folder` (resolved; from its parent up to `/`) could let someone else
    replace it, or None: each must belong to this user or root, and be writable by no one else
    unless sticky."""
    me = os.getuid() if hasattr(os, "getuid") else None
    for above in Path(os.path.realpath(folder)).parents:
        st = above.stat()
        if me is not None and st.st_uid not in (me, 0):
            return f"{above} (above it) is owned by user id {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{above} (above it) is writable by others than its owner "
                    f"(mode {st.st_mode & 0o777:o})")
    return None


def untrusted_folder(folder: Path) -> str | None:
    """Why files in `folder` must not be trusted (the folder itself, or one above it), or None."""
    if (problem := untrusted(Path(os.path.realpath(folder)))) is not None:
        return f"{folder} is {problem}"
    return untrusted_ancestry(folder)


def make_dirs(folder: Path, mode: int = 0o755) -> None:
    """Create `folder` and the folders missing above it, each with `mode` exactly (no group or
    other write, whatever the umask); folders that exist are left as they are."""
    missing = []
    for level in (folder, *folder.parents):
        if level.exists():
            break
        missing.append(level)
    for level in reversed(missing):
        try:
            level.mkdir(mode=mode)
        except FileExistsError:  # made meanwhile by another process: checked when used
            continue
        os.chmod(level, mode)


def open_trusted(path: Path) -> int:
    """A read-only descriptor of the regular file at `path`, opened without following a link
    in its last component, whose owner and mode (read from the descriptor) make it trusted;
    `UntrustedPath` otherwise. The caller closes it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else _problem(st)
    if problem is not None:
        os.close(fd)
        raise UntrustedPath(f"{path} is {problem}")
    return fd
