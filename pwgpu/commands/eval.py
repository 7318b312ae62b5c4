"""Quality of a precision plan: KL vs full precision (nats/token) and perplexity per domain.

--plan is what `pwsim allocate --out` writes (layer,expert,precision,...); --uniform P evaluates
every expert at P instead. Each --data file is one domain, named after the file.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Mixtral-layout checkpoint directory")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", metavar="PLAN.csv", help="per-expert precisions (pwsim allocate --out)")
    which.add_argument("--uniform", metavar="PRECISION", help="every routed expert at this precision")
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE", help="evaluation texts, one per domain")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per domain (default: the whole file)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward window (default 1024)")
    parser.add_argument("--out", metavar="RESULTS.csv", help="also write the results as CSV")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import torch

    from pwgpu.evaluate import (
        MoeForward,
        ReferenceCache,
        evaluate_plan,
        load_tokens,
        read_plan,
        uniform_plan,
        write_results,
    )

    torch.set_num_threads(args.threads)
    start = time.monotonic()
    model = MoeForward(args.model)
    plan = read_plan(args.plan, model.num_layers, model.num_experts) if args.plan else None
    plan = plan if plan is not None else uniform_plan(model, args.uniform)
    data = {Path(f).stem: load_tokens(args.model, f, args.max_tokens) for f in args.data}
    ref = ReferenceCache(model, data, args.window)
    results = evaluate_plan(model, ref, plan)
    print(f"{'domain':<14}{'tokens':>8}{'KL nats/tok':>14}{'ppl full':>10}{'ppl plan':>10}")
    for r in results:
        print(f"{r.domain:<14}{r.tokens:>8}{r.kl_nats_per_token:>14.4g}{r.ppl_full:>10.2f}{r.ppl_plan:>10.2f}")
    if args.out:
        write_results(args.out, results, {"plan": args.plan or f"uniform-{args.uniform}"})
    print(f"done in {time.monotonic() - start:.0f} s")
    return 0
