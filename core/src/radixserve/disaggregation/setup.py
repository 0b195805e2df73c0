"""What the scheduler holds in a disaggregated mode: every rank's transfer engine over its KV
pool (:mod:`radixserve.disaggregation.agent`), and the prefill side (bootstrap endpoint and
sender) or the decode side (receiver)."""

from __future__ import annotations

import threading

from radixserve.disaggregation.agent import KVAgent, RankGroup
from radixserve.disaggregation.bootstrap import BootstrapServer
from radixserve.disaggregation.decode import DecodeReceiver
from radixserve.disaggregation.prefill import PrefillSender
from radixserve.flags import ConfigError


class Disaggregation:
    def __init__(self, args, registry, runner, kv, queues, outputs, spec=None) -> None:
        self.mode = args.disaggregation_mode
        self.group = RankGroup(KVAgent(args, registry, runner), runner.step_driver)
        self.transfer = self.group.transfer  # rank 0's (its numbers are the ones get_stats() shows)
        self.wake = threading.Event()
        self.bootstrap = self.sender = self.receiver = None
        try:
            ranks = self.group.call("info")  # every rank's address and pool layout
            if self.mode == "prefill":
                self.bootstrap = BootstrapServer(args.disaggregation_host, args.disaggregation_bootstrap_port,
                                                 {"role": "prefill", "tp_size": args.tp_size,
                                                  "layouts": [r["layout"] for r in ranks]},
                                                 keep_seconds=2 * args.disaggregation_transfer_timeout)
                self.bootstrap.on_register = self.wake.set
                self.sender = PrefillSender(args, kv, self.group, ranks, self.bootstrap)
                self.sender.on_done = self.wake.set
                outputs.hold = self.sender.hold
            else:
                if spec is not None and spec.proposer.hidden_layers:
                    raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm} with "
                                      "--disaggregation-mode decode: its draft needs the target's hidden states over "
                                      "the prompt, which stay on the prefill server; NGRAM and draft models "
                                      "(STANDALONE) work here")
                self.receiver = DecodeReceiver(args, kv, queues, outputs, self.group, ranks, spec)
                self.receiver.wake = self.wake
        except BaseException:
            self.close()
            raise

    @property
    def num_queued(self) -> int:
        """Requests waiting here for pages or for their KV (they count against --max-queued-requests)."""
        return len(self.receiver.pending) + len(self.receiver.waiting) if self.receiver is not None else 0

    @property
    def busy(self) -> bool:
        return (self.sender or self.receiver).busy

    def poll(self) -> None:
        (self.sender or self.receiver).poll()

    def wait(self, seconds: float) -> None:
        """Nothing else to run: wait for a registration, a room's outcome or (prefill) a write."""
        self.wake.wait(seconds)
        self.wake.clear()

    def admit_check(self, req) -> str | None:
        return self.sender.admit_check(req) if self.sender is not None else None

    def takes(self, req) -> bool:
        """Whether the decode side takes ``req`` (instead of the waiting queue)."""
        if self.receiver is None or not self.receiver.wants(req):
            return False
        self.receiver.enqueue(req)
        self.wake.set()
        return True

    def take(self, rid: str):
        return self.receiver.take(rid) if self.receiver is not None else None

    def take_all(self) -> list:
        if self.sender is not None:
            self.sender.release_all()
        return self.receiver.take_all() if self.receiver is not None else []

    def stats(self) -> dict:
        return (self.sender or self.receiver).stats()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.release_all()
        if self.receiver is not None:
            self.receiver.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
        self.group.close()


def attach_disaggregation(scheduler, args, registry, runner) -> None:
    scheduler.attach_disaggregation(Disaggregation(args, registry, runner, scheduler.kv, scheduler.queues,
                                                   scheduler.outputs, scheduler.spec))
