"""For LoRA backends (``register_lora_backends``).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "LoRABackend": "radixserve.lora.backend",
    "LoRAContext": "radixserve.lora.backend",
    "reference_apply": "radixserve.lora.backend",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
