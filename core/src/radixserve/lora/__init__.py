"""LoRA adapters over the base model (``--enable-lora``, ``--lora-paths``; SGLang's names).

* :mod:`.adapter` reads and checks a PEFT adapter directory;
* :mod:`.backend` is the LoRA backend contract (``--lora-backend``: the plugins compute the
  adapters' deltas of a batch whose rows use different adapters) and the step context the
  model's linear layers read;
* :mod:`.manager` keeps the loaded adapters and the pool of slots a batch's adapters sit in,
  and gives the targeted linear layers their stacks.

A request names its adapter (``lora_path`` on ``/generate`` and ``Engine.generate``, the
adapter's name as ``model`` on the OpenAI routes); its KV is cached under the adapter's own
prefix-cache namespace, so no other adapter (or the base model) reuses it.
"""

from radixserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from radixserve.lora.backend import LoRABackend, LoRAContext, current_lora, lora_step, reference_apply

__all__ = ["LoRAAdapter", "LoRABackend", "LoRAContext", "LoRAError", "current_lora", "load_adapter", "lora_step",
           "reference_apply"]
