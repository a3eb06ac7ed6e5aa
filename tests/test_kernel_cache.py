"""The CPU kernel cache is private: created owner-only, and a cached library that another user owns
or could have written is rebuilt, never loaded."""

from __future__ import annotations

import os
import stat

import pytest

from pdserve.kernels import cpu


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        cpu._compiler()
    except cpu.KernelUnavailable:
        pytest.skip("no C compiler")
    return tmp_path / "xdg" / "pdserve" / "kernels"


def test_cache_dir_is_owner_only_and_builds_are_reused(cache):
    lib = cpu._build("fused")
    assert lib.parent == cache and stat.S_IMODE(cache.stat().st_mode) == 0o700
    inode = lib.stat().st_ino
    assert cpu._build("fused") == lib and lib.stat().st_ino == inode  # trusted: loaded as built


def test_an_open_cache_dir_of_ours_is_tightened(cache):
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    cpu._build("fused")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.parametrize("tamper", ["group-writable", "other-owner", "symlink"])
def test_a_library_others_could_have_written_is_rebuilt(cache, tmp_path, tamper):
    lib = cpu._build("fused")
    if tamper == "group-writable":
        lib.chmod(0o664)
    elif tamper == "other-owner":
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(lib, 12345, 12345)
    else:
        planted = tmp_path / "planted.so"
        planted.write_bytes(lib.read_bytes())
        lib.unlink()
        lib.symlink_to(planted)
    assert not cpu._trusted(lib)
    rebuilt = cpu._build("fused")
    st = rebuilt.lstat()
    assert rebuilt == lib and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def test_a_cache_dir_of_another_user_is_refused(cache):
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    cache.mkdir(parents=True)
    os.chown(cache, 12345, 12345)
    with pytest.raises(cpu.KernelUnavailable, match="belongs to uid 12345"):
        cpu._build("fused")
