"""MooncakeTransfer: the contract of radixserve.plugin_api.disaggregation over Mooncake.

Mooncake writes straight into the peer's registered memory (a one-sided write over RDMA; over
TCP its server side checks that every write lies inside a registered buffer and rejects it
otherwise). ``batch_transfer_sync_write`` releases the GIL while it runs, so each write runs
on a worker thread and ``poll`` reads its future; a write still running at the context's
timeout is reported FAILED (the core then never uses those pages: see docs/plugins.md).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Sequence

from radixserve.plugin_api.disaggregation import (
    DONE,
    FAILED,
    PENDING,
    TransferContext,
    TransferEngine,
    TransferError,
    WriteBook,
    coalesce,
)

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every segment it opens at INFO


class MooncakeTransfer(TransferEngine):
    name = "mooncake"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        from mooncake.engine import TransferEngine as MooncakeEngine

        extra = ctx.extra_config
        protocol = extra.get("protocol") or ("rdma" if ctx.ib_device else "tcp")
        self._engine = MooncakeEngine()
        ret = self._engine.initialize(ctx.host, extra.get("metadata_server", "P2PHANDSHAKE"), protocol,
                                      ctx.ib_device or "")
        if ret != 0:
            raise TransferError(f"mooncake: initialize({ctx.host!r}, {protocol!r}, device {ctx.ib_device!r}) "
                                f"failed ({ret})")
        self._address = f"{ctx.host}:{self._engine.get_rpc_port()}"
        self._pool = concurrent.futures.ThreadPoolExecutor(int(extra.get("workers", 2)),
                                                           thread_name_prefix="mooncake-transfer")
        self._book = WriteBook(ctx.timeout)  # job: the write's future
        self._registered: list[int] = []
        self._connected: set[str] = set()
        self._closed = False

    def address(self) -> str:
        return self._address

    def register_regions(self, regions: Sequence[tuple[int, int]]) -> None:
        addrs = [int(a) for a, _ in regions]
        sizes = [int(n) for _, n in regions]
        if addrs and self._engine.batch_register_memory(addrs, sizes) != 0:
            raise TransferError(f"mooncake: could not register {len(addrs)} memory regions ({sum(sizes)} bytes)")
        self._registered += addrs

    def connect(self, peer: str) -> None:
        """Mooncake opens a peer's segment on the first write; this checks that its handshake
        port answers, so an unreachable peer fails here within the timeout."""
        if peer in self._connected:
            return
        host, _, port = peer.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.ctx.timeout):
                pass
        except (OSError, ValueError) as e:
            raise TransferError(f"mooncake: peer {peer} unreachable: {e}") from e
        self._connected.add(peer)

    def submit_write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        if self._closed:
            raise TransferError("mooncake: engine closed")
        src, dst, lengths = coalesce(src, dst, lengths)
        if not lengths:
            return self._book.add(None, 0, DONE)
        return self._book.add(self._pool.submit(self._write, peer, src, dst, lengths), sum(lengths))

    def _write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> bool:
        self.connect(peer)
        return self._engine.batch_transfer_sync_write(peer, src, dst, lengths) == 0

    def poll(self, handle: int) -> str:
        return self._book.poll(handle, self._state_of)

    def _state_of(self, future: concurrent.futures.Future) -> str:
        if future.done():
            return DONE if future.exception() is None and future.result() and not self._closed else FAILED
        return FAILED if self._closed else PENDING

    def stats(self) -> dict[str, int | float]:
        return dict(self._book.counts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
