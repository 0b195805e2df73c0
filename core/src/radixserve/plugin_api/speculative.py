"""For speculative methods (``register_speculative_algorithms``): the proposer contract, the
draft-model base class, and the layers and loaders a draft model is built from."""

from radixserve.layers.linear import Linear
from radixserve.model_loader import load_checkpoint
from radixserve.models.config import ModelConfig
from radixserve.models.llama import RMSNorm
from radixserve.models.rope import RotaryEmbedding, apply_rotary
from radixserve.quantization import QuantizationConfig, quantization_scope
from radixserve.speculative import Draft, Proposer, SpeculativeContext, TargetStep
from radixserve.speculative.draft_model import DraftModel, draft_quantization, load_module
from radixserve.tokenizer import load_tokenizer

__all__ = ["Draft", "DraftModel", "Linear", "ModelConfig", "Proposer", "QuantizationConfig", "RMSNorm",
           "RotaryEmbedding", "SpeculativeContext", "TargetStep", "apply_rotary", "draft_quantization",
           "load_checkpoint", "load_module", "load_tokenizer", "quantization_scope"]
