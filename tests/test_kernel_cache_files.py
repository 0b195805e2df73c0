"""Compiled kernels are loaded from the cache directory only when this user owns the file
and its directory and no one else may write them; otherwise a private copy is built and
loaded instead, so a library planted by another user never runs."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess

import pytest
from radixserve.kernels import cpu as cpu_kernels

GENUINE = "int rs_probe_value(void) { return 1; }\n"
PLANTED = "int rs_probe_value(void) { return 666; }\n"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    cc = cpu_kernels._compiler()
    if cc is None or os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        pytest.skip("no C compiler (or kernels disabled): nothing is built or loaded")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "probe.c"
    src.write_text(GENUINE)
    target = cpu_kernels.build_library(cc, "probe", [src])  # the cached library, as a first run leaves it
    planted_src = tmp_path / "planted.c"
    planted_src.write_text(PLANTED)
    planted = tmp_path / "planted.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(planted), str(planted_src)], check=True)
    return src, target, planted


def value_of(lib: ctypes.CDLL | None) -> int:
    assert lib is not None
    return lib.rs_probe_value()


def plant(target, planted, mode: int, owner: int | None = None) -> None:
    """``planted`` put in place of the cached ``target`` (a new file: never overwrite a
    library in place, a process may have it mapped)."""
    tmp = target.with_suffix(".planting")
    shutil.copyfile(planted, tmp)
    os.replace(tmp, target)
    os.chmod(target, mode)
    if owner is not None:
        os.chown(target, owner, owner)


def test_a_cached_library_of_this_user_is_loaded(cache):
    src, target, planted = cache
    plant(target, planted, 0o644)  # ours and safe: the cache is trusted (nothing rebuilt)
    assert value_of(cpu_kernels.load_library("probe", [src])) == 666


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646], ids=lambda m: f"{m:04o}")
def test_a_library_others_may_write_is_not_loaded(cache, mode, caplog):
    src, target, planted = cache
    plant(target, planted, mode)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.logger.name):
        assert value_of(cpu_kernels.load_library("probe", [src])) == 1  # a private rebuild
    assert "other users could change or read it" in caplog.text and "private copy" in caplog.text


def test_a_library_of_another_user_or_in_a_shared_directory_is_not_loaded(cache, caplog):
    src, target, planted = cache
    if os.geteuid() == 0:  # only root can plant a file as another user
        plant(target, planted, 0o644, owner=12345)
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.logger.name):
            assert value_of(cpu_kernels.load_library("probe", [src])) == 1
        assert "belongs to uid 12345" in caplog.text
    plant(target, planted, 0o644)
    os.chmod(target.parent, 0o777)  # anyone could have replaced the file
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.logger.name):
        assert value_of(cpu_kernels.load_library("probe", [src])) == 1
    assert f"{target.parent} has mode 0777" in caplog.text
