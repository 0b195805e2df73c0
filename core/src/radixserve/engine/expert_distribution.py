"""Expert load statistics of a MoE model: running totals for ``/metrics`` and ``get_stats()``,
and the expert distribution recorder (``--expert-distribution-recorder-mode``) that writes
what it recorded to a JSON file, the input of expert load balancing.

The totals are the :class:`~radixserve.layers.moe.ExpertLoadRecorder` counters the MoE
layers add to on the device each forward (no host sync); this module reads them. A
recording covers the forward passes between :meth:`ExpertDistributionRecorder.start` and
:meth:`~ExpertDistributionRecorder.stop` (it starts at launch when a mode is given):

* ``stat``: per layer and expert, the (token, choice) pairs routed there in the recording;
* ``per_pass``: the same, per forward pass, for the last ``--expert-distribution-recorder-buffer-size``
  passes, with the pass's token count (and the totals of ``stat``).

File format (``expert_distribution_<unix ms>_<pid>_<n>.json`` in ``--expert-distribution-recorder-dir``)::

    {"format": "radixserve-expert-distribution", "version": 1, "mode": "stat" | "per_pass",
     "num_experts": E, "top_k": K, "layers": [decoder layer index of each row],
     "num_forward_passes": P, "num_tokens": N,
     "counts": [[pairs routed to expert e in row l, ...], ...],          # [len(layers), E]
     "passes": [{"num_tokens": n, "counts": [[...], ...]}, ...]}         # per_pass only
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import torch

from radixserve.layers.moe import ExpertLoadRecorder

FORMAT = "radixserve-expert-distribution"
MODES = ("stat", "per_pass")


class ExpertDistributionRecorder:
    def __init__(self, load: ExpertLoadRecorder, *, num_experts: int, top_k: int, mode: str | None,
                 directory: str | None, buffer_size: int = 1000) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"--expert-distribution-recorder-mode: invalid value {mode!r}; choose from: "
                             f"{', '.join(MODES)}")
        self.load, self.num_experts, self.top_k = load, num_experts, top_k
        self.mode = mode or "stat"
        self.directory = directory or os.getcwd()
        self.recording = False
        self._dumps = 0
        self._start_counts: torch.Tensor | None = None  # the totals when the recording began
        self._frozen: torch.Tensor | None = None  # what a stopped recording holds
        self._last_counts: torch.Tensor | None = None
        self.passes: collections.deque = collections.deque(maxlen=buffer_size)
        self.num_passes = self.num_tokens = 0
        if mode is not None:
            self.start()

    # ------------------------------------------------------------------ totals
    def totals(self) -> dict[str, Any]:
        """``get_stats()`` keys: ``moe_expert_tokens`` ``{layer: [pairs per expert]}`` since
        launch and ``moe_expert_imbalance`` ``{layer: max / mean}`` (1.0 is perfectly even)."""
        snap = self.load.snapshot()
        imbalance = {}
        for layer, row in snap.items():
            mean = sum(row) / len(row) if row else 0.0
            imbalance[layer] = max(row) / mean if mean else 0.0
        return {"moe_expert_tokens": snap, "moe_expert_imbalance": imbalance,
                "expert_distribution_recording": self.recording}

    # --------------------------------------------------------------- recording
    def start(self) -> None:
        """Begin a new recording (a running one is discarded)."""
        self._start_counts = self.load.counts.clone()
        self._frozen = None
        self._last_counts = self._start_counts.clone() if self.mode == "per_pass" else None
        self.passes.clear()
        self.num_passes = self.num_tokens = 0
        self.recording = True

    def stop(self) -> None:
        """Freeze the recording; :meth:`dump` still writes it."""
        if self.recording:
            self._frozen = self.load.counts - self._start_counts
            self.recording = False

    def on_forward(self, num_tokens: int) -> None:
        """Called by the model runner after every forward pass of ``num_tokens`` tokens."""
        if not self.recording:
            return
        self.num_passes += 1
        self.num_tokens += num_tokens
        if self.mode == "per_pass":
            now = self.load.counts.clone()
            self.passes.append((num_tokens, now - self._last_counts))
            self._last_counts = now

    @property
    def has_record(self) -> bool:
        """A recording is running or a stopped one is kept."""
        return self.recording or self._frozen is not None

    def recorded_counts(self) -> torch.Tensor:
        if self.recording:
            return self.load.counts - self._start_counts
        return self._frozen if self._frozen is not None else torch.zeros_like(self.load.counts)

    def record(self) -> dict[str, Any]:
        """What the current (or last) recording holds, in the file format."""
        out = {"format": FORMAT, "version": 1, "mode": self.mode, "num_experts": self.num_experts,
               "top_k": self.top_k, "layers": list(self.load.layer_ids), "num_forward_passes": self.num_passes,
               "num_tokens": self.num_tokens, "counts": self.recorded_counts().cpu().tolist()}
        if self.mode == "per_pass":
            out["passes"] = [{"num_tokens": n, "counts": c.cpu().tolist()} for n, c in self.passes]
        return out

    def dump(self, path: str | None = None) -> str:
        """Write :meth:`record` as JSON (atomically) and return the file's path."""
        if path is None:
            os.makedirs(self.directory, exist_ok=True)
            self._dumps += 1
            name = f"expert_distribution_{int(time.time() * 1000)}_{os.getpid()}_{self._dumps}.json"
            path = os.path.join(self.directory, name)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.record(), fh)
        os.replace(tmp, path)
        return path


def load_distribution(path: str) -> dict[str, Any]:
    """Read a file :meth:`ExpertDistributionRecorder.dump` wrote; ValueError if it is not one."""
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a radixserve expert distribution file")
    return data


def dump_expert_distribution_at_exit(scheduler) -> str | None:
    """At shutdown, with a recorder mode set: write what was recorded (path, or None)."""
    rec = scheduler.runner.expert_distribution
    if rec is None or scheduler.runner.args.expert_distribution_recorder_mode is None:
        return None
    if not rec.has_record:
        return None
    return rec.dump()
