"""Check (or with --write, rewrite) the generated tables of a Markdown file against the outputs
they are rendered from: every block between <!-- generated: NAME --> and <!-- end: NAME -->, and
the whole-file reports beside the outputs (equal_memory.md, served_quality.md). Exit 1 when one
differs from its outputs."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--doc", default="reports/quality/README.md", help="the Markdown file with generated blocks")
    p.add_argument("--dir", default=None, help="where the outputs are (default: the document's directory)")
    p.add_argument("--write", action="store_true", help="rewrite the blocks that differ")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pwgpu.quality_tables import sync, sync_files

    doc = Path(args.doc)
    d = Path(args.dir) if args.dir else doc.parent
    stale = sync(doc, d, write=args.write) + sync_files(d, write=args.write)
    if not stale:
        print(f"{doc}: every generated block and report matches its outputs")
        return 0
    verb = "rewrote" if args.write else "differ from their outputs"
    print(f"{doc}: {len(stale)} block(s) {verb}: {', '.join(stale)}")
    return 0 if args.write else 1
