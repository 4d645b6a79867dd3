"""Where specserve keeps what it builds and fetches: one root for every cache."""

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
