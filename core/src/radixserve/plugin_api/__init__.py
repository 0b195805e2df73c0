"""The plugin API: everything a radixserve plugin may import from the core, and the only
surface that stays stable for plugins (docs/plugins.md). One module per plugin kind:

=============================== ==============================================================
``radixserve.plugin_api``       ``hookimpl`` (every plugin's registration), ``ConfigError``
``plugin_api.attention``        the attention contract, the forward batch, KV storage helpers
``plugin_api.moe``              MoE runner and all-to-all contracts, ``split_range``
``plugin_api.cache``            the HiCache storage tier contract
``plugin_api.grammar``          the grammar backend contract
``plugin_api.speculative``      proposers, the draft-model base, the layers a draft model uses
``plugin_api.kernels``          radixserve's CPU kernels and the Triton helpers
=============================== ==============================================================

This module itself stays light (no torch): a plugin's entry point imports ``hookimpl`` from
here when the registry loads it. In-tree plugins import nothing else from ``radixserve``
(``tests/test_plugin_api.py`` checks it).
"""

from radixserve.config import ConfigError
from radixserve.hookspecs import hookimpl

__all__ = ["ConfigError", "hookimpl"]
