"""Every rank's part of moving KV between servers, and how rank 0 reaches all of them.

With tensor parallelism each rank's KV pool holds only its own KV heads, in its own process,
so every rank runs a :class:`KVAgent`: its own transfer engine over its own pool
(``TransferContext.tp_rank``), which writes the heads it holds (prefill side) or checks the
heads that arrived (decode side). Rank 0 alone runs the scheduler and the bootstrap traffic;
it drives the agents with service calls (:meth:`StepDriver.call
<radixserve.distributed.step_sync.StepDriver.call>`, between forward steps, under the step
lock) through a :class:`RankGroup`. With one rank the group calls the local agent directly.

Calls (payloads and replies are plain data: ints, strings, lists, dicts, numpy arrays):

* ``info``: this rank's transfer address and pool layout (gathered once, at start-up);
* ``send``: ``{key, src_slots, dst_slots, pieces, peers, layouts}``: start the writes of the
  pieces whose source is this rank (:func:`radixserve.disaggregation.kv_pages.plan_pieces`);
  replies ``[[piece index, checksum], ...]``;
* ``state``: ``[key, ...]``: per key, this rank's writes' state (done when all are);
  an ended key is forgotten;
* ``checksum``: ``{slots, pieces}``: the checksums of the pieces this rank received;
* ``drop``: ``key``: forget a key's writes (another rank's failed).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from radixserve.disaggregation.kv_pages import Piece, PoolLayout, checksum, segments
from radixserve.disaggregation.transfer import DONE, FAILED, PENDING, TransferContext, TransferError

CALLS = ("info", "send", "state", "checksum", "drop")


class KVAgent:
    """One rank's transfer engine over its KV pool (``runner``: the rank's ModelRunner)."""

    def __init__(self, args, registry, runner) -> None:
        from radixserve.distributed import get_parallel_state

        ps = get_parallel_state()
        self.rank = ps.tp_rank
        entry = registry.resolve("kv_transfer", args.disaggregation_transfer_backend,
                                 flag="--disaggregation-transfer-backend")
        ctx = TransferContext(role=args.disaggregation_mode, host=args.disaggregation_host,
                              ib_device=args.disaggregation_ib_device, tp_rank=ps.tp_rank, tp_size=ps.tp_size,
                              timeout=args.disaggregation_transfer_timeout, extra_config=args.transfer_extra_config())
        self.pool = runner.kv_pool
        self.layout = PoolLayout.from_pool(self.pool, runner.heads.kv_start,
                                           runner.model_config.num_key_value_heads)
        self.transfer = entry.factory(ctx)
        try:
            self.transfer.register_regions([(self.layout.base, self.layout.nbytes)])
        except BaseException:
            self.transfer.close()
            raise
        self.writes: dict[int, list[int]] = {}  # key -> this rank's write handles

    def handlers(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in CALLS}

    def info(self, _payload=None) -> dict:
        return {"address": self.transfer.address(), "layout": self.layout.as_dict()}

    def send(self, p: dict) -> list[list[int]]:
        sums = []
        handles = self.writes.setdefault(int(p["key"]), [])
        for i, raw in enumerate(p["pieces"]):
            piece = Piece(*(int(x) for x in raw))
            if piece.src_rank != self.rank:
                continue
            dst = PoolLayout.from_dict(p["layouts"][piece.dst_rank])
            segs = segments(self.layout, p["src_slots"], dst, p["dst_slots"], piece)
            sums.append([i, checksum(self.pool, p["src_slots"], piece.src_head, piece.num_heads)])
            handles.append(self.transfer.submit_write(p["peers"][piece.dst_rank], *segs))
        return sums

    def state(self, keys: list) -> list[str]:
        out = []
        for key in keys:
            states = [self.transfer.poll(h) for h in self.writes.get(int(key), [])]
            state = FAILED if FAILED in states else PENDING if PENDING in states else DONE
            if state != PENDING:
                self.writes.pop(int(key), None)
            out.append(state)
        return out

    def checksum(self, p: dict) -> list[list[int]]:
        return [[i, checksum(self.pool, p["slots"], int(head), int(n))]
                for i, (rank, head, n) in enumerate(p["pieces"]) if int(rank) == self.rank]

    def drop(self, key) -> None:
        self.writes.pop(int(key), None)

    def close(self) -> None:
        self.transfer.close()


class RankGroup:
    """Rank 0's handle on every rank's agent: ``call(name, payload)`` returns the replies in
    rank order (TransferError when a rank's handler failed)."""

    def __init__(self, agent: KVAgent, driver=None) -> None:
        self.agent = agent
        self.driver = driver  # the replica's StepDriver, None with one rank
        self._handlers = agent.handlers()
        self.poll_delay = 0.0002 if driver is None else 0.002  # a call to many ranks is a collective

    @property
    def transfer(self):
        return self.agent.transfer

    def call(self, name: str, payload: Any = None) -> list[Any]:
        if self.driver is None:
            try:
                return [self._handlers[name](payload)]
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001 - the same as on many ranks: this request fails
                raise TransferError(f"{name}: {type(e).__name__}: {e}") from e
        from radixserve.distributed.step_sync import RankCallError

        try:
            return self.driver.call(name, payload, self._handlers)
        except RankCallError as e:
            raise TransferError(str(e)) from e

    def send(self, key: int, src_slots, dst_slots, pieces: list[Piece], peers: list[str],
             layouts: list[dict]) -> list[int]:
        """Start every rank's writes for ``key``; the checksum of each piece."""
        sums: dict[int, int] = {}
        try:
            for reply in self.call("send", {"key": key, "src_slots": np.asarray(src_slots, dtype=np.int64),
                                            "dst_slots": np.asarray(dst_slots, dtype=np.int64),
                                            "pieces": [list(astuple(p)) for p in pieces], "peers": peers,
                                            "layouts": layouts}):
                sums.update((int(i), int(c)) for i, c in reply)
        except TransferError:
            self.call("drop", key)  # the ranks whose writes started forget them (they end on their own)
            raise
        return [sums[i] for i in range(len(pieces))]

    def wait(self, key: int, timeout: float) -> str:
        """Poll every rank's writes for ``key`` until all are DONE, one is FAILED, or
        ``timeout`` passes (FAILED)."""
        deadline = time.monotonic() + timeout
        delay = self.poll_delay
        while True:
            states = [s[0] for s in self.call("state", [key])]
            state = FAILED if FAILED in states else PENDING if PENDING in states else DONE
            if state == PENDING and time.monotonic() >= deadline:
                state = FAILED
            if state != PENDING:
                if state == FAILED:
                    self.call("drop", key)
                return state
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def checksums(self, slots, pieces: list[list[int]]) -> list[int]:
        """The checksums of what arrived: ``pieces`` are ``[decode rank, head, heads]``."""
        sums: dict[int, int] = {}
        for reply in self.call("checksum", {"slots": np.asarray(slots, dtype=np.int64), "pieces": pieces}):
            sums.update((int(i), int(c)) for i, c in reply)
        return [sums[i] for i in range(len(pieces))]

    def close(self) -> None:
        self.agent.close()


def astuple(piece: Piece) -> tuple[int, ...]:
    return (piece.src_rank, piece.dst_rank, piece.src_head, piece.dst_head, piece.num_heads)
