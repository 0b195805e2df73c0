"""Expert parallelism at the layer level, on CPU ranks (gloo, one process per rank): a model of
two :class:`~radixserve.layers.moe.SparseMoE` layers bound by ``setup_moe`` under the
parallel state gives, on every rank, the single-rank ``reference_moe`` result over the
full expert set, with the ``none`` and ``torch_distributed`` transports, experts split over
``ep_size`` ranks and each expert's intermediate dim over ``tp_size / ep_size``, with and
without redundant experts (EPLB); and the transport conformance suite on 2 and 4 ranks.
"""

from __future__ import annotations

import json

import pytest
import torch
from radixserve.config import ServerArgs
from radixserve.engine.expert_distribution import FORMAT
from radixserve.layers.moe import NoA2A, SparseMoE, reference_moe, select_experts
from radixserve.registry import get_registry
from radixserve.testing import moe_conformance as mc
from radixserve.testing.multi_rank import run_ranks
from torch import nn

E, K, H, INTER = 8, 2, 64, 48
SKEW = [[900, 40, 30, 20, 500, 10, 5, 1], [3, 700, 2, 2, 600, 2, 2, 400]]  # per layer, per expert


def _transport(name: str):
    entry = get_registry().get("moe_a2a", name)
    reason = entry.unavailable_reason()
    if reason is not None:
        pytest.skip(f"moe_a2a {name!r} unavailable here: {reason}")
    return entry.factory


class TwoLayers(nn.Module):
    """Decoder-shaped container: ``layers.N.mlp`` is what ``moe_layers`` indexes."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)  # the same weights on every rank
        self.layers = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.mlp = SparseMoE(H, INTER, E, K, renormalize=True)
            with torch.no_grad():
                block.mlp.gate.weight.copy_(torch.randn(E, H, generator=g) * 4 / H**0.5)
                block.mlp.w13.copy_(torch.randn(E, 2 * INTER, H, generator=g) / H**0.5)
                block.mlp.w2.copy_(torch.randn(E, H, INTER, generator=g) / INTER**0.5)
            self.layers.append(block.to(dtype))


def write_record(path: str, counts=SKEW) -> str:
    with open(path, "w") as fh:
        json.dump({"format": FORMAT, "version": 1, "mode": "stat", "num_experts": E, "top_k": K, "layers": [0, 1],
                   "num_forward_passes": 1, "num_tokens": 1, "counts": counts}, fh)
    return path


@torch.no_grad()
def run_layers(a2a: str, dtype: torch.dtype = torch.float32, num_redundant: int = 0, location: str | None = None,
               sizes=(1, 3, 37), device: torch.device = torch.device("cpu"), add_partial: bool = False) -> dict:
    """Build, bind and run the two layers under the current parallel state; the max error
    against the single-rank reference per batch size, and the load counters.
    ``add_partial``: every rank also hands the layer its own random ``[T, H]`` part, whose
    sum over the ranks must appear in the output (a shared expert's path)."""
    from radixserve.distributed import get_parallel_state
    from radixserve.engine.moe import setup_moe

    model = TwoLayers(dtype)
    full = [(b.mlp.w13.data.clone(), b.mlp.w2.data.clone()) for b in model.layers]
    model.to(device)
    args = ServerArgs(moe_runner_backend="torch_native", moe_a2a_backend=a2a, ep_num_redundant_experts=num_redundant,
                      init_expert_location=location)
    recorder = setup_moe(model, get_registry(), args, dtype=dtype, device=device, max_num_tokens=64)
    layer = model.layers[0].mlp
    out: dict = {"ctx": (layer.runner.ctx.num_experts, layer.runner.ctx.num_local_experts,
                         layer.runner.ctx.intermediate_size), "errors": {}}
    g = torch.Generator().manual_seed(1)  # the same tokens on every rank
    for t in sizes:
        x = torch.randn(t, H, generator=g).to(dtype).to(device)
        err = 0.0
        for (w13, w2), block in zip(full, model.layers):
            ids, weights = select_experts(block.mlp.gate(x), K, True)
            ref = reference_moe(x.cpu(), ids.cpu(), weights.cpu(), w13, w2).float()
            if add_partial:
                ps = get_parallel_state()
                parts = [torch.randn(t, H, generator=torch.Generator().manual_seed(100 + r)).to(dtype)
                         for r in range(ps.tp_size)]
                ref += torch.stack(parts).float().sum(0)
                y = block.mlp(x, add_partial=parts[ps.tp_rank].to(device))
            else:
                y = block.mlp(x)
            assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
            err = max(err, float((y.float().cpu() - ref).abs().max()) if t else 0.0)
            x = y  # the next layer gets this one's output: ranks must agree exactly
        out["errors"][t] = err
    out["counts"] = recorder.counts.tolist()
    return out


def _layer_rank(rank, world_size, init_method, ep_size, configs, device="cpu", conformance=()):
    """The layer configs, then (tp == ep only: the EP group is the whole world) the transport
    conformance suite for each transport in ``conformance``, in the same processes."""
    from radixserve.distributed import init_parallel_state

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device(device)  # one GPU per rank
    if device == "cuda":
        torch.cuda.set_device(rank)
    init_parallel_state(tp_size=world_size, ep_size=ep_size, tp_rank=rank, init_method=init_method, device=dev)
    out = [run_layers(**cfg, device=dev) for cfg in configs]
    for name in conformance:
        for i, case in enumerate(mc.A2A_CASES):
            mc.run_a2a_case(get_registry().get("moe_a2a", name).factory, case, ep_rank=rank, ep_size=world_size,
                            device=str(dev), seed=i)
    return out


def _check(results, configs, tp, ep):
    moe_tp = tp // ep
    for i, cfg in enumerate(configs):
        per_rank = [r[i] for r in results]
        tol = 5e-2 if cfg.get("dtype") == torch.bfloat16 else 1e-4
        for rank, res in enumerate(per_rank):
            physical = E + cfg.get("num_redundant", 0)
            assert res["ctx"] == (physical, physical // ep, INTER // moe_tp), (cfg, rank, res["ctx"])
            for t, err in res["errors"].items():
                assert err <= tol, f"tp {tp} ep {ep} {cfg} rank {rank}: {t} tokens, max error {err}"
        # the counters are per logical expert, and the same on every rank
        assert all(len(row) == E for row in per_rank[0]["counts"])
        assert all(r["counts"] == per_rank[0]["counts"] for r in per_rank)


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2), (2, 1), (4, 4)], ids=lambda v: str(v))
def test_layers_match_the_single_rank_reference(tp, ep, tmp_path):
    """At tp == ep the same ranks also run the transport conformance suite for every
    transport (2 and 4 ranks)."""
    _transport("torch_distributed")
    record = write_record(str(tmp_path / "record.json"))
    configs = [dict(a2a="none"), dict(a2a="torch_distributed"), dict(a2a="none", add_partial=True),
               dict(a2a="torch_distributed", add_partial=True)]
    if (tp, ep) == (2, 2):
        configs += [dict(a2a="torch_distributed", dtype=torch.bfloat16),
                    dict(a2a="torch_distributed", num_redundant=2, location=record),
                    dict(a2a="none", num_redundant=4, location=record),
                    dict(a2a="torch_distributed", location=record)]  # placement only, no copies
    if (tp, ep) == (4, 2):
        configs.append(dict(a2a="torch_distributed", num_redundant=2, location=record))
    conformance = [n for n in get_registry().names("moe_a2a")
                   if get_registry().get("moe_a2a", n).unavailable_reason() is None] if tp == ep else []
    results = run_ranks(_layer_rank, tp, ep, configs, "cpu", conformance, timeout_s=180)
    _check(results, configs, tp, ep)


class SumsTwice(NoA2A):
    """Breaks the multi-rank contract: every rank's partial sum counted twice."""

    def combine(self, expert_output, dispatched):
        return super().combine(expert_output * 2, dispatched)


def test_the_multi_rank_suite_catches_a_broken_transport():
    with pytest.raises(AssertionError, match="max abs error"):
        mc.run_a2a_cases_on_ranks(SumsTwice, 2, cases=[mc.A2ACase(16, 8, 2)])


NCCL_REASON = "expert parallelism over NCCL needs 2 CUDA devices (one per rank)"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=NCCL_REASON)
def test_layers_and_transports_on_gpus(tmp_path):
    """tp 2 x ep 2 over NCCL: the layers in float32 and bfloat16, with and without redundant
    experts, and the transport conformance suite for both transports."""
    _transport("torch_distributed")
    record = write_record(str(tmp_path / "record.json"))
    configs = [dict(a2a="none"), dict(a2a="torch_distributed"), dict(a2a="torch_distributed", dtype=torch.bfloat16),
               dict(a2a="torch_distributed", num_redundant=2, location=record)]
    results = run_ranks(_layer_rank, 2, 2, configs, "cuda", ["none", "torch_distributed"], timeout_s=300)
    _check(results, configs, 2, 2)


class PartialTwice(NoA2A):
    """combine is right, combine_partial counts every row twice."""

    def combine_partial(self, expert_output, dispatched):
        return expert_output * 2


def test_the_suite_checks_combine_partial():
    with pytest.raises(AssertionError, match="combine_partial summed over the EP group"):
        mc.run_a2a_case(PartialTwice, mc.A2ACase(16, 8, 2))
