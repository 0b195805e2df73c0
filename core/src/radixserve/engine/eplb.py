"""Expert-parallel load balancing (EPLB) at load time: which logical experts get a redundant
copy and which EP rank holds each physical expert, from a recorded expert distribution.

``--ep-num-redundant-experts N --init-expert-location FILE`` (FILE: what the expert
distribution recorder writes, :mod:`radixserve.engine.expert_distribution`). Per MoE layer:

1. the ``N`` experts with the most recorded (token, choice) pairs get one extra physical
   copy each (ties: the lower id), so the layer has ``E + N`` physical experts, which must
   split evenly over ``--ep-size`` ranks;
2. a copy carries its expert's load divided by the number of copies (the layer spreads an
   expert's tokens evenly over its copies, :class:`~radixserve.layers.moe.ExpertLocation`);
3. greedy bin packing: the physical experts, heaviest first, each go to the rank with the
   least load so far that still has a free slot (``(E + N) / ep_size`` slots per rank;
   on a tie, one that does not hold the same expert yet); then, while it helps, one
   expert of the most loaded rank swaps with a lighter one of another rank;
4. physical ids number the slots rank by rank (rank ``r`` holds
   ``[r * slots, (r + 1) * slots)``, each rank's experts in logical order), so runners and
   transports see the usual even split in rank order.

The plan depends only on the file and the flags, so every rank computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.config import ConfigError


def plan_layer(load: Sequence[float], num_redundant: int, ep_size: int) -> list[int]:
    """``physical_to_logical`` (``len(load) + num_redundant`` entries) for one layer whose
    logical expert ``e`` had ``load[e]`` routed pairs."""
    num_experts = len(load)
    if not 0 <= num_redundant <= num_experts:
        raise ConfigError(f"--ep-num-redundant-experts {num_redundant}: between 0 and the number of experts "
                          f"({num_experts}); each of the N hottest experts gets one extra copy")
    total = num_experts + num_redundant
    if total % ep_size:
        raise ConfigError(f"{num_experts} experts + --ep-num-redundant-experts {num_redundant} = {total} physical "
                          f"experts do not split evenly over --ep-size {ep_size}; choose N so that {num_experts} + N "
                          f"is a multiple of {ep_size}")
    hottest = sorted(range(num_experts), key=lambda e: (-load[e], e))[:num_redundant]
    copies = [1] * num_experts
    for e in hottest:
        copies[e] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    slots = total // ep_size
    bins: list[list[int]] = [[] for _ in range(ep_size)]
    bin_load = [0.0] * ep_size
    for weight, e in items:
        free = [r for r in range(ep_size) if len(bins[r]) < slots]
        r = min(free, key=lambda r: (bin_load[r], e in bins[r], r))
        bins[r].append(e)
        bin_load[r] += weight
    _refine(bins, bin_load, [load[e] / copies[e] for e in range(num_experts)])
    return [e for b in bins for e in sorted(b)]


def _refine(bins: list[list[int]], bin_load: list[float], weight: list[float], max_swaps: int = 1000) -> None:
    """Swap experts between the most loaded rank and another while that lowers the pair's
    larger load (the greedy pass alone can leave a heavy rank that one swap fixes)."""
    for _ in range(max_swaps):
        a = max(range(len(bins)), key=lambda r: (bin_load[r], -r))
        best = None  # (new max of the pair, b, i, j)
        for b in range(len(bins)):
            if b == a:
                continue
            for i, ea in enumerate(bins[a]):
                for j, eb in enumerate(bins[b]):
                    delta = weight[ea] - weight[eb]
                    if delta <= 0:
                        continue
                    pair_max = max(bin_load[a] - delta, bin_load[b] + delta)
                    if pair_max < bin_load[a] - 1e-9 and (best is None or pair_max < best[0]):
                        best = (pair_max, b, i, j)
        if best is None:
            return
        _, b, i, j = best
        ea, eb = bins[a][i], bins[b][j]
        bins[a][i], bins[b][j] = eb, ea
        delta = weight[ea] - weight[eb]
        bin_load[a] -= delta
        bin_load[b] += delta


def rank_loads(physical_to_logical: Sequence[int], load: Sequence[float], ep_size: int) -> list[float]:
    """Each EP rank's expected load under a placement (an expert's load split evenly over
    its copies)."""
    copies = [0] * len(load)
    for e in physical_to_logical:
        copies[e] += 1
    slots = len(physical_to_logical) // ep_size
    return [sum(load[e] / copies[e] for e in physical_to_logical[r * slots:(r + 1) * slots]) for r in range(ep_size)]


def imbalance(loads: Sequence[float]) -> float:
    """``max / mean`` of per-rank loads (1.0 is perfectly even; 0.0 with no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 0.0


def plan_placement(record: dict[str, Any], layer_ids: Sequence[int], num_experts: int, num_redundant: int,
                   ep_size: int, source: str = "--init-expert-location") -> dict[int, list[int]]:
    """``{decoder layer index: physical_to_logical}`` for every MoE layer in ``layer_ids``
    from a recorded distribution (:func:`radixserve.engine.expert_distribution.load_distribution`)."""
    if record.get("num_experts") != num_experts:
        raise ConfigError(f"{source}: the record is for {record.get('num_experts')} experts per layer, the model has "
                          f"{num_experts}")
    counts = dict(zip(record.get("layers", []), record.get("counts", [])))
    missing = [i for i in layer_ids if i not in counts]
    if missing:
        raise ConfigError(f"{source}: no recorded counts for MoE layers {missing} (the record has layers "
                          f"{sorted(counts)}); record the distribution with the same model")
    plans = {}
    for i in layer_ids:
        row = counts[i]
        if len(row) != num_experts:
            raise ConfigError(f"{source}: layer {i} has {len(row)} counts, expected {num_experts}")
        plans[i] = plan_layer([float(c) for c in row], num_redundant, ep_size)
    return plans
