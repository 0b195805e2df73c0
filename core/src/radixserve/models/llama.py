"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) over the paged KV cache.

One plain module: fused QKV and gate/up projections, RMSNorm, RoPE; attention is
whatever backend the runner hands in. The norms, RoPE and SiLU * up are layers from
:mod:`radixserve.layers` that pick their kernels themselves when the model is placed
(:meth:`LlamaForCausalLM.finalize`; radixserve's compiled CPU kernels for float32 on CPU).
Qwen2 adds QKV bias, Qwen3 adds per-head RMSNorm on q and k. ``load_weights`` takes
Hugging Face tensor names.

Inside the model, submodules are run through ``.forward`` rather than ``__call__``: the
module call machinery costs ~0.7 us a call, and over the 30 layers of the default model
that was ~0.4 ms of a ~7 ms batch-1 decode step. Forward hooks on the layers and their
parts therefore do not fire (radixserve registers none); the model itself is still called
normally by the runner.

Tensor parallelism is read from :func:`radixserve.distributed.get_parallel_state` when the
model is built: attention heads split by KV-head group
(:func:`~radixserve.distributed.partition.partition_heads`, uneven splits allowed), QKV and
gate/up column-parallel, o_proj and down_proj row-parallel with one all-reduce each,
embedding and LM head split over the vocabulary. Every rank loads from the full checkpoint
tensors and keeps its shard; norms and RoPE are replicated.

Pipeline parallelism is read from it too: a stage builds and loads only its own layers
(:func:`~radixserve.distributed.pipeline.stage_layers`; the others are empty placeholders, so
the weight names keep their layer numbers), the first stage the embedding, the last the final
norm and LM head; its attention layers number their KV pool's layers from 0.
:meth:`LlamaForCausalLM.forward` takes the previous stage's ``(hidden, residual)`` and, on a
stage that is not the last, returns them for the next.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixserve.distributed import get_parallel_state
from radixserve.distributed.context import ring_attention
from radixserve.distributed.partition import partition_heads
from radixserve.distributed.pipeline import stage_layers
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.attention import AttentionBackend, AttentionLayer, ForwardBatch
from radixserve.layers.custom_op import place_ops
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, even_shard
from radixserve.layers.rotary import QKVRotary, RotaryEmbedding
from radixserve.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool) -> None:
        super().__init__()
        state = get_parallel_state()
        heads = partition_heads(cfg.num_attention_heads, cfg.num_key_value_heads, state.tp_size, state.tp_rank)
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        q_full, kv_full = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        kv_rows = (kv_full, heads.kv_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(  # [q | k | v] rows of this rank's heads
            cfg.hidden_size, {"q_proj": (q_full, heads.q_start * d, self.q_size), "k_proj": kv_rows,
                              "v_proj": kv_rows}, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, shard=(q_full, heads.q_start * d, self.q_size))
        norms = [RMSNorm(self.head_dim, cfg.rms_norm_eps, kernel=False) for _ in range(2)] if qk_norm else [None] * 2
        self.q_norm, self.k_norm = norms
        self.rotary = QKVRotary(self.num_heads, self.num_kv_heads, d, *norms)  # split, q/k norms, RoPE
        self.layer = AttentionLayer(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                    self.head_dim ** -0.5, cfg.sliding_window)
        self.backend: AttentionBackend | None = None  # set by the runner

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.rotary.forward(self.qkv_proj.forward(x), rope)  # [T, H | Hkv | Hkv, D]
        ring = batch.extra.get("ring")  # --attn-cp-size: this rank's slice of a long prefill
        o = self.backend.forward(q, k, v, self.layer, batch) if ring is None else \
            ring_attention(q, k, v, self.layer, ring)  # [T, H, D]
        return self.o_proj.forward(o.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU MLP, the intermediate size split over the tensor-parallel ranks (gate/up
    column-parallel, down row-parallel). ``reduce_results=False`` returns this rank's
    partial sum, for a block that adds it to other partial sums before one all-reduce."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; this model supports 'silu'")
        shard = even_shard(intermediate_size or cfg.intermediate_size)
        self.inter = shard[2]  # this rank's intermediate columns
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, {"gate_proj": shard, "up_proj": shard})
        self.down_proj = RowParallelLinear(shard[0], cfg.hidden_size, shard=shard, reduce_results=reduce_results)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))  # via [T, 2I], [T, I]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool, mlp: nn.Module | None = None,
                 attn: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attn if attn is not None else Attention(cfg, layer_id, qk_norm)
        self.mlp = mlp if mlp is not None else MLP(cfg)  # [T, hidden] -> [T, hidden]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, batch):
        """One layer on ``x`` (the previous layer's output) and ``residual`` (the running
        sum before it; None at the first layer). Returns the new ``(x, residual)``; the
        hidden state is their sum."""
        h, residual = self._attend(x, residual, rope, batch)
        return self.mlp.forward(h), residual

    def stages(self, x, residual, rope, batch):
        """:meth:`forward` as a generator that yields where a MoE block has communication in
        flight (``SparseMoE.stages``; two-batch overlap, :mod:`radixserve.engine.two_batch`)."""
        h, residual = self._attend(x, residual, rope, batch)
        mlp_stages = getattr(self.mlp, "stages", None)
        return ((yield from mlp_stages(h)) if mlp_stages is not None else self.mlp.forward(h)), residual

    def _attend(self, x, residual, rope, batch):
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, rope, batch)
        return self.post_attention_layernorm.forward(h, residual)


# Hugging Face names of the separate projections -> the fused layer that holds them
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 and SmolLM2: RMSNorm, RoPE (default, linear or llama3 scaling), SwiGLU."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        ps = get_parallel_state()
        self.start, self.end = stage_layers(cfg.num_hidden_layers, ps.pp_size, ps.pp_rank)  # this stage's layers
        self.first, self.last = ps.is_first_stage, ps.is_last_stage
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.first else None
        self.layers = nn.ModuleList(  # a layer's KV lives in this stage's pool at its index from the stage's start
            DecoderLayer(cfg, i - self.start, self.qk_norm, self.build_mlp(cfg, i),
                         self.build_attention(cfg, i - self.start)) if self.start <= i < self.end
            else nn.Identity() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.last else None
        # tied: a copy of the embedding
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size) if self.last else None
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(self.rotary_dim(cfg), self.max_positions, cfg.rope_theta, cfg.rope_scaling,
                                      torch.float32, kernel=self.rotary_kernel)  # tables built by finalize()

    #: RoPE through the CPU kernels (which rotate a fused QKV output in place); False: the step's
    #: (cos, sin) rows for the layers to apply
    rotary_kernel = True

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """Dimensions RoPE rotates (a whole head here)."""
        return cfg.head_dim

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module | None:
        """The attention block of this stage's layer ``layer_id`` (None: Llama's)."""
        return None

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        """The feed-forward block of decoder layer ``layer_id`` (a dense SwiGLU MLP here;
        MoE models return a sparse block for their sparse layers)."""
        return MLP(cfg)

    def finalize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Once the weights are placed: build the RoPE tables, pack the linear layers and let
        every layer choose its kernels for ``device`` and ``dtype``."""
        head_dim, theta, scaling = self.rotary_dim(self.config), self.config.rope_theta, self.config.rope_scaling
        rotary = RotaryEmbedding(head_dim, self.max_positions, theta, scaling, torch.float32,
                                 kernel=self.rotary.kernel).to(device)  # (built on the meta device)
        rotary.cos, rotary.sin = rotary.cos.to(dtype).contiguous(), rotary.sin.to(dtype).contiguous()
        self.rotary = rotary
        if self.embed_tokens is not None:
            self.embed_tokens.finalize(dtype)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
            elif isinstance(module, QKVRotary):
                module.tables = rotary
        if self.config.tie_word_embeddings and self.first and self.last:  # one 16-bit copy for both, where it can
            self.embed_tokens.share_with(self.lm_head)
        place_ops(self, device, dtype)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        for i in range(self.start, self.end):
            self.layers[i].self_attn.backend = backend

    def forward(self, batch: ForwardBatch, hidden: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Logits ``# [B, V]`` at ``batch.logits_indices`` (last new token of each request).
        Pipeline parallel: a later stage starts from the previous one's ``hidden``
        (``(x, residual)``, each ``# [T, hidden]``), and a stage before the last returns its own."""
        x, residual = hidden if hidden is not None else (self.embed_tokens(batch.input_ids), None)  # [T, hidden]
        capture = batch.capture_hidden_layers
        aux = []
        if "two_batch" in batch.extra:  # --enable-two-batch-overlap: two interleaved micro-batches
            overlap, parts = batch.extra["two_batch"]
            x, residual = overlap.run_layers(self, x, parts)
        else:
            rope = self.rotary.forward(batch.positions)  # this step's rotary rows, shared by every layer
            for i in range(self.start, self.end):
                x, residual = self.layers[i].forward(x, residual, rope, batch)
                if i in capture:  # the hidden state after this layer (the kernels update residual in place)
                    aux.append((i, x + residual))
        if capture:
            batch.extra["aux_hidden"] = torch.cat([h for _, h in sorted(aux, key=lambda t: capture.index(t[0]))],
                                                  dim=-1)  # [T, len(capture) * hidden]
        if not self.last:
            return x, residual
        if batch.capture_final_hidden:  # every row's final hidden state (return_hidden_states)
            x, _ = self.norm(x, residual)  # [T, hidden]
            batch.extra["final_hidden"] = x
            if batch.logits_indices.shape[0] != x.shape[0]:
                x = x[batch.logits_indices]
            return self.lm_head(x).float()  # [B, V]
        if batch.logits_indices.shape[0] != x.shape[0]:
            x, residual = x[batch.logits_indices], residual[batch.logits_indices]
        x, _ = self.norm(x, residual)
        return self.lm_head(x).float()  # [B, V]

    # ------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; every parameter must be covered exactly once."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or not self._holds(name):
                continue
            if name == "lm_head.weight" and tied:
                continue
            if self.first or not name.startswith("embed_tokens."):  # a last stage takes a tied table as its head
                self.load_tensor(name, tensor, modules, params, loaded)
            if name == "embed_tokens.weight" and tied and self.last:
                self.lm_head.load("weight", tensor)  # the same vocabulary rows as the embedding shard
                mark_loaded(loaded, "lm_head.weight", name)
        missing = sorted(self.expected_weight_keys(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _holds(self, name: str) -> bool:
        """Whether this pipeline stage keeps checkpoint tensor ``name`` (``model.`` removed)."""
        if name.startswith("layers."):
            return self.start <= int(name.split(".", 2)[1]) < self.end
        if name.startswith("embed_tokens."):
            return self.first or (self.last and self.config.tie_word_embeddings)
        if name.startswith(("norm.", "lm_head.")):
            return self.last
        return True

    def load_tensor(self, name: str, tensor: torch.Tensor, modules: dict[str, nn.Module],
                    params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        """Copy one checkpoint tensor (``model.`` prefix removed) where it belongs and add
        the key(s) it covers to ``loaded`` (see :meth:`expected_weight_keys`)."""
        module_name, _, pname = name.rpartition(".")
        owner, _, short = module_name.rpartition(".")
        if short in _FUSED:
            target = f"{owner}.{_FUSED[short]}"
            if not isinstance(modules.get(target), ColumnParallelLinear):
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            modules[target].load(pname, tensor, short)
            mark_loaded(loaded, f"{target}.{pname}#{short}", name)
        elif isinstance(modules.get(module_name), (Linear, VocabParallelEmbedding)):
            modules[module_name].load(pname, tensor)
            mark_loaded(loaded, name, name)
        elif name in params:
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"model shape {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            mark_loaded(loaded, name, name)
        else:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")

    def expected_weight_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        """Every key :meth:`load_tensor` must have added once the checkpoint is read: a
        parameter's name, or ``name#part`` for each part of a fused parameter."""
        expected = set()
        for pname in params:
            owner, _, rest = pname.rpartition(".")
            base, _, kind = owner.rpartition(".")
            parts = [k for k, f in _FUSED.items() if f == kind]
            if parts:
                expected.update(f"{pname}#{p}" for p in parts)
            else:
                expected.add(pname)
        return expected


def mark_loaded(loaded: set[str], key: str, name: str) -> None:
    """Record that checkpoint tensor ``name`` covered ``key``; a key covered twice is an error."""
    if key in loaded:
        raise ValueError(f"checkpoint tensor {name!r} covers {key!r} a second time (the checkpoint "
                         "holds the same weight twice, e.g. under two names)")
    loaded.add(key)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with QKV bias (``attention_bias`` is on by default in its config)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE."""

    qk_norm = True


ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
