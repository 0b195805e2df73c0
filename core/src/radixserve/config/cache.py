"""Engine flags: the paged KV pool, the radix cache and HiCache's tiers."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag, json_object
from radixserve.flags import ConfigError, flag_of

HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
HICACHE_IO_BACKENDS = ("kernel", "direct")
HICACHE_PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")


@dataclass
class CacheArgs(Checks):
    page_size: int = flag(1, "tokens per KV cache page")
    max_total_tokens: int | None = flag(None, "KV pool size in tokens (default: from --mem-fraction-static)")
    mem_fraction_static: float | None = flag(
        None,
        "GPU: fraction of the device's memory for the weights and the KV pool (default 0.88); CPU: fraction of "
        "the memory available after loading the weights (MemAvailable, or a closer cgroup limit) for the KV "
        "pool (default 0.15)",
    )
    disable_radix_cache: bool = flag(False, "do not reuse cached prefixes")
    enable_hierarchical_cache: bool = flag(
        False,
        "HiCache: keep evicted KV pages in a host-memory tier (and a storage tier below it) instead "
        "of dropping them",
    )
    disable_hicache_first_token_preemption: bool = flag(
        False,
        "with HiCache, a request still waiting for its first token does not pause decoding requests "
        "(whose pages the host tier keeps) to get a slot and KV pages",
    )
    hicache_ratio: float = flag(
        2.0,
        "host KV pool size as a multiple of the device pool (ignored when --hicache-size is set)",
    )
    hicache_size: float = flag(0.0, "host KV pool size in GB (0: from --hicache-ratio)")
    hicache_write_policy: str = flag(
        "write_through",
        "when cached pages are copied to the host: at once (write_through), when evicted from the "
        "device (write_back), or once reused (write_through_selective)",
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_io_backend: str = flag(
        "kernel",
        "device<->host copies: one fused copy over all layers (kernel) or a copy per layer (direct)",
        choices=HICACHE_IO_BACKENDS,
    )
    hicache_storage_backend: str | None = flag(
        None,
        "KV cache tier below host memory (see `radixserve plugins`: file, redis, ...)",
    )
    hicache_storage_dir: str | None = flag(
        None,
        "directory of the file storage tier (also storage_dir in "
        "--hicache-storage-backend-extra-config)",
    )
    hicache_storage_size: int | None = flag(
        None,
        "most bytes the storage tier keeps, least recently used dropped first (also storage_size in "
        "the extra config)",
    )
    hicache_storage_url: str | None = flag(
        None,
        "server of a remote storage tier, e.g. redis://HOST:PORT/DB (also url in the extra config)",
    )
    hicache_storage_backend_extra_config: str | None = flag(
        None,
        "JSON object of storage-tier options (storage_dir, storage_size, url, prefetch_timeout_base, "
        "prefetch_timeout_per_ki_token, ...)",
    )
    hicache_storage_secret: str | None = flag(
        None,
        "key of the MAC that authenticates every stored KV page (servers sharing a tier share it); "
        "visible in ps: prefer --hicache-storage-secret-file or RADIXSERVE_HICACHE_STORAGE_SECRET "
        "(default: generated once and kept with mode 0600 in the storage dir, or in the cache dir)",
        secret=True,
    )
    hicache_storage_secret_file: str | None = flag(
        None,
        "file holding --hicache-storage-secret (mode 0600, this user's or root's)",
    )
    hicache_storage_shutdown_timeout: float = flag(
        5.0,
        "seconds a shutdown waits for queued storage-tier writes to finish (the rest are dropped); "
        "keep it below the supervisor's grace period before SIGKILL",
    )
    hicache_storage_prefetch_policy: str = flag(
        "auto",
        "how long a queued request waits for its prefix to arrive from storage: as long as loading it"
        " is estimated cheaper than recomputing it, from the measured storage read rate and prefill "
        "rate (auto), not at all (best_effort), until it has (wait_complete), or up to a timeout "
        "(timeout)",
        choices=HICACHE_PREFETCH_POLICIES,
    )

    def check_cache(self) -> None:
        self._check_int("page_size", minimum=1)
        self._check_int("max_total_tokens", minimum=1, optional=True)
        frac = self.mem_fraction_static
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                                 or not 0.0 < frac < 1.0):
            raise ConfigError(f"--mem-fraction-static must be a number in (0, 1), got {frac!r}")
        for name in ("hicache_ratio", "hicache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ConfigError(f"{flag_of(name)} must be a number >= 0.0, got {value!r}")
        if self.enable_hierarchical_cache and self.hicache_size == 0 and self.hicache_ratio <= 0:
            raise ConfigError("--hicache-ratio must be > 0 (or give --hicache-size)")
        self._check_int("hicache_storage_size", minimum=1, optional=True)
        self._check_name("hicache_storage_backend", "a backend name")
        self._check_name("hicache_storage_secret", "a non-empty secret")
        self._check_name("hicache_storage_secret_file", "a file path")
        if self.hicache_storage_secret and self.hicache_storage_secret_file:
            raise ConfigError("give --hicache-storage-secret or --hicache-storage-secret-file, not both")
        self._check_seconds("hicache_storage_shutdown_timeout")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache (storage sits below "
                              "the host tier)")
        self.hicache_extra_config()  # validates the JSON

    def hicache_extra_config(self) -> dict:
        """``--hicache-storage-backend-extra-config`` as a dict; the dedicated flags
        (``--hicache-storage-dir``, ``--hicache-storage-size``, ``--hicache-storage-url``)
        win over the same keys in it."""
        raw = self.hicache_storage_backend_extra_config
        out = json_object(raw, "--hicache-storage-backend-extra-config") if raw else {}
        for name, key in (("hicache_storage_dir", "storage_dir"), ("hicache_storage_size", "storage_size"),
                          ("hicache_storage_url", "url")):
            if getattr(self, name) is not None:
                out[key] = getattr(self, name)
        return out
