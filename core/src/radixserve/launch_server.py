"""``python -m radixserve.launch_server [flags]``: the HTTP server, as in SGLang.

The server lives in the ``radixserve-server`` distribution; this module only forwards to
it, so the core stays free of HTTP dependencies.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from radixserve_server.launch import main as server_main
    except ImportError:
        print("radixserve: error: the HTTP server is not installed; "
              "run `pip install radixserve-server` (or `pip install -e server`)", file=sys.stderr)
        return 2
    return server_main(argv)


if __name__ == "__main__":
    sys.exit(main())
