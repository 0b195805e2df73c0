"""Hook specifications: one ``register_*`` hook per kind of plugin.

Every hook receives a ``register`` callback from the host and calls it once per thing it
provides::

    register(name, factory, probe=None, description="")

``factory`` builds the object the engine uses (its arguments depend on the kind, see
docs/plugins.md); ``probe`` is an optional zero-argument callable that returns ``None``
when the backend can run here, or a short reason why not ("needs CUDA", "flashinfer is
not installed"). Hooks are called once at start-up, never on the per-token path.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "radixserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_attention_backends(register):
    """Register attention backends (``--attention-backend`` and its prefill/decode variants)."""


@hookspec
def register_moe_runners(register):
    """Register MoE runners that compute experts over routed tokens (``--moe-runner-backend``)."""


@hookspec
def register_moe_a2a_backends(register):
    """Register MoE all-to-all transports that dispatch and combine tokens (``--moe-a2a-backend``)."""


@hookspec
def register_cache_tiers(register):
    """Register KV cache tiers below the device pool (``--hicache-storage-backend``)."""


@hookspec
def register_kv_transfer_backends(register):
    """Register KV transfer engines that move KV pages between prefill and decode servers."""


@hookspec
def register_speculative_algorithms(register):
    """Register speculative decoding methods that propose draft tokens (``--speculative-algorithm``)."""


@hookspec
def register_grammar_backends(register):
    """Register structured-output backends that compile grammars into logit masks (``--grammar-backend``)."""


@hookspec
def register_quantization_methods(register):
    """Register weight quantization methods that give linear layers their storage and kernel (``--quantization``)."""


@hookspec
def register_lora_backends(register):
    """Register LoRA backends that add adapters' deltas to a batch's linear layers (``--lora-backend``)."""


@hookspec
def register_model_architectures(register):
    """Register model classes by the architecture name found in a checkpoint's config."""


@hookspec
def register_commands(register):
    """Register ``radixserve <command>`` subcommands as (name, add_arguments, run) triples."""
