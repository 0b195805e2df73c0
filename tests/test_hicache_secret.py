"""The storage secret (radixserve.hicache.secret): where it comes from, that a generated
one is kept private and reused, and that a secret file others could read or write is
refused with an error naming the fix."""

from __future__ import annotations

import os
import stat

import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.hicache.secret import DIR_SECRET_NAME, ENV_SECRET, storage_secret


def args(**kw) -> ServerArgs:
    return ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file", **kw)


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_generated_secret_is_kept_private_beside_the_pages_and_reused(tmp_path):
    store = tmp_path / "store"
    first = storage_secret(args(), {"storage_dir": str(store)})
    path = store / DIR_SECRET_NAME
    assert len(first) == 64 and path.read_bytes() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()
    assert storage_secret(args(), {"storage_dir": str(store)}) == first  # a restart: same secret
    other = storage_secret(args(), {"storage_dir": str(tmp_path / "elsewhere")})
    assert other != first


def test_without_a_directory_the_secret_is_kept_in_the_cache_dir(tmp_path):
    secret = storage_secret(args(), {"url": "redis://127.0.0.1:1/0"})
    path = tmp_path / "cache" / "hicache-storage-secret"
    assert path.read_bytes() == secret and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert storage_secret(args(), {}) == secret


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620], ids=lambda m: f"{m:04o}")
def test_a_kept_secret_others_may_read_or_write_is_refused(tmp_path, mode):
    store = tmp_path / "store"
    storage_secret(args(), {"storage_dir": str(store)})
    os.chmod(store / DIR_SECRET_NAME, mode)
    with pytest.raises(ConfigError, match=f"mode 0{mode:o}.*chmod 600"):
        storage_secret(args(), {"storage_dir": str(store)})


def test_a_kept_secret_of_another_user_or_in_a_shared_directory_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    planted = store / DIR_SECRET_NAME
    planted.write_bytes(b"chosen by someone else")
    os.chmod(planted, 0o600)
    if os.geteuid() == 0:  # root can plant a file as another user
        os.chown(planted, 12345, 12345)
        with pytest.raises(ConfigError, match="belongs to uid 12345"):
            storage_secret(args(), {"storage_dir": str(store)})
        os.chown(planted, 0, 0)
    os.chmod(store, 0o777)  # anyone could have replaced it
    with pytest.raises(ConfigError, match="--hicache-storage-secret-file"):
        storage_secret(args(), {"storage_dir": str(store)})


def test_a_given_secret_wins_flag_then_file_then_environment(tmp_path, monkeypatch):
    store = {"storage_dir": str(tmp_path / "store")}
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"  from-the-file\n")
    os.chmod(secret_file, 0o600)
    monkeypatch.setenv(ENV_SECRET, "from-the-env")
    assert storage_secret(args(hicache_storage_secret="from-the-flag"), store) == b"from-the-flag"
    assert storage_secret(args(hicache_storage_secret_file=str(secret_file)), store) == b"from-the-file"
    assert storage_secret(args(), store) == b"from-the-env"
    assert not (tmp_path / "store").exists()  # nothing generated


def test_bad_secret_flags_name_the_flag(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"s")
    os.chmod(secret_file, 0o644)
    with pytest.raises(ConfigError, match="--hicache-storage-secret-file .*mode 0644"):
        storage_secret(args(hicache_storage_secret_file=str(secret_file)), {})
    with pytest.raises(ConfigError, match="--hicache-storage-secret-file .*No such file"):
        storage_secret(args(hicache_storage_secret_file=str(tmp_path / "missing")), {})
    with pytest.raises(ConfigError, match="not both"):
        args(hicache_storage_secret="a", hicache_storage_secret_file=str(secret_file))
    with pytest.raises(ConfigError, match="--hicache-storage-secret"):
        args(hicache_storage_secret="")
    with pytest.raises(ConfigError, match="--hicache-storage-shutdown-timeout"):
        args(hicache_storage_shutdown_timeout=0)
