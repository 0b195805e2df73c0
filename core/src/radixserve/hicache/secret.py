"""The storage secret: the key of the MAC that authenticates every page a storage tier
holds (:func:`radixserve.hicache.encode_page`).

Where it comes from, first found wins:

1. ``--hicache-storage-secret VALUE`` (visible in ``ps``: prefer the next two);
2. ``--hicache-storage-secret-file PATH``: the file's content, white space trimmed; the file
   must not be readable or writable by group or others, and belong to this user or root;
3. the environment variable ``RADIXSERVE_HICACHE_STORAGE_SECRET``;
4. generated on first use and kept, mode 0600, in ``<storage_dir>/.radixserve-storage-secret``
   for a tier with a directory (the file tier: every server of this user sharing the
   directory shares it), else in ``<cache dir>/hicache-storage-secret`` (``$RADIXSERVE_CACHE_DIR``,
   default ``~/.cache/radixserve``; servers on other hosts sharing e.g. a Redis must be given
   the same secret by 1-3). A kept secret another user owns, or that group or others may
   read, is refused at start-up (pages survive restarts because the secret does).
"""

from __future__ import annotations

import logging
import os
import stat

from radixserve.flags import ConfigError
from radixserve.private_files import UnsafeFileError, cache_root, read_or_create_secret, read_secret

logger = logging.getLogger(__name__)

ENV_SECRET = "RADIXSERVE_HICACHE_STORAGE_SECRET"
DIR_SECRET_NAME = ".radixserve-storage-secret"
CACHE_SECRET_NAME = "hicache-storage-secret"


def storage_secret(args, extra: dict) -> bytes:
    """The storage secret for ``args`` (flags) and ``extra`` (the tier's extra config)."""
    if args.hicache_storage_secret:
        return args.hicache_storage_secret.encode()
    if args.hicache_storage_secret_file:
        return _given_file(args.hicache_storage_secret_file)
    if os.environ.get(ENV_SECRET, "").strip():
        return os.environ[ENV_SECRET].strip().encode()
    directory = extra.get("storage_dir")
    path = os.path.join(directory, DIR_SECRET_NAME) if directory else os.path.join(cache_root(), CACHE_SECRET_NAME)
    try:
        secret = read_or_create_secret(path, "HiCache storage secret")
    except (UnsafeFileError, OSError) as e:
        raise ConfigError(f"{e}; or give the secret with --hicache-storage-secret-file or {ENV_SECRET}") from None
    logger.info("HiCache: storage pages authenticated with the secret kept in %s%s", path,
                "" if directory else " (servers on other hosts sharing the tier need it too: "
                "--hicache-storage-secret-file)")
    return secret


def _given_file(path: str) -> bytes:
    flag = "--hicache-storage-secret-file"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror}") from None
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{flag} {path}: belongs to uid {st.st_uid}, neither this user nor root")
    if st.st_mode & 0o077:
        raise ConfigError(f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read or "
                          f"write it; chmod 600 {path}")
    try:
        return read_secret(path, flag)
    except UnsafeFileError as e:
        raise ConfigError(str(e)) from None
