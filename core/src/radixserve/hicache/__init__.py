"""HiCache: the KV cache tiers below the device pool, and the storage-tier contract.

The device pool holds the K/V that attention reads. With ``--enable-hierarchical-cache``
the prefix cache (:class:`radixserve.hicache.hiradix_cache.HiRadixCache`) keeps a second
copy of cached pages in a host-memory pool (pinned on CUDA, plain RAM on CPU): evicting a
page from the device demotes it to the host instead of dropping it, and a later request
whose prefix is on the host loads it back before it runs. Below the host sits at most one
*storage tier*, a plugin registered through ``register_cache_tiers`` and chosen with
``--hicache-storage-backend NAME``: a store of whole pages keyed by content, which
survives restarts and may be shared by several servers.

A storage tier's factory::

    factory(ctx: CacheTierContext) -> CacheTier

A :class:`CacheTier` stores opaque byte strings under string keys, page by page
(``batch_exists`` / ``batch_get`` / ``batch_set``). The core does everything else: it
computes the keys (:func:`page_keys`: a hash chained over the token ids of the prefix up
to and including the page, salted with :func:`model_key`, so equal prefixes of the same
model share keys and a different model never does), frames each page with a header and a
keyed MAC (:func:`encode_page`) and verifies what comes back (:func:`decode_page`), so a
corrupted, truncated, misplaced, foreign or forged value is detected and recomputed in the
core, whatever the tier. The MAC (blake2b keyed with the storage secret,
:mod:`radixserve.hicache.secret`) covers the header (model key, page key, length) and the
payload: whoever can write the tier but does not hold the secret cannot make a page the
core accepts. Tier methods run on the core's storage worker thread, never on the
scheduler's; an exception from one counts as a miss (reads) or a failed write and is
logged, so a tier that breaks degrades the engine to recomputation, never to an error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only in annotations: a cache-tier plugin's module imports this without torch
    import torch

    from radixserve.config import ServerArgs

__all__ = ["CacheTier", "CacheTierContext", "PageFormatError", "decode_page", "encode_page", "model_key",
           "mac_key", "files_fingerprint", "page_keys", "rank_key", "rank_tag"]

MAGIC = b"RXKV"
FORMAT_VERSION = 2  # 2: a keyed MAC over header and payload (1: an unkeyed checksum of the payload)
# magic, version, model key (32 bytes), page key (32 bytes), payload length, MAC (32 bytes)
_HEADER = struct.Struct("<4sH32s32sQ32s")
_MAC_BYTES = 32
_SIGNED = struct.Struct("<4sH32s32sQ")  # the header's fields the MAC covers, before the payload
HEADER_BYTES = _HEADER.size
MAC_KEY_BYTES = 32


@dataclass(frozen=True)
class CacheTierContext:
    """What a storage tier's factory receives."""

    args: ServerArgs  # hicache_storage_dir, hicache_storage_size, hicache_storage_url, ...
    extra_config: dict[str, Any]  # --hicache-storage-backend-extra-config, parsed (JSON object)
    model_key: str  # hex: the model's identity (:func:`model_key`); every page key is salted with it
    page_size: int  # tokens per page
    page_bytes: int  # bytes of one stored value (header + K/V of every layer)
    options: Any = None  # the options the tier declares (radixserve.options); None: it declares none


class CacheTier(ABC):
    """A store of whole KV pages by content key. Keys are lower-case hex strings (64
    characters); values are ``bytes`` of ``ctx.page_bytes`` (the core's framed pages).

    Thread safety: the core calls a tier from one worker thread at a time. Failures may
    raise (the core logs them and recomputes); a read must never return a value that was
    only partly written (write atomically or detect it)."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored (stop at the first missing)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key, ``None`` where it is not stored (or unreadable)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store ``values[i]`` under ``keys[i]``; per key whether it is stored now. A
        size-bounded tier makes room by dropping its least recently used values."""

    def clear(self) -> None:  # noqa: B027 - optional
        """Drop every value this tier holds for any model (tests, ``flush_cache`` does not)."""

    def stats(self) -> dict[str, int | float]:
        """Numbers for ``get_stats()`` (e.g. ``bytes``, ``num_pages``), prefixed by the core."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        """Release files, sockets and threads (engine shutdown)."""


class PageFormatError(ValueError):
    """A stored value is not a valid page for the asked key (the message says why)."""


@dataclass
class TierCounters:
    """Per-tier numbers the core keeps (``get_stats()``, ``/metrics``)."""

    hit_tokens: int = 0  # prompt tokens served from this tier
    hit_pages: int = 0
    load_bytes: int = 0  # bytes read from this tier into the one above
    load_seconds: float = 0.0  # total time of those loads
    num_loads: int = 0
    store_bytes: int = 0  # bytes written to this tier
    store_pages: int = 0
    errors: int = 0  # failed, corrupted or refused operations
    extra: dict[str, float] = field(default_factory=dict)


def files_fingerprint(paths: Sequence[str], chunks: int = 64, chunk_bytes: int = 4096) -> str:
    """A hex digest of a checkpoint's files: each file's name and size and ``chunks``
    blocks of ``chunk_bytes`` spread evenly over it (any fine-tune or re-quantisation
    changes them; hashing every byte of a large model would cost seconds at start-up)."""
    h = hashlib.sha256()
    for path in sorted(paths):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}|{size}".encode())
        with open(path, "rb") as f:
            step = max(1, (size - chunk_bytes) // max(1, chunks - 1))
            for i in range(chunks):
                off = min(i * step, max(0, size - chunk_bytes))
                f.seek(off)
                h.update(f.read(chunk_bytes))
    return h.hexdigest()


def model_key(fingerprint: str, *, dtype: torch.dtype, page_size: int, num_layers: int, num_kv_heads: int,
              head_dim: int, extra: str = "") -> str:
    """The salt of every page key: what makes two servers' K/V interchangeable."""
    text = (f"radixserve-kv/{FORMAT_VERSION}|{fingerprint}|{dtype}|page={page_size}|layers={num_layers}|"
            f"kv_heads={num_kv_heads}|head_dim={head_dim}|{extra}")
    return hashlib.sha256(text.encode()).hexdigest()


def page_keys(salt: str, token_ids: Sequence[int], page_size: int, prev: str | None = None) -> list[str]:
    """One key per whole page of ``token_ids``: ``key[i] = sha256(key[i-1] + ids of page i)``
    with ``key[-1] = prev or salt``. Pass the key of the page before ``token_ids[0]`` as
    ``prev`` to continue a chain."""
    out = []
    last = bytes.fromhex(prev or salt)
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        h = hashlib.sha256(last)
        h.update(struct.pack(f"<{page_size}q", *token_ids[start:start + page_size]))
        last = h.digest()
        out.append(last.hex())
    return out


def rank_tag(rank: int, tp_size: int, pp_size: int = 1) -> str:
    """What sets one rank's stored pages apart with tensor or pipeline parallelism (each rank
    holds its own KV heads and layers); empty on one rank, whose keys stay what they always were."""
    if pp_size > 1:
        return f"tp={tp_size}|pp={pp_size}|rank={rank}"
    return f"tp={tp_size}|rank={rank}" if tp_size > 1 else ""


def rank_key(key: str, tag: str) -> str:
    """The key the rank of ``tag`` stores a page under, from rank 0's content key."""
    return hashlib.sha256(bytes.fromhex(key) + tag.encode()).hexdigest() if tag else key


def mac_key(secret: bytes) -> bytes:
    """The MAC key derived from a storage secret of any length (the secret is never used raw)."""
    return hashlib.blake2b(secret, digest_size=MAC_KEY_BYTES, person=b"radixserve-kv").digest()


def _mac(key: bytes, head: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(head, digest_size=_MAC_BYTES, key=key)
    h.update(payload)
    return h.digest()


def encode_page(salt: str, key: str, payload: bytes | memoryview, *, mac: bytes) -> bytes:
    """``payload`` (one page's K/V bytes) framed for storage under ``key``, authenticated
    with the MAC key ``mac`` (:func:`mac_key`)."""
    signed = _SIGNED.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(salt), bytes.fromhex(key), len(payload))
    return signed + _mac(mac, signed, payload) + bytes(payload)


def decode_page(salt: str, key: str, value: bytes | memoryview | None, payload_bytes: int, *,
                mac: bytes) -> memoryview:
    """The payload of ``value`` stored under ``key``; raises :class:`PageFormatError` when
    it is truncated, corrupted, another model's or another key's, or was not written with
    the MAC key ``mac`` (forged, or written under another storage secret)."""
    if value is None:
        raise PageFormatError("missing")
    view = memoryview(value)
    if len(view) < HEADER_BYTES:
        raise PageFormatError(f"truncated: {len(view)} bytes, shorter than the header")
    magic, version, vsalt, vkey, length, digest = _HEADER.unpack(view[:HEADER_BYTES])
    if magic != MAGIC or version != FORMAT_VERSION:
        raise PageFormatError("not a radixserve KV page (bad magic or version)")
    if vsalt.hex() != salt:
        raise PageFormatError("written by another model or KV layout (model key differs)")
    if vkey.hex() != key:
        raise PageFormatError("stored under another key")
    if length != payload_bytes:
        raise PageFormatError(f"payload of {length} bytes, expected {payload_bytes}")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise PageFormatError(f"truncated: {len(payload)} of {length} payload bytes")
    if not hmac.compare_digest(_mac(mac, view[:_SIGNED.size], payload), digest):
        raise PageFormatError("MAC mismatch (corrupted, forged, or written under another storage secret)")
    return payload
