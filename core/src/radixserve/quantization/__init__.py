"""Quantized weights: the linear-method contract behind ``--quantization``.

A *quantization method* (a plugin kind, ``register_quantization_methods``) is a factory
``factory(QuantizationContext) -> QuantizationConfig``. The config hands every linear layer
of the model its :class:`LinearMethod` while the model is built, and says how the checkpoint
must be read (GGUF blocks kept as stored, or everything as float). A linear method owns the
layer's weight from start to end, in the three steps SGLang and vLLM also use:

* :meth:`LinearMethod.create_weights` — when the layer is built: register what the
  checkpoint loads into (nothing at all when the weight arrives in blocks);
* :meth:`LinearMethod.load_weight` — for each checkpoint tensor of the layer (this rank's
  shard, a float tensor or a :class:`GGUFTensor`), copy it into output rows ``(start, size)``;
* :meth:`LinearMethod.process_weights_after_loading` — once the model is placed on its
  device and dtype: quantize, repack for a kernel, free what the kernel does not need;
* :meth:`LinearMethod.apply` — ``x  # [M, K]`` -> ``# [M, N]`` (+ bias).

Built-in methods (:mod:`radixserve.quantization.methods`): ``none`` (the ``--dtype`` weights,
radixserve's packed float kernel on CPU), ``gguf`` (a GGUF file's blocks as stored, multiplied
by on-the-fly dequantising kernels), ``w8a16_int8`` (per-channel int8, quantized at load) and
``int4wo`` (per-group int4, quantized at load). Layers that must stay exact (MoE routers,
gates of one output) are built with ``quantize=False`` and always get the float method.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.quantization.base import (
    GGUFTensor,
    LinearMethod,
    QuantizationConfig,
    QuantizationContext,
    QuantizationError,
    current_config,
    quantization_scope,
)

__all__ = ["GGUFTensor", "LinearMethod", "QuantizationConfig", "QuantizationContext", "QuantizationError",
           "current_config", "default_method_name", "linear_method_for", "make_quantization",
           "model_weight_bytes", "quantization_scope"]


def linear_method_for(layer: nn.Module, quantize: bool = True) -> LinearMethod:
    """The method a linear layer being built gets: the scope's config's, or the float method
    (outside a scope, or for a layer built with ``quantize=False``)."""
    from radixserve.quantization.methods import UnquantizedLinearMethod

    config = current_config()
    if config is None or not quantize:
        return UnquantizedLinearMethod()
    return config.linear_method(layer)


def default_method_name(checkpoint_format: str) -> str:
    """``--quantization`` when not given: a GGUF file's blocks as stored, else the float weights."""
    return "gguf" if checkpoint_format == "gguf" else "none"


def make_quantization(registry, name: str | None, checkpoint_format: str, device: torch.device,
                      dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
                      flag: str = "--quantization", keep_16bit_weights: bool = False) -> QuantizationConfig:
    """The ``flag`` config for a checkpoint (``name`` None: :func:`default_method_name`),
    resolved through the plugin registry; an unknown, unavailable or unfitting method is a
    :class:`QuantizationError` naming the flag (``--speculative-draft-model-quantization``
    for a draft model)."""
    from radixserve.registry import PluginError

    name = name or default_method_name(checkpoint_format)
    try:
        entry = registry.resolve("quantization", name, flag=flag)
    except PluginError as e:
        raise QuantizationError(str(e)) from None
    try:
        return entry.factory(QuantizationContext(device=device, dtype=dtype, checkpoint_format=checkpoint_format,
                                                 weight_dtype=weight_dtype,
                                                 keep_16bit_weights=keep_16bit_weights))
    except QuantizationError as e:
        if flag == "--quantization":
            raise
        raise QuantizationError(str(e).replace("--quantization", flag)) from None


def model_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """``(all weights, the token embedding table)`` in resident bytes, as the linear methods
    and the embedding keep them after processing (packed panels, blocks, int8/int4)."""
    total = embed = 0
    for module in model.modules():
        if hasattr(module, "weight_nbytes"):  # linear layers and embeddings: their method decides
            n = module.weight_nbytes()
            if hasattr(module, "qtable"):
                embed += n
        else:
            n = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        total += n
    return total, embed
