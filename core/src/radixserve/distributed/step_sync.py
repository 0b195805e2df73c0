"""The step protocol of a multi-rank replica: rank 0 decides, every rank runs the same step.

Rank 0 owns the scheduler, the radix cache and the request-to-token table; the other ranks
("followers") own only their slice of the weights and of the KV pool. Before each forward
pass rank 0 sends ONE message describing the step; every follower rebuilds the identical
:class:`ForwardBatch` around its own KV
pool and runs the model, so the layers' collectives line up. Rank 0 samples; the
followers drop their logits. Messages::

    ("step", fields)   the ForwardBatch's fields, plus "table": the
                       request-to-token entries the follower does not have yet, and
                       "ops": KV operations rank 0 did since the last step or call
                       (speculative decoding's K/V moves, HiCache's host copies),
                       applied before the forward
    ("call", {"name", "payload", "ops"})
                       a service call every rank answers (rank 0 too): the deferred
                       "ops" first, then each runs its handler for ``name`` (e.g. the KV
                       transfer agent's, HiCache's storage reads) and the replies are
                       gathered to every rank in rank order (:meth:`StepDriver.call`)
    ("ping", None)     rank 0 is idle and alive (sent every HEARTBEAT_S without a step)
    ("stop", None)     the replica stops: followers leave their loop and exit 0

Table invariant: rank 0 keeps ``shadow``, a copy of what every follower's table holds.
Each step, for the batch's rows up to each request's ``seq_len`` (what attention reads),
the entries where rank 0's table differs from ``shadow`` are sent and copied into
``shadow``. Cached prefixes the scheduler writes into its table, slots moved by the radix
cache, rows reused by new requests: all reach a follower before a step reads them, and
only then (a decode step sends one entry per request).

Wire format (:class:`MessageChannel`): the message is encoded with
:mod:`radixserve.distributed.wire` (plain data, numpy arrays and the ForwardMode enum only,
never pickle: a follower runs no code from the bytes it receives, and refuses a message
that does not parse) and sent in ONE broadcast of a fixed ``MESSAGE_BYTES`` buffer over the
replica's gloo group (an 8-byte length, then the message); a longer message (a large
prefill) sends its remainder in a second broadcast. Encoding and decoding a decode step's
message of 1 / 32 / 256 requests takes ~0.07 / 0.07 / 0.11 ms (pickle: 0.04 / 0.04 / 0.05
ms); the broadcast itself, 0.3-0.5 ms on 2 CPU ranks (gloo, loopback, 2 busy cores),
dominates.

Lockstep: a step, and the heartbeat, hold one lock for the whole forward pass, so their
collectives never interleave. Once any rank fails inside a step the ranks can no longer
be known to be in step: the driver marks itself failed, reports it (``on_failure``) and
every later step raises :class:`RanksFailed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from radixserve.distributed import get_parallel_state
from radixserve.distributed.wire import Decoder, Encoder, WireFormatError
from radixserve.layers.attention import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # an idle rank 0 pings its followers this often (a dead one is found then)
MESSAGE_BYTES = 32768  # the one broadcast of a step; decode batches of ~300 requests fit
POOL_OPS = ("move_kv",)  # KVPool methods rank 0 may ask the followers to repeat
# handlers rank 0 may defer to the next step (HiCache's host copies, LoRA slot fills)
DEFERRABLE_PREFIXES = ("hicache.", "lora.")
_LOCAL_FIELDS = ("req_to_token", "kv_pool", "attn_metadata", "extra")  # each rank's own, never sent
_ENUMS = (ForwardMode,)  # the only classes a step message names


class RanksFailed(RuntimeError):
    """A rank of this replica died or lost step with the others; the replica cannot go on."""


class RankCallError(RuntimeError):
    """A service call's handler raised on some rank (the ranks are still in step)."""


def answer(handlers: dict[str, Callable[[Any], Any]], name: str, payload: Any) -> tuple[str, Any]:
    """One rank's reply to a service call: ``("ok", value)`` or ``("error", message)`` (a
    handler's exception never leaves the call: the other ranks wait for this reply)."""
    handler = handlers.get(name)
    if handler is None:
        return "error", f"no handler for the call {name!r} on this rank"
    try:
        return "ok", handler(payload)
    except Exception as e:  # noqa: BLE001 - reported to the caller, which fails its request only
        logger.exception("the call %r failed on this rank", name)
        return "error", f"{type(e).__name__}: {e}"


def replies(answers: list[tuple[str, Any]], name: str) -> list[Any]:
    """The values of every rank's answer, or RankCallError naming the first rank that failed."""
    for rank, (status, value) in enumerate(answers):
        if status != "ok":
            raise RankCallError(f"rank {rank}: {name}: {value}")
    return [value for _, value in answers]


def _to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.cpu()
        if value.dtype in (torch.bfloat16,):  # no numpy dtype: pickled as a tensor
            return value
        return value.numpy()
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return tuple(_to_wire(v) for v in value)
    return value


def _from_wire(value: Any, device: torch.device) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value).to(device)
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and value and isinstance(value[0], (np.ndarray, torch.Tensor)):
        return tuple(_from_wire(v, device) for v in value)
    return value


class MessageChannel:
    """Rank 0 broadcasts Python messages to the replica's other ranks over its CPU (gloo)
    group: one fixed-size broadcast per message (two when it is longer)."""

    def __init__(self, capacity: int = MESSAGE_BYTES) -> None:
        self.group = get_parallel_state().cpu_group
        self.buf = torch.zeros(capacity, dtype=torch.uint8)
        self.view = self.buf.numpy()
        self.encoder, self.decoder = Encoder(_ENUMS), Decoder(_ENUMS)

    def send(self, message: Any) -> None:
        """Broadcast ``message``; raises WireFormatError (before sending anything) for a
        value outside the wire schema."""
        data = self.encoder.dumps(message)
        n, room = len(data), self.buf.numel() - 8
        self.view[:8] = np.frombuffer(n.to_bytes(8, "little"), dtype=np.uint8)
        self.view[8:8 + min(n, room)] = np.frombuffer(data, dtype=np.uint8, count=min(n, room))
        dist.broadcast(self.buf, 0, group=self.group)
        if n > room:
            rest = torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)

    def recv(self) -> Any:
        dist.broadcast(self.buf, 0, group=self.group)
        n, room = int.from_bytes(self.view[:8].tobytes(), "little"), self.buf.numel() - 8
        data = self.view[8:8 + min(n, room)].tobytes()
        if n > room:
            rest = torch.empty(n - room, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)
            data += rest.numpy().tobytes()
        return self.decoder.loads(data)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (two all-gathers: the encoded
        lengths, then the bytes padded to the longest)."""
        data = self.encoder.dumps(value)
        world = dist.get_world_size(self.group)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(t) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(parts, mine, group=self.group)
        return [self.decoder.loads(p.numpy()[:int(n)].tobytes()) for p, n in zip(parts, sizes, strict=True)]


class StepDriver:
    """Rank 0's side: describes each step to the followers and keeps them alive."""

    def __init__(self, table: torch.Tensor, on_failure: Callable[[str], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.table = table  # [R, W] rank 0's request-to-token table
        self.shadow = torch.zeros_like(table)  # [R, W] what the followers' tables hold
        self.on_failure = on_failure
        self.failure: str | None = None
        self.channel = MessageChannel()
        self._ops: list[tuple] = []  # pool operations the followers have not done yet
        self._ops_lock = threading.Lock()  # defer() runs on the scheduler thread, calls on any
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), name="radixserve-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------ messages
    def describe(self, batch: ForwardBatch) -> dict[str, Any]:
        """The step's message: every ForwardBatch field a follower cannot know (tensors as
        numpy arrays)."""
        fields = {f.name: _to_wire(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                  if f.name not in _LOCAL_FIELDS}
        fields["table"] = self._table_delta(batch.req_pool_indices, batch.seq_lens_cpu)
        fields["ops"] = self._take_ops()
        return fields

    def defer(self, op: str, *values: Any) -> None:
        """An operation rank 0 just did on its KV (``op`` names a KVPool method in POOL_OPS,
        or a handler the followers were started with, e.g. HiCache's host copies); the
        followers do it at the start of the next step or service call, before anything reads
        what it wrote. Operations run in the order they were deferred."""
        item = (op, *(_to_wire(v) for v in values))
        with self._ops_lock:
            self._ops.append(item)

    def _take_ops(self) -> list[tuple]:
        with self._ops_lock:
            ops, self._ops = self._ops, []
        return ops

    def _table_delta(self, rows: torch.Tensor, seq_lens: list[int]) -> tuple[np.ndarray, ...]:
        """(rows, columns, slots) of the entries of ``rows`` below each ``seq_len`` that the
        followers lack; ``shadow`` takes them."""
        width = max(seq_lens, default=0)
        if width == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        cur = self.table[rows, :width]  # [B, W]
        lens = torch.tensor(seq_lens, device=cur.device)
        valid = torch.arange(width, device=cur.device)[None, :] < lens[:, None]
        changed = (cur != self.shadow[rows, :width]) & valid
        i, col = changed.nonzero(as_tuple=True)
        row, slot = rows[i], cur[i, col]
        self.shadow[row, col] = slot
        return row.cpu().numpy(), col.cpu().numpy(), slot.cpu().numpy()

    # ------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, batch: ForwardBatch) -> Iterator[None]:
        """Around rank 0's own forward pass: send the step, hold the ranks' lock until done."""
        with self._lock:
            if self.failure is not None:
                raise RanksFailed(self.failure)
            try:
                self.channel.send(("step", self.describe(batch)))
            except Exception as e:
                self.fail(f"could not send the step to the other ranks ({type(e).__name__}: {e})")
                raise RanksFailed(self.failure) from e
            self._last_sent = time.monotonic()
            try:
                yield
            except Exception as e:
                self.fail(f"a forward step failed on rank 0 after the other ranks started it "
                          f"({type(e).__name__}: {e}); the ranks are out of step")
                raise RanksFailed(self.failure) from e

    def call(self, name: str, payload: Any, handlers: dict[str, Callable[[Any], Any]]) -> list[Any]:
        """Run the service call ``name`` on every rank (rank 0 with ``handlers``, a follower
        with those it was started with) and return every rank's reply in rank order; raises
        RankCallError when a handler failed (the replica goes on), RanksFailed when a rank is
        gone. Between forward steps, under the same lock."""
        with self._lock:
            if self.failure is not None:
                raise RanksFailed(self.failure)
            try:
                # what was deferred runs first, in order
                self.channel.send(("call", {"name": name, "payload": payload, "ops": self._take_ops()}))
                self._last_sent = time.monotonic()
                answers = self.channel.gather(answer(handlers, name, payload))
            except Exception as e:
                self.fail(f"the call {name!r} to the other ranks failed ({type(e).__name__}: {e})")
                raise RanksFailed(self.failure) from e
        return replies(answers, name)

    def fail(self, reason: str) -> None:
        """Mark the replica failed (once) and report it."""
        if self.failure is not None:
            return
        self.failure = reason
        self._closed.set()
        logger.error("multi-rank replica failed: %s", reason)
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - reporting must not hide the failure itself
                logger.exception("the rank failure handler raised")

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval / 4):
            if time.monotonic() - self._last_sent < interval:
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    self.channel.send(("ping", None))
                except Exception as e:  # noqa: BLE001 - a rank went away
                    self.fail(f"a rank stopped answering ({type(e).__name__}: {e})")
                    return
                self._last_sent = time.monotonic()

    def stop(self, timeout: float = 10.0) -> bool:
        """Tell the followers to leave (unless the replica failed); stops the heartbeat.
        True when the stop message went out."""
        if not self._lock.acquire(timeout=timeout):  # a step is stuck; the caller kills the ranks
            self._closed.set()
            return False
        try:
            self._closed.set()
            if self.failure is not None:
                return False
            try:
                self.channel.send(("stop", None))
            except Exception as e:  # noqa: BLE001
                logger.warning("could not tell the other ranks to stop: %r", e)
                return False
            self.failure = "the replica was shut down"
            return True
        finally:
            self._lock.release()


def _apply_ops(runner, ops: list, handlers: dict[str, Callable[[Any], Any]]) -> None:
    """A follower does the operations rank 0 deferred: KVPool methods (POOL_OPS, tensors on
    this rank's device) or its handlers (given the values as sent)."""
    for op, *values in ops:
        if op in POOL_OPS:
            getattr(runner.kv_pool, op)(*(_from_wire(v, runner.device) for v in values))
        elif op in handlers and op.startswith(DEFERRABLE_PREFIXES):
            handlers[op](values)
        else:
            raise RanksFailed(f"rank 0 sent an unknown KV operation {op!r}")


def runner_services(runner) -> dict[str, Callable[[Any], Any]]:
    """The service calls every rank answers about its own model, whatever features run:
    ``embedding_rows``: its slice of the token embedding (the whole table is gathered on rank 0
    when a module there needs it, e.g. an EAGLE draft head); with LoRA adapters, their loads,
    unloads and slot fills (:meth:`~radixserve.lora.manager.LoRAManager.services`)."""
    services = {"embedding_rows": lambda _payload: _to_wire(runner.model.embed_tokens.local_rows(runner.device))}
    if getattr(runner, "lora", None) is not None:
        services.update(runner.lora.services())
    return services


def gather_embedding(runner) -> Callable[[], torch.Tensor] | None:
    """Rank 0 of a multi-rank replica: a function that gathers the model's whole token
    embedding ``# [V, H]`` from every rank's slice, in rank order (None on one rank)."""
    if runner.step_driver is None:
        return None

    def gather() -> torch.Tensor:
        parts = runner.step_driver.call("embedding_rows", None, runner_services(runner))
        return torch.cat([_from_wire(p, runner.device) for p in parts])

    return gather


def follow_steps(runner, handlers: dict[str, Callable[[Any], Any]] | None = None) -> None:
    """A follower's loop: rebuild and run every step rank 0 describes, until ("stop", ...);
    answer service calls (:func:`runner_services` and ``handlers``). Raises when rank 0 goes away (the broadcast
    fails) or a step fails here."""
    device = runner.device
    table = runner.req_to_token_pool.req_to_token
    state = get_parallel_state()
    channel = MessageChannel()
    handlers = {**runner_services(runner), **(handlers or {})}
    while True:
        try:
            kind, fields = channel.recv()
        except (WireFormatError, ValueError) as e:  # ValueError: not a (kind, fields) pair
            raise RanksFailed(f"rank {state.tp_rank}: refused a step message from rank 0: {e}") from e
        if kind == "stop":
            logger.info("rank %d: the replica stops", state.tp_rank)
            return
        if kind == "call":
            if not isinstance(fields, dict) or not isinstance(fields.get("name"), str):
                raise RanksFailed(f"rank {state.tp_rank}: refused a malformed call from rank 0")
            _apply_ops(runner, fields.get("ops") or [], handlers)
            channel.gather(answer(handlers, fields["name"], fields.get("payload")))
            continue
        if kind != "step":
            continue
        row, col, slot = (torch.from_numpy(a).to(device) for a in fields.pop("table"))
        if row.numel():
            table[row, col] = slot
        _apply_ops(runner, fields.pop("ops"), handlers)
        fields = {k: _from_wire(v, device) for k, v in fields.items()}
        batch = ForwardBatch(**fields, req_to_token=table, kv_pool=runner.kv_pool)
        runner.forward_local(batch)  # the logits are rank 0's to sample; dropped here


__all__ = ["StepDriver", "MessageChannel", "RanksFailed", "RankCallError", "answer", "replies", "follow_steps",
           "runner_services", "gather_embedding", "HEARTBEAT_S", "MESSAGE_BYTES"]
