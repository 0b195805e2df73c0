"""For KV transfer engines (``register_kv_transfer_backends``): prefill-decode disaggregation.

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "DONE": "radixserve.disaggregation.transfer",
    "FAILED": "radixserve.disaggregation.transfer",
    "PENDING": "radixserve.disaggregation.transfer",
    "TransferContext": "radixserve.disaggregation.transfer",
    "TransferEngine": "radixserve.disaggregation.transfer",
    "TransferError": "radixserve.disaggregation.transfer",
    "WriteBook": "radixserve.disaggregation.transfer",
    "coalesce": "radixserve.disaggregation.transfer",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
