"""Run a request trace through the engine in-process for one or more policies (no HTTP).

The real-engine counterpart of `pwsim run`: requests arrive at the trace's times on the
engine's clock; the results directory (requests, steps, transitions, summary, report.html)
has the simulator's format with "runtime": "pwgpu". --like mixtral-8x7b --layers 4 serves a
random checkpoint with that model's shape and fewer layers (the GPU benchmark).
--ep N (or a scenario's parallel.ep) runs it on N expert-parallel rank processes.
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
        "--ep",
        type=int,
        help="expert parallelism: N rank processes, each holding 1/N of every MoE layer's experts in its own "
        "budget, rank 0 writing the results (gloo ranks on the CPU, NCCL with a GPU per rank; default: the "
        "scenario's parallel.ep, else 1)",
    )
    p.add_argument(
        "--prompt-text",
        nargs="+",
        metavar="FILE",
        help="prompts are windows of these texts (request i from file i mod N) instead of random ids; "
        "also writes tokens.jsonl for re-scoring what was served (pwgpu served-quality)",
    )


def run(args: argparse.Namespace) -> int:
    job = _Job(args)
    if job.ep == 1:
        _print(job.run(), job.num_requests, args.out)
        return 0
    from pwgpu.ep_launch import ep_backend, launch

    backend = ep_backend(job.ep, job.model_dir, args.device)
    launch(job.ep, backend, _rank, (args, backend))
    return 0


def _rank(rank: int, world: int, args: argparse.Namespace, backend: str) -> None:
    """One rank of ``pwgpu run --ep N``: rank 0 runs the policies and writes the results, the
    others follow it (``pwgpu.ep_agree``)."""
    from pwgpu.ep_launch import follow_policies, rank_device

    args = argparse.Namespace(**{**vars(args), "device": rank_device(rank, backend)})
    job = _Job(args, leader=rank == 0)
    if rank == 0:
        _print(job.run(ep=True), job.num_requests, args.out)
    else:
        follow_policies(job.model_dir, job.base, job.policies, job.table)


class _Job:
    """What a run needs, from the command line or a scenario; built the same way on every rank
    of an expert-parallel run (``leader``: also the real prompts, which only rank 0 reads)."""

    def __init__(self, args: argparse.Namespace, leader: bool = True):
        if args.ep is not None and args.ep < 1:
            from pagedweight.errors import ConfigError

            raise ConfigError(f"--ep(={args.ep}) must be >= 1")
        self.args = args
        if args.scenario:
            self._from_scenario(args, leader)
        else:
            self._from_options(args, leader)

    def _from_options(self, args: argparse.Namespace, leader: bool) -> None:
        from pagedweight.core.spec import load_model
        from pagedweight.errors import PagedWeightError
        from pagedweight.workload.build import scale_rate, take
        from pwgpu.default_model import default_model_dir, random_model_dir
        from pwgpu.engine import EngineConfig
        from pwgpu.replay import load_trace

        if not (args.trace and args.mem_budget):
            raise PagedWeightError("give --scenario, or --trace and --mem-budget")
        policies = [p.strip() for p in (args.policies or "static-fp16,pagedweight").split(",") if p.strip()]
        bad = [p for p in policies if p not in POLICY_NAMES]
        if bad:
            raise PagedWeightError(f"unknown policies {bad}; allowed: {', '.join(POLICY_NAMES)}")
        like = args.like
        self.model_dir = random_model_dir(load_model(like), args.layers) if like else args.model or default_model_dir()
        trace = load_trace(args.trace)
        if args.max_requests is not None:
            trace = take(trace, args.max_requests)
        if args.rate_scale != 1.0:
            trace = scale_rate(trace, args.rate_scale)
        self.ep = args.ep or 1
        core = core_options.core_config(args)
        self.base = EngineConfig(core, importance=args.importance, device=args.device, dtype=args.dtype)
        self.trace, self.policies, self.table, self.seed = trace, policies, None, args.seed
        self.extra = {}
        if args.prompt_text and leader:
            from pwgpu.served import TextPrompts

            self.extra["prompt_source"] = TextPrompts(self.model_dir, args.prompt_text, args.seed)

    def _from_scenario(self, args: argparse.Namespace, leader: bool) -> None:
        """The engine configured exactly as ``pwsim`` configures its RuntimeCore for the scenario
        (``pagedweight.config.run.scenario_run``); ``--ep`` overrides its ``parallel.ep``."""
        from pagedweight.config.run import scenario_run
        from pagedweight.config.scenario import load_scenario
        from pagedweight.errors import PagedWeightError
        from pwgpu.default_model import default_model_dir, random_model_dir
        from pwgpu.offline import scenario_engine_config

        given = [f"--{k.replace('_', '-')}" for k in _SET_BY_SCENARIO if getattr(args, k) is not None]
        if given:
            raise PagedWeightError(
                f"--scenario sets the trace, budget, model, limits and importance; drop {', '.join(given)}"
            )
        loaded = load_scenario(args.scenario, require_latency_table=False)  # the engine times itself
        sc = loaded.scenario
        self.model_dir = args.model or (
            default_model_dir() if sc.model == "tiny-moe" else random_model_dir(loaded.model, None)
        )
        policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
        run = scenario_run(loaded, policies)
        self.ep = args.ep or run.ep
        self.base = scenario_engine_config(run, args.device, args.dtype, self.ep)
        self.trace, self.policies, self.table, self.seed = run.trace, run.policies, run.table, run.seed
        self.extra = {"scenario": run.name, "slo": run.slo, "scenario_yaml": run.resolved_yaml}
        if args.prompt_text and leader:
            from pwgpu.served import TextPrompts

            self.extra["prompt_source"] = TextPrompts(self.model_dir, args.prompt_text, run.seed)

    @property
    def num_requests(self) -> int:
        return len(self.trace)

    def run(self, ep: bool = False) -> dict:
        from pwgpu.offline import run_policies

        return run_policies(self.model_dir, self.trace, self.base, self.policies, self.args.out, self.seed,
                            table=self.table, ep=ep, **self.extra)  # fmt: skip


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
