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
    prompt_source=None,
    overrides: dict[str, dict] | None = None,
    record_logits: bool = False,
) -> dict:
    """Every policy over the same requests, one engine each; one results directory.
    ``scenario`` names the run (as ``pwsim run`` does) so that the two can be compared.
    ``prompt_source(trace) -> (prompts, sources)`` gives real prompts and turns on
    ``tokens.jsonl`` (``record_logits``: also the engine's logits of every sampled token, in
    ``served_logits.npz``); ``overrides[policy]`` replaces fields of that policy's ``EngineConfig``
    (e.g. ``precisions`` for a policy on its own ladder)."""
    import dataclasses

    writer: ResultsWriter | None = None
    errors: dict[str, str] = {}
    token_logs, engine_logits = [], {}
    for policy in policies:
        wall0 = time.perf_counter()
        try:
            engine = Engine(model_dir, dataclasses.replace(base, policy=policy, **(overrides or {}).get(policy, {})))
        except PolicyInfeasible as e:
            errors[policy] = str(e)
            continue
        t = truncate_to_context(trace, engine.core.scheduler.config.max_model_len)
        if writer is None:
            writer = ResultsWriter(Path(out_dir), _meta(engine, t, seed, scenario))
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
        reqs = [er.req for er in ers]
        summary = policy_summary(reqs, engine.core, Slo(), time.perf_counter() - wall0, engine.store.h2d_bytes)
        writer.add(policy, reqs, engine.core, summary)
        del engine
    if writer is None:
        raise PagedWeightError(f"no policy fits in {base.budget_bytes} bytes: {errors}")
    for policy, message in errors.items():
        writer.add_error(policy, message)
    if prompt_source is not None:
        from pwgpu.served import write_token_logs

        write_token_logs(writer.out_dir / "tokens.jsonl", token_logs, engine_logits if record_logits else None)
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
