"""Models named by Hugging Face Hub id: names parsed, files chosen as llama.cpp's `-hf` chooses
them, and fetched through huggingface_hub from a local Hub that serves repositories built here
(`hub_server.py`): a download, then cache hits, offline mode, one-line errors for a wrong
name, a missing quant and an unreachable Hub; and the command line, configured as a user
would (HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE), downloading and generating with a model."""

from __future__ import annotations

import hashlib
import json
import random
import socket
from pathlib import Path

import pytest

from specserve.hub.huggingface import HubAccess, HubName, Listing, choose, quant_of
from specserve.hub.registry import DownloadError
from specserve.hub.resolver import download, resolve_model
from specserve.weights.loader import load_model
from tests import spm_vocab, tiny
from tests.hub.hub_server import Hub
from tests.test_cli import assert_one_line_error, run_cli

GGUF_REPO, HF_REPO = "org/tiny-GGUF", "org/tiny-hf"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("repos")
    q8 = spm_vocab.write_model(folder / "q8.gguf", "gemma", "Q8_0").read_bytes()
    f32 = spm_vocab.write_model(folder / "f32.gguf", "gemma", "F32").read_bytes()
    hf = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), folder / "hf")
    return {GGUF_REPO: {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32, "README.md": b"# tiny\n",
                        "mmproj-tiny-Q8_0.gguf": b"not a model"},
            HF_REPO: {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()}}


@pytest.fixture
def hub(repos):
    with Hub(repos) as hub:
        yield hub


def access(hub: Hub | str, tmp_path, offline: bool = False) -> HubAccess:
    endpoint = hub if isinstance(hub, str) else hub.url
    return HubAccess(endpoint, tmp_path / "hf-cache", offline, progress=False)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_ids_parse_and_paths_or_aliases_do_not():
    assert HubName.parse("google/gemma-3-270m-it-GGUF:Q4_K_M") == \
        HubName("google/gemma-3-270m-it-GGUF", "Q4_K_M")
    assert HubName.parse("Qwen/Qwen2.5-0.5B-Instruct") == HubName("Qwen/Qwen2.5-0.5B-Instruct")
    for name in ("qwen2.5-coder-1.5b", "models/x.gguf", "a/b/c", "./a/b", "/abs/path", "a/b:",
                 "~/x/y", "a/..", "a--b/c"):
        assert HubName.parse(name) is None, name


def test_files_are_chosen_as_llama_cpp_chooses_them():
    ggufs = ("README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-q6_k.gguf", "mmproj-m-Q8_0.gguf",
             "big/m-Q2_K-00002-of-00002.gguf", "big/m-Q2_K-00001-of-00002.gguf", "m-IQ4_XS.gguf")
    listing = Listing("c0ffee", ggufs, True)
    assert choose(HubName("o/m", "Q6_K"), listing) == ["m-q6_k.gguf"]  # any case
    assert choose(HubName("o/m", "q2_k"), listing) == ["big/m-Q2_K-00001-of-00002.gguf",
                                                       "big/m-Q2_K-00002-of-00002.gguf"]
    assert choose(HubName("o/m"), listing) == ["m-Q4_K_M.gguf"]  # the default quant
    assert choose(HubName("o/m"), Listing("c", ("m-F16.gguf", "m-Q8_0.gguf"), True)) == \
        ["m-Q8_0.gguf"]
    assert choose(HubName("o/m"), Listing("c", ("mmproj-F16.gguf", "m-F16.gguf"), True)) == \
        ["m-F16.gguf"]  # the first model file, never a projector
    with pytest.raises(ValueError, match=r"^o/m: no GGUF file for quant 'Q5_K_S'; it has IQ4_XS, "
                                         r"Q2_K, Q4_K_M, Q6_K, Q8_0 \(name one as o/m:QUANT\)$"):
        choose(HubName("o/m", "Q5_K_S"), listing)
    both = ("config.json", "model-00002-of-00002.safetensors", "tokenizer.json", "m-Q8_0.gguf",
            "model-00001-of-00002.safetensors", "model.safetensors.index.json")
    assert choose(HubName("o/m"), Listing("c", both, True)) == [
        "config.json", "tokenizer.json", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert choose(HubName("o/m", "Q8_0"), Listing("c", both, True)) == ["m-Q8_0.gguf"]
    assert quant_of("x/m.Q5_K_M-00001-of-00003.gguf") == "Q5_K_M"


def test_a_gguf_is_downloaded_once_then_served_from_the_cache_online_and_offline(hub, repos,
                                                                                 tmp_path):
    path = resolve_model(f"{GGUF_REPO}:q8_0", access=access(hub, tmp_path))
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == repos[GGUF_REPO][path.name]
    assert resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path)) == path
    assert hub.downloads("tiny-Q8_0.gguf") == 1  # the second time, no bytes were sent
    seen = len(hub.requests)
    assert resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True)) == path
    assert len(hub.requests) == seen  # offline: not one request
    with pytest.raises(ValueError, match=r"no GGUF file for quant 'F32' in the cached copy"):
        resolve_model(f"{GGUF_REPO}:F32", access=access(hub, tmp_path, offline=True))
    assert load_model(path, "float32", weights="float32").tokenizer.pieces is not None  # SPM


def test_without_a_quant_the_safetensors_model_comes_as_a_folder_that_loads(hub, tmp_path):
    folder = resolve_model(HF_REPO, access=access(hub, tmp_path))
    assert folder.is_dir() and {"config.json", "model.safetensors", "tokenizer.json"} <= \
        {p.name for p in folder.iterdir()}
    assert load_model(folder, "float32", weights="float32").config.architecture == "qwen2"


def test_a_wrong_repository_or_quant_is_a_one_line_value_error(hub, tmp_path):
    with pytest.raises(ValueError, match=rf"^org/nope: no such model repository on the Hub "
                                         rf"\({hub.url}\); check the name") as e:
        resolve_model("org/nope:Q4_K_M", access=access(hub, tmp_path))
    with pytest.raises(ValueError, match=r"^org/tiny-GGUF: no GGUF file for quant 'Q4_K_M'; it "
                                         r"has F32, Q8_0 ") as e:
        resolve_model(f"{GGUF_REPO}:Q4_K_M", access=access(hub, tmp_path))
    assert "\n" not in str(e.value)


def test_an_unreachable_hub_is_a_download_error_unless_the_model_is_cached(hub, tmp_path):
    down = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(DownloadError, match=rf"^org/tiny-GGUF: not in the Hugging Face cache "
                                            rf"\(.*\) and cannot reach the Hub at {down} "):
        resolve_model(f"{GGUF_REPO}:Q8_0", access=access(down, tmp_path))
    with pytest.raises(DownloadError, match="offline mode is on"):
        resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True))
    path = resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path))
    assert resolve_model(f"{GGUF_REPO}:Q8_0", access=access(down, tmp_path)) == path


def test_a_download_that_breaks_off_resumes_where_it_stopped(tmp_path):
    """huggingface_hub writes what arrived in 10 MiB chunks, so the file must be larger for a
    break halfway to leave something to resume from."""
    data = random.Random(0).randbytes(24 << 20)
    with Hub({"org/big-GGUF": {"big-Q4_0.gguf": data}}, cut=frozenset({"big-Q4_0.gguf"})) as hub:
        (path,) = download(["org/big-GGUF:Q4_0"], access=access(hub, tmp_path))
        assert path.read_bytes() == data
        assert hub.downloads("big-Q4_0.gguf") == 2 and len(hub.resumed_at) == 1
        assert 0 < hub.resumed_at[0] <= len(data) // 2  # the second request asked for the rest


def test_download_takes_aliases_and_hub_ids_alike(hub, tmp_path):
    paths = download([f"{GGUF_REPO}:F32", HF_REPO], access=access(hub, tmp_path))
    assert [p.name for p in paths] == ["tiny-F32.gguf", paths[1].name] and paths[1].is_dir()


def test_the_command_line_downloads_generates_and_works_offline(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = run_cli("download", f"{GGUF_REPO}:Q8_0", cache=tmp_path / "ss", env=env)
    assert proc.returncode == 0, proc.err
    assert proc.out.strip().endswith("tiny-Q8_0.gguf")
    generate = ("generate", "--model", f"{GGUF_REPO}:Q8_0", "--prompt", "The quick brown",
                "--max-tokens", "4", "--ignore-eos", "--json", "--no-speculation",
                "--weights", "float32")  # dense: the quickest start
    proc = run_cli(*generate, cache=tmp_path / "ss", env={**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.err
    assert json.loads(proc.out.strip().splitlines()[-1])["num_output_tokens"] == 4
    assert hub.downloads("tiny-Q8_0.gguf") == 1
    proc = run_cli("download", f"{GGUF_REPO}:Q8_0", cache=tmp_path / "ss",
                   env={**env, "HF_ENDPOINT": f"http://127.0.0.1:{unused_port()}",
                        "HF_HUB_CACHE": str(tmp_path / "empty")})
    assert_one_line_error(proc, "download", 1, "cannot reach the Hub at http://127.0.0.1:")


def cached_files(cache: Path) -> list[str]:
    """Every file (and link) under a Hugging Face cache, relative to it."""
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")
                  if p.is_file() or p.is_symlink())


def test_a_same_size_corrupt_file_is_refused_by_its_sha256_and_not_kept(repos, tmp_path):
    good = repos[GGUF_REPO]["tiny-Q8_0.gguf"]
    bad = good[:-1] + bytes([good[-1] ^ 1])  # one bit off, the same size
    with Hub(repos, corrupt={"tiny-Q8_0.gguf": bad}) as hub:
        with pytest.raises(DownloadError, match=(
                rf"^org/tiny-GGUF: tiny-Q8_0\.gguf is corrupt \(sha256 {sha256(bad)}; the Hub "
                rf"says sha256 {sha256(good)}\); the bad copy was deleted")):
            resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path))
    assert not [f for f in cached_files(tmp_path / "hf-cache") if f.endswith((
        ".gguf", sha256(bad), sha256(good)))]  # neither the blob nor its link
    with Hub(repos) as hub:  # the next try downloads it afresh
        path = resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path))
        assert path.read_bytes() == good and hub.downloads("tiny-Q8_0.gguf") == 1


def test_a_resumed_download_is_verified_whole(tmp_path):
    data = random.Random(1).randbytes(24 << 20)
    bad = data[:-10] + bytes(10)  # the part sent after the break is wrong at its end
    with Hub({"org/big-GGUF": {"big-Q4_0.gguf": data}}, cut=frozenset({"big-Q4_0.gguf"}),
             corrupt={"big-Q4_0.gguf": bad}) as hub:
        with pytest.raises(DownloadError, match=r"big-Q4_0\.gguf is corrupt \(sha256 "):
            download(["org/big-GGUF:Q4_0"], access=access(hub, tmp_path))
        assert len(hub.resumed_at) == 1  # it did resume, then failed the check
    assert not [f for f in cached_files(tmp_path / "hf-cache") if "blobs/" in f]


def test_a_small_file_is_checked_by_its_git_blob_id(repos, tmp_path):
    config = repos[HF_REPO]["config.json"]
    with Hub(repos, corrupt={"config.json": config.replace(b"qwen2", b"qwen3")}) as hub:
        with pytest.raises(DownloadError, match=r"config\.json is corrupt \(git blob id [0-9a-f]{40}"
                                                r"; the Hub says git "):
            resolve_model(HF_REPO, access=access(hub, tmp_path))


def test_a_cached_file_damaged_on_disk_is_caught_offline_and_hashed_only_when_changed(
        hub, repos, tmp_path, monkeypatch):
    from specserve.hub import registry

    path = resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path))
    hashed = []
    real_hash = registry._hash_file
    monkeypatch.setattr(registry, "_hash_file", lambda *a: hashed.append(a[0]) or real_hash(*a))
    assert resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True)) == path
    assert hashed == []  # its stamp still matches: not hashed again
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(DownloadError, match=rf"is corrupt \(sha256 {sha256(bytes(data))}; the "
                                            rf"Hub says sha256 {blob.name}\)"):
        resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True))
    assert hashed == [blob] and not blob.exists() and not path.is_symlink()


def test_refs_main_is_used_offline_only_when_it_is_a_commit_id(hub, tmp_path):
    path = resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path))
    storage = next((tmp_path / "hf-cache").glob("models--org--tiny-GGUF"))
    outside = tmp_path / "elsewhere"
    (outside / "tiny-Q8_0.gguf").parent.mkdir()
    (outside / "tiny-Q8_0.gguf").write_bytes(b"not the model")
    (storage / "snapshots" / "x").symlink_to(outside)
    for text in ("../../../elsewhere", "x", "0" * 39, ""):
        (storage / "refs" / "main").write_text(text)
        with pytest.raises(DownloadError, match="not in the Hugging Face cache"):
            resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True))
    (storage / "refs" / "main").write_text(path.parent.name + "\n")
    assert resolve_model(f"{GGUF_REPO}:Q8_0", access=access(hub, tmp_path, offline=True)) == path
