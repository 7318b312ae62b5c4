"""Clusters in the simulator: ``cluster.replicas`` identical replicas behind a request router.

Each replica is what a scenario without ``cluster`` simulates (one GPU, or an expert-parallel
replica of ``parallel.ep`` GPUs, ``pwsim.parallel``), running the scenario's policy on its own.
The router (``pwsim.router``) sends each arriving request to one replica:

- ``round-robin`` looks at nothing but the arrival order, so request i goes to replica
  ``i mod N`` whatever happens: the replicas are independent runs on their shares of the trace,
  and ``pwsim run`` simulates them as separate jobs in worker processes (``pwsim.executor``,
  ``--jobs``), as it does policies;
- ``least-outstanding`` and ``least-kv`` look at the replicas' state at each arrival, so the
  replicas of a policy share one SimPy clock in one process.

Replica i's routing sampler is seeded with ``seed + i`` (the replicas' routing noise is
independent; a one-replica cluster is the scenario run as it is).

Outputs: the usual tables with a ``replica`` column after ``policy`` (each replica's own steps,
requests with their trace-wide ids, transitions, initial precisions; an expert-parallel
replica's ``steps_by_rank.csv`` and ``ep_steps.csv`` too); ``summary.json`` per policy: the
request figures over the whole cluster, memory and transition counts summed over the replicas,
``cluster`` (router, requests and output tokens per replica, load imbalance max / mean) and
``replicas`` (each replica's summary). Inter-token latencies are pooled across replicas in a
histogram of 0.01 ms bins (percentiles to that resolution; mean and deviation exact), so that
no process holds every token's time of an hour of cluster traffic.

A replica job writes its tables with their ``replica`` column and sends back its summary, the
figures of its requests as arrays (``RequestColumns``) and its ITL histogram: the parent never
rewrites a table row (the results writer concatenates the replicas' files) nor unpickles a
request object.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import simpy

from pagedweight.config.run import ScenarioRun
from pagedweight.config.scenario import LoadedScenario
from pagedweight.core.scheduler import Request
from pagedweight.policy.policies import PolicyInfeasible, relative_run_cost
from pagedweight.results.metrics import PERCENTILES, RequestColumns, inter_token_ms, summarize_columns
from pagedweight.results.writer import policy_summary
from pagedweight.workload.traces import RequestTrace
from pwsim.engine import replay_arrivals, run_until, verify_memory
from pwsim.router import RequestRouter

ITL_BIN_MS = 0.01
ITL_NUM_BINS = 1_000_000  # up to 10 s; longer gaps fall in the last bin (the mean stays exact)
STATIC_ROUTERS = ("round-robin",)


def replica_share(trace: RequestTrace, replica: int, replicas: int) -> tuple[RequestTrace, np.ndarray]:
    """Replica ``replica``'s requests under round-robin routing, and their trace-wide ids."""
    ids = np.arange(replica, len(trace), replicas)
    share = RequestTrace(
        trace.arrival_s[ids], trace.prompt_tokens[ids], trace.output_tokens[ids], trace.source, list(trace.notes)
    )
    return share, ids


def _engine(loaded: LoadedScenario, run: ScenarioRun, policy: str, replica: int, env=None):
    from pwsim.run import _latency, scenario_engine

    return scenario_engine(
        dataclasses.replace(run, seed=run.seed + replica),
        policy,
        _latency(loaded),
        loaded.scenario.routing,
        loaded,
        env,
    )


def _itl_histogram(requests: list[Request], batch: int = 4096) -> dict:
    """The requests' inter-token gaps in bins of ``ITL_BIN_MS``, with their sum and sum of
    squares, ``batch`` requests at a time: the temporaries stay a few MB (an hour of a busy
    replica has ~10 million gaps, and fresh 80 MB arrays cost more in page faults than in
    arithmetic), and the sums are added up in the order the cluster's figures always were."""
    counts = np.zeros(ITL_NUM_BINS, dtype=np.int64)
    total = total_sq = 0.0
    n = 0
    for start in range(0, len(requests), batch):
        ms = inter_token_ms(requests[start : start + batch])
        if not len(ms):
            continue
        counts += np.bincount(np.minimum((ms / ITL_BIN_MS).astype(np.int64), ITL_NUM_BINS - 1), minlength=ITL_NUM_BINS)
        total += float(ms.sum())
        total_sq += float((ms * ms).sum())
        n += len(ms)
    return {"counts": counts, "sum": total, "sum_sq": total_sq, "n": n}


def _replica_result(
    eng, policy: str, replica: int, ids: np.ndarray | None, parts_dir: Path, run, wall0, step_tables: bool = True
) -> dict:
    """A replica's summary and tables (in ``parts_dir``, with the replica's column; the request
    table alone without ``step_tables``); its requests go back as ``RequestColumns``, their token
    times as the ITL histogram."""
    wall_s = time.perf_counter() - wall0
    if ids is not None:  # the cluster's request ids (no figure of the summary depends on them)
        for r in eng.requests:
            r.request_id = int(ids[r.request_id])
    columns = RequestColumns.of(eng.requests)
    if hasattr(eng, "ranks"):
        from pwsim.parallel import ep_summary

        summary = ep_summary(eng, run.slo, wall_s)
    else:
        summary = policy_summary(eng.requests, eng.core, run.slo, wall_s, eng.bytes_h2d, columns)
    from pwsim.run import write_engine_tables

    write_engine_tables(parts_dir, policy, eng, step_tables, columns, replica)
    summary["replica"] = replica
    itl = _itl_histogram(eng.requests)
    return {"summary": summary, "parts_dir": str(parts_dir), "requests": columns, "itl": itl}


def simulate_replica(
    loaded: LoadedScenario,
    run: ScenarioRun,
    policy: str,
    replica: int,
    parts_dir: str,
    step_tables: bool = True,
    progress=None,
) -> dict:
    """One replica of a statically routed cluster (a job of ``pwsim run``)."""
    wall0 = time.perf_counter()
    share, ids = replica_share(run.trace, replica, run.replicas)
    out: dict = {"policy": policy, "replica": replica}
    try:
        eng = _engine(loaded, dataclasses.replace(run, trace=share), policy, replica)
    except PolicyInfeasible as e:
        out["error"] = str(e)
        return out
    _run(eng.env, [eng.start()], share, progress)
    verify_memory(eng.cores)
    out.update(_replica_result(eng, policy, replica, ids, Path(parts_dir), run, wall0, step_tables))
    return out


def _run(env: simpy.Environment, done: list, trace: RequestTrace, progress) -> None:
    horizon_s = float(trace.arrival_s[-1]) if len(trace) else 1.0
    fraction = None if progress is None else (lambda now_s: progress(min(now_s / horizon_s, 1.0)))
    run_until(env, env.all_of(done), trace, fraction)


def simulate_routed_cluster(
    loaded: LoadedScenario, run: ScenarioRun, policy: str, parts_dir: str, step_tables: bool = True, progress=None
):
    """Every replica of a cluster whose router looks at their state, on one SimPy clock.
    Returns one result per replica (as ``simulate_replica`` does)."""
    wall0 = time.perf_counter()
    env = simpy.Environment()
    try:
        engines = [_engine(loaded, run, policy, i, env) for i in range(run.replicas)]
    except PolicyInfeasible as e:
        return [{"policy": policy, "replica": i, "error": str(e)} for i in range(run.replicas)]
    router = RequestRouter(loaded.scenario.cluster.router, [e.cores for e in engines])
    trace = run.trace

    def close() -> None:
        for e in engines:
            e.close_arrivals()

    env.process(replay_arrivals(env, trace, lambda req: engines[router.choose()].accept(req), close))
    _run(env, [e.start(arrivals=False) for e in engines], trace, progress)
    verify_memory([core for e in engines for core in e.cores])
    return [
        {
            "policy": policy,
            "replica": i,
            **_replica_result(e, policy, i, None, Path(parts_dir) / str(i), run, wall0, step_tables),
        }
        for i, e in enumerate(engines)
    ]


# ---- joining the replicas ---------------------------------------------------------------------
def cluster_summary(results: list[dict], loaded: LoadedScenario, run: ScenarioRun, wall_s: float) -> dict:
    """The cluster's summary from its replicas' results (see the module docstring)."""
    requests = RequestColumns.concat([res["requests"] for res in results])
    s = summarize_columns(requests, run.slo, np.empty(0))
    _itl_stats(s, [res["itl"] for res in results])
    reps = [res["summary"] for res in results]
    weights: dict[str, dict] = {}
    for rep in reps:
        for name, w in rep.get("weight_bytes", {}).items():
            acc = weights.setdefault(name, {"mean_bytes": 0.0, "final_bytes": 0})
            acc["mean_bytes"] += w["mean_bytes"]
            acc["final_bytes"] += w["final_bytes"]
    kv = [rep["mean_kv_cache_usage_perc"] for rep in reps if "mean_kv_cache_usage_perc" in rep]
    if kv:
        s["mean_kv_cache_usage_perc"] = float(np.mean(kv))
        s["max_kv_cache_usage_perc"] = float(
            max(rep["max_kv_cache_usage_perc"] for rep in reps if "max_kv_cache_usage_perc" in rep)
        )
    sim_s = max(rep["simulated_s"] for rep in reps)
    s.update(
        num_steps=sum(rep["num_steps"] for rep in reps),
        weight_bytes=weights,
        # Every request is served by one replica: the cluster's quality is the replicas' mean.
        mean_quality_proxy=float(np.mean([rep["mean_quality_proxy"] for rep in reps])),
        max_quality_proxy=float(max(rep["max_quality_proxy"] for rep in reps)),
        num_downgrades=sum(rep["num_downgrades"] for rep in reps),
        num_upgrades=sum(rep["num_upgrades"] for rep in reps),
        h2d_bytes=sum(rep["h2d_bytes"] for rep in reps),
        simulated_s=sim_s,
        wall_s=wall_s,
        sim_s_per_wall_s=sim_s / wall_s if wall_s > 0 else float("inf"),
    )
    out_tokens = np.array([rep["total_output_tokens"] for rep in reps], dtype=np.float64)
    s["cluster"] = {
        "replicas": len(reps),
        "router": loaded.scenario.cluster.router,
        "requests_per_replica": [rep["num_requests"] for rep in reps],
        "output_tokens_per_replica": [int(x) for x in out_tokens],
        "load_imbalance": float(out_tokens.max() / out_tokens.mean()) if out_tokens.mean() > 0 else 1.0,
    }
    s["replicas"] = reps
    return s


def _itl_stats(out: dict, hists: list[dict]) -> None:
    n = sum(h["n"] for h in hists)
    if n == 0:
        return
    counts = sum(h["counts"] for h in hists)
    mean = sum(h["sum"] for h in hists) / n
    out["mean_itl_ms"] = mean
    out["std_itl_ms"] = math.sqrt(max(sum(h["sum_sq"] for h in hists) / n - mean * mean, 0.0))
    cum = np.cumsum(counts)
    for label, q in PERCENTILES:
        k = int(np.searchsorted(cum, q / 100 * n))  # the bin holding the q-th percentile
        out[f"{label}_itl_ms"] = (min(k, ITL_NUM_BINS - 1) + 0.5) * ITL_BIN_MS


def run_cluster(
    loaded: LoadedScenario, run: ScenarioRun, names: list[str], writer, display, jobs: int, step_tables: bool = True
) -> None:
    """Every policy's cluster into ``writer`` (called by ``pwsim.run.run_scenario``)."""
    from pwsim.executor import Job, run_jobs

    n = run.replicas
    static = loaded.scenario.cluster.router in STATIC_ROUTERS
    root = writer.parts_root
    job_list = []
    for p, name in enumerate(names):
        if static:
            job_list += [
                Job(
                    f"{name}/{i}",
                    simulate_replica,
                    (loaded, run, name, i, str(root / f"c{p}" / str(i)), step_tables),
                    cost=relative_run_cost(name),
                )
                for i in range(n)
            ]
        else:
            job_list.append(
                Job(
                    name,
                    simulate_routed_cluster,
                    (loaded, run, name, str(root / f"c{p}"), step_tables),
                    cost=relative_run_cost(name),
                )
            )
    wall0 = time.perf_counter()
    results = run_jobs(job_list, jobs, display, on_result=_line)
    wall_s = time.perf_counter() - wall0
    for p, name in enumerate(names):
        mine = results[p * n : (p + 1) * n] if static else results[p]
        errors = [r["error"] for r in mine if "error" in r]
        if errors:
            writer.add_error(name, errors[0])
            continue
        writer.add_parts(name, [Path(r["parts_dir"]) for r in mine], cluster_summary(mine, loaded, run, wall_s))


def _line(index: int, r) -> str:
    rs = r if isinstance(r, list) else [r]
    if any("error" in x for x in rs):
        return f"{rs[0]['policy']}: infeasible: {next(x['error'] for x in rs if 'error' in x)}"
    steps = sum(x["summary"]["num_steps"] for x in rs)
    sim_s = max(x["summary"]["simulated_s"] for x in rs)
    who = rs[0]["policy"] + (f" replica {rs[0]['replica']}" if len(rs) == 1 else f" ({len(rs)} replicas)")
    return f"{who}: {steps:,} steps, {sim_s:,.0f} simulated s"
