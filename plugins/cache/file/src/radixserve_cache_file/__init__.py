"""radixserve HiCache storage tier ``file`` (HiCache-SSD): KV pages as files in a directory.

``--hicache-storage-backend file --hicache-storage-dir PATH [--hicache-storage-size BYTES]``
(or ``storage_dir`` / ``storage_size`` in ``--hicache-storage-backend-extra-config``).
Pages survive a restart, several servers may share one directory, and with a size bound
the least recently used pages are dropped first. See :mod:`radixserve_cache_file.store`
for the layout and the invariants.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

from radixserve_cache_file.store import FileTier, parse_size

__all__ = ["FileTier", "parse_size"]


@hookimpl
def register_cache_tiers(register):
    register("file", FileTier.from_context,
             description="HiCache-SSD: KV pages as files under --hicache-storage-dir, LRU-bounded by "
                         "--hicache-storage-size")
