"""The MoE conformance suites (:mod:`radixserve.testing.moe_conformance`) over every
installed MoE runner and all-to-all transport, and the suites themselves: each way of
breaking the runner contract fails.

Entries unavailable here skip with the registry's reason. The Triton runner is not usable
on a CPU-only machine except through Triton's interpreter, which has to be switched on
before Triton is imported, so it runs a reduced case list in a subprocess with
``TRITON_INTERPRET=1`` (its own package's tests run the rest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from radixserve.kernels.triton_support import interpreter_enabled
from radixserve.layers.moe import MoERunner, NoA2A, reference_moe
from radixserve.registry import get_registry
from radixserve.testing import moe_conformance as mc

_REGISTRY = get_registry()
RUNNERS = _REGISTRY.names("moe_runner")
TRANSPORTS = _REGISTRY.names("moe_a2a")

#: what the Triton interpreter runs here: small, every routing kind, both dtypes
INTERPRETER_CASES = [
    mc.Case(1, 8, 2, 64, 32), mc.Case(1, 16, 8, 64, 32), mc.Case(33, 8, 1, 64, 32, "uneven"),
    mc.Case(24, 16, 2, 64, 32, "empty_experts"), mc.Case(20, 8, 2, 64, 32, "one_expert"),
    mc.Case(30, 16, 4, 64, 32, "remote"), mc.Case(9, 8, 2, 64, 32, "unnormalized"),
    mc.Case(0, 8, 2, 64, 32), mc.Case(17, 4, 2, 80, 24), mc.Case(12, 8, 2, 64, 32, dtype=torch.bfloat16),
]


def _available(kind: str, name: str):
    entry = _REGISTRY.get(kind, name)
    reason = entry.unavailable_reason()
    if reason is not None:
        pytest.skip(f"{kind} {name!r} from {entry.distribution} unavailable here: {reason}")
    return entry.factory


@pytest.mark.parametrize("case", mc.CASES, ids=str)
@pytest.mark.parametrize("name", RUNNERS)
def test_runner_conforms(name, case):
    if name == "triton" and interpreter_enabled():
        pytest.skip("the Triton runner under the interpreter: its package's tests run this suite "
                    "(plugins/moe/triton/tests), test_triton_runner_through_the_interpreter a reduced list")
    mc.run_case(_available("moe_runner", name), case)


@pytest.mark.parametrize("case", mc.A2A_CASES, ids=str)
@pytest.mark.parametrize("name", TRANSPORTS)
def test_transport_conforms(name, case):
    mc.run_a2a_case(_available("moe_a2a", name), case)


def test_none_transport_is_registered_by_the_core():
    assert _REGISTRY.get("moe_a2a", "none").distribution == "radixserve"


@pytest.mark.skipif("triton" not in RUNNERS, reason="no MoE runner named 'triton' is installed")
def test_triton_runner_through_the_interpreter():
    script = textwrap.dedent(f"""
        import torch
        from radixserve.registry import get_registry
        from radixserve.testing import moe_conformance as mc
        from radixserve.testing.moe_conformance import Case
        entry = get_registry().get("moe_runner", "triton")
        reason = entry.unavailable_reason()
        if reason is not None:
            print("UNAVAILABLE", reason)
            raise SystemExit(0)
        for case in {INTERPRETER_CASES!r}:
            mc.run_case(entry.factory, case)
        print("OK")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if proc.stdout.strip().startswith("UNAVAILABLE"):
        pytest.skip(f"triton MoE runner unavailable even under TRITON_INTERPRET=1: {proc.stdout.strip()}")
    assert proc.stdout.strip().endswith("OK"), proc.stdout[-3000:]


# -------------------------------------------------------- the suite catches breaches
class Oracle(MoERunner):
    """Correct: the reference itself."""

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        return reference_moe(hidden_states, topk_ids, topk_weights, state.w13, state.w2)


class WrapsMinusOne(Oracle):
    """Reads id -1 as the last expert (Python indexing) instead of skipping it."""

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        ids = torch.where(topk_ids < 0, torch.full_like(topk_ids, state.w13.shape[0] - 1), topk_ids)
        return super().forward(hidden_states, ids, topk_weights, state)


class IgnoresWeights(Oracle):
    def forward(self, hidden_states, topk_ids, topk_weights, state):
        return super().forward(hidden_states, topk_ids, torch.ones_like(topk_weights), state)


class KeepsLastLayer(Oracle):
    """Keeps the weights of the last prepared layer on self and uses them for every layer."""

    def prepare(self, weights):
        self.weights = weights
        return None

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        return super().forward(hidden_states, topk_ids, topk_weights, self.weights)


class CachesOutput(Oracle):
    """Returns the first result it computed for a batch of the same size."""

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        cache = self.__dict__.setdefault("cache", {})
        if hidden_states.shape[0] not in cache:
            cache[hidden_states.shape[0]] = super().forward(hidden_states, topk_ids, topk_weights, state)
        return cache[hidden_states.shape[0]]


class ScalesInputInPlace(Oracle):
    def forward(self, hidden_states, topk_ids, topk_weights, state):
        out = super().forward(hidden_states, topk_ids, topk_weights, state)
        hidden_states.mul_(1.0)
        topk_weights.div_(topk_weights.sum(1, keepdim=True).clamp(min=1e-6))
        return out


class ReturnsFloat32(Oracle):
    def forward(self, hidden_states, topk_ids, topk_weights, state):
        return super().forward(hidden_states.float(), topk_ids, topk_weights, state)


class RenormalizesWeights(Oracle):
    def forward(self, hidden_states, topk_ids, topk_weights, state):
        w = topk_weights / topk_weights.sum(1, keepdim=True).clamp(min=1e-6)
        return super().forward(hidden_states, topk_ids, w, state)


class ScalesWeightsInPrepare(Oracle):
    """Folds a scale into the weights it was handed, in place."""

    def prepare(self, weights):
        weights.w13.mul_(0.5)
        return weights


REMOTE = mc.Case(40, 8, 2, 32, 16, "remote")
BREACHES = [
    (WrapsMinusOne, REMOTE, "max abs error"),
    (IgnoresWeights, mc.Case(20, 8, 2, 32, 16), "max abs error"),
    (KeepsLastLayer, mc.Case(20, 8, 2, 32, 16), "max abs error"),
    (CachesOutput, mc.Case(20, 8, 2, 32, 16), "max abs error"),
    (ScalesInputInPlace, mc.Case(20, 8, 2, 32, 16, "unnormalized"), "topk_weights was modified"),
    (ScalesWeightsInPrepare, mc.Case(4, 8, 2, 32, 16), "handed to prepare was modified"),
    (ReturnsFloat32, mc.Case(5, 8, 2, 32, 16, dtype=torch.bfloat16), "float32"),
    (RenormalizesWeights, mc.Case(20, 8, 2, 32, 16, "unnormalized"), "max abs error"),
]


def test_the_oracle_passes_every_case_kind():
    for case in {(c.routing, c.dtype): c for c in mc.CASES}.values():
        assert mc.run_case(Oracle, mc.Case(min(case.num_tokens, 24), case.num_experts, case.top_k, 32, 16,
                                           case.routing, case.dtype)) == 0.0


@pytest.mark.parametrize("runner,case,message", BREACHES, ids=[b[0].__name__ for b in BREACHES])
def test_a_broken_runner_fails(runner, case, message):
    with pytest.raises(AssertionError, match=message):
        mc.run_case(runner, case)


class DropsWeights(NoA2A):
    def dispatch(self, hidden_states, topk_ids, topk_weights):
        return super().dispatch(hidden_states, topk_ids, torch.ones_like(topk_weights))


class Int64Ids(NoA2A):
    def dispatch(self, hidden_states, topk_ids, topk_weights):
        d = super().dispatch(hidden_states, topk_ids, topk_weights)
        d.topk_ids = d.topk_ids.long()
        return d


class ReversesOrder(NoA2A):
    def combine(self, expert_output, dispatched):
        return expert_output.flip(0)


@pytest.mark.parametrize("transport,message", [(DropsWeights, "max abs error"), (Int64Ids, "int32"),
                                               (ReversesOrder, "max abs error")])
def test_a_broken_transport_fails(transport, message):
    with pytest.raises(AssertionError, match=message):
        mc.run_a2a_case(transport, mc.A2ACase(16, 8, 2))


class ScalesDispatchInput(NoA2A):
    def dispatch(self, hidden_states, topk_ids, topk_weights):
        hidden_states.mul_(2.0)
        return super().dispatch(hidden_states, topk_ids, topk_weights)


def test_a_transport_that_modifies_its_input_fails():
    with pytest.raises(AssertionError, match="hidden_states was modified"):
        mc.run_a2a_case(ScalesDispatchInput, mc.A2ACase(16, 8, 2))
