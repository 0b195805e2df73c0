"""Can fa3 / fa2 run here? One line per backend, and the exit status scripts/gpu_check.sh acts on.

    python plugins/attention/flash_attn/scripts/availability.py

* ``fa3: available`` / ``fa2: available``;
* ``<name>: unavailable: <the probe's reason>`` where the backend's library is installed (its
  module is found) but the backend reports unavailable: a broken, too old or partial build, or
  a GPU it does not run on. A failure, never a pass;
* ``<name>: not installed: <the probe's reason>`` where the library is not there at all.

Exit status: 1 when a backend is unavailable although its library is installed; 4 when
neither ``flash_attn`` nor ``flash_attn_interface`` is installed (the last line then starts
with "not installed"); else 0 (at least one backend is available).
"""

from __future__ import annotations

import sys

from radixserve_attention_flash_attn import probes

BACKENDS = (("fa3", "flash_attn_interface", "fa3_unavailable_reason"),
            ("fa2", "flash_attn", "fa2_unavailable_reason"))
NOT_INSTALLED = 4


def main() -> int:
    unavailable, found = [], []
    for name, module, probe in BACKENDS:
        reason = getattr(probes, probe)()
        if reason is None:
            print(f"{name}: available")
            found.append(name)
        elif probes.installed(module):
            print(f"{name}: unavailable: {reason}")
            unavailable.append(name)
            found.append(name)
        else:
            print(f"{name}: not installed: {reason}")
    if unavailable:
        print(f"{' and '.join(unavailable)}: the library is installed but the backend is unavailable "
              "(reason above)")
        return 1
    if not found:
        print("not installed: neither flash_attn (fa2) nor flash_attn_interface (fa3) is installed here")
        return NOT_INSTALLED
    return 0


if __name__ == "__main__":
    sys.exit(main())
