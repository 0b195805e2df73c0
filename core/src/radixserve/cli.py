"""The ``radixserve`` command. Subcommands come from the ``register_commands`` hook.

Errors a user can fix (bad flags, a missing file, an unreachable server) print one line
``radixserve: error: ...`` and exit 2 (a command may return 1 for a failure at run time).
A closed stdout (``radixserve plugins --json | head -1``) ends the command quietly with
exit code 141 (128 + SIGPIPE), as a command killed by SIGPIPE would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from radixserve.config import ConfigError, ServerArgs, without_plugin_flags
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
            features = f" [{', '.join(r['features'])}]" if r["features"] else ""
            print(f"  {r['name']:<24} {r['package']:<32} {state}{features}")
            for opt in r["options"]:
                print(f"    {opt['flag']} (default {opt['default']!r})")
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


# sampling parameter -> the ``generate`` flag that sets it
GENERATE_SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                           "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed"}


def generate_sampling_params(args: argparse.Namespace) -> dict:
    """The sampling parameters of ``generate``, checked before any model loads; a bad one
    is a ConfigError naming its flag."""
    from radixserve.sampling import InvalidSamplingParams, SamplingParams

    params = {name: getattr(args, name) for name in GENERATE_SAMPLING_FLAGS}
    try:
        SamplingParams.from_dict(dict(params))
    except InvalidSamplingParams as e:
        raise ConfigError(f"{GENERATE_SAMPLING_FLAGS.get(e.param, e.param)}: {e}") from None
    return params


def generate_command(args: argparse.Namespace) -> int:
    params = generate_sampling_params(args)
    server_args = ServerArgs.from_cli_args(args)
    # torch and the model code load only once the flags are known to be good
    from radixserve.engine.engine import Engine

    engine = Engine(**vars(server_args))
    try:
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
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; only the command named in ``argv`` gets the flags plugins
    declare (collecting them loads every plugin kind: ``radixserve --help`` stays quick)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, entry in sorted(get_registry().entries["command"].items()):
        p = sub.add_parser(name, help=entry.description, description=entry.description)
        add = entry.extra.get("add_arguments")
        if add is not None and name == chosen:
            add(p)
        elif add is not None:
            with without_plugin_flags():
                add(p)
        p.set_defaults(_run=entry.factory)
    return parser


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away


def _stdout_closed() -> int:
    """The reader of stdout went away: stop quietly (no traceback now or at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser(argv)
        args, extra = parser.parse_known_args(argv)
        if extra:  # only a command that hands its flags on (radixserve router) takes unknown ones
            if not getattr(args, "accepts_extra_args", False):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.extra_args = extra
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (ConfigError, PluginError, FileNotFoundError, ValueError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
