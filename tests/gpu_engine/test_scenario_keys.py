"""Every scenario key reaches both runtimes with the same value.

The test walks the scenario schema (``Scenario`` and its sub-models), so a key added later fails
here until this file says where it lands. Each key is set to a value that is not its default,
the scenario is turned into both runtimes' objects the way ``pwsim run`` and ``pwgpu run
--scenario`` do it, and both are run on a two-request workload. The model is the tiny model
counted at 4 bytes per activation, so that the engine can compute in float32 (fast on a CPU)."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from pydantic import BaseModel

from pagedweight.config.run import scenario_run
from pagedweight.config.scenario import Scenario, load_scenario
from pagedweight.core.spec import PRECISION_NAMES, load_model
from pagedweight.errors import ConfigError
from pagedweight.results.writer import trace_meta
from pwgpu.offline import policy_engine, scenario_engine_config
from pwgpu.offline import run_scenario as engine_run_scenario
from pwsim.latency import build_latency_model
from pwsim.routing import waterfill_top_k, zipf_frequencies
from pwsim.run import run_scenario as sim_run_scenario
from pwsim.run import scenario_engine

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-moe"
POLICIES = ["static-mixed", "pagedweight"]

# Every key, at a value that is not its default.
SCENARIO = {
    "name": "every-key",
    "description": "each key at a value of its own",
    "model": "tiny-moe-fp32.yaml",  # written by the test: the tiny model at 4-byte dtype
    "gpu": "cpu",
    "memory": {
        "budget": "40 MiB",
        "page_bytes": "64 KiB",
        "kv_block_tokens": 8,
        "prefix_caching": False,
        "precisions": ["bf16", "int8", "int4"],
        "paper_greedy_precisions": ["bf16", "int4"],
    },
    "workload": {
        "kind": "synthetic",
        "arrival": {"kind": "poisson", "rate_qps": 50.0},
        "lengths": {"kind": "fixed", "prompt_tokens": 12, "output_tokens": 3},
        "num_requests": 2,
    },
    "scheduler": {
        "max_num_batched_tokens": 1000,
        "max_num_seqs": 7,
        "max_model_len": 1500,
        "admission": "greedy",
        "admission_reserve_tokens": 77,
    },
    "latency": {"kind": "constant", "step_time_s": 0.02},
    "routing": {"kind": "zipf", "alpha": 1.5},
    "importance": {"kind": "synthetic", "seed": 5, "zipf_exponent": 1.1},
    "controller": {
        "horizon_steps": 9,
        "low_watermark": 0.03,
        "high_watermark": 0.2,
        "copy_budget_bytes_per_s": 5_000_000_000,
        "max_in_flight": 1_000_000_000,
        "min_dwell_s": 0.7,
        "plan_interval_s": 0.01,
        "rescale_interval_s": 3.0,
        "latency_margin": 0.25,
        "recompute_weight": 0.3,
        "backlog_fraction": 0.4,
        "backlog_calm_s": 3.0,
        "slo_batching": False,
        "min_prefill_tokens": 64,
        "late_wait_max_s": 20.0,
        "kv_offload": True,
        "static_mixed_fraction": 0.7,
    },
    "policies": POLICIES,
    # SLOs no request can meet: goodput 0 shows they were applied.
    "slo": {"ttft_ms": 1e-6, "tpot_ms": 1e-6, "e2el_ms": 1e-6},
    "seed": 4,
}


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of the schema: sub-models are walked into; unions (workload, latency,
    importance) are compared whole, through what they build."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += leaf_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def both(get_sim, get_engine, want):
    """The key lands in both runtimes: equal there, and equal to what the scenario says."""

    def check(r):
        sim, eng, expected = get_sim(r), get_engine(r), want(r)
        assert sim == eng == expected, (sim, eng, expected)

    return check


def sim_only(get_sim, want, why):
    def check(r):
        assert get_sim(r) == want(r), why

    return check


def core(r, side):
    return (r.sim if side == "sim" else r.engine).core


def shape_of(spec):
    return (spec.num_moe_layers, spec.num_experts, spec.expert_matrices, spec.pinned_bytes(), spec.kv_bytes_per_token())


def ctl(key):
    return both(
        lambda r: getattr(core(r, "sim").config.controller, key),
        lambda r: getattr(core(r, "engine").config.controller, key),
        lambda r: SCENARIO["controller"][key],
    )


CHECKS = {
    "name": both(lambda r: r.meta["pwsim"]["scenario"], lambda r: r.meta["pwgpu"]["scenario"], lambda r: "every-key"),
    "description": both(
        lambda r: r.resolved["pwsim"]["description"],
        lambda r: r.resolved["pwgpu"]["description"],
        lambda r: SCENARIO["description"],
    ),
    "model": both(
        lambda r: shape_of(core(r, "sim").model),
        lambda r: shape_of(core(r, "engine").model),
        lambda r: shape_of(r.spec),
    ),
    "gpu": sim_only(
        lambda r: r.meta["pwsim"]["gpu"],
        lambda r: "cpu",
        "the engine runs on its own device; the gpu's memory reaches both through memory.budget_fraction",
    ),
    "memory.budget": both(
        lambda r: core(r, "sim").pool.total_bytes, lambda r: core(r, "engine").pool.total_bytes, lambda r: 40 << 20
    ),
    "memory.budget_fraction": lambda r: _check_budget_fraction(r),
    "memory.page_bytes": both(
        lambda r: core(r, "sim").pool.page_bytes, lambda r: core(r, "engine").pool.page_bytes, lambda r: 64 << 10
    ),
    "memory.kv_block_tokens": both(
        lambda r: core(r, "sim").kv.block_tokens, lambda r: core(r, "engine").kv.block_tokens, lambda r: 8
    ),
    "memory.prefix_caching": both(
        lambda r: core(r, "sim").scheduler.prefix_caching,
        lambda r: core(r, "engine").scheduler.prefix_caching,
        lambda r: False,
    ),
    "memory.precisions": both(
        lambda r: core(r, "sim").controller.table.ladder,
        lambda r: core(r, "engine").controller.table.ladder,
        lambda r: tuple(SCENARIO["memory"]["precisions"]),
    ),
    "memory.paper_greedy_precisions": both(
        lambda r: core(r, "sim").config.paper_greedy_precisions,
        lambda r: core(r, "engine").config.paper_greedy_precisions,
        lambda r: tuple(SCENARIO["memory"]["paper_greedy_precisions"]),
    ),
    "workload": both(
        lambda r: r.meta["pwsim"]["trace"], lambda r: r.meta["pwgpu"]["trace"], lambda r: trace_meta(r.run.trace)
    ),
    "scheduler.max_num_batched_tokens": both(
        lambda r: core(r, "sim").scheduler.config.max_num_batched_tokens,
        lambda r: core(r, "engine").scheduler.config.max_num_batched_tokens,
        lambda r: 1000,
    ),
    "scheduler.max_num_seqs": both(
        lambda r: core(r, "sim").scheduler.config.max_num_seqs,
        lambda r: core(r, "engine").scheduler.config.max_num_seqs,
        lambda r: 7,
    ),
    "scheduler.max_model_len": both(
        lambda r: core(r, "sim").scheduler.config.max_model_len,
        lambda r: core(r, "engine").scheduler.config.max_model_len,
        lambda r: 1500,
    ),
    **{
        f"scheduler.{k}": both(
            lambda r, k=k: getattr(core(r, "sim").scheduler.config, k),
            lambda r, k=k: getattr(core(r, "engine").scheduler.config, k),
            lambda r, k=k: SCENARIO["scheduler"][k],
        )
        for k in ("admission", "admission_reserve_tokens")
    },
    "latency": sim_only(
        lambda r: r.meta["pwsim"]["latency_model"], lambda r: "constant 20 ms", "the engine's steps take what they take"
    ),
    "routing.kind": sim_only(lambda r: r.sim.routing.kind, lambda r: "zipf", "the engine's router routes for real"),
    "routing.alpha": lambda r: _check_zipf_alpha(r),
    "importance": both(
        lambda r: r.meta["pwsim"]["importance"],
        lambda r: r.meta["pwgpu"]["importance"],
        lambda r: r.run.table.provenance,
    ),
    **{
        f"controller.{k}": ctl(k) for k in SCENARIO["controller"] if k not in ("max_in_flight", "static_mixed_fraction")
    },
    "controller.max_in_flight": both(
        lambda r: core(r, "sim").config.controller.max_in_flight_bytes,
        lambda r: core(r, "engine").config.controller.max_in_flight_bytes,
        lambda r: SCENARIO["controller"]["max_in_flight"],
    ),
    "controller.static_mixed_fraction": both(
        lambda r: r.initial["pwsim"]["static-mixed"], lambda r: r.initial["pwgpu"]["static-mixed"], lambda r: r.mixed
    ),
    "policies": both(
        lambda r: list(r.meta["pwsim"]["policies"]), lambda r: list(r.meta["pwgpu"]["policies"]), lambda r: POLICIES
    ),  # fmt: skip
    **{f"slo.{k}": lambda r, k=k: _check_slo(r, k) for k in SCENARIO["slo"]},
    "seed": both(lambda r: r.meta["pwsim"]["seed"], lambda r: r.meta["pwgpu"]["seed"], lambda r: 4),
    **{f"parallel.{k}": lambda r, k=k: _check_parallel(r, k) for k in ("ep", "tp", "placement", "request_router")},
    "parallel.a2a_bytes_per_value": lambda r: _check_parallel(r, "a2a_bytes_per_value"),
    "parallel.placement_file": lambda r: _check_placement_file(r),
    "cluster.replicas": lambda r: _check_cluster(r, "replicas"),
    "cluster.router": lambda r: _check_cluster(r, "router"),
}

CLUSTER = {"replicas": 2, "router": "least-kv"}


def _check_cluster(r, key):
    """Simulator only: replicas behind a router (pwsim.cluster); the engine serves one replica
    and refuses more in one line."""
    if "cluster" not in r.cache:
        loaded = _load(r.tmp_path, {**SCENARIO, "cluster": CLUSTER}, "cluster.yaml")
        meta = sim_run_scenario(loaded, r.tmp_path / "cluster", report=False)
        with pytest.raises(ConfigError, match="cluster.replicas=2"):
            scenario_engine_config(scenario_run(loaded))
        r.cache["cluster"] = meta
    meta = r.cache["cluster"]
    assert meta["cluster"][key] == CLUSTER[key]
    for summary in meta["policies"].values():
        assert summary["cluster"][key] == CLUSTER[key] if key == "router" else len(summary["replicas"]) == 2


PARALLEL = {"ep": 2, "tp": 1, "placement": "balanced", "request_router": "round-robin", "a2a_bytes_per_value": 1}


def _check_parallel(r, key):
    """An expert-parallel replica (pwsim.parallel) gets every parallel key; the engine runs
    ``parallel.ep`` ranks (``pwgpu run --scenario``, tests/gpu_engine/test_ep_launch.py) with its
    experts placed contiguously, and refuses ``balanced`` placement in one line."""
    if "parallel" not in r.cache:
        loaded = _load(r.tmp_path, {**SCENARIO, "parallel": PARALLEL}, "parallel.yaml")
        meta = sim_run_scenario(loaded, r.tmp_path / "parallel", report=False)
        with pytest.raises(ConfigError, match="parallel.placement=balanced"):
            scenario_engine_config(scenario_run(loaded))
        r.cache["parallel"] = meta
    meta = r.cache["parallel"]
    assert meta["parallel"][key] == PARALLEL[key]
    for summary in meta["policies"].values():
        assert summary["ep"]["ep"] == 2 and len(summary["ranks"]) == 2
        assert summary["ep"]["placement"] == "balanced" and summary["ep"]["request_router"] == "round-robin"


def _check_placement_file(r):
    """A placement from a file: the simulator's replica places the experts as it says (even
    experts on GPU 0, odd on GPU 1); the engine, which places them contiguously, refuses it in
    one line."""
    layers = load_model("tiny-moe").num_moe_layers
    rows = "".join(f"{layer},{e},{e % 2}\n" for layer in range(layers) for e in range(8))
    (r.tmp_path / "placement.csv").write_text("layer,expert,gpu\n" + rows)
    raw = {**SCENARIO, "parallel": {**PARALLEL, "placement": "file", "placement_file": "placement.csv"}}
    loaded = _load(r.tmp_path, raw, "placed.yaml")
    eng = scenario_engine(scenario_run(loaded), "static-fp16", None, loaded.scenario.routing, loaded)
    assert eng.placement[0].tolist() == [[0, 2, 4, 6]] * layers and eng.placement[1].tolist() == [[1, 3, 5, 7]] * layers
    with pytest.raises(ConfigError, match="parallel.placement=file"):
        scenario_engine_config(scenario_run(loaded))


def _check_budget_fraction(r):
    """The other way to give the budget: both runtimes get the same bytes from it."""
    raw = {**SCENARIO, "memory": {**SCENARIO["memory"], "budget_fraction": 0.001}}
    del raw["memory"]["budget"]
    loaded = _load(r.tmp_path, raw)
    run = scenario_run(loaded)
    want = int(0.001 * loaded.gpu.hbm_bytes)
    assert run.core.budget_bytes == scenario_engine_config(run).core.budget_bytes == want


def _check_zipf_alpha(r):
    """Simulator only, as routing.kind: the sampler draws from zipf frequencies of this alpha."""
    expected = zipf_frequencies(r.spec.num_moe_layers, r.spec.num_experts, 1.5, np.random.default_rng(4))
    assert np.allclose(r.sim.routing.probs, waterfill_top_k(expected, r.spec.top_k))


def _check_slo(r, key):
    """Both runtimes judge goodput by the scenario's SLOs (which no request meets)."""
    assert getattr(r.run.slo, key) == SCENARIO["slo"][key]
    for side in ("pwsim", "pwgpu"):
        for summary in r.meta[side]["policies"].values():
            assert summary["request_throughput"] > 0 and summary["request_goodput"] == 0, (side, summary)


def _load(tmp_path, raw, name="scenario.yaml"):
    spec = load_model("tiny-moe").model_dump(mode="json") | {"dtype_bytes": 4}
    (tmp_path / "tiny-moe-fp32.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / name).write_text(yaml.safe_dump(raw))
    return load_scenario(tmp_path / name, require_latency_table=False)


def initial_precisions(out_dir):
    """Policy -> every expert's starting precision, from the results directory."""
    df = pd.read_csv(out_dir / "initial_precisions.csv")
    return {p: g.sort_values("expert")["precision"].tolist() for p, g in df.groupby("policy")}


def test_the_walk_covers_every_scenario_key():
    assert set(leaf_keys(Scenario)) == set(CHECKS), set(leaf_keys(Scenario)) ^ set(CHECKS)


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="needs models/tiny-moe")
def test_every_scenario_key_reaches_both_runtimes_alike(tmp_path):
    loaded = _load(tmp_path, SCENARIO)
    # Every value differs from the schema's default, so that a key dropped on the way shows.
    defaults = Scenario.model_validate({**SCENARIO, "memory": {"budget": 1}, "scheduler": {}, "controller": {},
                                        "slo": {}, "routing": {}})  # fmt: skip
    for section in ("scheduler", "controller", "slo", "routing"):
        for k, v in getattr(defaults, section).model_dump().items():
            assert getattr(loaded.scenario, section).model_dump()[k] != v, f"{section}.{k} is at its default"

    run = scenario_run(loaded)
    latency = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)
    base = scenario_engine_config(run, device="cpu", dtype="float32")
    sim = scenario_engine(run, "pagedweight", latency, loaded.scenario.routing)
    engine = policy_engine(MODEL, base, "pagedweight", run.table)
    # The whole configuration, not only the keys named below.
    assert replace(sim.core.config, model=None) == replace(engine.core.config, model=None)
    meta = {
        "pwsim": sim_run_scenario(loaded, tmp_path / "sim", report=False),
        "pwgpu": engine_run_scenario(run, MODEL, tmp_path / "real", device="cpu", dtype="float32", report=False),
    }
    dirs = {"pwsim": tmp_path / "sim", "pwgpu": tmp_path / "real"}
    for side, d in dirs.items():
        assert json.loads((d / "summary.json").read_text())["runtime"] == side
    # static-mixed at the scenario's fraction: a plan other than the default fraction's.
    default_fraction = {**SCENARIO, "controller": {}, "policies": ["static-mixed"]}
    sim_run_scenario(_load(tmp_path, default_fraction, "default.yaml"), tmp_path / "default", report=False)
    mixed_at_default = initial_precisions(tmp_path / "default")["static-mixed"]
    ran = SimpleNamespace(
        run=run, sim=sim, engine=engine, meta=meta, spec=loaded.model, tmp_path=tmp_path,
        resolved={side: yaml.safe_load((d / "scenario.resolved.yaml").read_text()) for side, d in dirs.items()},
        initial={side: initial_precisions(d) for side, d in dirs.items()},
        mixed=sim_run_scenario_plan(run, latency, loaded), cache={},
    )  # fmt: skip
    assert ran.mixed != mixed_at_default
    for key in leaf_keys(Scenario):
        CHECKS[key](ran)


def sim_run_scenario_plan(run, latency, loaded):
    """static-mixed's starting precisions at the scenario's fraction, from the core itself."""
    ids = scenario_engine(run, "static-mixed", latency, loaded.scenario.routing).core.setup.initial_ids
    return [PRECISION_NAMES[i] for i in ids]
