"""Which decode graphs an engine gets, chosen once it is assembled: CUDA graphs on a GPU,
kernel tapes on CPU (radixserve.engine.cuda_graph, radixserve.engine.verify_graph), or none
(logged with the reason; ``--disable-cuda-graph`` turns both off)."""

from __future__ import annotations

import logging
import time

import torch

from radixserve.engine.cuda_graph import (
    CPU_LADDER,
    DEFAULT_CPU_MAX_BS,
    DEFAULT_MAX_BS,
    CudaGraphCapturer,
    CudaGraphRunner,
    FakeGraphCapturer,
    GraphCapturer,
    TapeCapturer,
    capture_sizes,
    capturer_lazy,
    graph_off_reason,
)
from radixserve.engine.verify_graph import VerifyTapeRunner
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels.tape import TapeError

logger = logging.getLogger(__name__)


def build_graphs(runner, capturer: GraphCapturer | None) -> tuple[CudaGraphRunner | None, VerifyTapeRunner | None]:
    """The decode graph runner of ``runner`` (a ModelRunner) and, with kernel tapes and a
    speculative method, its verify tapes. Without ``capturer``: CUDA graphs on CUDA, kernel
    tapes on CPU, unless a reason keeps decode eager."""
    args = runner.args
    cpu = runner.device.type == "cpu"
    what = "kernel tapes" if cpu and not isinstance(capturer, FakeGraphCapturer) else "CUDA graphs"
    if capturer is None:
        if not cpu and runner.device.type != "cuda":
            return None, None
        reason = graph_off_reason(runner, args)
        if reason is not None:
            log = logger.info if reason == "--disable-cuda-graph" or cpu else logger.warning
            log("decode %s off: %s; decode steps run eagerly", what, reason)
            return None, None
        capturer = TapeCapturer(cpu_kernels.load()) if cpu else CudaGraphCapturer(runner.device)
    tapes = isinstance(capturer, TapeCapturer)
    default_max, ladder = (DEFAULT_CPU_MAX_BS, CPU_LADDER) if tapes else (DEFAULT_MAX_BS, None)
    max_bs = min(args.cuda_graph_max_bs or default_max, runner.max_running_requests)
    sizes = capture_sizes(max_bs, args.cuda_graph_bs, ladder)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():  # as every forward runs: no autograd state in the graphs
            graphs = CudaGraphRunner(runner, sizes, capturer, pad=not args.disable_cuda_graph_padding)
        # (speculative verify steps with LoRA adapters run eagerly: their tapes do not record the adapters)
        verify = VerifyTapeRunner(runner, capturer) if tapes and args.speculative_algorithm and not args.enable_lora \
            else None
    except TapeError as exc:  # this model's decode step is not made of recordable kernels only
        logger.info("decode kernel tapes off: %s; decode steps run eagerly", exc)
        return None, None
    except Exception:  # noqa: BLE001 - a model or backend that cannot be captured still serves
        logger.exception("capturing decode %s failed; decode steps run eagerly", what)
        return None, None
    listed = f"{sizes[0]}-{sizes[-1]}" if sizes == list(range(sizes[0], sizes[-1] + 1)) else ", ".join(map(str, sizes))
    logger.info("decode %s for batch sizes %s (%s) in %.1f s", what, listed,
                "the smallest recorded now, the others when first needed" if capturer_lazy(capturer)
                else "captured", time.perf_counter() - t0)
    return graphs, verify
