"""The ``radixserve`` command. Subcommands come from the ``register_commands`` hook."""

from __future__ import annotations

import argparse
import json
import sys

from radixserve.config import ConfigError, ServerArgs
from radixserve.registry import KINDS, PluginError, get_registry


# ------------------------------------------------------------------ plugins
def plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def plugins_command(args: argparse.Namespace) -> int:
    rows = get_registry().describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind in KINDS.values():
        print(f"{kind.title}" + (f" ({', '.join(kind.flags)})" if kind.flags else ""))
        mine = [r for r in rows if r["kind"] == kind.name]
        if not mine:
            print("  (none installed)")
        for r in mine:
            state = "available" if r["available"] else f"unavailable: {r['reason']}"
            print(f"  {r['name']:<24} {r['package']:<32} {state}")
    return 0


# ----------------------------------------------------------------- generate
def generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    ServerArgs.add_cli_args(parser)


def generate_command(args: argparse.Namespace) -> int:
    from radixserve.engine.engine import Engine

    engine = Engine(**vars(ServerArgs.from_cli_args(args)))
    try:
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                  "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
        if args.chat:
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
            out = engine.generate(input_ids=ids, sampling_params=params)
        else:
            out = engine.generate(args.prompt, params)
        print(out["text"])
    finally:
        engine.shutdown()
    return 0


# --------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, entry in sorted(get_registry().entries["command"].items()):
        p = sub.add_parser(name, help=entry.description, description=entry.description)
        add = entry.extra.get("add_arguments")
        if add is not None:
            add(p)
        p.set_defaults(_run=entry.factory)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except (ConfigError, PluginError, FileNotFoundError, ValueError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
