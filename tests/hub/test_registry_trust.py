"""The registry's trust in its verification stamps: a stamp someone else could have written
(the stamp, or its folder, writable by group or others) vouches for nothing, so the file is
hashed again; the models folder is made writable by this user only, whatever the umask."""

from __future__ import annotations

import os

from specserve.hub import registry
from specserve.hub.registry import check_cached, download, models_dir
from tests.hub.test_registry import HashCounter, part_payloads, setup_fake


def test_a_stamp_others_could_write_is_ignored_and_the_file_hashed_again(tmp_path, monkeypatch):
    source, fetch, cache = setup_fake(tmp_path, part_payloads(3))
    (path,) = download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    stamp = path.with_name(path.name + ".verified")
    assert registry.verified_sha256(path) == source.sha256
    hashes = HashCounter(monkeypatch)
    os.chmod(stamp, 0o664)
    assert registry.verified_sha256(path) is None  # the weight cache's key is hashed anew too
    assert check_cached(source, cache) == path and hashes.calls == 1
    assert stamp.stat().st_mode & 0o022 == 0  # the new stamp is private again
    os.chmod(models_dir(cache), 0o777)
    try:
        assert check_cached(source, cache) == path and hashes.calls == 2
    finally:
        os.chmod(models_dir(cache), 0o755)
    assert check_cached(source, cache) == path and hashes.calls == 2


def test_the_models_folder_is_private_under_a_group_writable_umask(tmp_path):
    source, fetch, cache = setup_fake(tmp_path, part_payloads(2))
    old = os.umask(0o002)
    try:
        download(["fake-1b"], cache, progress=False, fetch=fetch, catalog=(source,))
    finally:
        os.umask(old)
    for made in (cache, models_dir(cache)):
        assert made.stat().st_mode & 0o022 == 0, made
