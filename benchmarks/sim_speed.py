"""Simulator speed and memory: one policy over an hour of traffic, every policy of a run, and
where a step's time goes.

Cases (Mixtral-8x7B on an H200, 120 GiB budget, analytic latency model):
- ``azure``: the full Azure conversation trace (19,366 requests, one hour), at 1x, 2x and 4x
  the requests (the trace tiled end to end: the same load, so cost should grow linearly).
- ``longctx``: one hour of Mooncake-like long-context traffic (the ``longctx`` preset at
  Mooncake's 3.4 req/s, seed 1: ~12,200 requests of ~10k-token prompts), replayed at 0.3x its
  rate like ``scenarios/longctx.yaml`` replays its trace (so ~3.3 simulated hours).
- ``run``: ``pwsim run`` of the long-context case, all 7 policies, report included.

Each case runs in its own process, so each peak RSS (``ru_maxrss``) is its own; CPU seconds
are given beside wall seconds because the machine may be shared (CPU time is what one core
spent). ``--before DIR`` runs the same cases on another checkout (e.g. main, exported to a
temporary folder) right before each one here, side by side. ``--profile`` adds the cost per
step by component (cProfile, functions grouped by module; numpy and built-in calls are charged
to the project function that made them; cProfile inflates call-heavy Python code).

    python benchmarks/sim_speed.py [--cases azure,longctx,run] [--times 1,2,4] [--policy pagedweight]
                                   [--before DIR] [--profile] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ../shared/traces beside the checkout (or beside the folder of worktrees).
SHARED = next(
    (p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()), ROOT.parent / "shared"
)
AZURE = SHARED / "traces" / "azure_conv_2023.csv"
LONGCTX_RATE_QPS, LONGCTX_DURATION_S, LONGCTX_SCALE = 3.4, 3600.0, 0.3
SCENARIO = """\
name: {name}
model: mixtral-8x7b
gpu: h200
memory: {{budget: 120 GiB, page_bytes: 2 MiB, kv_block_tokens: 16, precisions: [bf16, fp8, int8, int4]}}
workload: {{kind: trace, path: {path}, format: {fmt}, rate_scale: {scale}}}
scheduler: {{max_num_batched_tokens: 8192, max_num_seqs: 256}}
latency: {{kind: analytic}}
importance: {{kind: synthetic, seed: 0}}
slo: {{ttft_ms: 10000, tpot_ms: 100}}
seed: 0
"""
COMPONENTS = (  # (path fragment, component), first match wins
    ("pagedweight/core/scheduler.py", "scheduler"),
    ("pagedweight/core/pool.py", "page pool"),
    ("pagedweight/core/kv_blocks.py", "page pool"),
    ("pagedweight/core/pagetable.py", "page pool"),
    ("pagedweight/core/step.py", "step shape"),
    ("pagedweight/core/runtime.py", "runtime core"),
    ("pagedweight/policy/", "controller"),
    ("pagedweight/results/", "step records"),
    ("pwsim/routing.py", "routing sampler"),
    ("pwsim/roofline.py", "latency model"),
    ("pwsim/table_latency.py", "latency model"),
    ("pwsim/latency.py", "latency model"),
    ("pwsim/engine.py", "engine loop"),
    ("/simpy/", "SimPy"),
)


# ---- inside one case's process -------------------------------------------------------------------
def _loaded(workdir: Path, case: str):
    from pagedweight.config.scenario import load_scenario

    path = workdir / f"{case}.yaml"
    if not path.exists():
        if case == "azure":
            text = SCENARIO.format(name="sim-speed-azure", path=AZURE, fmt="azure", scale=1.0)
        else:
            from pagedweight.workload.synth import synthesize
            from pagedweight.workload.traces import write_jsonl

            trace = synthesize("longctx", 1, duration_s=LONGCTX_DURATION_S, rate_qps=LONGCTX_RATE_QPS)
            write_jsonl(trace, workdir / "longctx_1h.jsonl")
            text = SCENARIO.format(
                name="sim-speed-longctx", path=workdir / "longctx_1h.jsonl", fmt="mooncake", scale=LONGCTX_SCALE
            )
        path.write_text(text)
    return load_scenario(path)


def _tiled(trace, times: int):
    import numpy as np

    from pagedweight.workload.traces import RequestTrace

    if times == 1:
        return trace
    span = float(trace.arrival_s[-1]) + 1.0
    return RequestTrace(
        np.concatenate([trace.arrival_s + k * span for k in range(times)]),
        np.tile(trace.prompt_tokens, times),
        np.tile(trace.output_tokens, times),
        source=f"{trace.source} x{times}",
    )


def one_policy(workdir: Path, case: str, policy: str, times: int, profile: bool) -> dict:
    """One policy over the case's trace, in this process."""
    import numpy as np

    from pagedweight.config.run import core_config
    from pagedweight.config.scenario import importance_table
    from pagedweight.results.metrics import Slo
    from pagedweight.results.writer import policy_summary
    from pagedweight.workload.build import build_workload
    from pwsim.engine import SimEngine
    from pwsim.latency import build_latency_model

    loaded = _loaded(workdir, case)
    sc = loaded.scenario
    trace = build_workload(sc.workload, loaded.base_dir, loaded.max_model_len, np.random.default_rng(sc.seed))
    trace = _tiled(trace, times)
    table = importance_table(loaded)
    latency = build_latency_model(sc.latency, loaded.model, loaded.gpu, loaded.base_dir)
    cfg = core_config(loaded)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    eng = SimEngine(cfg, policy, trace, table, latency, "importance", seed=sc.seed)
    eng.run()
    summary = policy_summary(eng.requests, eng.core, Slo(), time.perf_counter() - wall0, eng.bytes_h2d)
    if profiler:
        profiler.disable()
    out = {
        "requests": len(trace),
        "steps": summary["num_steps"],
        "sim_s": summary["simulated_s"],
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "completed": summary["completed"],
        "output_throughput": summary["output_throughput"],
    }
    if profiler:
        out["components"] = _components(profiler)
    return out


def _component(filename: str) -> str | None:
    name = filename.replace("\\", "/")
    for fragment, comp in COMPONENTS:
        if fragment in name:
            return comp
    if "/pagedweight/" in name or "/pwsim/" in name:
        return "other project code"
    return None  # numpy, built-ins, the standard library: charged to their callers


def _components(profiler) -> dict[str, float]:
    """Seconds per component: each function's own time goes to its module's component; time of
    functions outside the project goes to their callers, in proportion to what each caller spent."""
    import pstats

    stats = pstats.Stats(profiler).stats  # func -> (cc, nc, tt, ct, callers{func: (cc, nc, tt, ct)})
    shares: dict = {}  # func -> {component: fraction of its time}, memoised: callers fan out

    def share(func, depth: int = 0) -> dict[str, float]:
        if func in shares:
            return shares[func]
        comp = _component(func[0])
        callers = stats.get(func, (0, 0, 0, 0, {}))[4]
        spent = sum(c[2] for c in callers.values())  # time of func attributed per caller
        if comp is not None:
            out = {comp: 1.0}
        elif depth > 8 or not callers or spent <= 0:
            out = {"other": 1.0}
        else:
            shares[func] = {"other": 1.0}  # a cycle back to func: charged to "other"
            out = {}
            for caller, c in callers.items():
                for name, f in share(caller, depth + 1).items():
                    out[name] = out.get(name, 0.0) + f * c[2] / spent
        shares[func] = out
        return out

    totals: dict[str, float] = {}
    for func, (_, _, tt, _, _) in stats.items():
        if tt > 0:
            for name, f in share(func).items():
                totals[name] = totals.get(name, 0.0) + tt * f
    return totals


def all_policies(workdir: Path, jobs: int) -> dict:
    """``pwsim run`` of the long-context case (report included), as a user runs it."""
    _loaded(workdir, "longctx")  # writes the scenario and the trace
    out = workdir / "run_out"
    cmd = [sys.executable, "-m", "pwsim.cli", "run", str(workdir / "longctx.yaml"), "--out", str(out), "--no-progress"]
    if jobs > 1:
        cmd += ["--jobs", str(jobs)]
    # From the root of the tree this process imports (``--before``'s or this one): ``python -m``
    # puts the working directory first on the path, ahead of PYTHONPATH, so run from another
    # checkout it would time that checkout's code.
    import pwsim

    root = Path(pwsim.__file__).resolve().parent.parent
    wall0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    wall_s = time.perf_counter() - wall0
    if done.returncode != 0:
        raise SystemExit(f"pwsim run failed: {done.stderr.strip()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "requests": summary["trace"]["num_requests"],
        "steps": sum(p.get("num_steps", 0) for p in summary["policies"].values()),
        "wall_s": wall_s,
        "cpu_s": children.ru_utime + children.ru_stime,
        "policy_wall_s": {k: round(v.get("wall_s", float("nan")), 1) for k, v in summary["policies"].items()},
        "policies": {
            k: {m: v.get(m) for m in ("completed", "output_throughput")} for k, v in summary["policies"].items()
        },
    }


def child(args) -> None:
    workdir = Path(args.workdir)
    if args.case == "run":
        out = all_policies(workdir, args.jobs)
        out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    else:
        out = one_policy(workdir, args.case, args.policy, args.times, args.profile)
        out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


# ---- the driver ---------------------------------------------------------------------------------
def run_case(tree: Path, workdir: Path, case: str, policy: str, times: int, profile: bool, jobs: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--workdir", str(workdir), "--cases", case, "--policy", policy]
    cmd += ["--times", str(times), "--jobs", str(jobs)] + (["--profile"] if profile else [])
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{case} on {tree} failed:\n{done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="azure,longctx,run")
    ap.add_argument("--times", default="1,2,4", help="azure: multiples of the trace (linearity)")
    ap.add_argument("--policy", default="pagedweight")
    ap.add_argument("--before", help="another checkout to run side by side (its root, put on PYTHONPATH)")
    ap.add_argument("--profile", action="store_true", help="also the cost per step by component (1x cases)")
    ap.add_argument("--jobs", type=int, default=2, help="run case: worker processes (the 'before' tree runs one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.case, args.times = args.cases, int(args.times)
        child(args)
        return 0
    cases = args.cases.split(",")
    if "azure" in cases and not AZURE.is_file():
        print(f"skipping azure: {AZURE} not found", file=sys.stderr)
        cases.remove("azure")
    trees = ([("before", Path(args.before).resolve())] if args.before else []) + [("after", ROOT)]
    load = os.getloadavg()
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, policy {args.policy}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        workdirs = {label: Path(tmp) / label for label, _ in trees}
        for d in workdirs.values():
            d.mkdir()
        head = f"{'case':9s} {'tree':6s} {'x':>2s} {'requests':>9s} {'steps':>9s} {'sim_s':>7s} {'wall_s':>7s} "
        print(head + f"{'cpu_s':>7s} {'us/step':>8s} {'peak MiB':>9s}")
        profiles = {}
        previous: dict = {}
        for case in cases:
            for times in [int(t) for t in args.times.split(",")] if case == "azure" else [1]:
                for label, tree in trees:
                    jobs = 1 if (label == "before" and case == "run") else args.jobs
                    r = run_case(tree, workdirs[label], case, args.policy, times, False, jobs)
                    per_step = r["cpu_s"] / r["steps"] * 1e6 if case != "run" else float("nan")
                    print(
                        f"{case:9s} {label:6s} {times:>2d} {r['requests']:>9,d} {r['steps']:>9,d} "
                        f"{r.get('sim_s', float('nan')):>7.0f} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} "
                        f"{per_step:>8.1f} {r['max_rss_mib']:>9.0f}",
                        flush=True,
                    )
                    if case == "run":
                        print(f"          per policy (wall s): {r['policy_wall_s']}", flush=True)
                    outcome = {k: r[k] for k in ("steps", "completed", "output_throughput", "policies") if k in r}
                    if label == "before":
                        previous = outcome
                    elif len(trees) > 1:
                        same = "the same results" if outcome == previous else "DIFFERENT RESULTS"
                        print(f"          {same} as before (steps, completed, output throughput)", flush=True)
            if args.profile and case != "run":
                for label, tree in trees:
                    profiles[(case, label)] = run_case(tree, workdirs[label], case, args.policy, 1, True, 1)
        for (case, label), r in profiles.items():
            comps = r["components"]
            total = sum(comps.values())
            print(f"\n# cost per step, {case}, {label} (cProfile, {r['steps']:,} steps, {total:.1f} s profiled)")
            for comp, s in sorted(comps.items(), key=lambda kv: -kv[1]):
                print(f"  {comp:20s} {s / r['steps'] * 1e6:7.1f} us/step {100 * s / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
