"""Files only this user may change (or read): secrets and compiled kernels kept on disk.

A file the engine trusts (a secret it signs with, a shared library it loads) must belong to
the user the engine runs as and must not be writable (for a secret: readable) by anyone
else, and the same holds for the directory it lies in, since whoever may write a directory
may replace the files in it. :func:`check_private` says what is wrong; :func:`read_or_create_secret`
keeps a generated secret with mode 0600.
"""

from __future__ import annotations

import os
import stat
import tempfile

GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
GROUP_OTHER_ANY = 0o077


class UnsafeFileError(PermissionError):
    """A file (or its directory) that another user could have written or read."""


def cache_root() -> str:
    """radixserve's per-user cache directory: ``$RADIXSERVE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/radixserve`` (``~/.cache/radixserve``)."""
    return os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixserve")


def unsafe_reason(path: str, forbidden: int) -> str | None:
    """Why ``path`` cannot be trusted (not ours, a link, or has a ``forbidden`` mode bit), or
    None when it can."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & forbidden:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}; other users could change or read it"
    return None


def check_private(path: str, what: str, *, forbidden: int = GROUP_OTHER_WRITE, hint: str = "") -> None:
    """Raise :class:`UnsafeFileError` naming ``what`` unless ``path`` and its directory are
    this user's and have none of the ``forbidden`` mode bits (the directory: no group/other
    write; sticky directories such as /tmp are not trusted either)."""
    problem = unsafe_reason(path, forbidden)
    where = path
    if problem is None:
        where = os.path.dirname(os.path.abspath(path))
        problem = unsafe_reason(where, GROUP_OTHER_WRITE)
    if problem is not None:
        raise UnsafeFileError(f"{what}: {where} {problem}" + (f"; {hint}" if hint else ""))


def read_or_create_secret(path: str, what: str, nbytes: int = 32) -> bytes:
    """The secret kept in ``path`` (this user's, mode 0600 in a directory only this user may
    write), created with ``nbytes`` random bytes when absent (atomically: processes starting
    together agree on one). Raises :class:`UnsafeFileError` for a file others could read or
    have written."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=directory)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(nbytes).hex().encode())
            os.link(tmp, path)  # fails if another process made it first: theirs is kept
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    hint = f"fix it with chmod 600 {path} (and chmod go-w on its directory), or remove it to have a new one made"
    check_private(path, what, forbidden=GROUP_OTHER_ANY, hint=hint)
    return read_secret(path, what)


def read_secret(path: str, what: str) -> bytes:
    """The secret in ``path`` (surrounding white space dropped); a clear error when it is
    missing or empty."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise UnsafeFileError(f"{what}: cannot read {path} ({e.strerror})") from None
    if not secret:
        raise UnsafeFileError(f"{what}: {path} is empty")
    return secret
