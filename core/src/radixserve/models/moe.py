"""Sparse mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is the Llama-family decoder of :mod:`radixserve.models.llama` (attention, norms, RoPE,
weight loading) with :class:`~radixserve.layers.moe.SparseMoE` as the feed-forward block
of its sparse layers. The router (softmax over all experts in float32, top-k, optional
renormalisation) is the core's :func:`~radixserve.layers.moe.select_experts`; the expert
computation is the ``--moe-runner-backend`` plugin's, bound after loading by
:func:`radixserve.engine.moe.setup_moe`.

How the three differ, as their transformers implementations define them:

* **Mixtral**: every layer sparse, top-k weights always renormalised; Hugging Face names
  ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.E.w1/w2/w3``
  (gate, down, up).
* **Qwen2-MoE**: QKV bias; a layer is sparse when it is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``, otherwise a dense MLP of ``intermediate_size``;
  renormalised only with ``norm_topk_prob``; each sparse block adds a shared expert (an MLP
  of ``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``.
* **Qwen3-MoE**: Qwen3's per-head q/k RMSNorm, the same sparse/dense layer rule and
  ``norm_topk_prob``, no shared expert.

Expert weights load from per-expert tensors (``mlp.experts.E.gate_proj.weight`` as
``save_pretrained`` writes them, Mixtral's ``w1``/``w3``/``w2``), from transformers' fused
3-D tensors (``mlp.experts.gate_up_proj  # [E, 2I, H]``, ``mlp.experts.down_proj
# [E, H, I]``) or from stacked per-projection 3-D tensors (``mlp.experts.gate_proj
# [E, I, H]``, ``up_proj``, what a GGUF file holds), each expert slice covered exactly once.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from radixserve.layers.linear import Linear
from radixserve.layers.moe import SparseMoE
from radixserve.models.config import ModelConfig
from radixserve.models.llama import MLP, LlamaForCausalLM, mark_loaded


class SharedExpertSparseMoE(SparseMoE):
    """Qwen2-MoE's sparse block: the routed experts plus a shared expert MLP whose output
    is scaled per token by ``sigmoid(shared_expert_gate(x))``.

    Under tensor parallelism the shared expert splits like a dense MLP (its intermediate
    size over the ranks) and returns this rank's partial sum; the gate ``[1, H]`` is
    replicated, so scaling the partial sums per token scales their total."""

    def __init__(self, cfg: ModelConfig, renormalize: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         renormalize)
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size, reduce_results=False)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, quantize=False)  # [1, H], replicated

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, H] this rank's part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x  # [T, H]`` -> ``# [T, H]``; SparseMoE adds the sum of the shared expert's
        partial outputs over the ranks inside its own all-reduce: one per block."""
        return self.forward_with_shared(x)


# one expert's projection, per expert: "experts.E.<proj>.weight"
_PER_EXPERT = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# all experts at once, 3-D: "experts.<proj>" (transformers' in-memory names) or "experts.<proj>.weight"
_STACKED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)"
                      r"(?:\.weight)?$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with sparse MoE blocks in the layers the config marks sparse."""

    #: renormalise the top-k routing weights whatever ``norm_topk_prob`` says (Mixtral)
    always_renormalize = False

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError(f"{type(self).__name__}: the config has {cfg.num_experts} experts and "
                             f"{cfg.num_experts_per_tok} per token; a MoE model needs at least one of each")
        if not cfg.is_sparse_layer(layer_id):
            return MLP(cfg)
        renormalize = self.always_renormalize or cfg.norm_topk_prob
        if cfg.shared_expert_intermediate_size > 0:
            return SharedExpertSparseMoE(cfg, renormalize)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         renormalize)

    # ------------------------------------------------------------- weights
    def load_tensor(self, name, tensor, modules, params, loaded) -> None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's block name
        m = _PER_EXPERT.match(name)
        if m is not None:
            proj = _MIXTRAL_PROJ.get(m["proj"], m["proj"])
            block = self._sparse_block(modules, m["block"], name)
            e = int(m["e"])
            if not 0 <= e < block.num_experts:
                raise ValueError(f"checkpoint tensor {name!r}: expert {e} out of range; the layer has "
                                 f"{block.num_experts} experts")
            self._load_experts(block, m["block"], proj, tensor, [e], name, loaded)
            return
        m = _STACKED.match(name)
        if m is not None:
            block = self._sparse_block(modules, m["block"], name)
            experts = list(range(block.num_experts))
            if tensor.dim() != 3 or tensor.shape[0] != block.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)}: expected "
                                 f"[{block.num_experts} experts, rows, columns]")
            self._load_experts(block, m["block"], m["proj"], tensor, experts, name, loaded)
            return
        super().load_tensor(name, tensor, modules, params, loaded)

    def _sparse_block(self, modules: dict[str, nn.Module], block: str, name: str) -> SparseMoE:
        module = modules.get(block)
        if not isinstance(module, SparseMoE):
            kind = "a dense layer" if module is not None else "no layer"
            raise ValueError(f"checkpoint tensor {name!r} holds expert weights but {block!r} is {kind} of "
                             f"{type(self).__name__} (check num_experts, decoder_sparse_step, mlp_only_layers)")
        return module

    @staticmethod
    def _load_experts(block: SparseMoE, block_name: str, proj: str, tensor: torch.Tensor, experts: list[int],
                      name: str, loaded: set[str]) -> None:
        """Copy ``proj`` of ``experts`` (one expert: a 2-D tensor; several: 3-D, one slice
        each) into the block's ``w13`` / ``w2``."""
        inter = block.intermediate_size
        if proj == "down_proj":
            param, rows, parts = block.w2, slice(None), [""]
        elif proj in ("gate_proj", "up_proj", "gate_up_proj"):
            param = block.w13
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter),
                    "gate_up_proj": slice(None)}[proj]
            parts = {"gate_proj": ["gate"], "up_proj": ["up"], "gate_up_proj": ["gate", "up"]}[proj]
        else:
            raise ValueError(f"checkpoint tensor {name!r}: unknown expert projection {proj!r} "
                             "(expected gate_proj, up_proj, down_proj, gate_up_proj, or Mixtral's w1/w3/w2)")
        pname = "w2" if proj == "down_proj" else "w13"
        dst = param.data[experts[0]:experts[-1] + 1, rows]  # [n, rows, cols]
        src = tensor if len(experts) > 1 else tensor.unsqueeze(0)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not fit "
                             f"{block_name}.{pname}: expected {tuple(dst.shape[1:])} per expert "
                             f"({block.num_experts} experts, intermediate size {inter}, hidden {block.hidden_size})")
        for e in experts:
            for part in parts:
                mark_loaded(loaded, f"{block_name}.{pname}#{e}{'.' + part if part else ''}", name)
        dst.copy_(src)

    def expected_weight_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        expected = super().expected_weight_keys(params)
        for name, module in self.named_modules():
            if isinstance(module, SparseMoE) and module.w13 is not None:
                expected -= {f"{name}.w13", f"{name}.w2"}
                for e in range(module.num_experts):
                    expected |= {f"{name}.w13#{e}.gate", f"{name}.w13#{e}.up", f"{name}.w2#{e}"}
        return expected


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: Llama attention, every layer a sparse MoE block, top-k weights renormalised."""

    always_renormalize = True


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: QKV bias, a shared expert with a sigmoid gate, dense layers by
    decoder_sparse_step / mlp_only_layers."""


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: q/k RMSNorm, dense layers by decoder_sparse_step / mlp_only_layers, norm_topk_prob."""

    qk_norm = True


ARCHITECTURES = {
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
