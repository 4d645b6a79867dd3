"""Models named by their Hugging Face Hub id, `org/repo` or `org/repo:QUANT`, fetched through
`huggingface_hub`: its cache, `HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`, downloads that
resume, with a progress bar.

Every file is checked against the digest the Hub publishes for it before it is used, fresh
or cached, resumed or whole: an LFS file (weights) by its sha256, any other by its git blob
id (a sha1 over `blob <size>\\0` and the bytes). Online the digests come with the file list
(`files_metadata`); offline, from the cache's own blob names (huggingface_hub names a blob
by the ETag the Hub sent: the sha256 of an LFS file, the git id of another). A weights file
once hashed is stamped as the registry's files are (`registry.verify_sha256`), so a load does
not hash it again while it stays as it was. A mismatch is a DownloadError naming the file and
both digests; the bad copy is deleted (blob and link), so nothing corrupt stays in the cache
and the next try downloads it afresh.

Which files a name means (llama.cpp's `-hf` rules for GGUF):
- `org/repo:QUANT`: the GGUF file whose name holds QUANT followed by `.` or `-`, in any case
  (`Q4_K_M` → `gemma-3-270m-it-Q4_K_M.gguf`); a split file (`-00001-of-00003.gguf`) brings
  all its parts.
- `org/repo`: the safetensors model (config.json, *.safetensors, the tokenizer's files) where
  the repository has one; else its GGUF file tagged Q4_K_M, else Q8_0, else its first.
Files named as no model (mmproj, imatrix, MTP/EAGLE/DFlash drafts) are never chosen.

The file list comes from the Hub. Where the Hub cannot be reached or offline mode is on, it
comes from the cached snapshot of `main`, so that a model fetched once loads offline. Errors
are one line naming the repository and what to do: ValueError where the name is wrong (no
such repository or quant, no model in it), DownloadError where the Hub or the cache fails.
Nothing here touches the network until `fetch` is called.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from specserve.hub.registry import DownloadError, verify_sha256

_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                   r"(?::(?P<quant>[A-Za-z0-9][\w.-]*))?")
_SPLIT = re.compile(r"(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.I)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "model.safetensors.index.json")
REVISION = "main"


@dataclass(frozen=True, slots=True)
class HubName:
    """`org/repo[:QUANT]`."""

    repo: str
    quant: str | None = None

    @staticmethod
    def parse(name: str) -> HubName | None:
        """The Hub id `name` spells; None where it spells none (e.g. a path `a/b.gguf`)."""
        m = _NAME.fullmatch(name.strip())
        if m is None or m["repo"].lower().endswith((".gguf", ".safetensors")) \
                or ".." in m["repo"] or "--" in m["repo"]:
            return None
        return HubName(m["repo"], m["quant"])

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True, slots=True)
class HubAccess:
    """How the Hub is reached; None follows huggingface_hub's settings (HF_ENDPOINT,
    HF_HUB_CACHE or HF_HOME, HF_HUB_OFFLINE, HF_TOKEN)."""

    endpoint: str | None = None
    cache_dir: Path | None = None
    offline: bool | None = None
    progress: bool = True


@dataclass(frozen=True, slots=True)
class Listing:
    """A repository's files at one commit, from the Hub (`online`) or from the cache, and the
    digest of each that has one (file → ("sha256" | "git", hex digest))."""

    commit: str
    files: tuple[str, ...]
    online: bool
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)


def fetch(name: HubName, access: HubAccess = HubAccess()) -> list[Path]:
    """The local paths of the files `name` means (downloaded where not cached): one GGUF file,
    the parts of a split one in order, or a safetensors folder."""
    listing = list_files(name, access)
    chosen = choose(name, listing)
    paths = [_download(name, f, listing, access) for f in chosen]
    if chosen[0].endswith(".gguf"):
        return paths
    return [paths[0].parent]  # the folder: config.json's


def choose(name: HubName, listing: Listing) -> list[str]:
    """The files of `listing` that `name` means (see the module docstring)."""
    ggufs = [f for f in listing.files if _is_model_gguf(f)]
    where = "" if listing.online else (" in the cached copy (the Hub is out of reach, so only "
                                       "files fetched before are known)")
    if name.quant is None:
        folder = _folder(listing.files)
        if folder:
            return folder
    for quant in [name.quant] if name.quant else DEFAULT_QUANTS:
        tagged = re.compile(re.escape(quant) + r"[.-]", re.I)
        first = next((f for f in ggufs if tagged.search(f) and _split_index(f) == 1), None)
        if first is not None:
            return _parts(first, ggufs)
    if name.quant is not None:
        quants = sorted({q for f in ggufs if (q := quant_of(f))})
        raise ValueError(f"{name.repo}: no GGUF file for quant {name.quant!r}{where}; it has "
                         f"{', '.join(quants) or 'none'} (name one as {name.repo}:QUANT)")
    if ggufs:
        return _parts(next(f for f in ggufs if _split_index(f) == 1), ggufs)
    raise ValueError(f"{name.repo}: no GGUF file and no safetensors model (config.json and "
                     f"*.safetensors){where}")


def quant_of(filename: str) -> str | None:
    """A GGUF file's quant tag, e.g. "Q4_K_M" for `x-Q4_K_M-00001-of-00002.gguf`."""
    stem = PurePosixPath(filename).name
    m = _SPLIT.fullmatch(stem)
    stem = m["prefix"] if m else stem.removesuffix(".gguf").removesuffix(".GGUF")
    tag = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    return tag[1].upper() if tag else None


def _is_model_gguf(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.lower().endswith(".gguf") and not any(n in name for n in _NOT_MODELS)


def _split_index(path: str) -> int:
    m = _SPLIT.fullmatch(PurePosixPath(path).name)
    return int(m["index"]) if m else 1


def _parts(first: str, ggufs: list[str]) -> list[str]:
    m = _SPLIT.fullmatch(PurePosixPath(first).name)
    if m is None:
        return [first]
    parent = str(PurePosixPath(first).parent)
    same = [f for f in ggufs if str(PurePosixPath(f).parent) == parent
            and (s := _SPLIT.fullmatch(PurePosixPath(f).name))
            and (s["prefix"], s["count"]) == (m["prefix"], m["count"])]
    return sorted(same, key=_split_index)


def _folder(files: tuple[str, ...]) -> list[str]:
    """A safetensors model's files at the repository's root; [] where it has none."""
    weights = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if "config.json" not in files or not weights:
        return []
    return [f for f in FOLDER_FILES if f in files] + weights


# ------------------------------------------------------------------ the Hub and its cache
def list_files(name: HubName, access: HubAccess) -> Listing:
    """The repository's files at `main`: from the Hub, else from the cache (see the module
    docstring); errors as the module docstring says."""
    import huggingface_hub as hub
    from huggingface_hub import constants, errors

    offline = access.offline if access.offline is not None else constants.is_offline_mode()
    if offline:
        return _cached_listing(name, access, "offline mode is on (HF_HUB_OFFLINE); unset it to "
                                             "download the model")
    api = hub.HfApi(endpoint=access.endpoint)
    try:
        info = api.model_info(name.repo, revision=REVISION, files_metadata=True)
    except errors.GatedRepoError:
        raise ValueError(f"{name.repo}: a gated repository; accept its terms on the Hub and set "
                         f"HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"{name.repo}: no such model repository on the Hub "
                         f"({_endpoint(access)}); check the name (org/repo[:QUANT]), or set "
                         f"HF_TOKEN if it is private") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{name.repo}: the repository has no '{REVISION}' revision") from None
    except Exception as e:  # the network, a proxy, the Hub's side: try the cache
        if isinstance(e, errors.HfHubHTTPError) and _status(e) in range(400, 500):
            raise DownloadError(f"{name.repo}: the Hub refused the request "
                                f"({_status(e)}); check HF_TOKEN") from None
        return _cached_listing(name, access, f"cannot reach the Hub at {_endpoint(access)} "
                                             f"({_reason(e)}); check the network, HF_ENDPOINT "
                                             f"and proxy settings")
    siblings = info.siblings or ()
    digests = {s.rfilename: ("sha256", s.lfs.sha256) if s.lfs is not None else ("git", s.blob_id)
               for s in siblings if s.lfs is not None or s.blob_id}
    return Listing(info.sha, tuple(s.rfilename for s in siblings), True, digests)


def _cached_listing(name: HubName, access: HubAccess, why: str) -> Listing:
    snapshot = _cached_snapshot(name.repo, access)
    if snapshot is None:
        raise DownloadError(f"{name.repo}: not in the Hugging Face cache "
                            f"({_cache_dir(access)}) and {why}")
    paths = {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}
    return Listing(snapshot.name, tuple(sorted(paths)), False,
                   {f: d for f, p in paths.items() if (d := _blob_digest(p)) is not None})


def _blob_digest(path: Path) -> tuple[str, str] | None:
    """The digest a cached file's blob is named by (None: the cache keeps no blobs by name,
    e.g. where it could not make links)."""
    blob = path.resolve().name
    if _SHA256.fullmatch(blob):
        return "sha256", blob
    if _COMMIT.fullmatch(blob):
        return "git", blob
    return None


def _cached_snapshot(repo: str, access: HubAccess) -> Path | None:
    """`<cache>/models--org--repo/snapshots/<commit of main>`, where it exists."""
    from huggingface_hub.file_download import repo_folder_name

    storage = _cache_dir(access) / repo_folder_name(repo_id=repo, repo_type="model")
    try:
        commit = (storage / "refs" / REVISION).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _COMMIT.fullmatch(commit):  # a commit id, never a path (`../..`)
        return None
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _download(name: HubName, filename: str, listing: Listing, access: HubAccess) -> Path:
    import huggingface_hub as hub
    from huggingface_hub import errors

    try:
        # online by the branch, so that huggingface_hub records where `main` points for
        # offline use; offline by the cached snapshot's commit
        revision = REVISION if listing.online else listing.commit
        path = Path(hub.hf_hub_download(
            name.repo, filename, revision=revision, endpoint=access.endpoint,
            cache_dir=access.cache_dir, local_files_only=not listing.online,
            tqdm_class=None if access.progress else _QuietBar))
    except errors.LocalEntryNotFoundError:
        raise DownloadError(f"{name.repo}: {filename} is not in the Hugging Face cache "
                            f"({_cache_dir(access)}) and the Hub cannot be reached") from None
    except errors.HfHubHTTPError as e:
        raise DownloadError(f"{name.repo}: downloading {filename} failed "
                            f"({_status(e) or _reason(e)})") from None
    except OSError as e:
        raise DownloadError(f"{name.repo}: cannot write {filename} to the Hugging Face cache "
                            f"({_cache_dir(access)}): {e.strerror or e}; set HF_HUB_CACHE to a "
                            f"writable directory") from None
    except Exception as e:  # the transfer broke off: the next try resumes it
        raise DownloadError(f"{name.repo}: downloading {filename} failed ({_reason(e)}); run "
                            f"the command again to resume") from None
    _verify(name, filename, path, listing.digests.get(filename), access)
    return path


def _verify(name: HubName, filename: str, path: Path, digest: tuple[str, str] | None,
            access: HubAccess) -> None:
    """Check a downloaded or cached file against the Hub's digest; a mismatch deletes it (blob
    and link) and is a DownloadError. A file the Hub gave no digest for passes as it is."""
    if digest is None:
        return
    kind, expected = digest
    blob = path.resolve()
    if kind == "sha256":
        problem = verify_sha256(blob, expected, f"verify {filename}", access.progress)
    else:
        actual = _git_blob_id(blob)
        problem = None if actual == expected else f"git blob id {actual}"
    if problem is None:
        return
    blob.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    raise DownloadError(f"{name.repo}: {filename} is corrupt ({problem}; the Hub says "
                        f"{kind} {expected}); the bad copy was deleted: run the command again "
                        f"to download it afresh")


def _git_blob_id(path: Path) -> str:
    """Git's id of a file's bytes: sha1 of `blob <size>\\0` and the bytes."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _QuietBar(tqdm):
    """A progress bar that shows nothing (`HubAccess.progress` false)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "disable": True})


def _cache_dir(access: HubAccess) -> Path:
    from huggingface_hub import constants

    return Path(access.cache_dir or constants.HF_HUB_CACHE)


def _endpoint(access: HubAccess) -> str:
    from huggingface_hub import constants

    return access.endpoint or constants.ENDPOINT


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
