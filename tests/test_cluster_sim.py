"""Clusters in the simulator (``pwsim.cluster``): replicas behind a router, per-replica and
cluster results, the shipped cluster scenario, and overlaid trace copies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pagedweight.config.scenario import load_scenario
from pagedweight.errors import ScenarioError
from pagedweight.workload.build import overlay_copies
from pagedweight.workload.traces import RequestTrace
from pwsim.run import run_scenario

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PAGEDWEIGHT_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
if not SHARED.is_dir():  # a worktree beside the main checkout: the folder beside the worktrees
    SHARED = ROOT.parent.parent / "shared" / "traces"
AZURE = SHARED / "azure_conv_2023.csv"


def _trace(tmp_path, n=36, seed=3) -> Path:
    rng = np.random.default_rng(seed)
    gaps = rng.integers(0, 120, n)
    gaps[:3] = 0  # the loader counts time from the first request: each round-robin share starts at 0
    t_ms = np.cumsum(gaps)
    lines = [
        json.dumps({"timestamp": int(t), "input_length": int(p), "output_length": int(o)})
        for t, p, o in zip(t_ms, rng.integers(200, 3000, n), rng.integers(5, 60, n), strict=True)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _scenario(tmp_path, trace: Path, name="c.yaml", **extra) -> Path:
    raw = {
        "name": "c",
        "model": "mixtral-8x7b",
        "gpu": "h200",
        "memory": {"budget": "96 GiB", "precisions": ["bf16", "int8", "int4"]},
        "workload": {"kind": "trace", "path": str(trace), "format": "mooncake"},
        "policies": ["static-fp16", "pagedweight"],
        "seed": 7,
        **extra,
    }
    (tmp_path / name).write_text(yaml.safe_dump(raw))
    return tmp_path / name


def test_round_robin_replica_is_its_share_run_alone(tmp_path):
    trace = _trace(tmp_path)
    meta = run_scenario(
        load_scenario(_scenario(tmp_path, trace, cluster={"replicas": 3})), tmp_path / "c", report=False, jobs=2
    )
    # Replica 1 alone: requests 1, 4, 7, ... of the trace, routing seeded with seed + 1.
    lines = trace.read_text().splitlines()
    (tmp_path / "share.jsonl").write_text("\n".join(lines[1::3]) + "\n")
    alone = _scenario(tmp_path, tmp_path / "share.jsonl", "alone.yaml", seed=8)
    run_scenario(load_scenario(alone), tmp_path / "alone", report=False)
    cluster = pd.read_csv(tmp_path / "c" / "requests.csv")
    single = pd.read_csv(tmp_path / "alone" / "requests.csv")
    for policy in ("static-fp16", "pagedweight"):
        mine = cluster[(cluster.policy == policy) & (cluster.replica == 1)].reset_index(drop=True)
        ref = single[single.policy == policy].reset_index(drop=True)
        assert mine["request_id"].tolist() == list(range(1, 36, 3))
        for col in ("arrival_s", "ttft_ms", "e2el_ms", "output_tokens"):
            assert np.allclose(mine[col], ref[col]), (policy, col)
        s = meta["policies"][policy]
        assert s["cluster"]["requests_per_replica"] == [12, 12, 12]
        assert s["completed"] == 36 == sum(r["completed"] for r in s["replicas"])
        assert s["num_steps"] == sum(r["num_steps"] for r in s["replicas"])
    steps = pd.read_csv(tmp_path / "c" / "steps.csv")
    assert sorted(steps["replica"].unique()) == [0, 1, 2]
    from pagedweight.results.report import write_report

    page = write_report([tmp_path / "c"], tmp_path / "rep" / "r.html").read_text()
    assert "<h3>Replicas</h3>" in page and "show replica 0" in page
    assert (tmp_path / "rep" / "c_replica_load.png").is_file()


@pytest.mark.parametrize("router", ["least-outstanding", "least-kv"])
def test_state_routed_cluster_serves_every_request_once(tmp_path, router):
    trace = _trace(tmp_path, n=40)
    meta = run_scenario(
        load_scenario(_scenario(tmp_path, trace, cluster={"replicas": 4, "router": router})),
        tmp_path / "c",
        report=False,
    )
    requests = pd.read_csv(tmp_path / "c" / "requests.csv")
    for policy, s in meta["policies"].items():
        mine = requests[requests.policy == policy]
        assert sorted(mine["request_id"]) == list(range(40))
        assert s["completed"] == 40 and sum(s["cluster"]["requests_per_replica"]) == 40
        assert min(s["cluster"]["requests_per_replica"]) > 0  # the router spreads the burst
        assert s["cluster"]["router"] == router
        assert s["mean_itl_ms"] > 0 and s["p99_itl_ms"] >= s["median_itl_ms"]


def test_a_one_replica_cluster_is_the_scenario(tmp_path):
    trace = _trace(tmp_path, n=12)
    a = run_scenario(load_scenario(_scenario(tmp_path, trace)), tmp_path / "a", report=False)
    b = run_scenario(load_scenario(_scenario(tmp_path, trace, "b.yaml", cluster={"replicas": 1})), tmp_path / "b")
    assert (tmp_path / "a" / "requests.csv").read_bytes() == (tmp_path / "b" / "requests.csv").read_bytes()
    assert a["policies"]["pagedweight"]["num_steps"] == b["policies"]["pagedweight"]["num_steps"]


def test_overlaid_copies_keep_the_span_and_every_request():
    trace = RequestTrace(np.array([0.0, 1.0, 2.5, 9.0]), np.array([5, 6, 7, 8]), np.array([1, 2, 3, 4]), "x")
    out = overlay_copies(trace, 3)
    assert len(out) == 12
    assert (np.diff(out.arrival_s) >= 0).all() and out.arrival_s[0] >= 0 and out.arrival_s[-1] < 9.0 + 9.0 / 3
    assert sorted(out.prompt_tokens.tolist()) == sorted([5, 6, 7, 8] * 3)
    assert overlay_copies(trace, 1) is trace


def test_cluster_scenario_names_a_missing_trace_in_one_line(tmp_path):
    with pytest.raises(ScenarioError) as e:
        load_scenario(
            ROOT / "scenarios" / "cluster_azure16.yaml", overrides=["workload.path=/nonexistent/azure_conv_2023.csv"]
        )
    msg = str(e.value)
    assert "workload.path" in msg and "does not exist" in msg and "\n" not in msg


@pytest.mark.skipif(not AZURE.is_file(), reason=f"shared trace {AZURE} not found")
def test_cluster_scenario_runs_on_the_azure_trace(tmp_path):
    loaded = load_scenario(
        ROOT / "scenarios" / "cluster_azure16.yaml",
        overrides=[f"workload.path={AZURE}", "workload.duration_s=5", "policies=[pagedweight]"],
    )
    meta = run_scenario(loaded, tmp_path / "c", report=False, jobs=2)
    s = meta["policies"]["pagedweight"]
    assert len(s["replicas"]) == 16 and s["completed"] == s["num_requests"] > 16 * 5
    assert meta["cluster"] == {"replicas": 16, "router": "round-robin"}


def test_itl_histogram_counts_and_sums_every_gap():
    """The histogram holds every gap of every request (unfinished ones too) in its bin, and its
    sums are those of the gaps added up ``batch`` requests at a time, bit for bit."""
    from pagedweight.core.scheduler import Request
    from pwsim.cluster import ITL_BIN_MS, ITL_NUM_BINS, _itl_histogram

    rng = np.random.default_rng(5)
    reqs = []
    for i in range(50):
        r = Request(i, float(i), 10, 8)
        r.token_times_s.extend((np.cumsum(rng.exponential(0.04, int(rng.integers(0, 8)))) + i).tolist())
        reqs.append(r)
    for batch in (1, 3, 4096):
        h = _itl_histogram(reqs, batch=batch)
        total = total_sq = 0.0
        for start in range(0, len(reqs), batch):
            part = reqs[start : start + batch]
            gaps = [np.diff(np.asarray(r.token_times_s)) for r in part if len(r.token_times_s) > 1]
            if gaps:
                ms = np.concatenate(gaps) * 1e3
                total += float(ms.sum())
                total_sq += float((ms * ms).sum())
        every = np.concatenate([np.diff(np.asarray(r.token_times_s)) * 1e3 for r in reqs])
        assert h["n"] == len(every) and h["sum"] == total and h["sum_sq"] == total_sq
        bins = np.minimum((every / ITL_BIN_MS).astype(np.int64), ITL_NUM_BINS - 1)
        expected = np.bincount(bins, minlength=ITL_NUM_BINS)
        np.testing.assert_array_equal(h["counts"], expected)
