"""Expert parallelism in the simulator: one replica on ``ep`` GPUs (``parallel: {ep: N}``).

Each GPU ("rank") is a ``RuntimeCore`` of its own, built exactly as a single GPU's is: its own
page pool (``memory.budget`` is per GPU), page table, KV cache, scheduler and controller, over
its share of the model (``rank_model``: ``E / ep`` routed experts per layer, every pinned weight
replicated). Attention is data-parallel: an arriving request goes to one rank
(``parallel.request_router``) and keeps its KV there. The policy is the same code on every rank;
it sees that rank's memory, KV demand and routing only, so the rank whose KV fills first (or
whose experts are hottest) is the one that downgrades.

The ranks step in lockstep, as an EP engine does (every MoE layer is an all-to-all that waits
for every rank):

1. every rank runs its core's step up to ``execute``: poll, plan, schedule (a rank with nothing
   to run still takes part: its experts serve the other ranks' tokens);
2. the step's routing is drawn once for all the ranks' tokens together (L, E), and each rank's
   controller is shown the tokens that reached *its* experts, from every rank, which in an
   engine are known after the dispatch;
3. each rank's compute time is its latency model's step time for its own batch and its own
   experts' token counts (``rank_compute_s``; an idle rank: its experts only), plus its
   downgrades' quantise time and its KV swaps;
4. the step takes ``max(rank compute) + all-to-all`` (dispatch and combine in every MoE layer
   at the busiest rank's bytes: ``a2a_time_s`` over the GPU spec's interconnect, or, when the
   latency model is a table with ``all_to_all`` rows for ``ep`` ranks, ``a2a_table_time_s`` from
   those measurements; a table without them falls back to the spec and the run's notes say so),
   and every rank's step ends then.

Where each rank's tokens go is not drawn per rank: tokens at a rank's experts come from the
ranks in proportion to their batch sizes (routing does not depend on where a token's request
lives), which gives the expected bytes each rank sends and receives. A token with two experts
on one rank is counted twice (no de-duplication of the dispatch).

Outputs: the usual tables over the whole replica (``steps.csv`` sums the ranks' pages and
counts step by step; ``transitions.csv`` and ``initial_precisions.csv`` name global experts and
add a ``rank`` column), ``steps_by_rank.csv`` (each rank's own rows) and ``ep_steps.csv`` (per
step: each rank's compute time, tokens and routed tokens, the all-to-all time, the slowest
rank and the imbalance max / mean of the compute times); ``summary.json`` gains ``ep`` and a
``ranks`` list with each rank's summary.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import simpy

from pagedweight.config.scenario import ParallelConfig, rank_model
from pagedweight.core.placement import place_experts, rank_table
from pagedweight.core.runtime import CoreConfig, Executed, Step
from pagedweight.core.scheduler import Batch, Request
from pagedweight.core.spec import PRECISION_NAMES, GpuSpec
from pagedweight.core.step import StepShape
from pagedweight.errors import PagedWeightError
from pagedweight.policy.controller import DOWNGRADE
from pagedweight.policy.importance import ImportanceTable
from pagedweight.results.metrics import Slo, StepRecorder
from pagedweight.results.writer import (
    _write_columns,
    _write_requests,
    label_rows,
    policy_summary,
    transition_frame,
    write_csv_rows,
)
from pagedweight.workload.traces import RequestTrace
from pwsim.engine import SimEngine, replay_arrivals, run_until, verify_memory
from pwsim.roofline import AnalyticLatencyModel
from pwsim.router import RequestRouter
from pwsim.routing import RoutingSampler
from pwsim.table_latency import A2aGrid

_UNREPORTED = np.zeros((0, 0), dtype=np.int64)  # a rank's routing before every rank has scheduled
_WAIT = object()  # what a rank's step "waits on": the lockstep driver resumes it


# ---- the all-to-all -------------------------------------------------------------------------
def a2a_volumes(rank_tokens: np.ndarray, expert_tokens: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Token copies each rank sends and receives in one MoE layer's dispatch, (L, ep) each.

    ``rank_tokens`` (ep,): tokens in each rank's batch; ``expert_tokens`` (L, ep): token copies
    routed to each rank's experts. Copies at rank r's experts come from rank s in proportion to
    ``rank_tokens[s]``, so rank r keeps ``X_r * n_r / n`` of them locally, receives the rest, and
    sends every copy of its own tokens but those it keeps. The combine moves the same copies
    back."""
    n = float(rank_tokens.sum())
    if n <= 0:
        z = np.zeros(expert_tokens.shape)
        return z, z
    share = rank_tokens / n
    kept = expert_tokens * share
    send = rank_tokens * top_k - kept
    recv = expert_tokens - kept
    return send, recv


def a2a_busiest_bytes(rank_tokens: np.ndarray, expert_tokens: np.ndarray, top_k: int, copy_bytes: int) -> np.ndarray:
    """(L,) the busiest rank's bytes in each MoE layer's dispatch: the larger of what it sends
    and receives, ``copy_bytes`` per token copy."""
    send, recv = a2a_volumes(rank_tokens, expert_tokens, top_k)
    return np.maximum(send, recv).max(axis=1) * copy_bytes


def a2a_time_s(
    rank_tokens: np.ndarray,
    expert_tokens: np.ndarray,
    top_k: int,
    hidden_size: int,
    bytes_per_value: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
) -> float:
    """Dispatch plus combine in every MoE layer: each is ``latency_s`` plus the busiest rank's
    bytes (the larger of what it sends and receives, each direction at ``bandwidth_bytes_per_s``)
    over its link. 0 on one GPU or for a step without tokens."""
    if len(rank_tokens) <= 1 or rank_tokens.sum() <= 0:
        return 0.0
    busiest = a2a_busiest_bytes(rank_tokens, expert_tokens, top_k, hidden_size * bytes_per_value)
    return 2.0 * float((latency_s + busiest / bandwidth_bytes_per_s).sum())


def a2a_table_time_s(
    rank_tokens: np.ndarray,
    expert_tokens: np.ndarray,
    top_k: int,
    copy_bytes: int,
    grid: A2aGrid,
    bandwidth_bytes_per_s: float,
    latency_s: float,
) -> tuple[float, int, float]:
    """Dispatch plus combine in every MoE layer from measured ``all_to_all`` rows (``grid``, one
    group size) at the busiest rank's bytes; a layer beyond the largest size measured is timed
    as ``a2a_time_s`` times it. Returns (seconds, layers beyond the grid, the largest such
    layer's bytes)."""
    if len(rank_tokens) <= 1 or rank_tokens.sum() <= 0:
        return 0.0, 0, 0.0
    busiest = a2a_busiest_bytes(rank_tokens, expert_tokens, top_k, copy_bytes)
    per_layer_s = grid.layer_s(busiest)
    beyond = np.isnan(per_layer_s)
    if not beyond.any():
        return 2.0 * float(per_layer_s.sum()), 0, 0.0
    per_layer_s[beyond] = latency_s + busiest[beyond] / bandwidth_bytes_per_s
    return 2.0 * float(per_layer_s.sum()), int(beyond.sum()), float(busiest[beyond].max())


def a2a_source(latency, ep: int) -> tuple[A2aGrid | None, str | None]:
    """Where an ``ep``-rank replica's all-to-all times come from: the latency table's
    ``all_to_all`` rows for ``ep`` ranks (the grid), or the GPU spec (None) with a one-line note
    when the model is a table without such rows (any other model: the spec, as documented)."""
    grids = getattr(latency, "a2a_grids", None)
    if grids is None or ep <= 1:
        return None, None
    grid = grids.get(ep)
    if grid is not None:
        return grid, None
    have = f"rows for {', '.join(map(str, sorted(grids)))} ranks" if grids else "no all_to_all rows"
    return None, (
        f"all-to-all timed from the GPU spec's interconnect: latency table {latency.cfg.path} has {have}, "
        f"none for {ep} (measure them with `pwgpu profile --ep {ep}`)"
    )


# ---- the ranks ------------------------------------------------------------------------------
class RankEngine(SimEngine):
    """One GPU of an EP replica: a ``SimEngine``'s core and copy engine; the replica
    (``EpEngine``) drives its steps and its arrivals."""

    def __init__(self, parent: EpEngine, rank: int, cfg: CoreConfig, policy: str, table: ImportanceTable, latency):
        routing = parent.routing  # one sampler for the replica (its core never samples itself)
        super().__init__(cfg, policy, parent.trace, table, latency, "uniform", 0, env=parent.env, routing=routing)
        self.parent, self.rank = parent, rank
        self.step_now: Step | None = None  # this rank's step of the current lockstep step
        self.extra_s = 0.0  # its downgrades' quantise time and KV swaps in that step

    def _wake_engine(self) -> None:
        self.parent._wake_engine()

    def _execute(self, step: Step) -> Executed:
        latency = self.latency
        extra_s = 0.0
        for c in step.changes:
            if c.kind is DOWNGRADE:
                extra_s += sum(latency.quantize_time_s(n, k, c.to_id) for _, n, k in self.model.expert_matrices)
        batch = step.batch
        swapped_bytes = (batch.swapped_out_tokens + batch.swapped_in_tokens) * self._kv_bytes_per_token
        if swapped_bytes:
            extra_s += latency.h2d_time_s(swapped_bytes)
            self.bytes_h2d += batch.swapped_in_tokens * self._kv_bytes_per_token
        self.step_now, self.extra_s = step, extra_s
        step.routing = _UNREPORTED  # reported by the replica once every rank has scheduled
        return Executed(None, swapped_bytes, wait=_WAIT)

    def compute_s(self, local_tokens: np.ndarray, moe_s: float | None = None) -> float:
        """This rank's share of the step: its batch (attention, pinned layers) and its experts'
        tokens from every rank; a rank without a batch runs only its experts. ``moe_s``: its
        experts' time, when the replica computed every rank's at once (an analytic model)."""
        lat, prec = self.latency, self.core.precision_grid
        step = self.step_now
        if step is not None:
            if moe_s is not None:
                return float(lat.step_time_s(step.shape, local_tokens, prec, moe_s)) + self.extra_s
            return float(lat.step_time_s(step.shape, local_tokens, prec)) + self.extra_s
        if moe_s is not None:
            return moe_s if local_tokens.any() else 0.0
        moe_fn = getattr(lat, "moe_s", None)
        return float(moe_fn(local_tokens, prec)) if moe_fn is not None and local_tokens.any() else 0.0


EP_STEP_COLUMNS = ("step", "start_s", "duration_s", "a2a_s", "slowest_rank", "imbalance")


class EpEngine:
    """One replica on ``parallel.ep`` GPUs running one policy (see the module docstring)."""

    def __init__(
        self,
        cfg: CoreConfig,
        policy: str,
        trace: RequestTrace,
        table: ImportanceTable,
        latency_for,
        gpu: GpuSpec,
        parallel: ParallelConfig,
        routing_kind: str,
        seed: int,
        routing_alpha: float = 1.0,
        env: simpy.Environment | None = None,
    ):
        """``cfg``: one GPU's configuration for the whole model (its budget is per GPU);
        ``latency_for(model)``: a latency model for a rank's share of the model."""
        self.env = env or simpy.Environment()
        self.trace, self.policy, self.parallel, self.gpu = trace, policy, parallel, gpu
        model = cfg.model
        self.model = model
        self.ep = ep = parallel.ep
        freqs = table.grid(table.routing_freq)
        rng = np.random.default_rng(seed)  # the run's one RNG, as on one GPU
        self.routing = RoutingSampler(
            model, freqs if routing_kind == "importance" else None, routing_kind, routing_alpha, rng
        )
        self.placement = place_experts(np.asarray(freqs), ep, parallel.placement, parallel.placement_file)
        share = rank_model(model, ep)
        rank_cfg = replace(cfg, model=share)
        # A latency model per rank: each keeps what depends on its own precisions cached.
        self.ranks = [
            RankEngine(self, r, rank_cfg, policy, rank_table(table, self.placement[r]), latency_for(share))
            for r in range(ep)
        ]
        self.router = RequestRouter(parallel.request_router, [[r.core] for r in self.ranks])
        # Each rank's experts as indices into a step's (layers, experts) counts, flattened: one
        # take() gathers every rank's share.
        layer_rows = np.arange(model.num_moe_layers)[:, None]
        self._placement_flat = layer_rows * model.num_experts + np.asarray(self.placement)
        self._analytic = all(type(r.latency) is AnalyticLatencyModel for r in self.ranks)
        self.requests: list[Request] = []
        self.request_rank: list[int] = []
        self._engine_wake: simpy.Event | None = None
        self._arrivals_done = False
        self._ep_rows: list[tuple] = []
        # The all-to-all from the latency table's rows for ep ranks, when it has them.
        self.a2a_grid, self.a2a_note = a2a_source(self.ranks[0].latency, ep)
        self._copy_bytes = model.hidden_size * parallel.a2a_bytes_per_value
        self.a2a_beyond_grid = 0  # layers' exchanges larger than the table's largest size

    @property
    def bytes_h2d(self) -> int:
        return sum(r.bytes_h2d for r in self.ranks)

    def _wake_engine(self) -> None:
        if self._engine_wake is not None and not self._engine_wake.triggered:
            self._engine_wake.succeed()

    @property
    def cores(self) -> list:
        return [r.core for r in self.ranks]

    def accept(self, req: Request) -> None:
        """A request arrives now: to the rank the request router picks."""
        r = self.router.choose()
        self.requests.append(req)
        self.request_rank.append(r)
        self.ranks[r].requests.append(req)
        self.ranks[r].core.add(req)
        self._wake_engine()

    def close_arrivals(self) -> None:
        """No request will arrive any more: the engine ends when the last one is done."""
        self._arrivals_done = True
        self._wake_engine()

    def arrivals(self, env: simpy.Environment):
        return replay_arrivals(env, self.trace, self.accept, self.close_arrivals)

    def engine(self, env: simpy.Environment):
        ranks = self.ranks
        while True:
            if not any(r.core.scheduler.has_work() for r in ranks):
                if self._arrivals_done:
                    return
                self._engine_wake = env.event()
                yield self._engine_wake
                continue
            start_s = env.now
            running = []
            for r in ranks:
                r.step_now = None
                gen = r.core.step(r._execute)
                try:
                    next(gen)
                except StopIteration:
                    continue
                running.append(gen)
            if not running:  # nothing fits anywhere: wait for an arrival or a landed upgrade
                for r in ranks:
                    r.core.check_stall(requests_coming=not self._arrivals_done)
                self._engine_wake = env.event()
                yield self._engine_wake
                continue
            duration_s = self._time_step(start_s)
            yield env.timeout(duration_s)
            for gen in running:
                try:
                    gen.send(None)
                except StopIteration:
                    continue
                raise PagedWeightError(f"{self.policy}: a rank's step waited twice")
            for r in ranks:  # every GPU took part in the step: each has a row for it
                if r.step_now is None:
                    r.core.record_step(start_s, duration_s, Batch(), StepShape.empty())

    def _time_step(self, start_s: float) -> float:
        ranks = self.ranks
        rank_tokens = np.array([r.step_now.shape.num_tokens if r.step_now else 0 for r in ranks], dtype=np.int64)
        counts = self.routing.sample(int(rank_tokens.sum()))
        local = counts.take(self._placement_flat)  # (ranks, layers, local experts)
        expert_tokens = local.sum(axis=2).T  # (layers, ranks)
        moe_s = None
        if self._analytic:  # every rank's experts in one pass (the same floats as rank by rank)
            moe_s = ranks[0].latency.moe_s_ranks(
                [r.latency for r in ranks], local, [r.core.precision_grid for r in ranks]
            )
        compute_s = np.zeros(self.ep)
        for i, r in enumerate(ranks):
            if r.step_now is not None:
                r.step_now.routing = local[i]
            r.core.observe_routing(local[i])
            compute_s[i] = r.compute_s(local[i], None if moe_s is None else moe_s[i])
        if self.a2a_grid is None:
            a2a_s = a2a_time_s(
                rank_tokens, expert_tokens, self.model.top_k, self.model.hidden_size,
                self.parallel.a2a_bytes_per_value, self.gpu.peer_bandwidth_bytes_per_s, self.gpu.interconnect_latency_s,
            )  # fmt: skip
        else:
            a2a_s, beyond, largest = a2a_table_time_s(
                rank_tokens, expert_tokens, self.model.top_k, self._copy_bytes, self.a2a_grid,
                self.gpu.peer_bandwidth_bytes_per_s, self.gpu.interconnect_latency_s,
            )  # fmt: skip
            if beyond:
                self.a2a_beyond_grid += beyond
                self.ranks[0].latency.miss(f"all_to_all/{self.ep} ranks", beyond, f"bytes={largest:.0f}")
        slowest = int(np.argmax(compute_s))
        mean_s = float(compute_s.mean())
        duration_s = float(compute_s[slowest]) + a2a_s
        self._ep_rows.append(
            (
                len(self._ep_rows), start_s, duration_s, a2a_s, slowest,
                float(compute_s[slowest]) / mean_s if mean_s > 0 else 1.0,
                *compute_s.tolist(), *rank_tokens.tolist(), *expert_tokens.sum(axis=0).tolist(),
            )
        )  # fmt: skip
        return duration_s

    def start(self, arrivals: bool = True):
        """Start the processes on the environment (``arrivals=False``: a cluster feeds
        ``accept``); returns the engine process."""
        env = self.env
        if arrivals:
            env.process(self.arrivals(env))
        for r in self.ranks:
            env.process(r.copy_engine(env))
        return env.process(self.engine(env))

    def run(self, progress=None) -> None:
        run_until(self.env, self.start(), self.trace, progress)
        verify_memory(self.cores)

    # ---- results --------------------------------------------------------------------------
    def ep_step_columns(self) -> dict[str, np.ndarray]:
        names = list(EP_STEP_COLUMNS)
        for what in ("compute_s", "tokens", "expert_tokens"):
            names += [f"{what}_r{i}" for i in range(self.ep)]
        table = np.array(self._ep_rows, dtype=np.float64).reshape(-1, len(names))
        out = {}
        for k, name in enumerate(names):
            col = table[:, k]
            floats = name in ("start_s", "duration_s", "a2a_s", "imbalance") or name.startswith("compute_s")
            out[name] = col if floats else col.astype(np.int64)
        return out

    def replica_steps(self) -> dict[str, np.ndarray]:
        """The replica's step table: every rank's counts and pages summed step by step (every
        rank has a row for every step); times from any rank; ``kv_usage`` the ranks' mean."""
        cols = [r.core.steps.columns() for r in self.ranks]
        out = {}
        for name in StepRecorder.COLUMNS:
            if name in ("step", "start_s", "duration_s"):
                out[name] = cols[0][name]
            elif name == "kv_usage":  # the ranks' pools are alike: their mean usage
                out[name] = sum(c[name] for c in cols) / len(cols)
            else:
                out[name] = sum(c[name] for c in cols)
        return out


class _ReplicaView:
    """What ``policy_summary`` reads of a core, for the replica's summed step table."""

    def __init__(self, steps: dict[str, np.ndarray], page_bytes: int, cores=()):
        self._steps = steps
        self.steps = self
        self.pool = SimpleNamespace(page_bytes=page_bytes)
        # Prefix caching's counters summed over the GPUs (each has its own cache).
        scheds = [c.scheduler for c in cores]
        self.scheduler = SimpleNamespace(
            prefix_caching=any(s.prefix_caching for s in scheds),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in scheds),
            prefix_query_tokens=sum(s.prefix_query_tokens for s in scheds),
        )
        self.kv = SimpleNamespace(num_evicted_blocks=sum(c.kv.num_evicted_blocks for c in cores))
        # The precisions the policy used: every GPU runs the same policy on the same ladder.
        first = cores[0] if cores else None
        self.controller = getattr(first, "controller", None)
        self.ladder = getattr(first, "ladder", ())
        initial = np.concatenate([np.asarray(c.setup.initial_ids) for c in cores]) if cores else np.zeros(0, int)
        self.setup = SimpleNamespace(initial_ids=initial)

    def columns(self) -> dict[str, np.ndarray]:
        return self._steps

    def __len__(self) -> int:
        return len(self._steps["step"])


def ep_summary(eng: EpEngine, slo: Slo, wall_s: float) -> dict:
    """The replica's summary (the usual figures over all its requests and summed memory) with
    ``ep`` (placement, imbalance, all-to-all share) and ``ranks`` (each GPU's own summary)."""
    page_bytes = eng.ranks[0].core.pool.page_bytes
    s = policy_summary(
        eng.requests,
        _ReplicaView(eng.replica_steps(), page_bytes, [r.core for r in eng.ranks]),
        slo,
        wall_s,
        eng.bytes_h2d,
    )
    ep_cols = eng.ep_step_columns()
    dur = ep_cols["duration_s"]
    total = float(dur.sum()) or 1.0
    slowest = np.bincount(ep_cols["slowest_rank"], minlength=eng.ep) if len(dur) else np.zeros(eng.ep)
    s["ep"] = {
        "ep": eng.ep,
        "placement": eng.parallel.placement,
        "request_router": eng.parallel.request_router,
        "interconnect": eng.gpu.interconnect,
        "mean_imbalance": float((ep_cols["imbalance"] * dur).sum() / total) if len(dur) else 1.0,
        "p99_imbalance": float(np.percentile(ep_cols["imbalance"], 99)) if len(dur) else 1.0,
        "a2a_share": float(ep_cols["a2a_s"].sum() / total) if len(dur) else 0.0,
        "a2a_timing": "latency table" if eng.a2a_grid is not None else "gpu spec",
    }
    if eng.a2a_grid is not None:  # MoE layers whose exchange the table's sizes did not reach
        s["ep"]["a2a_beyond_table"] = eng.a2a_beyond_grid
    ranks = []
    for i, r in enumerate(eng.ranks):
        rs = policy_summary(r.requests, r.core, slo, wall_s, r.bytes_h2d)
        for key in ("wall_s", "sim_s_per_wall_s"):
            rs.pop(key, None)
        compute = ep_cols[f"compute_s_r{i}"]
        rs.update(
            rank=i,
            mean_compute_ms=float(compute.mean() * 1e3) if len(compute) else 0.0,
            slowest_share=float(slowest[i] / max(len(dur), 1)),
            routed_tokens=int(ep_cols[f"expert_tokens_r{i}"].sum()),
        )
        ranks.append(rs)
    s["ranks"] = ranks
    return s


def write_ep_tables(
    parts_dir: Path, policy: str, eng: EpEngine, replica: int | None = None, step_tables: bool = True
) -> None:
    """The replica's tables (see the module docstring) as CSV files in ``parts_dir``; with
    ``replica`` (a cluster's), a ``replica`` column after ``policy``; without ``step_tables``,
    the request table alone."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    _write_requests(parts_dir / "requests.csv", policy, eng.requests, replica)
    if not step_tables:
        return
    _write_columns(parts_dir / "steps.csv", policy, eng.replica_steps(), replica)
    num_experts = eng.model.num_experts
    transitions, initial = [], []
    for i, r in enumerate(eng.ranks):
        core, place = r.core, eng.placement[i]
        local_e = core.model.num_experts
        ids = np.asarray(core.setup.initial_ids)
        flat = np.arange(len(ids))
        layer = flat // local_e
        glob = layer * num_experts + place[layer, flat % local_e]
        initial.append(
            pd.DataFrame({"expert": glob, "layer": layer, "precision": np.asarray(PRECISION_NAMES)[ids], "rank": i})
        )
        tf = transition_frame(core.transitions)
        t_layer = tf["layer"].to_numpy()  # the rank's flat expert index -> the model's
        tf["expert"] = t_layer * num_experts + place[t_layer, tf["expert"].to_numpy() % local_e]
        tf["rank"] = np.full(len(tf), i, dtype=np.int64)
        transitions.append(tf)
    tdf = pd.concat(transitions, ignore_index=True).sort_values("time_s", kind="stable")
    idf = pd.concat(initial).sort_values("expert", kind="stable")
    label_rows(tdf, policy, replica)
    with (parts_dir / "transitions.csv").open("w", newline="") as f:
        write_csv_rows(f, tdf)
    label_rows(idf, policy, replica)
    idf.to_csv(parts_dir / "initial_precisions.csv", index=False)
    # The per-rank step tables are the largest a run writes (DeepSeek-V3 on 8 GPUs, an hour:
    # ~0.9 GB): written as the step table is, not by pandas' slower writer (the same bytes).
    with (parts_dir / "steps_by_rank.csv").open("w", newline="") as f:
        for i, r in enumerate(eng.ranks):
            df = pd.DataFrame(r.core.steps.columns())
            df.insert(0, "rank", i)
            label_rows(df, policy, replica)
            write_csv_rows(f, df, header=i == 0)
    df = pd.DataFrame(eng.ep_step_columns())
    label_rows(df, policy, replica)
    with (parts_dir / "ep_steps.csv").open("w", newline="") as f:
        write_csv_rows(f, df)
