"""Make or check importance tables: `synth` writes a SYNTHETIC table for a built-in model;
`check` validates a table and summarises it."""

from __future__ import annotations

import argparse

import numpy as np

from pagedweight.core.spec import DEFAULT_LADDER, load_model
from pagedweight.policy.importance import read_table, synthetic_table, write_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    subs = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    synth = subs.add_parser("synth", help="write a synthetic table (skew documented in synthetic_table)")
    synth.add_argument("--model", required=True, help="built-in model name or ModelSpec YAML path")
    synth.add_argument("--out", required=True, metavar="FILE.csv")
    synth.add_argument("--ladder", default=",".join(DEFAULT_LADDER), help="precisions, comma separated")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--zipf-exponent", type=float, default=0.8, help="routing skew within a layer")
    synth.add_argument("--outlier-sigma", type=float, default=0.7, help="spread of per-expert quantisation damage")
    check = subs.add_parser("check", help="validate a table and print a summary")
    check.add_argument("table", metavar="FILE.csv")


def run(args: argparse.Namespace) -> int:
    if args.action == "synth":
        names = tuple(s.strip() for s in args.ladder.split(",") if s.strip())
        table = synthetic_table(
            load_model(args.model),
            names,
            seed=args.seed,
            zipf_exponent=args.zipf_exponent,
            outlier_sigma=args.outlier_sigma,
        )
        write_table(table, args.out)
        print(f"wrote {args.out}: {table.num_layers} x {table.num_experts} experts, ladder {', '.join(table.ladder)}")
        print(table.provenance)
        return 0
    table = read_table(args.table)
    print(
        f"{args.table}: ok, {table.num_layers} layers x {table.num_experts} experts, ladder {', '.join(table.ladder)}"
    )
    print(table.provenance)
    freq = table.grid(table.routing_freq)
    print(f"routing_freq per layer sums to {freq.sum(axis=1).min():.3f}..{freq.sum(axis=1).max():.3f}")
    top = np.sort(freq, axis=1)[:, ::-1]
    tenth = max(1, table.num_experts // 10)
    print(f"busiest 10% of experts take {top[:, :tenth].sum() / max(freq.sum(), 1e-300):.1%} of routed tokens")
    print(
        "sum dloss if every expert at "
        + ", ".join(f"{p} {table.dloss[:, j].sum():.4g}" for j, p in enumerate(table.ladder))
    )
    print("bytes at each precision: " + ", ".join(f"{p} {table.bytes[:, j].sum()}" for j, p in enumerate(table.ladder)))
    return 0
