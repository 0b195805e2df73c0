"""``radixserve serve --dp-size N``: N engine processes (whole replicas of the model)
behind one HTTP server.

:class:`DataParallelClient` offers the :class:`~radixserve_server.engine_client.EngineClient`
interface the server uses, over N of them: each submitted sequence goes to the replica the
routing policy picks from its token ids and the replicas' loads (sequences in flight there,
from this server), and stays there until it finishes. Each replica is started with
``dp_size=1``: the engine itself runs one replica and refuses ``--dp-size`` > 1.

Devices: on CPU the replicas share the machine's cores (``--num-threads`` each). On CUDA
each replica gets its own ``--tp-size`` GPUs, replica ``i`` the ``i``-th group of the
visible ones (through ``CUDA_VISIBLE_DEVICES`` of its processes), as SGLang places them;
with fewer GPUs than ``dp_size x tp_size`` the replicas share them round-robin, which needs
an explicit ``--mem-fraction-static`` small enough for all of them (else a ConfigError).

Faults: a replica that fails to start, dies or fails takes the server down, as one
engine does (SGLang's data parallelism fails loudly too): the others' waiting requests are
answered at once with 503 and ``on_death`` fires, so the server exits 1. Nothing is
re-routed: a replica's death is a fault to fix, not load to shed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from radixserve.config import ConfigError

from radixserve_server.engine_client import EngineClient, EngineError, RequestHandle
from radixserve_server.engine_proc import LEAK_EXIT_CODE, Update, engine_main
from radixserve_server.router.policy import PolicyArgs, RoutingPolicy, make_policy
from radixserve_server.router.tree import ids_key

_SUMMED_PREFIXES = ("num_", "max_")
_SUMMED_SUFFIXES = ("_tokens", "_bytes", "_count", "_loads", "_errors", "_seconds")


def combine_stats(replicas: list[dict]) -> dict:
    """One engine-like stats dict over the replicas: counts summed, ``token_usage`` and
    ``cache_hit_rate`` recomputed from the sums, other numbers averaged, anything else
    (per-layer tables, names) as replica 0 reports it."""
    out = dict(replicas[0])
    for key, value in replicas[0].items():
        values = [r.get(key) for r in replicas]
        if isinstance(value, bool) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in values):
            continue
        if key.startswith(_SUMMED_PREFIXES) or key.endswith(_SUMMED_SUFFIXES):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    if out.get("max_total_num_tokens"):
        out["token_usage"] = out.get("num_used_tokens", 0) / out["max_total_num_tokens"]
    if "num_prompt_tokens" in out:
        prompt = out["num_prompt_tokens"]
        out["cache_hit_rate"] = out.get("num_cached_prompt_tokens", 0) / prompt if prompt else 0.0
    return out


def replica_gpus(dp_size: int, tp_size: int, visible: list[str], shared_ok: bool) -> list[list[str]]:
    """The GPUs (entries of ``visible``) of each replica: replica ``i`` takes the ``i``-th
    ``tp_size`` of them, wrapping around (sharing) only when ``shared_ok``."""
    need = dp_size * tp_size
    if not visible:
        raise ConfigError("--dp-size with CUDA: no GPU is visible")
    if need > len(visible) and not shared_ok:
        raise ConfigError(f"--dp-size {dp_size} x --tp-size {tp_size} needs {need} GPUs, {len(visible)} visible; "
                          "lower --dp-size, or let replicas share GPUs by giving --mem-fraction-static small "
                          f"enough for {-(-need // len(visible))} of them per GPU")
    return [[visible[(i * tp_size + k) % len(visible)] for k in range(tp_size)] for i in range(dp_size)]


def _visible_gpus() -> list[str]:
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _uses_cuda(engine_kwargs: dict) -> bool:
    device = engine_kwargs.get("device", "auto")
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _environ(name: str, value: str | None):
    """``os.environ[name] = value`` while a replica's process is spawned (it copies the environment)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class DataParallelClient:
    """N :class:`EngineClient` replicas as one; see the module docstring."""

    def __init__(self, engine_kwargs: dict, dp_size: int, policy_args: PolicyArgs | None = None,
                 target: Callable = engine_main) -> None:
        if dp_size < 2:
            raise ValueError(f"dp_size must be >= 2 for data parallelism, got {dp_size}")
        self.engine_kwargs = engine_kwargs
        self.dp_size = dp_size
        self.policy_args = policy_args or PolicyArgs()
        self.policy: RoutingPolicy = make_policy(self.policy_args, seed=engine_kwargs.get("random_seed"))
        if engine_kwargs.get("nnodes", 1) > 1 or engine_kwargs.get("dist_init_addr"):
            raise ConfigError("--dp-size runs its replicas on this machine, each with its own rendezvous: drop "
                              "--nnodes / --dist-init-addr, or run one `radixserve serve` per replica and "
                              "`radixserve router --worker-urls ...` in front of them")
        self.gpus: list[list[str]] | None = None
        if _uses_cuda(engine_kwargs):
            self.gpus = replica_gpus(dp_size, engine_kwargs.get("tp_size", 1), _visible_gpus(),
                                     engine_kwargs.get("mem_fraction_static") is not None)
        replica_kwargs = dict(engine_kwargs, dp_size=1)
        self.replicas = [EngineClient(replica_kwargs, target) for _ in range(dp_size)]
        self.ids = [f"dp{i}" for i in range(dp_size)]
        self.num_routed = [0] * dp_size
        self.on_update: Callable[[Update], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self._error: str | None = None
        self._owner: dict[str, int] = {}  # rid -> replica, while the sequence runs
        self._pinned: dict[str, int] = {}  # rid -> replica chosen by the caller, until submitted
        self._lock = threading.Lock()
        for i, r in enumerate(self.replicas):
            r.on_update = self._updated
            r.on_death = lambda message, i=i: self._replica_died(i, message)

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        for i, r in enumerate(self.replicas):
            with _environ("CUDA_VISIBLE_DEVICES", ",".join(self.gpus[i]) if self.gpus else None):
                r.start()

    @property
    def started(self) -> bool:
        """Every replica is up, or one failed (then ``error`` says which and why)."""
        return self._error is not None or all(r.started for r in self.replicas)

    def wait_ready(self, timeout: float | None = None) -> dict:
        for r in self.replicas:
            r.wait_ready(timeout)
        return self.info

    @property
    def info(self) -> dict[str, Any] | None:
        first = self.replicas[0].info
        if first is None:
            return None
        return {**first, "dp_size": self.dp_size, "load_balance_method": self.policy.name}

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def ready(self) -> bool:
        return self._error is None and all(r.ready for r in self.replicas)

    @property
    def alive(self) -> bool:
        return self._error is None and all(r.alive for r in self.replicas)

    @property
    def failure(self) -> str | None:
        for i, r in enumerate(self.replicas):
            failure = r.failure
            if failure:
                return f"data-parallel replica {i}: {failure}"
        return None

    def shutdown(self, timeout: float = 10.0) -> int | None:
        """Stop every replica at once; the worst exit code (a leak's code first)."""
        codes: list[int | None] = [None] * self.dp_size

        def stop(i: int) -> None:
            codes[i] = self.replicas[i].shutdown(timeout)

        threads = [threading.Thread(target=stop, args=(i,), daemon=True) for i in range(self.dp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10.0)
        if LEAK_EXIT_CODE in codes:
            return LEAK_EXIT_CODE
        return next((c for c in codes if c), codes[0])

    def _replica_died(self, i: int, message: str) -> None:
        with self._lock:
            first = self._error is None
            if first:
                self._error = f"data-parallel replica {i}: {message}"
        if not first:
            return
        for j, r in enumerate(self.replicas):
            if j != i:
                r.fail_all(self._error)
        if self.on_death is not None:
            self.on_death(self._error)

    def _updated(self, u: Update) -> None:  # a replica's reader thread
        if u.finished:
            with self._lock:
                self._owner.pop(u.rid, None)
        if self.on_update is not None:
            self.on_update(u)

    # -------------------------------------------------------------- public
    def route(self, input_ids: list[int]) -> int:
        """The replica for a sequence with these token ids (recorded by the policy)."""
        loads = [r.num_in_flight() for r in self.replicas]
        return self.policy.select(self.ids, loads, ids_key(input_ids))

    def pin(self, rid: str, replica: int) -> None:
        """Send the sequence ``rid``, when it is submitted, to ``replica`` whatever the
        policy would say (``/health_generate`` probes every replica)."""
        with self._lock:
            self._pinned[rid] = replica

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict,
               priority: int | None = None, bootstrap: dict | None = None,
               cache_salt: str | None = None, lora_path: str | None = None) -> RequestHandle:
        if self._error is not None:
            raise EngineError(self._error)
        with self._lock:
            i = self._pinned.pop(rid, None)
        if i is None:
            i = self.route(input_ids)
        with self._lock:
            if rid in self._owner:
                raise ValueError(f"request id {rid!r} is already in use")
            self._owner[rid] = i
        try:
            handle = self.replicas[i].submit(rid, input_ids, sampling_params, priority, bootstrap, cache_salt,
                                             lora_path)
        except BaseException:
            with self._lock:
                self._owner.pop(rid, None)
            raise
        self.num_routed[i] += 1
        return handle

    def abort(self, rid: str) -> None:
        with self._lock:
            i = self._owner.get(rid)
        if i is not None:
            self.replicas[i].abort(rid)

    def fail_all(self, message: str) -> int:
        return sum(r.fail_all(message) for r in self.replicas)

    def num_in_flight(self) -> int:
        return sum(r.num_in_flight() for r in self.replicas)

    def in_flight(self) -> list[str]:
        return [rid for r in self.replicas for rid in r.in_flight()]

    def replica_stats(self, i: int) -> dict[str, Any]:
        """The router's numbers for replica ``i``."""
        r = self.replicas[i]
        return {"dp_rank": i, "pid": r.proc.pid if r.proc is not None else None, "alive": r.alive,
                "gpus": self.gpus[i] if self.gpus else None,
                "num_in_flight": r.num_in_flight(), "num_routed": self.num_routed[i],
                **self.policy.worker_stats(self.ids[i])}

    async def call(self, name: str, timeout: float | None = None, args: tuple = ()) -> Any:
        """An engine call (with ``args``) on every replica, the answers combined: ``get_stats`` sums them
        (with ``dp_replicas``, each replica's own stats and router numbers), ``flush_cache``
        succeeds when every replica flushed (and resets the router's trees), ``check_idle``
        reports the first replica's problem, the expert distribution calls answer replica
        0's reply (with every replica's ``paths`` for a dump)."""
        replies = await asyncio.gather(*(r.call(name, timeout, args) for r in self.replicas))
        if name == "get_stats":
            if not all(isinstance(s, dict) and "error" not in s for s in replies):
                return next(s for s in replies if not isinstance(s, dict) or "error" in s)
            out = combine_stats(replies)
            out["dp_size"] = self.dp_size
            out["load_balance_method"] = self.policy.name
            out["dp_replicas"] = [{**self.replica_stats(i), **s} for i, s in enumerate(replies)]
            return out
        if name == "flush_cache":
            if all(replies):
                for w in self.ids:
                    self.policy.remove_worker(w)
            return all(replies)
        if name == "check_idle":
            if "busy" in replies:
                return "busy"
            return next((f"data-parallel replica {i}: {p}" for i, p in enumerate(replies) if p), None)
        first = replies[0]
        if name == "dump_expert_distribution_record" and all(isinstance(r, dict) and "path" in r for r in replies):
            return {**first, "paths": [r["path"] for r in replies]}
        return next((r for r in replies if isinstance(r, dict) and "error" in r), first)
