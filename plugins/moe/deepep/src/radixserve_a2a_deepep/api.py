"""What the transport and its factory call on ``deep_ep``, and a check of an imported
``deep_ep`` against it. No torch and no ``deep_ep`` import here.

Each :class:`Call` is one call site in :mod:`.factory` / :mod:`.transport` on
``deep_ep.Buffer``: the method's name, how many positional arguments the call passes (after
``self``) and which keywords. A module passes when it has ``Buffer``, ``Config`` and
``topk_idx_t``, ``Buffer`` has every method called and (where Python can read it) each
method accepts its call's arguments, and ``Config`` has the size hints the factory reads.

Verified against DeepEP 2.1.0 (github.com/deepseek-ai/DeepEP, commit dd758ca, 2026-07-14):
``deep_ep/buffers/legacy.py`` (``Buffer``), ``csrc/legacy/config.hpp`` (``Config``),
``csrc/python_api.cpp`` (``topk_idx_t``), ``deep_ep/__init__.py`` (``__version__``).
"""

from __future__ import annotations

from typing import Any

from radixserve.plugin_api.probes import LibraryCall as Call
from radixserve.plugin_api.probes import check_calls, mismatch_reason

#: the library release this transport was checked against, for messages
NEEDED = "DeepEP 2.1.0's legacy deep_ep.Buffer"


BUFFER_CALLS = (
    # factory: sizes, then the buffer
    Call("get_dispatch_config", 1),
    Call("get_combine_config", 1),
    Call("get_low_latency_rdma_size_hint", 4),
    Call("__init__", 3, ("low_latency_mode", "num_qps_per_rank")),
    # normal mode
    Call("get_dispatch_layout", 2),
    Call("dispatch", 1, ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                         "is_token_in_rank", "num_tokens_per_expert", "async_finish")),
    Call("combine", 2, ("async_finish",)),
    # low-latency mode
    Call("clean_low_latency_buffer", 3),
    Call("low_latency_dispatch", 4, ("use_fp8", "async_finish", "return_recv_hook")),
    Call("low_latency_combine", 4, ("async_finish", "return_recv_hook")),
)
MODULE_ATTRS = ("Buffer", "Config", "topk_idx_t")
CONFIG_METHODS = ("get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint")


def api_mismatch(module: Any) -> str | None:
    """``None`` when ``module`` (an imported ``deep_ep``) has what the transport calls, else a
    reason naming what is missing, the version found and the version needed."""
    missing = [name for name in MODULE_ATTRS if not hasattr(module, name)]
    refused = []
    buffer, config = getattr(module, "Buffer", None), getattr(module, "Config", None)
    if buffer is not None:
        lacks, refused = check_calls(buffer, BUFFER_CALLS, "Buffer.")
        missing += lacks
    if config is not None:
        missing += [f"Config.{name}" for name in CONFIG_METHODS if not callable(getattr(config, name, None))]
    version = getattr(module, "__version__", None)
    found = f"deep_ep {version}" if version else "deep_ep (no __version__)"
    return mismatch_reason(found, missing, refused,
                           f"the deepep transport needs {NEEDED} (see plugins/moe/deepep/README.md)")
