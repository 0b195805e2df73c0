"""The prefill server's part of a disaggregated request (``--disaggregation-mode prefill``).

A request carrying a ``bootstrap_room`` is prefilled here and its first token sampled (it runs
with ``max_new_tokens`` 1: that token is the prefill server's own answer). It then does not
let go of its pages: :meth:`PrefillSender.hold` keeps it until the decode server of its room
has registered where the KV goes, the transfer engine has written it there, and the room is
marked done with the first token (and its logprobs) and the KV's checksum; then its pages go to
the prefix cache like any finished request's. No registration within
``--disaggregation-transfer-timeout``, a refused layout or a failed write mark the room
failed (one log line) and free the pages. Requests without a room are served here in full.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from dataclasses import dataclass, field

from radixserve.disaggregation import bootstrap as bs
from radixserve.disaggregation.agent import RankGroup
from radixserve.disaggregation.kv_pages import PoolLayout, plan_pieces
from radixserve.disaggregation.transfer import DONE, FAILED, TransferError

logger = logging.getLogger(__name__)


def room_of(req) -> int | None:
    b = req.bootstrap or {}
    room = b.get("bootstrap_room")
    return None if room is None else int(room)


@dataclass
class _Send:
    req: object
    room: int
    deadline: float
    handle: int | None = None
    started: float = 0.0  # when the write was submitted
    seconds: float = 0.0  # submit to done
    result: dict = field(default_factory=dict)  # what the room reports when done
    final: str = ""  # the write's end state (set by the waiter thread)


class PrefillSender:
    def __init__(self, args, kv, group: RankGroup, ranks: list[dict], bootstrap: bs.BootstrapServer) -> None:
        self.timeout = args.disaggregation_transfer_timeout
        self.kv = kv
        self.group = group  # every rank's transfer agent (each writes the KV heads it holds)
        self.bootstrap = bootstrap
        self.layouts = [PoolLayout.from_dict(r["layout"]) for r in ranks]
        self.sending: list[_Send] = []
        self.num_sent = self.num_failed = 0
        self.transfer_seconds = 0.0  # submit to done, summed over the requests sent
        # a waiter thread per write in flight marks its room done the moment the write is (the
        # decode server need not wait for this scheduler's next step); pages go back here
        self._waiters = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="disagg-send")
        self._ended: queue.SimpleQueue = queue.SimpleQueue()
        self.on_done = None  # called from the waiter thread: wakes the scheduler

    def wants(self, req) -> bool:
        return room_of(req) is not None and req.max_new_tokens > 0

    def admit_check(self, req) -> str | None:
        """Why ``req`` cannot be taken (a room already in use), else None; makes it a
        one-token request."""
        if not self.wants(req):
            return None
        room = room_of(req)
        with self.bootstrap.lock:
            rec = self.bootstrap.rooms.get(room)
            if rec is not None and (rec.state != bs.WAITING or rec.result.get("taken")):
                return f"bootstrap room {room} is already in use"
            self.bootstrap.room(room).result["taken"] = req.rid  # the room's owner
        req.max_new_tokens = 1
        return None

    def hold(self, req, reason: dict) -> bool:
        """Keep a finished request's pages until its KV is sent (True), or let it go (a
        failed or aborted request fails its room at once: the decode server need not wait)."""
        if not self.wants(req):
            return False
        if reason.get("type") == "abort" or not req.output_ids:
            room = room_of(req)
            with self.bootstrap.lock:  # a request refused for a room in use must not fail its owner's
                owner = self.bootstrap.rooms.get(room) is not None and \
                    self.bootstrap.rooms[room].result.get("taken") == req.rid
            if owner:
                self.bootstrap.finish(room, bs.FAILED, message=f"the prefill server could not serve it: "
                                                               f"{reason.get('message', 'aborted')}")
            return False
        self.sending.append(_Send(req, room_of(req), time.monotonic() + self.timeout))
        return True

    @property
    def busy(self) -> bool:
        return bool(self.sending)

    def poll(self) -> None:
        """Start the writes whose room is registered; let go of those that ended."""
        while True:
            try:
                s = self._ended.get_nowait()
            except queue.Empty:
                break
            if s.final == DONE:
                self.num_sent += 1
                self.transfer_seconds += s.seconds
                self._release(s)
            else:
                self._fail(s, "the KV transfer failed" if s.final == FAILED else
                           f"the KV transfer did not finish within {self.timeout:g} s")
        for s in list(self.sending):
            if s.handle is None:
                try:
                    self._start(s)
                except TransferError as e:
                    self._fail(s, str(e))

    def _await(self, s: _Send) -> None:
        """Waiter thread: the write's end; a done room is reported at once."""
        try:
            s.final = self.group.wait(s.handle, self.timeout)
        except Exception:  # noqa: BLE001 - a transport's failure fails this request only
            logger.exception("bootstrap room %s: waiting for the KV transfer failed", s.room)
            s.final = FAILED
        if s.final == DONE:
            s.seconds = time.monotonic() - s.started
            self.bootstrap.finish(s.room, bs.DONE, **s.result)
        self._ended.put(s)
        if self.on_done is not None:
            self.on_done()

    def _start(self, s: _Send) -> None:
        with self.bootstrap.lock:
            rec = self.bootstrap.room(s.room)
            reg, state = rec.registration, rec.state
        if state == bs.FAILED:  # cancelled by the decode server
            self._release(s)
            return
        if reg is None:
            if time.monotonic() > s.deadline:
                self._fail(s, f"no decode server registered for bootstrap room {s.room} within "
                              f"{self.timeout:g} s (--disaggregation-transfer-timeout)")
            return
        req = s.req
        n = len(req.input_ids)
        if len(reg["slots"]) != n:
            raise TransferError(f"the decode server set aside {len(reg['slots'])} slots for a {n}-token prompt")
        layouts = [r["layout"] for r in reg["ranks"]]
        pieces = plan_pieces(self.layouts, [PoolLayout.from_dict(d) for d in layouts])
        s.started = time.monotonic()
        s.handle = s.room  # every rank's writes for this room
        sums = self.group.send(s.room, self.kv.table[req.req_pool_idx, :n].cpu().numpy(), reg["slots"], pieces,
                               [r["address"] for r in reg["ranks"]], layouts)
        # what the decode server checks: per piece, the decode rank, its first head, the heads, the checksum
        s.result = {"first_token": req.output_ids[0],
                    "pieces": [[p.dst_rank, p.dst_head, p.num_heads, c] for p, c in zip(pieces, sums, strict=True)]}
        if req.output_token_logprobs:
            s.result["logprob"] = req.output_token_logprobs[0]
        if req.output_top_logprobs:
            s.result["top_logprobs"] = req.output_top_logprobs[0]
        self._waiters.submit(self._await, s)

    def _fail(self, s: _Send, message: str) -> None:
        if s not in self.sending:  # already let go (shutdown), its waiter reported late
            return
        logger.warning("bootstrap room %s: %s; its pages are freed", s.room, message)
        self.bootstrap.finish(s.room, bs.FAILED, message=message)
        self.num_failed += 1
        self._release(s)

    def _release(self, s: _Send) -> None:
        if s in self.sending:
            self.sending.remove(s)
            self.kv.release(s.req)

    def release_all(self) -> None:
        """At shutdown: every held request lets go (its room fails)."""
        for s in list(self.sending):
            self._fail(s, "the prefill server is shutting down")
        self._waiters.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {"num_disagg_sending_reqs": len(self.sending), "num_disagg_sent": self.num_sent,
                "num_disagg_send_failed": self.num_failed, "disagg_transfer_seconds": self.transfer_seconds,
                **{f"disagg_transfer_{k}": v for k, v in self.group.transfer.stats().items()}}
