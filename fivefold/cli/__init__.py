"""`fivefold COMMAND ...`: one module per command in this package.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args, extra) -> int`;
`extra` holds the words argparse did not recognise (dotted overrides, Megatron flags) for the
commands that set `ACCEPTS_EXTRA = True`. A `UserError` ends the command with its message and exit 2;
output piped into a reader that stops early (`| head`) ends it quietly, as Unix tools do.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

from fivefold.errors import UserError

COMMANDS = [
    "validate", "layout", "train", "schedule", "plan", "estimate", "preprocess", "export", "convert", "check", "rl", "plot"]


def _load(name: str):
    try:
        return importlib.import_module(f"fivefold.cli.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"fivefold.cli.{name}":
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader stopped


@functools.lru_cache(maxsize=1)
def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser of every command, built once per process (in-process callers run main many times)."""
    parser = argparse.ArgumentParser(prog="fivefold", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name in COMMANDS:
        module = _load(name)
        help_text = module.HELP if module else "(not implemented yet)"
        # allow_abbrev=False: a Megatron flag such as --bf16 must reach the dialect parser, not be
        # taken as a prefix of one of our options (--bf16-tflops)
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if module:
            module.add_arguments(p)
        modules[name] = module
    return parser, modules


def _main(argv: list[str]) -> int:
    parser, modules = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = modules[args.command]
    if module is None:
        print(f"fivefold {args.command}: not implemented yet", file=sys.stderr)
        return 2
    if extra and not getattr(module, "ACCEPTS_EXTRA", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(module.run(args, extra) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # on a terminal, past the echoed ^C and any progress bar's unfinished line
        print("\ninterrupted" if sys.stderr.isatty() else "interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout replaced by an object without a file descriptor
        pass
