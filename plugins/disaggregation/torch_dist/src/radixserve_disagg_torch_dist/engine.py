"""``torch_dist``: a KV transfer engine over ``torch.distributed`` point-to-point (gloo).

Every engine receives: it runs a ``TCPStore`` server on ``ctx.host`` (port
``extra_config["port"]`` plus the rank, default any free port) and its :meth:`address` is ``host:port``
of that store (:mod:`.receiver`). A sender pairs with a receiver on the first
:meth:`connect` or write to it:

1. it connects to the receiver's store as a client (a plain TCP connect first, so that an
   address nobody listens at fails at once), picks a fresh pair id and pushes it onto the
   store's ``pairs`` queue;
2. both sides build a 2-rank ``ProcessGroupGloo`` over ``PrefixStore("pair/<id>/", store)``:
   the sender is rank 0, the receiver rank 1 (a thread per pair on the receiver).

A write on a pair (writes to one peer run in order on one worker thread per peer):

1. the sender pushes ``"<seq> <segments> <bytes>"`` onto the pair's store queue
   ``pair/<id>/q`` (what wakes the receiver's pair thread) and sends the header, an int64
   tensor of the destination addresses then the lengths;
2. the receiver checks that every segment lies inside one registered region and that the
   lengths add up, and sends a verdict (1 or 0). On 0 nothing is written and the write is
   FAILED; the pair stays usable;
3. on 1 the sender sends the payload, one uint8 tensor of the segments back to back
   (the source memory itself when there is one segment), the receiver receives it (into
   the destination itself when there is one segment, else into a staging buffer it then
   scatters) and sends an ack; the write is DONE when the ack arrives.

Every gloo wait is bounded by what is left of the write's timeout (``ctx.timeout`` from
``submit_write``). A failure or a timeout (gloo closes the connection on one) drops the
pair on both sides and makes the write FAILED; the next write to that peer pairs again.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from radixserve.plugin_api.disaggregation import (
    DONE,
    FAILED,
    PENDING,
    TransferContext,
    TransferEngine,
    TransferError,
    coalesce,
)

from radixserve_disagg_torch_dist.common import (
    BYE,
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
    wait,
)
from radixserve_disagg_torch_dist.receiver import Receiver

logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet = weakref.WeakSet()
KEEP_FINISHED = 1 << 16  # finished handles poll() still answers for; older ones are forgotten


@atexit.register
def _close_all() -> None:  # threads blocked in c10d calls at interpreter exit abort the process
    for engine in list(_LIVE):
        engine.close()


def parse_address(peer: str) -> tuple[str, int]:
    host, sep, port = str(peer).rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 < number < 65536:
        raise TransferError(f"torch_dist: a peer address is host:port, got {peer!r}")
    return host.strip("[]"), number


class _Pair:
    """The sending side of one pair: the store client and the process group (rank 0)."""

    def __init__(self, store: dist.TCPStore, group, pair_id: str) -> None:
        self.store, self.group, self.pair_id = store, group, pair_id
        self.queue = f"pair/{pair_id}/q"
        self.seq = 0

    def bye(self) -> None:
        try:
            self.store.set_timeout(seconds(0.5))
            self.store.queue_push(self.queue, BYE)
        except Exception:  # noqa: BLE001 - the receiver is gone already
            pass


class _Peer:
    """One receiver this engine writes to: its pair and its worker thread."""

    def __init__(self, engine: TorchDistTransfer, address: str) -> None:
        self.engine, self.address = engine, address
        self.host, self.port = parse_address(address)
        self.lock = threading.Lock()  # guards ``pair``
        self.pair: _Pair | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.staging = Staging()
        self.thread = threading.Thread(target=self._work, daemon=True, name=f"torch_dist-send-{address}")
        self.thread.start()

    def connect(self, deadline: float) -> _Pair:
        with self.lock:
            if self.pair is not None:
                return self.pair
            self.pair = self._pair(deadline)
            return self.pair

    def _pair(self, deadline: float) -> _Pair:
        ctx = self.engine.ctx
        left = deadline - time.monotonic()
        try:  # a refused connection fails here at once; TCPStore would retry until the timeout
            socket.create_connection((self.host, self.port), timeout=max(left, 0.001)).close()
        except OSError as e:
            raise TransferError(f"torch_dist: cannot reach {self.address}: {e}") from e
        try:
            left = deadline - time.monotonic()
            store = hedged(lambda: dist.TCPStore(self.host, self.port, None, False, seconds(left)), left)
            pair_id = uuid.uuid4().hex
            store.queue_push(PAIRS_QUEUE, pair_id)
            group = new_group(store, f"pair/{pair_id}/", 0, ctx, deadline - time.monotonic())
        except Exception as e:
            raise TransferError(f"torch_dist: cannot pair with {self.address}: {e}") from e
        return _Pair(store, group, pair_id)

    def drop(self, pair: _Pair | None = None) -> None:
        """Forget the pair (only ``pair``, when given); its connections close with it."""
        with self.lock:
            if self.pair is None or (pair is not None and self.pair is not pair):
                return
            old, self.pair = self.pair, None
        old.bye()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            handle, deadline, segments = job
            ok = False
            if not self.engine.closed and time.monotonic() < deadline:
                pair = None
                try:
                    pair = self.connect(deadline)
                    ok = self._write(pair, deadline, *segments)
                except Exception as e:  # noqa: BLE001 - any failure fails this write
                    logger.warning("torch_dist: a write to %s failed: %s", self.address, e)
                    if pair is not None:
                        self.drop(pair)
            self.engine.finish(handle, ok, sum(segments[2]) if ok else 0)
            del job, segments

    def _write(self, pair: _Pair, deadline: float, src: list[int], dst: list[int], lengths: list[int]) -> bool:
        n, total = len(lengths), sum(lengths)
        group = pair.group
        pair.store.set_timeout(seconds(deadline - time.monotonic()))
        pair.store.queue_push(pair.queue, f"{pair.seq} {n} {total}")
        pair.seq += 1
        header = torch.tensor(dst + lengths, dtype=torch.int64)
        verdict = torch.zeros(1, dtype=torch.int64)
        sent = group.send([header], 1, TAG_HEADER)
        answered = group.recv([verdict], 1, TAG_VERDICT)
        wait(sent, deadline - time.monotonic())
        wait(answered, deadline - time.monotonic())
        if int(verdict.item()) != 1:
            logger.warning("torch_dist: %s refused a write of %d segments (outside its registered memory)",
                           self.address, n)
            return False
        ack = torch.zeros(1, dtype=torch.int64)
        sent = group.send([self.staging.gather(src, lengths, total)], 1, TAG_PAYLOAD)
        acked = group.recv([ack], 1, TAG_ACK)
        wait(sent, deadline - time.monotonic())
        wait(acked, deadline - time.monotonic())
        return int(ack.item()) == 1

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(0.1)  # a write in progress ends within its timeout; it is FAILED already
        self.drop()


class TorchDistTransfer(TransferEngine):
    """KV transfer over ``torch.distributed`` gloo point-to-point; see the module docstring."""

    name = "torch_dist"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        if not (dist.is_available() and dist.is_gloo_available()):
            raise TransferError("torch_dist needs torch.distributed with the gloo backend")
        self.closed = False
        self._regions = Regions()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._states: dict[int, str] = {}
        self._handles = itertools.count(1)
        self._finished: deque[int] = deque()
        self._bytes = self._writes = self._failed = 0
        self._receiver = Receiver(ctx, self._regions)
        self._address = f"{ctx.host}:{self._receiver.port}"
        _LIVE.add(self)

    def address(self) -> str:
        return self._address

    def register_regions(self, regions: Sequence[tuple[int, int]]) -> None:
        """Adds ``regions`` to the memory peers may write into and writes may read from."""
        self._regions.add(regions)

    def _peer(self, peer: str) -> _Peer:
        with self._lock:
            if self.closed:
                raise TransferError("torch_dist: the engine is closed")
            found = self._peers.get(peer)
            if found is None:
                found = self._peers[peer] = _Peer(self, peer)
            return found

    def connect(self, peer: str) -> None:
        self._peer(peer).connect(time.monotonic() + self.ctx.timeout)

    def submit_write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        if not len(src) == len(dst) == len(lengths):
            raise TransferError(f"torch_dist: {len(src)} sources, {len(dst)} destinations, {len(lengths)} lengths")
        if any(int(n) < 0 for n in lengths):
            raise TransferError("torch_dist: a negative segment length")
        src, dst, lengths = coalesce([int(v) for v in src], [int(v) for v in dst], [int(v) for v in lengths])
        if lengths and not self._regions.covers(src, lengths):
            raise TransferError("torch_dist: a source segment lies outside the registered memory")
        target = self._peer(peer)
        with self._lock:
            handle = next(self._handles)
            if not lengths:
                self._states[handle] = DONE
                self._finished.append(handle)
                self._writes += 1
                return handle
            self._states[handle] = PENDING
        target.jobs.put((handle, time.monotonic() + self.ctx.timeout, (src, dst, lengths)))
        return handle

    def finish(self, handle: int, ok: bool, nbytes: int) -> None:
        with self._lock:
            if self._states.get(handle) != PENDING:
                return  # FAILED by close() meanwhile
            self._states[handle] = DONE if ok else FAILED
            self._finished.append(handle)
            if len(self._finished) > KEEP_FINISHED:  # the oldest finished handles are forgotten
                self._states.pop(self._finished.popleft(), None)
            if ok:
                self._bytes += nbytes
                self._writes += 1
            else:
                self._failed += 1

    def poll(self, handle: int) -> str:
        with self._lock:
            state = self._states.get(handle)
        if state is None:
            raise TransferError(f"torch_dist: unknown (or long finished and forgotten) handle {handle!r}")
        return state

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out = {"bytes_written": self._bytes, "writes": self._writes, "failed": self._failed,
                   "peers": len(self._peers)}
        receiver = self._receiver
        out.update(bytes_received=receiver.bytes_received, writes_received=receiver.writes_received,
                   writes_refused=receiver.writes_rejected)
        return out

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            for handle, state in self._states.items():
                if state == PENDING:
                    self._states[handle] = FAILED
                    self._failed += 1
        for peer in peers:
            peer.close()
        self._receiver.close()
        _LIVE.discard(self)
