"""A small argparse front end shared by the ``pwsim`` and ``pwgpu`` commands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported when the CLI is built, so they must keep heavy
imports (torch, simpy) inside ``run``. Errors the project raises on purpose
(``PagedWeightError``, including ``ConfigError`` for a setting outside its allowed values) and
files that cannot be read or written (``OSError``) are printed as one clear message with exit
code 2, never a traceback.

Exit codes scripts can rely on: 0 success, 1 the command ran but its check failed
(e.g. a validation bound), 2 bad input or a command that is not available, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from pagedweight.errors import PagedWeightError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_main(prog: str, description: str, commands: dict[str, str]) -> Callable[[list[str] | None], int]:
    """``commands`` maps a subcommand name to the module that implements it."""

    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        subs = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, module_name in commands.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                # An optional dependency is missing (e.g. the gpu extra): the command says so when
                # used, and every other command keeps working.
                sub = subs.add_parser(name, help=f"(unavailable: needs module {e.name})", add_help=False)
                sub.add_argument("rest", nargs=argparse.REMAINDER)
                sub.set_defaults(run_command=_unavailable(prog, name, e))
                continue
            doc = (module.__doc__ or "").strip().replace("%", "%%")  # argparse formats help with %
            sub = subs.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc)
            module.add_arguments(sub)
            sub.set_defaults(run_command=module.run)
        args = parser.parse_args(argv)
        if not getattr(args, "run_command", None):
            parser.print_help()
            return EXIT_USAGE
        try:
            return int(args.run_command(args) or 0)
        except PagedWeightError as e:
            print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as e:  # a path that cannot be read or written: its message names it
            print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print(f"{prog} {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return main


def _unavailable(prog: str, name: str, err: ImportError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(
            f"{prog} {name}: unavailable: module {err.name!r} is not installed "
            "(install the extras: pip install -e '.[gpu]')",
            file=sys.stderr,
        )
        return EXIT_USAGE

    return run
