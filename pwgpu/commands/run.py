"""Run a request trace through the engine in-process for one or more policies (no HTTP).

The real-engine counterpart of `pwsim run`: requests arrive at the trace's times on the
engine's clock; the results directory (requests, steps, transitions, summary, report.html)
has the simulator's format with "runtime": "pwgpu". --like mixtral-8x7b --layers 4 serves a
random checkpoint with that model's shape and fewer layers (the GPU benchmark).
"""

from __future__ import annotations

import argparse

from pagedweight.policy.policies import POLICY_NAMES
from pwgpu.commands import core_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: the default model)")
    src.add_argument("--like", help="built-in model spec (e.g. mixtral-8x7b): random weights of that shape")
    p.add_argument("--layers", type=int, help="with --like: number of layers (default: the spec's)")
    p.add_argument(
        "--scenario",
        help="scenario YAML: model, budget, pages, scheduler, controller, workload and policies come from it "
        "(the real counterpart of `pwsim run SCENARIO`, which `pwsim validate` compares with)",
    )
    p.add_argument("--trace", help="trace file (azure, mooncake, burstgpt or generic CSV/JSONL)")
    p.add_argument("--policies", help=f"comma list of {', '.join(POLICY_NAMES)} (default: static-fp16,pagedweight)")
    core_options.add_arguments(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="activations, pinned weights and KV")
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--max-requests", type=int)
    p.add_argument("--importance", help="importance table CSV (default: a synthetic table)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-text",
        nargs="+",
        metavar="FILE",
        help="prompts are windows of these texts (request i from file i mod N) instead of random ids; "
        "also writes tokens.jsonl for re-scoring what was served (pwgpu served-quality)",
    )


def run(args: argparse.Namespace) -> int:
    from pagedweight.core.spec import load_model
    from pagedweight.errors import PagedWeightError
    from pagedweight.workload.build import scale_rate, take
    from pwgpu.default_model import default_model_dir, random_model_dir
    from pwgpu.engine import EngineConfig
    from pwgpu.offline import run_policies
    from pwgpu.replay import load_trace

    if args.scenario:
        return _run_scenario(args)
    if not (args.trace and args.mem_budget):
        raise PagedWeightError("give --scenario, or --trace and --mem-budget")
    policies = [p.strip() for p in (args.policies or "static-fp16,pagedweight").split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad:
        raise PagedWeightError(f"unknown policies {bad}; allowed: {', '.join(POLICY_NAMES)}")
    model_dir = random_model_dir(load_model(args.like), args.layers) if args.like else args.model or default_model_dir()
    trace = load_trace(args.trace)
    if args.max_requests is not None:
        trace = take(trace, args.max_requests)
    if args.rate_scale != 1.0:
        trace = scale_rate(trace, args.rate_scale)
    base = EngineConfig(
        core_options.core_config(args), importance=args.importance, device=args.device, dtype=args.dtype
    )
    prompts = None
    if args.prompt_text:
        from pwgpu.served import TextPrompts

        prompts = TextPrompts(model_dir, args.prompt_text, args.seed)
    meta = run_policies(model_dir, trace, base, policies, args.out, args.seed, prompt_source=prompts)
    _print(meta, len(trace), args.out)
    return 0


def _run_scenario(args: argparse.Namespace) -> int:
    """The engine configured exactly as ``pwsim`` configures its RuntimeCore for the scenario
    (``pagedweight.config.run.scenario_run``)."""
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pagedweight.errors import PagedWeightError
    from pwgpu.default_model import default_model_dir, random_model_dir
    from pwgpu.offline import run_scenario

    given = [f"--{k.replace('_', '-')}" for k in _SET_BY_SCENARIO if getattr(args, k) is not None]
    if given:
        raise PagedWeightError(
            f"--scenario sets the trace, budget, model, limits and importance; drop {', '.join(given)}"
        )
    loaded = load_scenario(args.scenario, require_latency_table=False)  # the engine times itself
    sc = loaded.scenario
    model_dir = args.model or (default_model_dir() if sc.model == "tiny-moe" else random_model_dir(loaded.model, None))
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
    run = scenario_run(loaded, policies)
    extra = {}
    if args.prompt_text:
        from pwgpu.served import TextPrompts

        extra["prompt_source"] = TextPrompts(model_dir, args.prompt_text, run.seed)
    meta = run_scenario(run, model_dir, args.out, device=args.device, dtype=args.dtype, **extra)
    _print(meta, len(run.trace), args.out)
    return 0


# Options a scenario sets itself.
_SET_BY_SCENARIO = (
    "trace", "mem_budget", "like", "importance", "page_bytes", "kv_block_tokens", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "prefix_caching",
)  # fmt: skip


def _print(meta: dict, num_requests: int, out: str) -> None:
    for policy, s in meta["policies"].items():
        if "error" in s:
            print(f"{policy:13s} infeasible: {s['error']}")
            continue
        print(f"{policy:13s} {s['completed']}/{num_requests} done, {s['output_throughput']:.1f} tok/s, "
              f"mean TTFT {s['mean_ttft_ms']:.1f} ms, mean TPOT {s['mean_tpot_ms']:.2f} ms, "
              f"{s['num_preemptions']} preemptions, {s['num_downgrades']} downgrades, "
              f"{s['num_upgrades']} upgrades")  # fmt: skip
    print(f"results in {out}")
