"""For MoE runners (``register_moe_runners``) and all-to-all transports
(``register_moe_a2a_backends``)."""

from radixserve.distributed import split_range
from radixserve.layers.moe import (
    DispatchOutput,
    ExpertWeights,
    MoEA2ABackend,
    MoEContext,
    MoERunner,
)

__all__ = ["DispatchOutput", "ExpertWeights", "MoEA2ABackend", "MoEContext", "MoERunner", "split_range"]
