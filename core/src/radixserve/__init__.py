"""radixserve: an LLM serving engine built from a small core and plugins."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "ServerArgs"]


def __getattr__(name: str):
    # Lazy: importing radixserve (e.g. for hookimpl) must not pull in torch or transformers.
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixserve.sampling import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from radixserve.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)
