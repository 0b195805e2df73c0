"""The adapters an engine serves: loaded adapters by name, and the pool of slots a batch's
adapters must sit in (``--max-loras-per-batch``).

At start-up every targeted linear layer of the model gets its stacks (a
:class:`~radixserve.lora.backend.LoRALayer`, zeros), sized for ``--max-loras-per-batch`` slots
of rank ``--max-lora-rank``. An adapter enters a slot when the scheduler admits a request of it
(:meth:`LoRAManager.ensure_slot`): a slot already holding it, else a free one, else the
least recently used one whose adapter no running request uses; if none, the request waits.
A running request's adapter never leaves its slot, so a batch's slots are stable for the
requests in it.

Tensor parallelism: every rank holds its shard of each adapter (A's columns of a row-parallel
layer, B's rows of a column-parallel one) in the same slots. Rank 0's scheduler picks the
slots; each fill is announced (:attr:`LoRAManager.announce`) and the other ranks repeat it
before their next step (:meth:`LoRAManager.services`), as they repeat run-time loads and
unloads. Adapters are copied into slots in float32 (the delta is added to the base
layer's output in the activations' dtype, whatever the base weights' quantization).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.config.lora import LORA_TARGET_MODULES, lora_name_and_path
from radixserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from radixserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from radixserve.lora.backend import LoRABackend, LoRALayer, LoRAStep, lora_step

logger = logging.getLogger(__name__)

# Hugging Face module name -> (the model's module, its part in a fused layer)
_FUSED = {"q_proj": ("self_attn.qkv_proj", "q_proj"), "k_proj": ("self_attn.qkv_proj", "k_proj"),
          "v_proj": ("self_attn.qkv_proj", "v_proj"), "o_proj": ("self_attn.o_proj", None),
          "gate_proj": ("mlp.gate_up_proj", "gate_proj"), "up_proj": ("mlp.gate_up_proj", "up_proj"),
          "down_proj": ("mlp.down_proj", None)}


@dataclass
class _Target:
    """One adapted (layer, module): its stacks and which rows/columns of the full module this
    rank holds, each ``(full, first held, held)``."""

    a: torch.Tensor  # [S, R, cols held]
    b: torch.Tensor  # [S, R, rows held] (B transposed)
    rows: tuple[int, int, int]
    cols: tuple[int, int, int]


class LoRAManager:
    def __init__(self, model: nn.Module, args, make_backend) -> None:
        """``make_backend(max_loras, max_rank)`` builds the LoRA backend once the pool's rank is known."""
        self.max_slots = args.max_loras_per_batch
        self.max_loaded = args.max_loaded_loras
        specs = [lora_name_and_path(s) for s in args.lora_paths or ()]
        initial = [load_adapter(n, p, max_rank=args.max_lora_rank, target_modules=self._targets_flag(args))
                   for n, p in specs]
        self.max_rank = args.max_lora_rank or max(a.rank for a in initial)
        self.targets = self._targets_flag(args) or tuple(sorted({m for a in initial for m in a.target_modules}))
        self.backend: LoRABackend = make_backend(self.max_slots, self.max_rank)
        dev = self.backend.ctx.device
        self.scaling = torch.zeros(self.max_slots, dtype=torch.float32, device=dev)
        self.layers: dict[tuple[int, str], _Target] = {}  # (layer, Hugging Face module) -> its stacks
        self._attach(model, dev)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * self.max_slots  # adapter name per slot
        self._lru: OrderedDict[str, None] = OrderedDict()  # adapters in slots, least recent first
        # rank 0 of a multi-rank replica: tells the other ranks (announce("lora.fill", slot, name))
        self.announce: Callable[..., None] | None = None
        self._last: torch.Tensor | None = None  # the last step's rows' slots (see recording)
        for adapter in initial:
            self.add(adapter)

    @staticmethod
    def _targets_flag(args) -> tuple[str, ...] | None:
        mods = args.lora_target_modules
        if not mods:
            return None
        return LORA_TARGET_MODULES if "all" in mods else tuple(sorted(set(mods)))

    def _attach(self, model: nn.Module, dev: torch.device) -> None:
        """Give every targeted linear layer of this rank's decoder layers its (zero) stacks."""
        modules = dict(model.named_modules())
        r = self.max_rank
        for layer_id in range(getattr(model, "start", 0), getattr(model, "end", len(model.layers))):
            by_module: dict[str, list] = {}  # the layer's adapted modules: (offset, b, hf) per part
            for hf in self.targets:
                path, part = _FUSED[hf]
                linear = modules.get(f"layers.{layer_id}.{path}")
                if not isinstance(linear, Linear):
                    raise LoRAError(f"LoRA target module {hf}: the model has no layers.{layer_id}.{path} "
                                    "linear layer to adapt")
                rows = (linear.out_features, 0, linear.out_features)  # (full, first held, held)
                cols = (linear.in_features, 0, linear.in_features)
                offset = 0
                if isinstance(linear, ColumnParallelLinear):
                    part = part if part is not None else next(iter(linear.parts))
                    rows, offset = linear.parts[part], linear._offsets[part]
                elif isinstance(linear, RowParallelLinear):
                    cols = (linear.full_in_features, linear.in_start, linear.in_features)
                b = torch.zeros(self.max_slots, r, rows[2], device=dev)
                by_module.setdefault(path, []).append((offset, b, hf, rows, cols))
            for path, parts in by_module.items():  # one A over the module's parts: they share x
                a = torch.zeros(self.max_slots, len(parts) * r, parts[0][4][2], device=dev)
                for p, (_, b, hf, rows, cols) in enumerate(parts):
                    self.layers[(layer_id, hf)] = _Target(a[:, p * r:(p + 1) * r], b, rows, cols)
                modules[f"layers.{layer_id}.{path}"].lora = LoRALayer(a, [(o, b) for o, b, *_ in parts], self.scaling)

    # ------------------------------------------------------------------ adapters
    def add(self, adapter: LoRAAdapter) -> None:
        """Register a loaded adapter (checked against the model and the pool's rank and targets)."""
        if adapter.name in self.adapters:
            raise LoRAError(f"LoRA adapter {adapter.name!r} is already loaded")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise LoRAError(f"LoRA adapter {adapter.name!r}: {len(self.adapters)} adapters are loaded, the most "
                            f"--max-loaded-loras allows; unload one first")
        if adapter.rank > self.max_rank:
            raise LoRAError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above the pool's "
                            f"--max-lora-rank {self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            if (layer, module) not in self.layers:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: targets layer {layer} {module}, which the pool "
                                f"does not adapt (--lora-target-modules: {', '.join(self.targets)})")
            t = self.layers[(layer, module)]
            out, k = t.rows[0], t.cols[0]
            if a.shape[1] != k or b.shape[0] != out:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)} do not fit the model's [{out}, {k}] layer")
        self.adapters[adapter.name] = adapter

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(name, path, max_rank=self.max_rank, target_modules=self.targets)
        self.add(adapter)
        return adapter

    def unload(self, name: str, in_use: set) -> None:
        """Forget adapter ``name``; refused while a request in ``in_use`` (queued or running) needs it."""
        if name not in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self.adapters) or 'none'}")
        if name in in_use:
            raise LoRAError(f"LoRA adapter {name!r} is in use by queued or running requests; unload it once they "
                            "finish")
        del self.adapters[name]
        if name in self.slots:
            self.slots[self.slots.index(name)] = None
            del self._lru[name]

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    # ------------------------------------------------------------------ slots
    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.slots.index(name)

    def ensure_slot(self, name: str, in_use: set) -> int | None:
        """The slot holding adapter ``name``, loading it into a free slot or over the least
        recently used adapter outside ``in_use`` (the running requests' adapters); None when
        every slot holds an adapter in use."""
        if name in self.slots:
            self._lru.move_to_end(name)
            return self.slots.index(name)
        free = next((i for i, n in enumerate(self.slots) if n is None), None)
        if free is None:
            victim = next((n for n in self._lru if n not in in_use), None)
            if victim is None:
                return None
            free = self.slots.index(victim)
        self.fill_slot(free, name)
        if self.announce is not None:
            self.announce("lora.fill", free, name)
        return free

    def fill_slot(self, slot: int, name: str) -> None:
        """Copy adapter ``name`` into ``slot`` (over whatever it held)."""
        if self.slots[slot] == name:
            return
        if name not in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded on this rank")
        self._lru.pop(self.slots[slot], None)
        self._fill(slot, self.adapters[name])
        self.slots[slot] = name
        self._lru[name] = None

    def services(self) -> dict[str, Callable[[Any], Any]]:
        """The other ranks' handlers: run-time loads and unloads (service calls, rank 0 having
        checked them), and slot fills (deferred to the next step)."""
        def load(payload) -> None:
            self.load(*payload)

        return {"lora.load": load, "lora.unload": lambda name: self.unload(name, set()),
                "lora.fill": lambda values: self.fill_slot(*values)}

    @torch.no_grad()
    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        r = adapter.rank
        for key, t in self.layers.items():
            t.a[slot].zero_()
            t.b[slot].zero_()
            w = adapter.weights.get(key)
            if w is None:
                continue
            wa, wb = w  # [r, in], [out, r]: this rank's columns of A, rows of B
            t.a[slot, :r] = wa[:, t.cols[1]:t.cols[1] + t.cols[2]].to(t.a.device)
            t.b[slot, :r] = wb[t.rows[1]:t.rows[1] + t.rows[2]].T.to(t.b.device)
        self.scaling[slot] = adapter.scaling

    def slots_for(self, reqs) -> list[int] | None:
        """Each request's slot (-1: the base model); None when no request has an adapter."""
        if all(r.lora_name is None for r in reqs):
            return None
        return [self.slot_of(r.lora_name) for r in reqs]

    def step(self, slots: list[int] | None, extend_lens: list[int]) -> LoRAStep | None:
        """The step's LoRA state for requests in slots ``slots`` (None or all -1: no adapter;
        None then, unless the backend's calls may be recorded in a decode graph: a replayed
        graph reads every step's plan, empty or not)."""
        if not self.backend.supports_cuda_graph:
            if slots is None or max(slots) < 0:
                return None
        elif slots is None:
            slots = [-1] * len(extend_lens)
        dev = self.scaling.device
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64, device=dev),
                                              torch.tensor(extend_lens, device=dev))
        self._last = token_slots
        return LoRAStep(self.backend, self.backend.prepare(token_slots))

    @contextlib.contextmanager
    def recording(self, rows: int) -> Iterator[None]:
        """A decode graph of ``rows`` rows is recorded under an empty step (its LoRA calls made,
        none of them adding anything); then the step being run, if any, gets its plan back."""
        empty = torch.full((rows,), -1, dtype=torch.int64, device=self.scaling.device)
        with lora_step(LoRAStep(self.backend, self.backend.prepare(empty))):
            yield
        if self._last is not None:
            self.backend.prepare(self._last)
