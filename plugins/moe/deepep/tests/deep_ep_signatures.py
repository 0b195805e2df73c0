"""DeepEP's ``Buffer`` signatures for the CPU tests, and recorders that bind every call to them.

:class:`BufferSignatures` copies the signatures (names, order, defaults; annotations and
bodies left out) of the ``deep_ep.Buffer`` methods the transport and its factory call, from
DeepEP 2.1.0 ``deep_ep/buffers/legacy.py`` (github.com/deepseek-ai/DeepEP, commit dd758ca,
2026-07-14); ``Config``'s size hints are pybind methods without argument names
(``csrc/legacy/buffer.hpp``: ``.def("get_nvl_buffer_size_hint", ...)``), so positional only.

:class:`BindingBuffer` is ``FakeDeepEPBuffer`` (which models the semantics and DeepEP's host
checks) with every transport call first bound to these signatures and recorded; a call whose
argument names or order DeepEP would not take raises ``TypeError`` before the fake runs.
:func:`fake_deep_ep` is a ``deep_ep`` module over it for the factory: ``Buffer(...)``, its
static size hints, ``Config`` and ``topk_idx_t``, each call recorded.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from radixserve_a2a_deepep.fake import FakeDeepEPBuffer


class BufferSignatures:
    """``deep_ep.Buffer`` as DeepEP 2.1.0 declares it (only what radixserve calls)."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None): ...

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts): ...

    @staticmethod
    def get_dispatch_config(num_ranks): ...

    @staticmethod
    def get_combine_config(num_ranks): ...

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False): ...

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False): ...

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False): ...

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts): ...

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False): ...

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None): ...


#: the methods the transport calls on a built buffer
TRANSPORT_METHODS = ("get_dispatch_layout", "dispatch", "combine", "clean_low_latency_buffer", "low_latency_dispatch",
                     "low_latency_combine")


def signature(name: str) -> inspect.Signature:
    """DeepEP's signature of ``Buffer.<name>`` as a call on an instance (no ``self``)."""
    member = inspect.getattr_static(BufferSignatures, name)
    if isinstance(member, staticmethod):
        return inspect.signature(member.__func__)
    sig = inspect.signature(member)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


@dataclass
class Bound:
    """One call as made (how many positional arguments, which keywords) and as DeepEP reads it."""

    name: str
    arguments: dict[str, Any]  # by DeepEP's parameter names
    num_positional: int
    keywords: tuple[str, ...]


def bind(name: str, args: tuple, kwargs: dict) -> Bound:
    """The call bound to DeepEP's signature; ``TypeError`` if DeepEP would not take it."""
    return Bound(name, dict(signature(name).bind(*args, **kwargs).arguments), len(args), tuple(kwargs))


class BindingBuffer(FakeDeepEPBuffer):
    """The fake buffer, each transport call bound to DeepEP's signature and recorded in
    :attr:`bound` before the fake runs it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bound: list[Bound] = []

    def _bind(self, name: str, args: tuple, kwargs: dict):
        self.bound.append(bind(name, args, kwargs))
        return getattr(super(), name)(*args, **kwargs)

    def get_dispatch_layout(self, *args, **kwargs):
        return self._bind("get_dispatch_layout", args, kwargs)

    def dispatch(self, *args, **kwargs):
        return self._bind("dispatch", args, kwargs)

    def combine(self, *args, **kwargs):
        return self._bind("combine", args, kwargs)

    def clean_low_latency_buffer(self, *args, **kwargs):
        return self._bind("clean_low_latency_buffer", args, kwargs)

    def low_latency_dispatch(self, *args, **kwargs):
        return self._bind("low_latency_dispatch", args, kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self._bind("low_latency_combine", args, kwargs)


class Group:
    """Just enough of a ``torch.distributed`` group for a buffer that is built, not run."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def fake_deep_ep(version: str = "2.1.0", topk_idx_t: torch.dtype = torch.int64) -> Any:
    """A ``deep_ep`` module whose ``Buffer`` is a :class:`BindingBuffer` built from DeepEP's
    constructor arguments; every call on the class (constructor, size hints) is bound and
    recorded in ``module.calls``, and ``module.buffers`` holds what was built."""
    module = types.ModuleType("deep_ep")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)  # importlib.util.find_spec reads it
    module.__version__, module.topk_idx_t = version, topk_idx_t
    module.calls, module.buffers = [], []

    def record(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        module.calls.append(bind(name, args, kwargs))
        return module.calls[-1].arguments

    class Config:
        def __init__(self, num_ranks: int) -> None:
            self.num_ranks = num_ranks

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks, /):
            return 1000 * hidden_bytes * num_ranks

        def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks, /):
            return 0 if num_ranks <= 8 else 2000 * hidden_bytes

    class Buffer(BindingBuffer):
        def __init__(self, *args, **kwargs) -> None:
            arguments = record("__init__", args, kwargs)
            group = arguments["group"]
            super().__init__(group.rank(), group.size(), group,
                             topk_idx_dtype=topk_idx_t, low_latency_mode=arguments.get("low_latency_mode", False))
            self.arguments = arguments
            module.buffers.append(self)

        @staticmethod
        def get_low_latency_rdma_size_hint(*args, **kwargs):
            arguments = record("get_low_latency_rdma_size_hint", args, kwargs)
            return 3000 * arguments["hidden"]

        @staticmethod
        def get_dispatch_config(*args, **kwargs):
            return Config(record("get_dispatch_config", args, kwargs)["num_ranks"])

        @staticmethod
        def get_combine_config(*args, **kwargs):
            return Config(record("get_combine_config", args, kwargs)["num_ranks"])

    module.Buffer, module.Config = Buffer, Config
    return module
