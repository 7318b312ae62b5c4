"""Measure the importance table of a checkpoint: routing, gradient score, Fisher dloss per precision, oracle.

Writes the table format of pagedweight/policy/importance.py (read by `pwsim allocate` and the controller).
--oracle also measures the KL with only one expert quantised (expensive: one forward pass per
expert and precision; --oracle-experts limits it to a subset). --details writes every estimator
per expert, including the oracle, for comparing them. --folds N cuts each file into windows
dealt round-robin to N folds: the table is calibrated on --fold and the oracle measured on
--oracle-fold (default the last fold), so the oracle never sees the calibration text.
"""

from __future__ import annotations

import argparse

from pagedweight.errors import ConfigError

# Copies of pwgpu.importance's constants: that module imports torch, which the CLI must not load
# before a command runs (a test checks the two agree).
TABLE_LADDER = ("bf16", "fp8", "int8", "int4", "int3", "int2")
DLOSS_SOURCES = ("fisher-token", "fisher-seq", "output-error", "oracle")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Mixtral-layout checkpoint directory, e.g. models/tiny-moe")
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE", help="calibration texts, one per domain")
    parser.add_argument("--out", required=True, metavar="TABLE.csv", help="importance table to write")
    parser.add_argument("--name", default=None, help="model name in the table (default: the directory name)")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration tokens per data file (default 8192)")
    parser.add_argument("--window", type=int, default=256, help="tokens per calibration window (default 256)")
    parser.add_argument("--ladder", default=",".join(TABLE_LADDER), help="precisions (comma list, starts at bf16)")
    parser.add_argument("--min-expert-tokens", type=int, default=16, help="below this an expert gets the fallback")
    parser.add_argument("--dloss", choices=DLOSS_SOURCES, default="fisher-token", help="estimator for dloss_<p>")
    parser.add_argument("--oracle", action="store_true", help="also measure the oracle KL per expert and precision")
    parser.add_argument("--oracle-tokens", type=int, default=2048, help="oracle tokens per data file (default 2048)")
    parser.add_argument(
        "--oracle-experts", default=None, metavar="L:E,...", help="measure the oracle for these experts only"
    )
    parser.add_argument("--folds", type=int, default=1, help="windows dealt round-robin to N folds (default 1)")
    parser.add_argument(
        "--fold", default=None, metavar="K[,K...]", help="folds to calibrate on (default: all but --oracle-fold)"
    )
    parser.add_argument(
        "--oracle-fold", type=int, default=None, help="fold the oracle is measured on (default: the last, N-1)"
    )
    parser.add_argument("--details", metavar="FILE.csv", help="write every estimator per expert")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")


def _experts(spec: str | None) -> list[tuple[int, int]] | None:
    if not spec:
        return None
    out = []
    for item in spec.split(","):
        layer, _, expert = item.partition(":")
        if not (layer.strip().isdigit() and expert.strip().isdigit()):
            raise ConfigError(f"--oracle-experts {spec!r}: {item!r} is not LAYER:EXPERT (e.g. 0:3,1:7)")
        out.append((int(layer), int(expert)))
    return out


def _folds(args: argparse.Namespace) -> tuple[list[int], int | None]:
    """(calibration folds, oracle fold or None when the oracle shares the calibration text)."""
    n = args.folds
    if n < 1:
        raise ConfigError(f"--folds {n}: must be >= 1")
    if n == 1:
        if args.oracle_fold not in (None, 0) or args.fold not in (None, "0"):
            raise ConfigError("--fold/--oracle-fold need --folds >= 2")
        return [0], None
    oracle = n - 1 if args.oracle_fold is None else args.oracle_fold
    if not 0 <= oracle < n:
        raise ConfigError(f"--oracle-fold {oracle}: allowed 0..{n - 1}")
    try:
        chosen = [int(x) for x in args.fold.split(",")] if args.fold else [f for f in range(n) if f != oracle]
    except ValueError:
        raise ConfigError(f"--fold {args.fold!r}: a comma list of fold numbers 0..{n - 1}") from None
    bad = [f for f in chosen if not 0 <= f < n]
    if bad:
        raise ConfigError(f"--fold {bad[0]}: allowed 0..{n - 1}")
    if args.oracle and oracle in chosen:
        raise ConfigError(f"--oracle-fold {oracle} is also a calibration fold; the oracle must see other text")
    return chosen, oracle


def run(args: argparse.Namespace) -> int:
    import os
    import time
    from pathlib import Path

    import torch

    from pagedweight.policy.importance import write_table
    from pwgpu.evaluate import MoeForward, QualityError, load_tokens
    from pwgpu.importance import build_table, calibrate, fold_tokens, oracle_kl, write_details

    # Flags that conflict are refused before minutes of calibration, not after.
    if args.dloss == "oracle" and not args.oracle:
        raise QualityError("--dloss oracle needs --oracle")
    experts = _experts(args.oracle_experts)
    chosen, oracle_fold = _folds(args)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    load_start = os.getloadavg()[0]
    model = MoeForward(args.model)
    texts = {Path(f).stem: load_tokens(args.model, f) for f in args.data}
    if oracle_fold is None:
        data = oracle_data = {d: ids[: max(args.tokens, args.oracle_tokens)] for d, ids in texts.items()}
    else:
        data = {d: fold_tokens(ids, args.window, args.folds, chosen) for d, ids in texts.items()}
        oracle_data = {d: fold_tokens(ids, args.window, args.folds, [oracle_fold]) for d, ids in texts.items()}
    ladder_names = tuple(s.strip() for s in args.ladder.split(",") if s.strip())
    est = calibrate(model, data, args.tokens, args.window, ladder_names, args.min_expert_tokens, progress=print)
    print(f"calibrated on {est.tokens:,} tokens in {time.monotonic() - start:.0f} s")
    if args.oracle:
        t0 = time.monotonic()
        window = args.window if oracle_fold is not None else 512  # fold windows must not be joined
        oracle_kl(model, est, oracle_data, args.oracle_tokens, window, experts=experts, progress=print)
        where = "the calibration text" if oracle_fold is None else f"fold {oracle_fold} of {args.folds} (disjoint)"
        print(f"oracle measured on {where} in {time.monotonic() - t0:.0f} s")
    name = args.name or Path(args.model).resolve().name
    source = f"pwgpu importance --model {args.model} --data {' '.join(args.data)}"
    if oracle_fold is not None:
        source += f" --folds {args.folds} --fold {','.join(map(str, chosen))}"
    table, fallback = build_table(model, est, args.dloss, args.min_expert_tokens, name, source)
    for layer, e, n in fallback:
        print(f"expert layer {layer} expert {e}: {n} calibration tokens (< {args.min_expert_tokens}); fallback dloss")
    write_table(table, args.out)
    if args.details:
        where = "calibration text"
        if oracle_fold is not None:
            folds = ",".join(map(str, chosen))
            where = f"fold {oracle_fold} of {args.folds}, disjoint from calibration folds {folds}"
        load = (load_start, os.getloadavg()[0], os.cpu_count())
        write_details(args.details, est, oracle_text=where, run_time_s=time.monotonic() - start, load=load)
    lossy = [p for p in table.ladder if p != "bf16"]
    totals = ", ".join(f"{p} {table.dloss[:, table.ladder.index(p)].sum():.4g}" for p in lossy)
    print(f"wrote {args.out} ({table.num_rows} experts); sum dloss over experts: {totals} nats/token")
    print(f"done in {time.monotonic() - start:.0f} s")
    return 0
