"""Measure the kernel latency table that pwsim's table latency model reads.

Times the MoE expert FFN per precision over tokens-per-expert x active experts, attention
prefill and decode, the dense per-layer ops, the LM head, quantisation and host-to-device
copies, and writes the long CSV of pagedweight/kernel_table.py plus its .meta.yaml. On a
machine without a GPU it times the CPU engine's PyTorch path (use --grid small).
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedweight.spec import PRECISION_NAMES, get_precision, load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in model name or spec .yaml; comma list for several")
    p.add_argument("--out", required=True, metavar="traces/kernels/<gpu>.csv", help="CSV to write (meta file beside)")
    p.add_argument("--grid", choices=("small", "full"), default="small", help="measurement grid (default: small)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--precisions", default=",".join(PRECISION_NAMES), help="weight precisions to measure (comma list)")
    p.add_argument(
        "--ops",
        default="moe_ffn,attention,dense,quantize,h2d_copy",
        help="op groups to measure (comma list of moe_ffn, attention, dense, quantize, h2d_copy)",
    )


def run(args: argparse.Namespace) -> int:
    from pagedweight.kernel_table import write_kernel_table
    from pwgpu.profile import profile

    models = [load_model(name.strip()) for name in args.model.split(",") if name.strip()]
    precisions = tuple(get_precision(p.strip()).name for p in args.precisions.split(",") if p.strip())
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    allowed = ("moe_ffn", "attention", "dense", "quantize", "h2d_copy")
    bad = [o for o in ops if o not in allowed]
    if bad:
        print(f"pwgpu profile: error: unknown ops {bad}; allowed: {', '.join(allowed)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def save(table, meta) -> None:
        write_kernel_table(table, args.out, meta)

    df, meta = profile(models, args.grid, args.device, precisions, ops, on_progress=save)
    save(df, meta)
    print(f"wrote {len(df)} rows for {', '.join(m.name for m in models)} on {meta['device']} to {args.out} "
          f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0
