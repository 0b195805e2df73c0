"""NixlTransfer: the contract of radixserve.plugin_api.disaggregation over a NIXL agent.

Each engine is a NIXL agent with the UCX backend and NIXL's metadata listener on a free port
(``extra_config["port"]`` to choose it: rank ``r`` of a server takes that port + ``r``); its
address is ``<agent name>@<host>:<port>``.
``connect`` asks the peer's listener for its metadata (which carries its registered memory:
peers register before anyone connects) and waits for it within the timeout. A write is one
NIXL transfer request of the segments (``WRITE`` from local to the peer's memory), posted at
once and polled with ``check_xfer_state``; NIXL refuses descriptors outside the peer's
registered memory when the request is made, which fails the write before any byte moves.
"""

from __future__ import annotations

import gc
import socket
import time
import uuid
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

from radixserve_disagg_nixl import nixl_api

MEM = "DRAM"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NixlTransfer(TransferEngine):
    name = "nixl"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        api = nixl_api()
        self._port = ctx.listen_port() or _free_port(ctx.host)
        self._name = f"radixserve-{ctx.role}-{ctx.tp_rank}-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(enable_listen_thread=True, listen_port=self._port,
                                       backends=list(ctx.extra_config.get("backends", ["UCX"])))
        try:
            self._agent = api.nixl_agent(self._name, config)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            raise TransferError(f"nixl: cannot start an agent on port {self._port}: {e}") from e
        self._book = WriteBook(ctx.timeout, release=self._release)  # job: the NIXL transfer request
        self._peers: dict[str, str] = {}  # address -> remote agent name
        self._registered = []
        self._closed = False

    def address(self) -> str:
        return f"{self._name}@{self.ctx.host}:{self._port}"

    def register_regions(self, regions: Sequence[tuple[int, int]]) -> None:
        if regions:
            try:
                self._registered.append(self._agent.register_memory([(int(a), int(n), 0, "") for a, n in regions], MEM))
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"nixl: could not register {len(regions)} memory regions: {e}") from e

    def connect(self, peer: str) -> None:
        if peer in self._peers:
            return
        try:
            name, _, hostport = peer.partition("@")
            host, _, port = hostport.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=self.ctx.timeout):
                pass  # a dead address fails here, at once
            self._agent.fetch_remote_metadata(name, host, int(port))
        except (OSError, ValueError) as e:
            raise TransferError(f"nixl: peer {peer} unreachable: {e}") from e
        deadline = time.monotonic() + self.ctx.timeout
        while not self._agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise TransferError(f"nixl: no metadata from {peer} within {self.ctx.timeout:g} s")
            time.sleep(0.002)
        self._peers[peer] = name

    def submit_write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        if self._closed:
            raise TransferError("nixl: engine closed")
        src, dst, lengths = coalesce(src, dst, lengths)
        xfer, state = None, DONE
        if lengths:
            self.connect(peer)
            try:
                local = self._agent.get_xfer_descs([(s, n, 0) for s, n in zip(src, lengths)], MEM)
                remote = self._agent.get_xfer_descs([(d, n, 0) for d, n in zip(dst, lengths)], MEM)
                xfer = self._agent.initialize_xfer("WRITE", local, remote, self._peers[peer])
                posted = self._agent.transfer(xfer)
            except Exception:  # noqa: BLE001 - e.g. descriptors outside the peer's memory
                posted = "ERR"
            state = {"DONE": DONE, "PROC": PENDING}.get(posted, FAILED)
        return self._book.add(xfer, sum(lengths), state)

    def _release(self, xfer) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception:  # noqa: BLE001 - a request NIXL still works on stays with it
            pass

    def poll(self, handle: int) -> str:
        return self._book.poll(handle, self._state_of)

    def _state_of(self, xfer) -> str:
        now = self._agent.check_xfer_state(xfer) if not self._closed else "ERR"
        return {"DONE": DONE, "PROC": PENDING}.get(now, FAILED)

    def stats(self) -> dict[str, int | float]:
        return dict(self._book.counts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                pass
        self._registered = []
        del self._agent  # stops NIXL's listener and progress threads
        gc.collect()  # now, not whenever a cycle holding the native agent is collected
