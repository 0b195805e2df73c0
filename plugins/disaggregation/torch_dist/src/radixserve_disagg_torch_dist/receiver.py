"""The receiving side of ``torch_dist``: a TCPStore server that senders rendezvous at, a
thread that accepts new pairs from the store's ``pairs`` queue, and one thread per pair that
serves its writes (see :mod:`.engine` for the protocol).

Every blocking call a receiver thread makes is either bounded by the context's timeout (the
gloo operations of a write a sender has announced) or a store queue pop that :meth:`close`
wakes by pushing :data:`~.common.CLOSE`; so closing never waits on a peer for long.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist
from radixserve.plugin_api.disaggregation import TransferContext, TransferError

from radixserve_disagg_torch_dist.common import (
    BYE,
    CLOSE,
    FOREVER,
    MAX_SEGMENTS,
    PAIRS_QUEUE,
    TAG_ACK,
    TAG_HEADER,
    TAG_PAYLOAD,
    TAG_VERDICT,
    Regions,
    Staging,
    hedged,
    new_group,
    seconds,
    view,
    wait,
)

logger = logging.getLogger(__name__)


class ProtocolError(Exception):
    """A sender broke the protocol: the pair is dropped."""


class Receiver:
    """Accepts pairs and lands their writes in ``regions``."""

    def __init__(self, ctx: TransferContext, regions: Regions) -> None:
        self.ctx = ctx
        self.regions = regions
        self.bytes_received = 0
        self.writes_received = 0
        self.writes_rejected = 0
        port = ctx.listen_port()
        try:
            self._store = hedged(lambda: dist.TCPStore(ctx.host, port, None, True, seconds(ctx.timeout),
                                                       wait_for_workers=False), ctx.timeout)
        except Exception as e:
            raise TransferError(f"torch_dist: cannot start a TCPStore server on {ctx.host}:{port}: {e}") from e
        self.port = int(self._store.port)
        self._lock = threading.Lock()
        self._closed = False
        self._pairs: dict[str, threading.Thread] = {}
        self._accepter = threading.Thread(target=self._accept, name=f"torch_dist-accept-{self.port}", daemon=True)
        self._accepter.start()

    # -- accepting pairs ------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            queue = hedged(self._store.clone, self.ctx.timeout)
        except Exception as e:  # noqa: BLE001
            logger.error("torch_dist: cannot watch the pairs queue: %s", e)
            return
        queue.set_timeout(FOREVER)
        while True:
            try:
                pair_id = queue.queue_pop(PAIRS_QUEUE, True).decode()
            except Exception as e:  # the store is going away
                if not self._closed:
                    logger.warning("torch_dist: the pairs queue failed (%s); accepting no more pairs", e)
                return
            with self._lock:
                if self._closed or pair_id == CLOSE:
                    return
                if not pair_id.isalnum() or pair_id in self._pairs:
                    logger.warning("torch_dist: ignoring a malformed or repeated pair id %r", pair_id[:64])
                    continue
                thread = threading.Thread(target=self._serve, args=(pair_id,), daemon=True,
                                          name=f"torch_dist-pair-{pair_id[:8]}")
                self._pairs[pair_id] = thread
            thread.start()

    # -- serving one pair -----------------------------------------------------------------

    def _serve(self, pair_id: str) -> None:
        group = None
        try:
            deadline = time.monotonic() + self.ctx.timeout
            store = hedged(self._store.clone, self.ctx.timeout)
            queue = hedged(self._store.clone, deadline - time.monotonic())
            group = new_group(store, f"pair/{pair_id}/", 1, self.ctx, deadline - time.monotonic())
            queue.set_timeout(FOREVER)
            staging = Staging()
            seq = 0
            while not self._closed:
                message = queue.queue_pop(f"pair/{pair_id}/q", True).decode()
                if self._closed or message in (CLOSE, BYE):
                    break
                self._one_write(group, staging, message, seq)
                seq += 1
        except ProtocolError as e:
            logger.warning("torch_dist: dropping pair %s: %s", pair_id[:8], e)
        except Exception as e:  # the sender went away or timed out: the pair is over
            if not self._closed:
                logger.info("torch_dist: pair %s ended: %s", pair_id[:8], e)
        finally:
            with self._lock:
                self._pairs.pop(pair_id, None)
            del group  # closes the pair's connections: the sender's operations fail at once

    def _one_write(self, group, staging: Staging, message: str, seq: int) -> None:
        try:
            got_seq, n, total = (int(v) for v in message.split())
        except ValueError as e:
            raise ProtocolError(f"bad write announcement {message[:64]!r}") from e
        if got_seq != seq or not 0 < n <= MAX_SEGMENTS or total <= 0:
            raise ProtocolError(f"write announcement {message[:64]!r} out of order or out of range")
        timeout = self.ctx.timeout
        deadline = time.monotonic() + timeout
        header = torch.empty(2 * n, dtype=torch.int64)
        wait(group.recv([header], 0, TAG_HEADER), timeout)
        values = header.tolist()
        dst, lengths = values[:n], values[n:]
        ok = sum(lengths) == total and self.regions.covers(dst, lengths)
        wait(group.send([torch.tensor([1 if ok else 0], dtype=torch.int64)], 0, TAG_VERDICT),
             deadline - time.monotonic())
        if not ok:
            with self._lock:
                self.writes_rejected += 1
            logger.warning("torch_dist: refused a write of %d segments outside the registered memory", n)
            return
        buf = view(dst[0], total) if n == 1 else staging.get(total)
        wait(group.recv([buf], 0, TAG_PAYLOAD), deadline - time.monotonic())
        if n > 1:
            staging.scatter(buf, dst, lengths)
        with self._lock:
            self.bytes_received += total
            self.writes_received += 1
        wait(group.send([torch.ones(1, dtype=torch.int64)], 0, TAG_ACK), deadline - time.monotonic())

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = dict(self._pairs)
        try:
            self._store.queue_push(PAIRS_QUEUE, CLOSE)
            for pair_id in pairs:
                self._store.queue_push(f"pair/{pair_id}/q", CLOSE)
        except Exception as e:  # noqa: BLE001 - the threads are daemons; nothing else to do
            logger.debug("torch_dist: waking the receiver threads failed: %s", e)
        deadline = time.monotonic() + min(self.ctx.timeout, 2.0)
        for thread in (self._accepter, *pairs.values()):
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))
        self._store = None  # the server stops listening once the threads let go of it
