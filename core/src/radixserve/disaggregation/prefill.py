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

import logging
import time
from dataclasses import dataclass

from radixserve.disaggregation import bootstrap as bs
from radixserve.disaggregation.kv_pages import PoolLayout, checksum, segments
from radixserve.disaggregation.transfer import DONE, FAILED, TransferEngine, TransferError

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
    checksum: int = 0
    started: float = 0.0  # when the write was submitted


class PrefillSender:
    def __init__(self, args, kv, pool, transfer: TransferEngine, bootstrap: bs.BootstrapServer) -> None:
        self.timeout = args.disaggregation_transfer_timeout
        self.kv = kv
        self.pool = pool
        self.transfer = transfer
        self.bootstrap = bootstrap
        self.layout = PoolLayout.from_pool(pool)
        self.sending: list[_Send] = []
        self.num_sent = self.num_failed = 0
        self.transfer_seconds = 0.0  # submit to done, summed over the requests sent

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
            self.bootstrap.room(room).result["taken"] = True
        req.max_new_tokens = 1
        return None

    def hold(self, req, reason: dict) -> bool:
        """Keep a finished request's pages until its KV is sent (True), or let it go."""
        if not self.wants(req) or reason.get("type") == "abort" or not req.output_ids:
            return False
        self.sending.append(_Send(req, room_of(req), time.monotonic() + self.timeout))
        return True

    @property
    def busy(self) -> bool:
        return bool(self.sending)

    def poll(self) -> None:
        """Start the writes whose room is registered; finish those that are done."""
        for s in list(self.sending):
            try:
                if s.handle is None:
                    self._start(s)
                else:
                    state = self.transfer.poll(s.handle)
                    if state == DONE:
                        self._done(s)
                    elif state == FAILED:
                        self._fail(s, "the KV transfer failed")
            except TransferError as e:
                self._fail(s, str(e))

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
        src_slots = self.kv.table[req.req_pool_idx, :n]
        segs = segments(self.layout, src_slots, PoolLayout.from_dict(reg["layout"]), reg["slots"])
        s.checksum = checksum(self.pool, src_slots)
        s.started = time.monotonic()
        s.handle = self.transfer.submit_write(reg["address"], *segs)

    def _done(self, s: _Send) -> None:
        req = s.req
        result = {"first_token": req.output_ids[0], "checksum": s.checksum}
        if req.output_token_logprobs:
            result["logprob"] = req.output_token_logprobs[0]
        if req.output_top_logprobs:
            result["top_logprobs"] = req.output_top_logprobs[0]
        self.bootstrap.finish(s.room, bs.DONE, **result)
        self.num_sent += 1
        self.transfer_seconds += time.monotonic() - s.started
        self._release(s)

    def _fail(self, s: _Send, message: str) -> None:
        logger.warning("bootstrap room %s: %s; its pages are freed", s.room, message)
        self.bootstrap.finish(s.room, bs.FAILED, message=message)
        self.num_failed += 1
        self._release(s)

    def _release(self, s: _Send) -> None:
        self.sending.remove(s)
        self.kv.release(s.req)

    def release_all(self) -> None:
        """At shutdown: every held request lets go (its room fails)."""
        for s in list(self.sending):
            self._fail(s, "the prefill server is shutting down")

    def stats(self) -> dict:
        return {"num_disagg_sending_reqs": len(self.sending), "num_disagg_sent": self.num_sent,
                "num_disagg_send_failed": self.num_failed, "disagg_transfer_seconds": self.transfer_seconds,
                **{f"disagg_transfer_{k}": v for k, v in self.transfer.stats().items()}}
