"""One resolver for every way a model is named: a path, an alias of the registry, or a Hugging
Face Hub id (`org/repo`, `org/repo:QUANT`). The Python API (`LLM`, `load_model`) and the
commands (`serve --model`, `generate --model`, `download`) all come through here.

Precedence: an existing path as written with a separator or `./`/`~`, then an alias (which
wins over a same-named file in the working directory, as `registry` says), then an existing
path, then a Hub id. An alias must be downloaded first (`specserve download ALIAS`); a Hub
id is downloaded on first use into huggingface_hub's cache (`huggingface.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from specserve.hub import huggingface
from specserve.hub.huggingface import HubAccess, HubName
from specserve.hub.registry import (MODELS, ModelSource, check_cached, fetch_model, find_source,
                                    models_dir)


def is_alias(name: str, catalog: Sequence[ModelSource] = MODELS) -> bool:
    return name.strip().lower() in (n.lower() for s in catalog for n in s.names)


def resolve_model(name_or_path: str, cache: Path | None = None,
                  catalog: Sequence[ModelSource] = MODELS,
                  access: HubAccess | None = None) -> Path:
    """The local file or folder `name_or_path` names (see the module docstring).

    FileNotFoundError if an alias is not downloaded yet; CorruptModelError if its file is
    corrupt; ValueError if the name is none of the three (or names a Hub model that is not
    there); DownloadError if a Hub model cannot be fetched.
    """
    path = Path(name_or_path).expanduser()
    as_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
    alias = is_alias(name_or_path, catalog)
    if path.exists() and (as_path or not alias):
        return path
    if alias:
        return _cached_alias(find_source(name_or_path, catalog), cache)
    hub = HubName.parse(name_or_path)
    if hub is None:
        known = ", ".join(n for s in catalog for n in s.names)
        raise ValueError(f"unknown model {name_or_path!r}: not an existing path, a known alias "
                         f"({known}) nor a Hugging Face Hub id (org/repo or org/repo:QUANT)")
    paths = huggingface.fetch(hub, access or HubAccess())
    if len(paths) > 1:
        raise ValueError(f"{hub}: a GGUF file split in {len(paths)} parts ({paths[0].name}, ...) "
                         f"cannot be loaded yet; merge them with llama.cpp's "
                         f"`llama-gguf-split --merge {paths[0]} merged.gguf` and load that file")
    return paths[0]


def download(names: Iterable[str] | None = None, cache: Path | None = None,
             progress: bool = True, catalog: Sequence[ModelSource] = MODELS,
             verify: bool = False, access: HubAccess | None = None) -> list[Path]:
    """Fetch the named models (aliases or Hub ids; every alias of `catalog` when None) and
    return their paths (every part of a split GGUF file). `verify` re-hashes the aliases'
    cached files in full."""
    names = [s.alias for s in catalog] if names is None else list(names)
    access = access or HubAccess(progress=progress)
    paths: list[Path] = []
    for name in names:
        hub = None if is_alias(name, catalog) else HubName.parse(name)
        if hub is None:
            paths.append(fetch_model(find_source(name, catalog), cache, progress, verify=verify))
        else:
            paths += huggingface.fetch(hub, access)
    return paths


def _cached_alias(source: ModelSource, cache: Path | None) -> Path:
    cached = check_cached(source, cache, progress=True)
    if cached is None:
        raise FileNotFoundError(
            f"model {source.alias!r} is not downloaded yet "
            f"(expected {models_dir(cache) / source.filename}); run `specserve download "
            f"{source.alias}`")
    return cached
