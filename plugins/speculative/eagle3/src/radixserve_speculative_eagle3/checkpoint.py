"""EAGLE-3 head checkpoints: the directory layout SGLang serves and SpecForge trains.

A directory with ``config.json`` (a Llama config with ``architectures:
["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``vocab_size`` = the target's,
``draft_vocab_size``, optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` holding, with ``H`` the hidden size, ``Ht`` the target's, ``D`` the
head dim, ``I`` the MLP width, ``V``/``Vd`` the target/draft vocabularies::

    fc.weight                                  [H, 3 Ht]   (fc.bias [H] when config bias)
    midlayer.hidden_norm.weight                [H]
    midlayer.input_layernorm.weight            [H]
    midlayer.self_attn.q_proj.weight           [heads D, 2H]
    midlayer.self_attn.k_proj.weight           [kv_heads D, 2H]
    midlayer.self_attn.v_proj.weight           [kv_heads D, 2H]
    midlayer.self_attn.o_proj.weight           [H, heads D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.gate_proj.weight, up_proj     [I, H]
    midlayer.mlp.down_proj.weight              [H, I]
    norm.weight                                [H]
    lm_head.weight                             [Vd, H]
    d2t                                        [Vd] int64: target id = draft id + d2t[draft id]
    t2d                                        [V] bool: target id is in the draft vocabulary

Names may carry a ``model.`` prefix. ``embed_tokens.weight``, when present, is ignored: the
head uses the target's embedding. Without ``draft_vocab_size`` the draft vocabulary is the
target's and ``d2t``/``t2d`` may be absent.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from radixserve.plugin_api.speculative import ModelConfig, QuantizationConfig, quantization_scope

from radixserve_speculative_eagle3.head import ARCHITECTURE, Eagle3Config, Eagle3Head, default_aux_layers

FLAG = "--speculative-draft-model-path"
WEIGHTS_FILE = "model.safetensors"
_IGNORED = ("embed_tokens.weight",)


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head with config ``cfg`` and its shape."""
    h, ht, i = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "fc.weight": (h, 3 * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.fc_bias:
        shapes["fc.bias"] = (h,)
    return shapes


def make_config(target: ModelConfig, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                intermediate_size: int | None = None) -> dict[str, Any]:
    """A head's config.json for ``target`` (its hidden, attention, RoPE and norm settings)."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if target.rope_scaling:
        cfg["rope_scaling"] = dict(target.rope_scaling)
    if target.bos_token_id is not None:
        cfg["bos_token_id"] = target.bos_token_id
    if target.eos_token_ids:
        cfg["eos_token_id"] = target.eos_token_ids[0] if len(target.eos_token_ids) == 1 else list(target.eos_token_ids)
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
                               "use_aux_hidden_state": True}
    return cfg


def vocab_mapping(token_counts: dict[int, int], draft_vocab_size: int,
                  target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the ``draft_vocab_size`` most frequent tokens of ``token_counts``
    (padded with the lowest ids never seen when there are fewer), sorted ascending."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in [1, {target_vocab_size}]")
    counts = dict(token_counts)
    for t in range(target_vocab_size):
        if len(counts) >= draft_vocab_size:
            break
        counts.setdefault(t, 0)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab_size]
    used = torch.tensor(sorted(t for t, _ in ranked), dtype=torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def write_head(path: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` to ``path``; ``tensors`` must be
    exactly the layout's names with the layout's shapes (weights are saved as float32)."""
    from safetensors.torch import save_file

    cfg = Eagle3Config.from_dict(config)
    shapes = expected_shapes(cfg)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise ValueError(f"EAGLE-3 head tensors do not match the layout: missing {missing}, unexpected {extra}")
    out = {}
    for name, shape in shapes.items():
        t = tensors[name].detach().to("cpu")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the layout wants {shape}")
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.float()
        out[name] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file(out, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})


def read_config(path: str | None, algorithm: str = "eagle3") -> dict[str, Any]:
    """The head's config.json, checked: the path exists, the architecture is EAGLE-3."""
    if not path:
        raise ValueError(f"--speculative-algorithm {algorithm} needs {FLAG} DIR: a directory with an EAGLE-3 "
                         f"draft head (config.json with architectures [\"{ARCHITECTURE}\"] and safetensors)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_file):
        raise ValueError(f"{FLAG} {path}: not a directory with a config.json; give the directory of an EAGLE-3 "
                         f"draft head (config.json with architectures [\"{ARCHITECTURE}\"] and safetensors)")
    with open(config_file) as fh:
        cfg = json.load(fh)
    archs = cfg.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ValueError(f"{FLAG} {path}: config.json architectures {archs} is not an EAGLE-3 head; "
                         f"--speculative-algorithm eagle3 expects [\"{ARCHITECTURE}\"] (for a whole smaller "
                         f"model use --speculative-algorithm standalone)")
    layers = cfg.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{FLAG} {path}: num_hidden_layers is {layers}; only one-layer EAGLE-3 heads are supported")
    return cfg


def check_against_target(cfg: Eagle3Config, target: ModelConfig, path: str) -> None:
    """Raise ValueError naming the mismatch unless the head fits ``target``."""
    th = target.hidden_size
    if cfg.target_hidden_size != th or cfg.hidden_size != th:
        raise ValueError(f"{FLAG} {path}: the head's hidden size is {cfg.hidden_size} (target_hidden_size "
                         f"{cfg.target_hidden_size}) but the target model's is {th}; the head was trained for "
                         f"another model")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{FLAG} {path}: the head's vocab_size is {cfg.vocab_size} but the target model's is "
                         f"{target.vocab_size}; the head was trained for another model")
    aux = cfg.aux_layer_ids
    if aux is not None:
        if len(aux) != 3 or len(set(aux)) != 3 or not all(0 <= i < target.num_hidden_layers for i in aux):
            raise ValueError(f"{FLAG} {path}: eagle_config.eagle_aux_hidden_state_layer_ids {list(aux)} must be "
                             f"three distinct layers of the target's {target.num_hidden_layers}")
    elif len(set(default_aux_layers(target.num_hidden_layers)) & set(range(target.num_hidden_layers))) != 3:
        raise ValueError(f"{FLAG} {path}: the head's config names no eagle_config.eagle_aux_hidden_state_layer_ids "
                         f"and the default layers {list(default_aux_layers(target.num_hidden_layers))} are not three "
                         f"distinct layers of the target's {target.num_hidden_layers}; name them in the config")


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head's safetensors files, names without a ``model.`` prefix."""
    import glob

    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{FLAG} {path}: no *.safetensors file next to config.json")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                out[name.removeprefix("model.")] = st.get_tensor(name)
    return out


def load_head(path: str | None, target: ModelConfig, *, algorithm: str = "eagle3",
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              quantization: QuantizationConfig | None = None) -> Eagle3Head:
    """The head in ``path``, checked against the target's config, on ``device`` in ``dtype``
    (d2t/t2d keep their integer and bool types), its linear layers built with
    ``quantization``'s methods (None: float). Not finalized: call
    :meth:`Eagle3Head.finalize` (which quantizes) or :meth:`Eagle3Head.build_rotary` next."""
    raw = read_config(path, algorithm)
    cfg = Eagle3Config.from_dict(raw)
    check_against_target(cfg, target, path)
    tensors = {k: v for k, v in read_tensors(path).items() if k not in _IGNORED and "rotary_emb" not in k}
    shapes = expected_shapes(cfg)
    if "draft_vocab_size" not in raw or raw["draft_vocab_size"] in (None, cfg.vocab_size):
        tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise ValueError(f"{FLAG} {path}: the EAGLE-3 checkpoint is missing {len(missing)} tensors: "
                         f"{', '.join(missing)}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ValueError(f"{FLAG} {path}: the checkpoint has tensors an EAGLE-3 head does not: {', '.join(extra[:8])}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{FLAG} {path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape} "
                             f"from config.json")
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    ids = d2t + torch.arange(cfg.draft_vocab_size)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{FLAG} {path}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    with quantization_scope(quantization):
        head = Eagle3Head(cfg)
    state = {k: (v if k in ("d2t", "t2d") else v.to(torch.float32)) for k, v in tensors.items()}
    state["d2t"], state["t2d"] = d2t, t2d
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype)
