"""The offline engine's calls that run on the scheduler's thread, between steps: flushing the
prefix cache, the expert distribution recorder, loading and unloading LoRA adapters
(:class:`SchedulerCalls`, a base of :class:`~radixserve.engine.engine.Engine`)."""

from __future__ import annotations

import threading
import time

from radixserve.engine.lora import adapters_in_use, load_adapter, unload_adapter

WAIT_POLL_SECONDS = 0.2  # how often a waiting caller checks that the engine is still alive
DEFAULT_CALL_TIMEOUT = 60.0  # flush_cache and other calls on the scheduler's thread


class EngineError(RuntimeError):
    """The engine stopped (its scheduler loop died, or it was shut down) while a call waited."""


class SchedulerCalls:
    def flush_cache(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> bool:
        """Drop every cached prefix; refused (False) while requests are running. Raises
        EngineError if the engine stops, TimeoutError after ``timeout`` seconds."""
        return self._on_scheduler_thread(self.scheduler.flush_cache, timeout)

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
        """Load a PEFT LoRA adapter at run time (on every rank) under ``lora_name``; requests
        name it in ``lora_path``. Raises LoRAError naming what is wrong with it."""
        self._on_scheduler_thread(lambda: load_adapter(self.runner, lora_name, lora_path), timeout)

    def unload_lora_adapter(self, lora_name: str, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
        """Unload an adapter; refused (LoRAError) while queued or running requests use it."""
        self._on_scheduler_thread(
            lambda: unload_adapter(self.runner, lora_name, adapters_in_use(self.scheduler.queues)), timeout)

    def start_expert_distribution_record(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
        """MoE models: begin recording the expert load (per layer and expert; also per
        forward pass with ``--expert-distribution-recorder-mode per_pass``)."""
        self._on_scheduler_thread(lambda: self.scheduler.expert_distribution_record("start"), timeout)

    def stop_expert_distribution_record(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
        """Freeze the recording; a later dump still writes it."""
        self._on_scheduler_thread(lambda: self.scheduler.expert_distribution_record("stop"), timeout)

    def dump_expert_distribution_record(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> str:
        """Write the recording as JSON in ``--expert-distribution-recorder-dir`` and return
        the file's path (format: :mod:`radixserve.engine.expert_distribution`)."""
        return self._on_scheduler_thread(lambda: self.scheduler.expert_distribution_record("dump"), timeout)

    def _on_scheduler_thread(self, fn, timeout: float | None = DEFAULT_CALL_TIMEOUT):
        with self._inline_lock:
            self._check_alive()
            if self._thread is None:
                return fn()
            box: list = []
            done = threading.Event()
            self._inbox.put(("call", (fn, box, done)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(WAIT_POLL_SECONDS):
            self._check_alive()
            if self._thread is None or not self._thread.is_alive():
                raise EngineError("the engine's scheduler thread is not running")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler did not answer within {timeout:g} s")
        if not box:
            return None
        ok, value = box[0]
        if not ok:
            raise value
        return value

