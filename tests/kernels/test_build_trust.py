"""`kernels.build` loads only a library this user owns and no one else can write: a library
with group or other write permission is rebuilt over, a kernel folder others may write to (or
one above it) is refused, and a fresh build is writable by its owner only whatever the umask.
`kernels.load_library` loads the file it checked: never through a link, never one that others
could write."""

from __future__ import annotations

import os

import pytest

from specserve import kernels
from specserve.paths import UntrustedPath

FLAGS = ["-O0", "-shared", "-fPIC"]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "one.c"
    path.write_text("int one(void) { return 1; }\n")
    return path


@pytest.mark.parametrize("bit", [0o020, 0o002], ids=["group-writable", "world-writable"])
def test_a_library_others_could_write_is_rebuilt(tmp_path, source, bit):
    out = tmp_path / "kernels"
    built = kernels.build(source, out, FLAGS)
    first = built.stat().st_ino
    assert kernels.build(source, out, FLAGS).stat().st_ino == first  # trusted: reused
    os.chmod(built, built.stat().st_mode | bit)
    rebuilt = kernels.build(source, out, FLAGS)
    assert rebuilt == built and rebuilt.stat().st_ino != first
    assert rebuilt.stat().st_mode & 0o777 == 0o755


def test_a_fresh_build_is_not_group_writable_under_a_loose_umask(tmp_path, source):
    old = os.umask(0o002)
    try:
        built = kernels.build(source, tmp_path / "kernels", FLAGS)
    finally:
        os.umask(old)
    assert built.stat().st_mode & 0o022 == 0


def test_a_kernel_folder_others_may_write_is_refused(tmp_path, source):
    out = tmp_path / "kernels"
    out.mkdir()
    os.chmod(out, 0o777)
    with pytest.raises(RuntimeError, match=r"kernel folder.* is writable by its group and others"):
        kernels.build(source, out, FLAGS)


def test_a_library_under_a_group_writable_folder_above_is_not_built_nor_loaded(tmp_path, source):
    above = tmp_path / "common"
    out = above / "cache" / "kernels"
    built = kernels.build(source, out, FLAGS)  # trusted while nothing above is loose
    assert kernels.load_library(built).one() == 1
    os.chmod(above, 0o775)  # a group member could now swap "cache" for a folder of theirs
    with pytest.raises(RuntimeError, match=r"common \(above it\) is writable by others"):
        kernels.build(source, out, FLAGS)
    os.chmod(above, 0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    assert kernels.build(source, out, FLAGS) == built


def test_a_library_is_loaded_from_the_checked_descriptor_never_through_a_link(tmp_path, source):
    built = kernels.build(source, tmp_path / "kernels", FLAGS)
    link = tmp_path / "link.so"
    link.symlink_to(built)
    with pytest.raises(OSError):
        kernels.load_library(link)
    os.chmod(built, 0o775)
    with pytest.raises(UntrustedPath, match="writable by its group"):
        kernels.load_library(built)
