"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

An adapter adds ``scaling * B @ A`` to each linear layer it targets: ``A  # [r, in]`` and
``B  # [out, r]`` per layer and module, ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with ``use_rslora``). Tensors are named as PEFT saves them,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``. What the
engine cannot serve is refused with the adapter's name and the reason: bias terms, DoRA,
``modules_to_save``, ``fan_in_fan_out``, a rank above ``--max-lora-rank``, a module outside
``--lora-target-modules``, a tensor whose shape does not match the base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter the engine cannot load, with its name and the reason."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r]) in float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    key: str = ""  # name and content hash: the adapter's prefix-cache namespace

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def load_adapter(name: str, path: str, *, max_rank: int | None = None,
                 target_modules: tuple[str, ...] | None = None) -> LoRAAdapter:
    """Read and check the adapter at ``path`` (shapes against the model come later, when it is
    placed in the pool)."""
    cfg_file, weights_file = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise LoRAError(f"LoRA adapter {name!r}: {f} not found (a PEFT adapter directory holds "
                            "adapter_config.json and adapter_model.safetensors)")
    try:
        with open(cfg_file) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {cfg_file}: {e}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r}, only LORA is served")
    for key, ok in (("bias", lambda v: v in (None, "none")), ("use_dora", lambda v: not v),
                    ("modules_to_save", lambda v: not v), ("fan_in_fan_out", lambda v: not v)):
        if not ok(cfg.get(key)):
            raise LoRAError(f"LoRA adapter {name!r}: {key}={cfg.get(key)!r} is not supported")
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: rank r={cfg.get('r')!r} must be a positive integer")
    if max_rank is not None and rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    from safetensors.torch import load_file

    try:
        raw = load_file(weights_file)
    except Exception as e:  # noqa: BLE001 - a corrupt file is the adapter's fault, say which
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {weights_file}: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for key in sorted(raw):
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights of "
                            "decoder layers' linear modules are served)")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if target_modules is not None and module not in target_modules:
            raise LoRAError(f"LoRA adapter {name!r}: targets {module}, outside --lora-target-modules "
                            f"({', '.join(target_modules)})")
        t = raw[key].float().contiguous()
        digest.update(key.encode())
        digest.update(t.numpy().tobytes())
        parts.setdefault((layer, module), {})[ab] = t
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A or lora_B but not both")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)} do not have rank {rank}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: no lora_A/lora_B tensors in {weights_file}")
    modules = tuple(sorted({m for _, m in weights}))
    return LoRAAdapter(name, path, rank, scaling, modules, weights, key=f"{name}@{digest.hexdigest()[:16]}")
