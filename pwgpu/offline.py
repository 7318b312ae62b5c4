"""Run a request trace through the engine in-process, at the trace's arrival times on the
engine's clock, for one or more policies: the real counterpart of ``pwsim run`` (same results
directory, ``"runtime": "pwgpu"``), without HTTP in the way.

Prompts are random token ids of the trace's lengths, or windows of real text
(``pwgpu.served.TextPrompts``); outputs are greedy with ``ignore_eos`` so every request produces
exactly its trace output length, as in the simulator. With a prompt source the run also writes
``tokens.jsonl``: every request's prompt and output ids and which precision map computed each
of its positions (``pwgpu.served.TokenLog``), for re-scoring what was served.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pagedweight.config.run import ScenarioRun
from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.importance import ImportanceTable
from pagedweight.policy.policies import PolicyInfeasible
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary, trace_meta
from pagedweight.workload.build import truncate_to_context
from pagedweight.workload.traces import RequestTrace
from pwgpu.engine import Clock, Engine, EngineConfig, EngineRequest
from pwgpu.loader import SCENARIO_DTYPE
from pwgpu.sampling import SamplingParams


def run_trace(
    engine: Engine,
    trace: RequestTrace,
    seed: int = 0,
    vocab_size: int | None = None,
    prompts: list[list[int]] | None = None,
    on_step=None,
) -> list[EngineRequest]:
    """Add each request when the engine clock reaches its arrival time (open loop) and step
    until all are done. Returns the requests in trace order. ``prompts``: token ids per request
    (default random ids of the trace's lengths); ``on_step(engine, requests)`` runs after every
    step that computed something."""
    rng = np.random.default_rng(seed)
    vocab = min(vocab_size or engine.arch.vocab_size, engine.arch.vocab_size)
    if prompts is None:
        prompts = [rng.integers(0, vocab, int(n)).tolist() for n in trace.prompt_tokens]
    out: list[EngineRequest] = []
    t0 = engine.now()
    i, n = 0, len(trace)
    while i < n or engine.has_work():
        now = engine.now() - t0
        while i < n and trace.arrival_s[i] <= now:
            params = SamplingParams(max_tokens=int(trace.output_tokens[i]), temperature=0.0, ignore_eos=True)
            out.append(engine.add(prompts[i], params, arrival_s=t0 + float(trace.arrival_s[i])))
            i += 1
        if engine.step():
            if on_step is not None:
                on_step(engine, out)
            continue
        if i < n:  # idle until the next arrival; let upgrades land meanwhile
            engine.idle_tick()
            engine.clock.idle(t0 + float(trace.arrival_s[i]))
        else:
            engine.core.check_stall(requests_coming=False)
    return out


def scenario_engine_config(
    run: ScenarioRun, device: str | None = None, dtype: str | None = None, ep: int | None = None
) -> EngineConfig:
    """The engine configured exactly as ``pwsim`` configures its core for the scenario: the
    scenario's ``CoreConfig`` (so its model must be the checkpoint's) and bf16 compute, the
    2-byte weights and KV the simulator counts, unless ``dtype`` says otherwise. ``ep``: the
    expert-parallel ranks it runs on (default: the scenario's ``parallel.ep``), each with the
    scenario's budget, as in the simulator (``memory.budget`` is per GPU)."""
    ep = run.ep if ep is None else ep
    if ep > 1 and run.ep_placement != "contiguous":
        raise ConfigError(
            f"scenario {run.name}: parallel.placement={run.ep_placement}: the engine places experts "
            "contiguously; allowed here: contiguous"
        )
    if run.replicas > 1:
        raise ConfigError(
            f"scenario {run.name}: cluster.replicas={run.replicas}: the engine runs one replica; "
            "clusters are simulated (pwsim run); allowed here: replicas 1"
        )
    return EngineConfig(core=run.core, device=device, dtype=dtype or SCENARIO_DTYPE)


def policy_engine(
    model_dir: str | Path,
    base: EngineConfig,
    policy: str,
    table: ImportanceTable | None = None,
    clock: Clock | None = None,
    ep: bool = False,
) -> Engine:
    """The engine of one policy of a run; ``ep``: this process's share of an expert-parallel
    group (``pwgpu.ep_launch.rank_engine``)."""
    cfg = dataclasses.replace(base, policy=policy)
    if ep:
        from pwgpu.ep_launch import rank_engine

        return rank_engine(model_dir, cfg, table, clock)
    return Engine(model_dir, cfg, table, clock)


def run_policies(
    model_dir: str | Path,
    trace: RequestTrace,
    base: EngineConfig,
    policies: list[str] | tuple[str, ...],
    out_dir: str | Path,
    seed: int = 0,
    report: bool = True,
    scenario: str | None = None,
    table: ImportanceTable | None = None,
    slo: Slo | None = None,
    scenario_yaml: str | None = None,
    clock: Callable[[], Clock] | None = None,
    prompt_source=None,
    tables: dict[str, ImportanceTable] | None = None,
    record_logits: bool = False,
    ep: bool = False,
) -> dict:
    """Every policy over the same requests, one engine each; one results directory.
    ``scenario`` names the run (as ``pwsim run`` does) so that the two can be compared;
    ``table``, ``slo`` and ``scenario_yaml`` come from the scenario when there is one;
    ``clock`` makes each engine's clock (default: wall time). ``tables[policy]`` replaces
    ``table`` for that policy (e.g. a policy on its own precision ladder).
    ``prompt_source(trace) -> (prompts, sources)`` gives real prompts and turns on
    ``tokens.jsonl`` (``record_logits``: also the engine's logits of every sampled token, in
    ``served_logits.npz``). ``ep``: this is rank 0 of an expert-parallel group whose other
    ranks run ``pwgpu.ep_launch.follow_policies`` over the same policies."""
    writer: ResultsWriter | None = None
    errors: dict[str, str] = {}
    token_logs, engine_logits = [], {}
    for policy in policies:
        wall0 = time.perf_counter()
        try:
            policy_table = (tables or {}).get(policy, table)
            engine = policy_engine(model_dir, base, policy, policy_table, clock() if clock else None, ep)
        except PolicyInfeasible as e:
            errors[policy] = str(e)
            continue
        t = truncate_to_context(trace, engine.core.scheduler.config.max_model_len)
        if writer is None:
            meta = engine.results_meta(scenario or f"{engine.spec.name} offline", trace_meta(t), seed)
            writer = ResultsWriter(Path(out_dir), meta)
        if prompt_source is None:
            ers = run_trace(engine, t, seed)
        else:
            from pwgpu.served import TokenLog

            prompts, sources = prompt_source(t)
            log = TokenLog(policy, sources)
            if record_logits:
                log.attach(engine)
            ers = run_trace(engine, t, seed, prompts=prompts, on_step=log.observe)
            token_logs.append(log.finish(engine, ers))
            engine_logits[policy] = log.logits
        if engine.agreement is not None:
            engine.agreement.close()
        reqs = [er.req for er in ers]
        summary = policy_summary(reqs, engine.core, slo or Slo(), time.perf_counter() - wall0, engine.h2d_bytes)
        writer.add(policy, reqs, engine.core, summary)
        del engine
    if writer is None:
        raise PagedWeightError(f"no policy fits in {base.core.budget_bytes} bytes: {errors}")
    for policy, message in errors.items():
        writer.add_error(policy, message)
    if prompt_source is not None:
        from pwgpu.served import write_token_logs

        write_token_logs(writer.out_dir / "tokens.jsonl", token_logs, engine_logits if record_logits else None)
    meta = writer.write(scenario_yaml)
    if report:
        from pagedweight.results.report import write_report

        write_report([writer.out_dir], writer.out_dir / "report.html")
    return meta


def run_scenario(
    run: ScenarioRun,
    model_dir: str | Path,
    out_dir: str | Path,
    device: str | None = None,
    dtype: str | None = None,
    report: bool = True,
    **extra,
) -> dict:
    """``pwgpu run --scenario``: the scenario's policies on the engine, from ``scenario_run``.
    ``extra``: ``run_policies``'s real prompts, per-policy tables and logits recording. One
    process: a scenario with ``parallel.ep > 1`` runs on its ranks through ``pwgpu run``."""
    if run.ep > 1:
        raise ConfigError(
            f"scenario {run.name}: parallel.ep={run.ep}: this runs one process; `pwgpu run --scenario` starts "
            "the ranks (or --ep 1 runs it in one); allowed here: ep 1"
        )
    base = scenario_engine_config(run, device, dtype, ep=1)
    return run_policies(model_dir, run.trace, base, run.policies, out_dir, run.seed, report=report,
                        scenario=run.name, table=run.table, slo=run.slo, scenario_yaml=run.resolved_yaml,
                        **extra)  # fmt: skip
