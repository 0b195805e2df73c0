"""Loading a draft model: its checkpoint and module, its linear method, its attention
backend (the target's prefill backend built for the draft's shapes), and the handles of the
engine the draft-model base needs (``SpeculativeContext.core``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.config import ServerArgs
from radixserve.engine.moe import setup_moe
from radixserve.layers.attention import AttentionBackend, AttentionContext, check_kv_dtype
from radixserve.quantization import QuantizationConfig, make_quantization, quantization_scope
from radixserve.speculative import SpeculativeContext

if TYPE_CHECKING:
    from radixserve.model_loader import LoadedCheckpoint
    from radixserve.models.config import ModelConfig
    from radixserve.registry import Registry

DRAFT_FLAG = "--speculative-draft-model-path"
DRAFT_QUANT_FLAG = "--speculative-draft-model-quantization"


@dataclass(frozen=True)
class CoreHandles:
    """``SpeculativeContext.core``: what this module needs of the engine beyond the context."""

    args: ServerArgs
    registry: Registry


# ----------------------------------------------------------------------------- loading
def draft_quantization(ctx: SpeculativeContext, checkpoint_format: str, default: str | None = None
                       ) -> QuantizationConfig:
    """``--speculative-draft-model-quantization`` for a draft checkpoint of
    ``checkpoint_format`` ("hf" or "gguf"): how its linear layers store their weights (not
    given: ``default``, else a GGUF draft's blocks and the float weights otherwise)."""
    return _quantization(ctx.core.registry, ctx.draft_model_quantization, checkpoint_format, ctx.device,
                         ctx.dtype, default)


def _quantization(registry: Registry, name: str | None, checkpoint_format: str, device: torch.device,
                  dtype: torch.dtype, default: str | None = None) -> QuantizationConfig:
    return make_quantization(registry, name or default, checkpoint_format, device, dtype, flag=DRAFT_QUANT_FLAG)


def build_module(ckpt: LoadedCheckpoint, registry: Registry, *, device: torch.device, dtype: torch.dtype,
                 max_positions: int, args: ServerArgs | None = None) -> nn.Module:
    """The model class registered for ``ckpt``'s architecture, with its weights, on
    ``device`` in ``dtype`` and finalized (the steps the target's runner takes); MoE
    layers get the runner and transport ``args`` name (the defaults without ``args``)."""
    cfg = ckpt.config
    arch = registry.get("model", cfg.architecture, flag=f"{DRAFT_FLAG} (config.json 'architectures')")
    quant = _quantization(registry, args.speculative_draft_model_quantization if args else None, ckpt.format,
                          device, dtype)
    with torch.device("meta"), quantization_scope(quant):
        module = arch.factory(cfg, max_positions=max_positions)
    module = module.to_empty(device="cpu")
    module.load_weights(ckpt.weights(keep_gguf_blocks=quant.keep_gguf_blocks))
    module = module.to(device=device, dtype=dtype).eval()
    module.finalize(dtype, device)
    # the expert placement flags (EPLB) describe the target model's layers, not the draft's
    draft_args = dataclasses.replace(args, ep_num_redundant_experts=0, init_expert_location=None) if args else None
    setup_moe(module, registry, draft_args or ServerArgs(), dtype=dtype, device=device,
              max_num_tokens=max_positions)
    return module


def load_module(path: str | None, ctx: SpeculativeContext, *, flag: str = DRAFT_FLAG) -> tuple[nn.Module, ModelConfig]:
    """The draft module at ``path`` (a Hugging Face directory or a .gguf file, opened with
    the core's checkpoint loader) and its config; errors name ``flag``."""
    import os

    from radixserve.model_loader import load_checkpoint

    what = "a smaller model with the target's tokenizer: a Hugging Face directory or a .gguf file"
    if not path:
        raise ValueError(f"--speculative-algorithm {ctx.algorithm} needs {flag} ({what})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path!r} does not exist; give {what}")
    try:
        ckpt = load_checkpoint(path, ctx.core.registry)
    except (OSError, ValueError) as e:
        msg = str(e).removeprefix("--model: ")
        raise type(e)(f"{flag} {path}: {msg}") from None
    cfg = ckpt.config
    if cfg.vocab_size != ctx.vocab_size:
        raise ValueError(f"{flag} {path}: vocab size {cfg.vocab_size} != target's {ctx.vocab_size}; the draft "
                         f"must share the target's tokenizer")
    module = build_module(ckpt, ctx.core.registry, device=ctx.device, dtype=ctx.dtype,
                          max_positions=ctx.target.context_len, args=ctx.core.args)
    return module, cfg


def build_attention_backend(ctx: SpeculativeContext, cfg: ModelConfig, max_batch_size: int) -> AttentionBackend:
    """The target's prefill attention backend (by name) for a draft of config ``cfg``; the
    draft's KV pool stores K/V in the target's storage dtype (``--kv-cache-dtype``)."""
    args, target = ctx.core.args, ctx.target
    actx = AttentionContext(
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        num_layers=cfg.num_hidden_layers, dtype=ctx.dtype, device=ctx.device, page_size=target.page_size,
        max_context_len=target.context_len, max_batch_size=max_batch_size, kv_dtype=target.kv_pool.dtype)
    flag = args.backend_flag("prefill")
    entry = ctx.core.registry.resolve("attention", args.prefill_backend_name, flag=flag)
    backend = entry.factory(actx)
    check_kv_dtype(backend, actx, f"{flag} {args.prefill_backend_name}")
    return backend
