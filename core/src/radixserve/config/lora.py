"""Engine flags: LoRA adapters served over the base model (SGLang's names)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixserve.config.common import Checks, flag
from radixserve.flags import ConfigError

#: the linear layers an adapter may target, by their Hugging Face names; "all" means every one
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAArgs(Checks):
    enable_lora: bool = flag(False, "serve LoRA adapters over the base model (implied by --lora-paths)")
    lora_paths: list[str] | None = flag(
        None,
        "adapters loaded at start-up, each NAME=PATH (or PATH, named by its directory): a PEFT adapter "
        "directory (adapter_config.json and adapter_model.safetensors); requests name one in `lora_path`",
        nargs="+",
    )
    max_loras_per_batch: int = flag(8, "most distinct adapters in one batch (the slots of the adapter pool)")
    max_loaded_loras: int | None = flag(
        None, "most adapters kept loaded in memory (default: no limit beyond --lora-paths and the loads)")
    max_lora_rank: int | None = flag(None, "largest adapter rank served (default: the largest of --lora-paths)")
    lora_target_modules: list[str] | None = flag(
        None,
        f"the linear layers adapters may target ({', '.join(LORA_TARGET_MODULES)}, or all; default: those the "
        "adapters of --lora-paths target)",
        nargs="+",
    )
    lora_backend: str | None = flag(None, "LoRA backend (see `radixserve plugins`; default: torch_native)")

    def check_lora(self) -> None:
        if self.lora_paths:
            self.enable_lora = True
        self._check_int("max_loras_per_batch", minimum=1)
        self._check_int("max_loaded_loras", minimum=1, optional=True)
        self._check_int("max_lora_rank", minimum=1, optional=True)
        for module in self.lora_target_modules or ():
            if module != "all" and module not in LORA_TARGET_MODULES:
                raise ConfigError(f"--lora-target-modules: invalid value {module!r}; choose from: "
                                  f"{', '.join(LORA_TARGET_MODULES)}, all")
        names = [lora_name_and_path(spec)[0] for spec in self.lora_paths or ()]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-paths: adapter names must be distinct, got {', '.join(names)}")
        if self.max_loaded_loras is not None and len(names) > self.max_loaded_loras:
            raise ConfigError(f"--lora-paths names {len(names)} adapters, more than --max-loaded-loras "
                              f"{self.max_loaded_loras}")
        if self.enable_lora and not self.lora_paths and (self.max_lora_rank is None or not self.lora_target_modules):
            raise ConfigError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules "
                              "(the adapter pool is sized before any adapter is loaded)")


def lora_name_and_path(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); a bare PATH is named by its last directory."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"--lora-paths: invalid value {spec!r}; expected NAME=PATH or PATH")
    name, sep, path = spec.partition("=")
    if not sep:
        path, name = spec, os.path.basename(os.path.normpath(spec))
    if not name or not path:
        raise ConfigError(f"--lora-paths: invalid value {spec!r}; expected NAME=PATH or PATH")
    return name, path
