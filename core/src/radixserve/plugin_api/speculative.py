"""For speculative methods (``register_speculative_algorithms``): the proposer contract, the
draft-model base class, and the layers and loaders a draft model is built from.

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "Draft": "radixserve.speculative",
    "Proposer": "radixserve.speculative",
    "SpeculativeContext": "radixserve.speculative",
    "TargetStep": "radixserve.speculative",
    "DraftModel": "radixserve.speculative.draft_model",
    "draft_quantization": "radixserve.speculative.draft_loading",
    "load_module": "radixserve.speculative.draft_loading",
    "Linear": "radixserve.layers.linear",
    "load_checkpoint": "radixserve.model_loader",
    "ModelConfig": "radixserve.models.config",
    "RMSNorm": "radixserve.layers.layernorm",
    "RotaryEmbedding": "radixserve.layers.rotary",
    "apply_rotary": "radixserve.layers.rotary",
    "QuantizationConfig": "radixserve.quantization",
    "quantization_scope": "radixserve.quantization",
    "load_tokenizer": "radixserve.tokenizer",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
