"""The ``pwsim`` command line."""

from __future__ import annotations

import sys

from pagedweight.cli_util import build_main

COMMANDS: dict[str, str] = {
    "run": "pwsim.commands.run",
    "specs": "pwsim.commands.specs",
    "allocate": "pwsim.commands.allocate",
    "importance": "pwsim.commands.importance",
    "trace": "pwsim.commands.trace",
    "report": "pwsim.commands.report",
    "compare": "pwsim.commands.compare",
    "sweep": "pwsim.commands.sweep",
    "bench": "pwsim.commands.bench",
    "validate": "pwsim.commands.validate",
}

main = build_main(
    "pwsim", "PagedWeight simulator: replay traces against an MoE model, a GPU and a memory budget.", COMMANDS
)

if __name__ == "__main__":
    sys.exit(main())
