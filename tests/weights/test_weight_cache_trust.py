"""The weight cache's trust in what it reads: an entry someone else could have written is a
miss and is rebuilt, a folder someone else could write (or one above it) is not used, and a
cache made under a group-writable umask is trusted (its folders are made writable by this user
only). Never a crash: every load gets its weights."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.paths import untrusted
from specserve.weights.loader import load_model
from tests.weights.test_weight_cache import entries, logits, write_gguf


@pytest.mark.parametrize("bit", [0o020, 0o002], ids=["group-writable", "world-writable"])
def test_an_entry_others_could_have_written_is_a_miss_and_rebuilt(tmp_path, cache, repacks, bit):
    path = write_gguf(tmp_path)
    reference = logits(load_model(path, weights="int4"))
    (entry,) = entries(cache)
    os.chmod(entry, entry.stat().st_mode | bit)
    repacks.clear()
    rebuilt = load_model(path, weights="int4")
    assert not rebuilt.cache_hit and repacks and torch.equal(logits(rebuilt), reference)
    (again,) = entries(cache)
    assert untrusted(again) is None and load_model(path, weights="int4").cache_hit


@pytest.mark.parametrize("where", ["folder", "folder above"])
def test_a_cache_folder_others_could_write_is_not_used(tmp_path, cache, repacks, where):
    path = write_gguf(tmp_path)
    reference = logits(load_model(path, weights="int4"))
    loose = cache if where == "folder" else cache.parent
    mode = loose.stat().st_mode & 0o777
    os.chmod(loose, mode | 0o020)
    try:
        counts = []
        for _ in range(2):  # neither read nor written: every load repacks, none fails
            repacks.clear()
            loaded = load_model(path, weights="int4")
            assert not loaded.cache_hit and torch.equal(logits(loaded), reference)
            counts.append(len(repacks))
        assert counts[0] == counts[1] > 0
    finally:
        os.chmod(loose, mode)
    assert load_model(path, weights="int4").cache_hit  # trusted again: the entry is still there


def test_an_entry_owned_by_another_user_is_a_miss(tmp_path, cache):
    path = write_gguf(tmp_path)
    load_model(path, weights="int4")
    (entry,) = entries(cache)
    other = os.getuid() + 4242
    if os.getuid() == 0:  # root can hand the file to another user; others test the mode above
        os.chown(entry, other, -1)
        assert untrusted(entry) == f"owned by user id {other}, not by this user (0)"
        assert not load_model(path, weights="int4").cache_hit
        (again,) = entries(cache)
        assert again.stat().st_uid == 0
    else:
        assert untrusted(entry) is None


def test_a_cache_made_under_a_group_writable_umask_loads_twice(tmp_path, cache):
    path = write_gguf(tmp_path)
    old = os.umask(0o002)
    try:
        first = load_model(path, weights="int4")
        second = load_model(path, weights="int4")
    finally:
        os.umask(old)
    assert not first.cache_hit and second.cache_hit
    assert torch.equal(logits(first), logits(second))
    for made in (cache.parent, cache, cache / "stamps", *entries(cache)):
        assert made.stat().st_mode & 0o022 == 0, made
