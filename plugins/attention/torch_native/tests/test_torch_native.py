"""torch_native against the dense reference of the shared conformance suite."""

import pytest
from radixserve.testing.attention_conformance import CASES, KV_DTYPE_CASES, MLA_CASES, run_case
from radixserve_attention_torch import TorchNativeAttention


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms_to_reference(case):
    run_case(TorchNativeAttention, case)


@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=str)
def test_kv_dtypes_conform(case):
    """Narrow pools (--kv-cache-dtype): read back and widened to float32 before SDPA."""
    run_case(TorchNativeAttention, case)


@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_mla_conforms(case):
    """MLA: the absorbed form over the latent pool (V inside K) and the expanded prefill."""
    run_case(TorchNativeAttention, case)


def test_registered_under_entry_point():
    from radixserve.registry import Registry

    reg = Registry()
    reg.load_entry_points()
    entry = reg.get("attention", "torch_native")
    assert entry.distribution == "radixserve-attention-torch"
    assert entry.factory is TorchNativeAttention
    assert entry.is_available
