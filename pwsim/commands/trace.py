"""Inspect and generate request traces: `trace stats FILE`, `trace synth --kind NAME --out FILE`.

`stats` prints rows, span, rate, IAT CV, per-1/3/60 s arrival-count CV and max, and prompt/output
token mean/median/p90/p99/max/min (the definitions of the shared traces' PROVENANCE.md). The
format is detected from the header unless --format says otherwise.

`synth` writes Mooncake-format JSONL (timestamp in ms, input_length, output_length) from a preset
fitted to published statistics (see pagedweight/workload/synth.py), then prints the statistics of what it wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedweight.config.workload import TRACE_FORMATS
from pagedweight.errors import TraceError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagedweight.workload.synth import MULTITURN_DESCRIPTION, SYNTH_PRESETS

    subs = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    s = subs.add_parser("stats", help="print the statistics of a trace file")
    s.add_argument("file", type=Path)
    s.add_argument("--format", choices=TRACE_FORMATS)
    s.add_argument(
        "--columns", metavar="ARRIVAL,PROMPT,OUTPUT", help="generic format: the three column names, comma-separated"
    )
    s.add_argument("--time-unit", choices=["s", "ms"], help="unit of numeric timestamps (mooncake default ms, else s)")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.add_argument("--sort", action="store_true", help="accept timestamps out of order: sort by time (noted)")

    y = subs.add_parser("synth", help="generate a synthetic trace from a fitted preset")
    kinds = "; ".join(
        [*(f"{k}: {v.description}" for k, v in SYNTH_PRESETS.items()), f"multiturn: {MULTITURN_DESCRIPTION}"]
    )
    y.add_argument("--kind", required=True, choices=sorted([*SYNTH_PRESETS, "multiturn"]), help=kinds)
    y.add_argument("--out", required=True, type=Path, help="output JSONL file")
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("--duration-s", type=float, help="override the preset's duration")
    y.add_argument("--num-requests", type=int, help="stop after this many requests instead")
    y.add_argument("--rate-qps", type=float, help="override the mean arrival rate")
    y.add_argument("--cv", type=float, help="Gamma inter-arrival CV instead of the preset's process")


def run(args: argparse.Namespace) -> int:
    if args.trace_command == "stats":
        return _stats(args)
    return _synth(args)


def _stats(args: argparse.Namespace) -> int:
    import pagedweight.workload.traces as tr
    from pagedweight.workload.stats import format_stats, length_stats, trace_stats

    fmt = args.format or tr.detect_format(args.file)
    unit = args.time_unit or ("ms" if fmt == "mooncake" else "s")
    notes: list[str] = []
    if fmt == "sharegpt":
        prompt, output = tr.load_lengths(args.file)
        stats = {"rows": len(prompt), "prompt_tokens": length_stats(prompt), "output_tokens": length_stats(output)}
        notes.append("no timestamps: lengths only")
    else:
        if fmt == "azure":
            trace = tr.load_azure(args.file, sort=args.sort)
        elif fmt == "mooncake":
            trace = tr.load_mooncake(args.file, unit, sort=args.sort)
        elif fmt == "burstgpt":
            trace = tr.load_burstgpt(args.file, time_unit=unit, sort=args.sort)
        else:
            if not args.columns or len(args.columns.split(",")) != 3:
                raise TraceError(
                    f"{args.file}: generic format needs --columns ARRIVAL,PROMPT,OUTPUT "
                    f"(or --format azure|mooncake|burstgpt|sharegpt)"
                )
            arrival, prompt, output = (c.strip() for c in args.columns.split(","))
            trace = tr.load_generic(args.file, arrival, prompt, output, unit, sort=args.sort)
        stats = trace_stats(trace)
        notes += trace.notes
    if args.json:
        print(json.dumps({"file": str(args.file), "format": fmt, **stats, "notes": notes}, indent=2))
        return 0
    print(f"{args.file} ({fmt})")
    print(format_stats(stats))
    for note in notes:
        print(f"note: {note}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from pagedweight.workload.stats import format_stats, trace_stats
    from pagedweight.workload.synth import synthesize
    from pagedweight.workload.traces import load_mooncake, write_jsonl

    try:
        trace = synthesize(
            args.kind,
            args.seed,
            duration_s=args.duration_s,
            num_requests=args.num_requests,
            rate_qps=args.rate_qps,
            cv=args.cv,
        )
    except ValueError as e:  # ConfigError, or pydantic's ValidationError from build_workload
        raise TraceError(f"synth --kind {args.kind}: {e}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(trace, args.out)
    print(f"wrote {len(trace)} requests to {args.out} ({args.out.stat().st_size:,} bytes)")
    # Statistics of the file as written (timestamps rounded to 1 ms), read back by its loader.
    print(format_stats(trace_stats(load_mooncake(args.out))))
    for note in trace.notes:
        print(f"note: {note}")
    return 0
