"""Where specserve keeps what it builds and fetches: one root for every cache, and whether a
cached file may be trusted (`untrusted`: owned by this user, writable by no one else)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of specserve's cache: $SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specserve"


def untrusted(path: Path) -> str | None:
    """Why the cached file or folder at `path` must not be used, or None when it may: it must
    belong to this user and be writable by no one else (group and others could otherwise put
    their code or data in it)."""
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by user id {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"writable by {who} (mode {st.st_mode & 0o777:o})"
    return None
