"""Measure the kernel latency table that pwsim's table latency model reads.

Times the MoE expert FFN per precision over tokens-per-expert x active experts, attention
prefill and decode, the dense per-layer ops, the LM head, quantisation, the CPU engine's
dequantisation and host-to-device copies (with --ep N also the all-to-all of N ranks), and
writes the long CSV of pagedweight/config/kernel_table.py plus its .meta.yaml. On a machine without a GPU it times the
CPU engine's PyTorch path (use --scenario or --grid small).
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedweight.config.kernel_table import OP_GROUPS
from pagedweight.core.spec import PRECISION_NAMES, get_precision, load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="built-in model name or spec .yaml; comma list (default: the scenario's)")
    p.add_argument("--out", required=True, metavar="traces/kernels/<gpu>.csv", help="CSV to write (meta file beside)")
    p.add_argument("--grid", choices=("small", "full"), default="small", help="measurement grid (default: small)")
    p.add_argument(
        "--scenario",
        metavar="SCENARIO.yaml",
        help="instead of --grid: a grid fitted to this scenario's scheduler limits and longest request, "
        "so that simulating it never leaves the measured range",
    )
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="activations and KV (default: with --scenario bf16, as `pwgpu run --scenario` computes; "
        "else the engine's default: bf16 on a GPU, fp32 on a CPU)",
    )
    p.add_argument("--precisions", help="weight precisions to measure (comma list; default: the scenario's, else all)")
    p.add_argument(
        "--ops",
        default=",".join(OP_GROUPS),
        help=f"op groups to measure (comma list of {', '.join(OP_GROUPS)}; dequantize: CPU only; "
        "empty with --ep: the all-to-all only)",
    )
    p.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help="also time the expert-parallel all-to-all (op all_to_all) on N >= 2 ranks: gloo processes on a "
        "CPU, NCCL on N GPUs (with --scenario up to the scenario's largest dispatch)",
    )


def run(args: argparse.Namespace) -> int:
    from pagedweight.config.kernel_table import write_kernel_table
    from pwgpu.loader import SCENARIO_DTYPE
    from pwgpu.profile import profile

    grid, models, loaded = args.grid, [], None
    if args.scenario:
        loaded, grid = _fitted_grid(args.scenario)
        models = [] if args.model else [loaded.model]
        args.precisions = args.precisions or ",".join(loaded.scenario.memory.precisions)
        args.dtype = args.dtype or SCENARIO_DTYPE
    elif not args.model:
        print("pwgpu profile: error: give --model (or --scenario, whose model is then profiled)", file=sys.stderr)
        return 2
    models += [load_model(name.strip()) for name in (args.model or "").split(",") if name.strip()]
    names = args.precisions or ",".join(PRECISION_NAMES)
    precisions = tuple(get_precision(p.strip()).name for p in names.split(",") if p.strip())
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OP_GROUPS]
    if bad:
        print(f"pwgpu profile: error: unknown ops {bad}; allowed: {', '.join(OP_GROUPS)}", file=sys.stderr)
        return 2
    if not ops and args.ep is None:
        msg = f"--ops is empty; give op groups of {', '.join(OP_GROUPS)} or --ep"
        print(f"pwgpu profile: error: {msg}", file=sys.stderr)
        return 2
    a2a_sizes = _a2a_sizes(args, loaded) if args.ep is not None else ()
    t0 = time.perf_counter()

    def save(table, meta) -> None:
        write_kernel_table(table, args.out, meta)

    df, meta = profile(models, grid, args.device, precisions, ops, on_progress=save, dtype=args.dtype)
    if a2a_sizes:
        import pandas as pd

        from pwgpu.profile_a2a import check_world, profile_all_to_all

        if len(df):  # what the kernels gave, kept should the all-to-all fail
            save(df, {**meta, "complete": False})
        device_type = _device_type(args)
        rows = profile_all_to_all(args.ep, device_type, a2a_sizes, models[0].name)
        df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True) if len(df) else pd.DataFrame(rows)
        meta["all_to_all"] = {"ranks": args.ep, "backend": check_world(args.ep, device_type)}
    save(df, meta)
    print(f"wrote {len(df)} rows for {', '.join(m.name for m in models)} on {meta['device']} to {args.out} "
          f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


def _device_type(args: argparse.Namespace) -> str:
    import torch

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type


def _a2a_sizes(args: argparse.Namespace, loaded) -> tuple[int, ...]:
    """The all-to-all sizes for --ep (checked before the kernels are timed): the device's
    default grid, or with --scenario up to one rank's whole batch of token copies (every copy
    sent to another rank): what a rank sends at most, and about what the busiest rank of a
    replica with even batches and routing receives at most."""
    from pwgpu.profile_a2a import a2a_bytes_grid, check_world

    device_type = _device_type(args)
    check_world(args.ep, device_type)
    if loaded is None:
        return a2a_bytes_grid(device_type)
    sc, spec = loaded.scenario, loaded.model
    copy_bytes = spec.hidden_size * sc.parallel.a2a_bytes_per_value
    return a2a_bytes_grid(device_type, sc.scheduler.max_num_batched_tokens * spec.top_k * copy_bytes)


def _fitted_grid(path: str):
    import numpy as np

    from pagedweight.config.scenario import load_scenario
    from pagedweight.workload.build import build_workload
    from pwgpu.profile import Grid

    loaded = load_scenario(path, require_latency_table=False)
    sc = loaded.scenario
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    longest = int((trace.prompt_tokens + trace.output_tokens).max()) if len(trace) else 1
    context = min(longest, loaded.max_model_len)
    # Copies: one page at least; an upgrade copies one expert, a KV swap one request's KV.
    expert_bytes = max(loaded.model.expert_bytes(p) for p in sc.memory.precisions)
    largest_copy = max(expert_bytes, context * loaded.model.kv_bytes_per_token(), sc.memory.page_bytes)
    grid = Grid.fitted(
        f"fitted to {path}",
        sc.scheduler.max_num_batched_tokens,
        sc.scheduler.max_num_seqs,
        context,
        (sc.memory.page_bytes, largest_copy),
    )
    return loaded, grid
