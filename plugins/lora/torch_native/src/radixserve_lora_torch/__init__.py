"""radixserve LoRA backend ``torch_native``: the rows of each adapter in the step gathered
once per step (:meth:`TorchNativeLoRA.prepare`), then per layer and adapter two matmuls (the
shrink to rank R and the expand) and an ``index_add_`` of the scaled delta into the output.
Runs wherever torch does; the batch is grouped by adapter, never merged into the weights."""

from __future__ import annotations

from radixserve.plugin_api import hookimpl


def make_backend(ctx):
    from radixserve_lora_torch.backend import TorchNativeLoRA

    return TorchNativeLoRA(ctx)


@hookimpl
def register_lora_backends(register):
    register("torch_native", make_backend,
             description="grouped per-adapter matmuls in PyTorch (shrink, expand, index_add); any device")
