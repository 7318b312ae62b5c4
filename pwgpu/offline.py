"""Run a request trace through the engine in-process, at the trace's arrival times on the
engine's clock, for one or more policies: the real counterpart of ``pwsim run`` (same results
directory, ``"runtime": "pwgpu"``), without HTTP in the way.

Prompts are random token ids of the trace's lengths; outputs are greedy with ``ignore_eos``
so every request produces exactly its trace output length, as in the simulator.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pagedweight.errors import PagedWeightError
from pagedweight.policy.policies import PolicyInfeasible
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary
from pagedweight.workload.build import truncate_to_context
from pagedweight.workload.traces import RequestTrace
from pwgpu.engine import Engine, EngineConfig, EngineRequest
from pwgpu.sampling import SamplingParams


def run_trace(engine: Engine, trace: RequestTrace, seed: int = 0, vocab_size: int | None = None) -> list[EngineRequest]:
    """Add each request when the engine clock reaches its arrival time (open loop) and step
    until all are done. Returns the requests in trace order."""
    rng = np.random.default_rng(seed)
    vocab = min(vocab_size or engine.arch.vocab_size, engine.arch.vocab_size)
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
            continue
        if i < n:  # idle until the next arrival; let upgrades land meanwhile
            engine.idle_tick()
            time.sleep(max(0.0, min(float(trace.arrival_s[i]) - (engine.now() - t0), 0.01)))
        elif not engine.store.upgrades_in_flight and not engine.core.scheduler.running:
            sched = engine.core.scheduler
            raise PagedWeightError(f"{engine.cfg.policy}: stalled with {len(sched.waiting)} requests waiting")
    return out


def run_policies(
    model_dir: str | Path,
    trace: RequestTrace,
    base: EngineConfig,
    policies: list[str],
    out_dir: str | Path,
    seed: int = 0,
    report: bool = True,
    scenario: str | None = None,
) -> dict:
    """Every policy over the same requests, one engine each; one results directory.
    ``scenario`` names the run (as ``pwsim run`` does) so that the two can be compared."""
    import dataclasses

    writer: ResultsWriter | None = None
    errors: dict[str, str] = {}
    for policy in policies:
        wall0 = time.perf_counter()
        try:
            engine = Engine(model_dir, dataclasses.replace(base, policy=policy))
        except PolicyInfeasible as e:
            errors[policy] = str(e)
            continue
        t = truncate_to_context(trace, engine.core.scheduler.config.max_model_len)
        if writer is None:
            writer = ResultsWriter(Path(out_dir), _meta(engine, t, seed, scenario))
        ers = run_trace(engine, t, seed)
        reqs = [er.req for er in ers]
        summary = policy_summary(reqs, engine.core, Slo(), time.perf_counter() - wall0, engine.store.h2d_bytes)
        writer.add(policy, reqs, engine.core, summary)
        del engine
    if writer is None:
        raise PagedWeightError(f"no policy fits in {base.budget_bytes} bytes: {errors}")
    for policy, message in errors.items():
        writer.add_error(policy, message)
    meta = writer.write()
    if report:
        from pagedweight.results.report import write_report

        write_report([writer.out_dir], writer.out_dir / "report.html")
    return meta


def _meta(engine: Engine, trace: RequestTrace, seed: int, scenario: str | None = None) -> dict:
    import torch

    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    return {
        "runtime": "pwgpu",
        "scenario": scenario or f"{engine.spec.name} offline",
        "model": engine.spec.name,
        "gpu": device,
        "budget_bytes": engine.core.pool.total_bytes,
        "page_bytes": engine.page_bytes,
        "latency_model": f"measured on {device} ({engine.dtype})",
        "importance": engine.table.provenance,
        "checkpoint_notes": engine.load_notes,
        "trace": {"source": trace.source, "num_requests": len(trace), "notes": list(trace.notes)},
        "seed": seed,
    }
