"""The ``pwgpu`` command line."""

from __future__ import annotations

import logging
import sys

from pagedweight.cli_util import build_main

COMMANDS: dict[str, str] = {
    "profile": "pwgpu.commands.profile",
    "serve": "pwgpu.commands.serve",
    "replay": "pwgpu.commands.replay",
    "run": "pwgpu.commands.run",
    "train": "pwgpu.commands.train",
    "importance": "pwgpu.commands.importance",
    "eval": "pwgpu.commands.eval",
    "experiments": "pwgpu.commands.experiments",
}

_main = build_main(
    "pwgpu", "PagedWeight engine: serve, profile and evaluate MoE models with dynamic expert precision.", COMMANDS
)


def main(argv: list[str] | None = None) -> int:
    # What loading a checkpoint ignored or converted (one line each) goes to stderr.
    log = logging.getLogger("pwgpu.loader")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pwgpu: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
