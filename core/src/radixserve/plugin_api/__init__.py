"""The plugin API: everything a radixserve plugin may import from the core, and the only
surface that stays stable for plugins (docs/plugins.md). One module per plugin kind:

=============================== ==============================================================
``radixserve.plugin_api``       ``hookimpl`` (every plugin's registration), ``ConfigError``,
                                ``option`` (a flag the plugin declares, :mod:`radixserve.options`),
                                ``redact_url`` (a URL without its credentials, for messages),
                                ``read_key_file`` (a key or password from a file's first line)
``plugin_api.attention``        the attention contract, the forward batch, KV storage helpers
``plugin_api.moe``              MoE runner and all-to-all contracts, ``split_range``
``plugin_api.cache``            the HiCache storage tier contract
``plugin_api.disaggregation``   the KV transfer engine contract (prefill-decode disaggregation)
``plugin_api.grammar``          the grammar backend contract
``plugin_api.speculative``      proposers, the draft-model base, the layers a draft model uses
``plugin_api.kernels``          radixserve's CPU kernels and the Triton helpers
=============================== ==============================================================

None of these modules imports torch until a name is used: a plugin's entry module imports
from them when the registry loads it. In-tree plugins import nothing else from ``radixserve``
(``tests/test_plugin_api.py`` checks it).
"""

import importlib
import sys

from radixserve.flags import ConfigError
from radixserve.hookspecs import hookimpl
from radixserve.options import option
from radixserve.secrets import read_key_file, redact_url

__all__ = ["ConfigError", "hookimpl", "option", "read_key_file", "redact_url"]


def lazy_attr(module: str, sources: dict[str, str], name: str):
    """A kind module's ``__getattr__``: import ``name`` from where it lives, once."""
    source = sources.get(name)
    if source is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    source, _, attr = source.partition(":")  # "module:attribute" where the names differ
    if name == "cpu_kernels":  # the module itself
        value = importlib.import_module(source)
    else:
        value = getattr(importlib.import_module(source), attr or name)
    setattr(sys.modules[module], name, value)
    return value
