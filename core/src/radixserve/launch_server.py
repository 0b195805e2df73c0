"""``python -m radixserve.launch_server [flags]``: the HTTP server, as in SGLang.

The server lives in the ``radixserve-server`` distribution, which registers the ``serve``
command through the command hook; this module runs that command, so the core stays free
of HTTP dependencies and never imports the server.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from radixserve.cli import main as cli_main
    from radixserve.registry import get_registry

    if "serve" not in get_registry().entries["command"]:
        print("radixserve: error: the HTTP server is not installed; "
              "run `pip install radixserve-server` (or `pip install -e server`)", file=sys.stderr)
        return 2
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
