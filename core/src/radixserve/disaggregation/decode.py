"""The decode server's part of a disaggregated request (``--disaggregation-mode decode``).

A request carrying a bootstrap room and address does not prefill here. Once its grammar (if
any) has compiled, :meth:`DecodeReceiver.enqueue` takes it: it waits for pages for its whole
prompt (``pending``), gets them and a request slot, and registers their slots with the prefill
server's bootstrap endpoint; then it waits in ``disagg_waiting`` while a worker thread follows
its room (a long poll). When the room is done the KV is in its pages: the checksum over them
must match the prefill server's (else the request fails with a 500 and nothing is decoded
from that KV), the prompt counts as computed (it enters the prefix cache), the first token
from the prefill server is taken as if sampled here (grammar, stop conditions, logprobs), and
the request joins the running batch. A failed room, an unreachable prefill server or no
answer within ``--disaggregation-transfer-timeout`` end the request with a 503; its pages stay
aside for another timeout (a write still in flight may land in them) and are then freed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from radixserve.disaggregation import bootstrap as bs
from radixserve.disaggregation.agent import RankGroup
from radixserve.disaggregation.kv_pages import PoolLayout
from radixserve.disaggregation.transfer import TransferError
from radixserve.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # one long poll of a room's state


def peer_of(req) -> tuple[str, int, int] | None:
    """(bootstrap host, port, room) of a request routed for disaggregation, else None."""
    b = req.bootstrap or {}
    host, port, room = b.get("bootstrap_host"), b.get("bootstrap_port"), b.get("bootstrap_room")
    if host is None or port is None or room is None:
        return None
    return str(host), int(port), int(room)


@dataclass
class _Recv:
    req: object
    peer: tuple[str, int, int]
    slots: list[int]
    deadline: float


class DecodeReceiver:
    def __init__(self, args, kv, queues, outputs, group: RankGroup, ranks: list[dict], spec=None) -> None:
        self.timeout = args.disaggregation_transfer_timeout
        self.kv = kv
        self.queues = queues
        self.outputs = outputs
        self.group = group  # every rank's transfer agent (each checks the KV heads it received)
        self.ranks = ranks  # every rank's transfer address and pool layout, as registered
        self.layouts = [PoolLayout.from_dict(r["layout"]) for r in ranks]
        self.spec = spec  # speculative decoding: its proposer learns the prompt that arrived
        self.pending: deque = deque()  # waiting for pages
        self.waiting: dict[int, _Recv] = {}  # registered, waiting for the KV (by id(req))
        self.quarantine: list[tuple[float, list[int]]] = []  # (free after, pages) of failed transfers
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()  # set when a room's outcome is in
        self._pool = concurrent.futures.ThreadPoolExecutor(max(4, args.max_running_requests or 64),
                                                           thread_name_prefix="disagg-follow")
        self.num_received = self.num_failed = 0

    def wants(self, req) -> bool:
        return peer_of(req) is not None and req.max_new_tokens > 0

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.waiting or self.quarantine)

    def enqueue(self, req) -> None:
        self.pending.append(req)

    # ------------------------------------------------------------ the scheduler's step
    def poll(self) -> None:
        self._admit()
        self._take_results()
        now = time.monotonic()
        keep = [(t, pages) for t, pages in self.quarantine if t > now]
        for t, pages in self.quarantine:
            if t <= now:
                self.kv.allocator.free(pages)
        self.quarantine = keep

    def _admit(self) -> None:
        while self.pending:
            req = self.pending[0]
            n = len(req.input_ids)
            holding = self.queues.running + [r.req for r in self.waiting.values()]
            if self.kv.free_request_slots < 1 or self.kv.admit(
                    req, self.kv.cache.match_prefix([]), n, self.kv.reserved_pages(holding)) is None:
                return  # when running requests finish
            self.pending.popleft()
            self.kv.write_table(req, 0, n)
            rec = _Recv(req, peer_of(req), self.kv.table[req.req_pool_idx, :n].tolist(),
                        time.monotonic() + self.timeout)
            self.waiting[id(req)] = rec
            self._pool.submit(self._follow, rec)

    def _follow(self, rec: _Recv) -> None:
        """Worker thread: register the request's slots, then follow its room to the end."""
        host, port, room = rec.peer
        registered = False
        try:
            bs.register(host, port, {"room": room, "ranks": self.ranks, "slots": rec.slots}, self.timeout)
            registered = True
            while True:
                left = rec.deadline - time.monotonic()
                if left <= 0:
                    outcome = {"state": bs.FAILED, "message": f"no KV from the prefill server {host}:{port} for "
                               f"bootstrap room {room} within {self.timeout:g} s (--disaggregation-transfer-timeout)"}
                    try:
                        bs.cancel(host, port, room, min(self.timeout, 5.0))
                    except TransferError:
                        pass
                    break
                outcome = bs.status(host, port, room, min(POLL_SECONDS, left), self.timeout)
                if outcome.get("state") in (bs.DONE, bs.FAILED):
                    break
        except TransferError as e:
            outcome = {"state": bs.FAILED, "message": str(e)}
        outcome["registered"] = registered
        self.results.put((rec, outcome))
        self.wake.set()

    def _take_results(self) -> None:
        while True:
            try:
                rec, outcome = self.results.get_nowait()
            except queue.Empty:
                return
            req = rec.req
            if self.waiting.pop(id(req), None) is None or req.finished:  # aborted meanwhile
                continue
            if outcome.get("state") != bs.DONE:
                self._fail(req, 503, f"prefill-decode disaggregation: {outcome.get('message', 'the transfer failed')}",
                           quarantine=outcome["registered"])
                continue
            problem = self._check(rec, outcome.get("pieces"))
            if problem is not None:
                self._fail(req, 500, f"prefill-decode disaggregation: {problem}", quarantine=True)
                continue
            self.num_received += 1
            req.kv_len = len(req.input_ids)
            self.kv.cache_computed(req)
            Sampler.skip_draw(req.params, req.generator)  # the first token was drawn on the prefill side
            lp = [outcome["logprob"]] if "logprob" in outcome else None
            tops = [outcome["top_logprobs"]] if "top_logprobs" in outcome else None
            if self.outputs.take_tokens([req], [int(outcome["first_token"])], lp, tops):
                self.outputs.notify(req, 0, True)
            else:
                if self.spec is not None:
                    self.spec.observe_received(req, req.kv_len)
                self.queues.running.append(req)

    def _check(self, rec: _Recv, pieces) -> str | None:
        """Why the KV that arrived cannot be used, else None: the pieces the prefill server
        wrote must cover every head of every rank here, and each rank's checksum of its heads
        must match the prefill server's."""
        try:
            want = [(int(d), int(h), int(n), int(c)) for d, h, n, c in pieces]
        except (TypeError, ValueError):
            return "the prefill server's report of the KV it sent is malformed"
        for d, layout in enumerate(self.layouts):
            heads = sorted((h, n) for r, h, n, _ in want if r == d)
            at = 0
            for h, n in heads:
                at = at + n if h == at else -1
            if at != layout.num_kv_heads:
                return f"the prefill server did not send every KV head of rank {d}"
        try:
            got = self.group.checksums(rec.slots, [[d, h, n] for d, h, n, _ in want])
        except TransferError as e:
            return f"the KV that arrived could not be checked: {e}"
        if got != [c for *_, c in want]:
            return "the KV that arrived does not match the prefill server's checksum"
        return None

    def _fail(self, req, status: int, message: str, quarantine: bool) -> None:
        logger.warning("request %s: %s", req.rid, message)
        self.num_failed += 1
        if quarantine:  # keep the pages out of use for a while: a late write may still land
            self.quarantine.append((time.monotonic() + self.timeout, list(req.pages)))
            req.pages = []
        self.outputs.finish(req, {"type": "abort", "status_code": status, "message": message})

    # ------------------------------------------------------------ abort and shutdown
    def take(self, rid: str):
        """Remove a request waiting here (for abort); None if it is not here."""
        for req in list(self.pending):
            if req.rid == rid:
                self.pending.remove(req)
                return req
        for key, rec in list(self.waiting.items()):
            if rec.req.rid == rid:
                del self.waiting[key]
                rec.req.pages, pages = [], rec.req.pages
                self.quarantine.append((time.monotonic() + self.timeout, pages))
                return rec.req
        return None

    def take_all(self) -> list:
        out = []
        for req in [*self.pending, *(r.req for r in self.waiting.values())]:
            out.append(self.take(req.rid))
        return [r for r in out if r is not None]

    def close(self) -> None:
        for _, pages in self.quarantine:
            self.kv.allocator.free(pages)
        self.quarantine = []
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {"num_disagg_waiting_reqs": len(self.waiting) + len(self.pending),
                "num_disagg_received": self.num_received, "num_disagg_receive_failed": self.num_failed}
