"""Expert parallelism in the simulator (``pwsim.parallel``): placement, a rank's share of the
model, the all-to-all and the lockstep step's time, checked against hand computations."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from pagedweight.config.scenario import load_scenario, rank_model
from pagedweight.core.spec import load_model
from pagedweight.errors import ScenarioError
from pagedweight.policy.importance import synthetic_table
from pwsim.parallel import a2a_time_s, a2a_volumes, place_experts, rank_table
from pwsim.run import run_scenario

GPU_BW, GPU_LAT = 3.6e11, 1.5e-5  # h200's interconnect (pagedweight/data/gpus/h200.yaml)


def test_a2a_of_8_ranks_by_hand():
    # 200 tokens on 8 ranks, top_k 2, two MoE layers: 400 token copies per layer.
    n = np.array([10, 20, 30, 40, 0, 0, 50, 50])
    x = np.array([[40, 40, 40, 40, 40, 40, 80, 80], [50] * 8])  # copies at each rank's experts, (L, ep)
    send, recv = a2a_volumes(n, x, top_k=2)
    # Rank r keeps X_r * n_r / n of the copies at its experts: rank 6 keeps 80 * 0.25 = 20 of
    # layer 0's and sends 2 * 50 - 20 = 80; rank 4 has no tokens and receives all its 40.
    assert send[0].tolist() == [18, 36, 54, 72, 0, 0, 80, 80]
    assert recv[0].tolist() == [38, 36, 34, 32, 40, 40, 60, 60]
    assert send[1].tolist() == [17.5, 35, 52.5, 70, 0, 0, 87.5, 87.5]
    assert (send.sum(axis=1) == recv.sum(axis=1)).all()  # every copy sent is received
    # Busiest rank per layer: 80 and 87.5 copies of 1000 bf16 values; dispatch and combine.
    t = a2a_time_s(n, x, 2, hidden_size=1000, bytes_per_value=2, bandwidth_bytes_per_s=1e9, latency_s=1e-5)
    assert t == pytest.approx(2 * ((1e-5 + 80 * 2000 / 1e9) + (1e-5 + 87.5 * 2000 / 1e9)))
    assert a2a_time_s(n[:1], x[:, :1], 2, 1000, 2, 1e9, 1e-5) == 0.0  # one GPU: no exchange


def test_placements_split_every_layer_and_balanced_evens_the_traffic():
    rng = np.random.default_rng(0)
    freqs = rng.zipf(1.5, size=(3, 32)).astype(float)
    for kind in ("contiguous", "balanced"):
        p = place_experts(freqs, 8, kind)
        assert p.shape == (8, 3, 4)
        for layer in range(3):
            assert sorted(p[:, layer].ravel().tolist()) == list(range(32))
    contiguous = place_experts(freqs, 8, "contiguous")
    assert contiguous[1, 2].tolist() == [4, 5, 6, 7]
    balanced = place_experts(freqs, 8, "balanced")

    def worst(p):  # the hottest rank's share of each layer's traffic
        loads = np.stack([np.take_along_axis(freqs, p[r], axis=1).sum(axis=1) for r in range(8)])
        return (loads.max(axis=0) / freqs.sum(axis=1)).max()

    assert worst(balanced) < worst(contiguous)


def test_a_rank_holds_its_experts_and_every_pinned_weight():
    model = load_model("deepseek-v3")
    share = rank_model(model, 8)
    assert share.num_experts == model.num_experts // 8
    assert share.pinned_bytes() == model.pinned_bytes()  # routers keep every row
    assert share.num_experts_total * 8 == model.num_experts_total
    table = synthetic_table(load_model("tiny-moe"), ["bf16", "int4"], 0)
    experts = np.array([[1, 5]] * 4)
    sub = rank_table(table, experts)
    assert sub.num_experts == 2 and sub.dloss.shape == (8, 2)
    assert sub.routing_freq[3] == table.routing_freq[1 * 8 + 5]


SPEC = {  # one MoE layer whose tokens go to every expert: each rank's routed tokens are known
    "name": "ep-hand",
    "source": "test",
    "num_layers": 1,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "top_k": 8,
    "expert_ffn_size": 128,
    "vocab_size": 256,
    "max_context_tokens": 4096,
}


def _scenario(tmp_path, **parallel):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    prompts = [100 * (r + 1) for r in range(8)]
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"timestamp": 0, "input_length": p, "output_length": 3}) + "\n" for p in prompts)
    )
    raw = {
        "name": "ep-hand",
        "model": "spec.yaml",
        "gpu": "h200",
        "memory": {"budget": "1 GiB", "page_bytes": "64 KiB", "precisions": ["bf16", "int4"]},
        "workload": {"kind": "trace", "path": "t.jsonl", "format": "mooncake"},
        "latency": {"kind": "constant", "step_time_s": 0.01, "per_token_s": 1e-5},
        "policies": ["static-fp16", "pagedweight"],
        "parallel": {"ep": 8, **parallel},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    return load_scenario(tmp_path / "s.yaml")


def test_ep_step_accounting_on_8_ranks_by_hand(tmp_path):
    summary = run_scenario(_scenario(tmp_path), tmp_path / "out", report=False)
    ep = pd.read_csv(tmp_path / "out" / "ep_steps.csv")
    ep = ep[ep.policy == "static-fp16"].reset_index(drop=True)
    # Step 0: the 8 requests (least outstanding: request r on rank r) prefill together. Rank r
    # computes 10 ms + 10 us x 100 (r + 1) tokens; every token visits all 8 experts, one per
    # rank, so rank r's experts get all 3,600 tokens, it keeps 100 (r + 1) of them, receives
    # 3,600 - 100 (r + 1) and sends 7 x 100 (r + 1). The busiest is rank 7 sending 5,600 copies
    # of 64 bf16 values over 360 GB/s, plus 15 us, for dispatch and again for combine.
    first = ep.iloc[0]
    assert [first[f"tokens_r{r}"] for r in range(8)] == [100 * (r + 1) for r in range(8)]
    assert [first[f"expert_tokens_r{r}"] for r in range(8)] == [3600] * 8
    assert first["compute_s_r7"] == pytest.approx(0.018)
    assert first["a2a_s"] == pytest.approx(2 * (GPU_LAT + 5600 * 128 / GPU_BW))
    assert first["duration_s"] == pytest.approx(0.018 + 2 * (GPU_LAT + 5600 * 128 / GPU_BW))
    assert first["slowest_rank"] == 7
    assert first["imbalance"] == pytest.approx(0.018 / np.mean([0.01 + 1e-5 * 100 * (r + 1) for r in range(8)]))
    # Every step, by the same rule from its recorded tokens.
    for _, row in ep.iterrows():
        n = np.array([row[f"tokens_r{r}"] for r in range(8)])
        x = np.array([[row[f"expert_tokens_r{r}"] for r in range(8)]])
        assert (x.sum() == 8 * n.sum()) and (x == n.sum()).all()
        compute = np.where(n > 0, 0.01 + 1e-5 * n, 0.0)  # the constant model: idle ranks take 0
        want = compute.max() + a2a_time_s(n, x, 8, 64, 2, GPU_BW, GPU_LAT)
        assert row["duration_s"] == pytest.approx(want)
    # Every rank has a row for every step, with the replica's times.
    by_rank = pd.read_csv(tmp_path / "out" / "steps_by_rank.csv")
    mine = by_rank[by_rank.policy == "static-fp16"]
    for _, rows in mine.groupby("rank"):
        assert np.allclose(rows["duration_s"].to_numpy(), ep["duration_s"].to_numpy())
    s = summary["policies"]["static-fp16"]
    assert s["completed"] == 8 and [r["completed"] for r in s["ranks"]] == [1] * 8
    assert s["num_steps"] == len(ep)
    assert s["simulated_s"] == pytest.approx(ep["duration_s"].sum())
    assert s["ep"]["ep"] == 8 and 0 < s["ep"]["a2a_share"] < 1
    # The replica's memory is the sum of its GPUs'.
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    steps = steps[steps.policy == "static-fp16"]
    assert (steps["pinned_pages"].to_numpy() == mine.groupby("step")["pinned_pages"].sum().to_numpy()).all()
    assert summary["gpu"] == "8x h200" and summary["parallel"]["ep"] == 8
    # Global expert ids in the initial precisions, each once.
    initial = pd.read_csv(tmp_path / "out" / "initial_precisions.csv")
    assert sorted(initial[initial.policy == "pagedweight"]["expert"]) == list(range(8))


def test_ep_run_is_reproducible_and_routes_requests_by_the_chosen_rule(tmp_path):
    a = run_scenario(_scenario(tmp_path, request_router="round-robin"), tmp_path / "a", report=False)
    run_scenario(_scenario(tmp_path, request_router="round-robin"), tmp_path / "b", report=False)
    for name in ("steps.csv", "ep_steps.csv", "requests.csv", "transitions.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert [r["num_requests"] for r in a["policies"]["pagedweight"]["ranks"]] == [1] * 8


def test_bad_parallel_settings_are_one_line_errors(tmp_path):
    _scenario(tmp_path)
    raw = yaml.safe_load((tmp_path / "s.yaml").read_text())
    for parallel, words in (
        ({"ep": 3}, ["parallel.ep", "not divisible by 3", "allowed: 1, 2, 4, 8"]),
        ({"ep": 2, "tp": 2}, ["parallel.tp"]),
        ({"ep": 2, "placement": "random"}, ["parallel.placement", "contiguous"]),
        ({"ep": 2, "placement": "file"}, ["parallel", "placement_file"]),
        ({"ep": 2, "placement_file": "p.csv"}, ["parallel", "placement: file"]),
    ):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**raw, "parallel": parallel}))
        with pytest.raises(ScenarioError) as e:
            load_scenario(tmp_path / "bad.yaml")
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg


def test_report_shows_each_gpu_and_the_imbalance(tmp_path):
    from pagedweight.results.report import write_report

    run_scenario(_scenario(tmp_path), tmp_path / "out", report=False)
    page = write_report([tmp_path / "out"], tmp_path / "rep" / "r.html").read_text()
    assert "GPUs of the expert-parallel replica" in page and "slowest in" in page
    assert (tmp_path / "rep" / "out_imbalance.png").is_file()
    assert (tmp_path / "rep" / "out_gpu_memory1.png").is_file()


# ---- the all-to-all from a latency table's all_to_all rows ----------------------------------
A2A_BYTES = [4096, 65536, 1048576, 4194304]  # bytes per rank
A2A_US = [50.0, 80.0, 300.0, 1000.0]


def _table_scenario(tmp_path, a2a_ranks=(2,), extra_rows=(), num_sizes=4):
    """The hand scenario on 2 GPUs with 2 MoE layers, timed by a table: one dense row for the
    model and ``all_to_all`` rows for each of ``a2a_ranks`` (written under another model: the
    exchange does not depend on it)."""
    from pagedweight.config.kernel_table import write_kernel_table

    rows = [{"model": "ep-hand", "op": "dense", "precision": "-", "m": 1, "latency_us_p50": 10.0}]
    for ranks in a2a_ranks:
        rows += [
            dict(model="tiny-moe", op="all_to_all", precision="-", batch=ranks, bytes=b, latency_us_p50=us)
            for b, us in zip(A2A_BYTES[:num_sizes], A2A_US[:num_sizes], strict=True)
        ]
    df = pd.DataFrame([*rows, *extra_rows])
    for col in ("m", "e", "batch", "kv_len", "n", "k", "bytes"):
        df[col] = df[col].fillna(0).astype(int) if col in df else 0
    df["latency_us_p20"] = df["latency_us_p80"] = df["latency_us_p50"]
    df["samples"] = 1
    meta = {"device": "test", "date": "2026-12-01", "torch": "-", "triton": "-", "cuda": "none",
            "models": ["ep-hand"], "grid": "test"}  # fmt: skip
    write_kernel_table(df, tmp_path / "k.csv", meta)
    _scenario(tmp_path)
    (tmp_path / "spec2.yaml").write_text(yaml.safe_dump({**SPEC, "num_layers": 2}))
    raw = yaml.safe_load((tmp_path / "s.yaml").read_text())
    raw.update(model="spec2.yaml", parallel={"ep": 2}, policies=["static-fp16"])
    raw["latency"] = {"kind": "table", "path": "k.csv"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    return load_scenario(tmp_path / "s.yaml")


def _run_quietly(loaded, out):
    import warnings

    with warnings.catch_warnings():  # ops the table lacks are timed by the fallback, warned once
        warnings.simplefilter("ignore")
        return run_scenario(loaded, out, report=False)


def test_ep_step_takes_its_all_to_all_from_the_tables_rows(tmp_path):
    summary = _run_quietly(_table_scenario(tmp_path), tmp_path / "out")
    ep = pd.read_csv(tmp_path / "out" / "ep_steps.csv")
    assert len(ep) > 1
    copy_bytes = SPEC["hidden_size"] * 2  # bf16 values per token copy
    layers = 2
    for _, row in ep.iterrows():
        n = np.array([row["tokens_r0"], row["tokens_r1"]])
        # ep_steps.csv sums the layers' routed tokens; every layer's are alike (all experts chosen)
        x = np.array([[row["expert_tokens_r0"], row["expert_tokens_r1"]]] * layers) / layers
        send, recv = a2a_volumes(n, x, top_k=8)
        busiest = float(np.maximum(send, recv).max()) * copy_bytes
        # Linear between the rows; below the smallest size, the smallest size's time.
        per_call_s = np.interp(busiest, A2A_BYTES, A2A_US) * 1e-6
        assert row["a2a_s"] == pytest.approx(per_call_s * layers * 2)
    # Step 0, by hand: the 8 prompts (3,600 tokens) split 1,600 / 2,000 over the two GPUs (least
    # outstanding: requests alternate); every token visits 4 experts on each GPU, so GPU 1 keeps
    # 4 x 2,000 of its 8 x 2,000 copies and sends 8,000 = 1,024,000 bytes; GPU 0 receives as much.
    first = ep.iloc[0]
    assert (first["tokens_r0"], first["tokens_r1"]) == (1600, 2000)
    want_s = np.interp(8000 * copy_bytes, A2A_BYTES, A2A_US) * 1e-6 * layers * 2
    assert first["a2a_s"] == pytest.approx(want_s)
    s = summary["policies"]["static-fp16"]["ep"]
    assert s["a2a_timing"] == "latency table" and s["a2a_beyond_table"] == 0
    assert "notes" not in summary


def test_ep_without_rows_for_its_size_uses_the_gpu_spec_and_says_so(tmp_path):
    summary = _run_quietly(_table_scenario(tmp_path, a2a_ranks=(4, 8)), tmp_path / "out")
    (note,) = summary["notes"]
    assert "\n" not in note and "GPU spec" in note and "rows for 4, 8 ranks, none for 2" in note
    assert "pwgpu profile --ep 2" in note
    ep = pd.read_csv(tmp_path / "out" / "ep_steps.csv")
    for _, row in ep.iterrows():
        n = np.array([row["tokens_r0"], row["tokens_r1"]])
        x = np.array([[row["expert_tokens_r0"], row["expert_tokens_r1"]]] * 2) / 2
        assert row["a2a_s"] == pytest.approx(a2a_time_s(n, x, 8, SPEC["hidden_size"], 2, GPU_BW, GPU_LAT))
    assert summary["policies"]["static-fp16"]["ep"]["a2a_timing"] == "gpu spec"


def test_ep_exchange_beyond_the_tables_sizes_is_timed_by_the_spec_and_counted():
    from pwsim.parallel import a2a_table_time_s
    from pwsim.table_latency import A2aGrid

    grid = A2aGrid(np.array(A2A_BYTES, dtype=float), np.array(A2A_US) * 1e-6)
    n = np.array([10, 10])
    x = np.array([[80, 80], [150, 10]])  # busiest: 40 and 75 copies of 64 KiB, under and past 4 MiB
    t, beyond, largest = a2a_table_time_s(n, x, 8, 65536, grid, 1e9, 1e-5)
    busiest = np.maximum(*a2a_volumes(n, x, 8)).max(axis=1) * 65536
    assert busiest.tolist() == [40 * 65536, 75 * 65536]
    assert busiest[0] <= A2A_BYTES[-1] < busiest[1]
    assert (beyond, largest) == (1, busiest[1])
    assert t == pytest.approx(2 * (np.interp(busiest[0], A2A_BYTES, A2A_US) * 1e-6 + 1e-5 + busiest[1] / 1e9))
    assert a2a_table_time_s(n[:1], x[:, :1], 8, 65536, grid, 1e9, 1e-5) == (0.0, 0, 0.0)  # one GPU


def test_a_run_past_the_tables_sizes_warns_and_counts_the_layers(tmp_path):
    loaded = _table_scenario(tmp_path, num_sizes=2)  # up to 64 KiB: step 0 moves 1,024,000 bytes
    with pytest.warns(UserWarning, match="all_to_all/2 ranks at bytes=1024000 is outside the measured grid"):
        summary = run_scenario(loaded, tmp_path / "out", report=False)
    first = pd.read_csv(tmp_path / "out" / "ep_steps.csv").iloc[0]
    assert first["a2a_s"] == pytest.approx(2 * 2 * (GPU_LAT + 8000 * 128 / GPU_BW))
    assert summary["policies"]["static-fp16"]["ep"]["a2a_beyond_table"] == 2  # step 0's two layers


def test_bad_all_to_all_rows_are_one_line_errors(tmp_path):
    from pagedweight.errors import SpecError

    bad = {"model": "ep-hand", "op": "all_to_all", "precision": "-", "batch": 1, "bytes": 4096, "latency_us_p50": 5.0}
    with pytest.raises(SpecError) as e:
        _run_quietly(_table_scenario(tmp_path, extra_rows=[bad]), tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and "k.csv: line 7" in msg and "batch (ranks) >= 2" in msg, msg


def _write_placement(path, placement):
    """``placement`` (ep, L, E/ep) as a CSV ``layer,expert,gpu``, rows in no particular order."""
    rows = [(layer, e, r) for r in range(placement.shape[0]) for layer in range(placement.shape[1])
            for e in placement[r, layer].tolist()]  # fmt: skip
    rows.reverse()
    path.write_text("layer,expert,gpu\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    return path


def test_a_placement_file_places_what_it_says(tmp_path):
    """A placement read from a file is the one written there (a balanced one round-trips); a
    file that says contiguous runs exactly as ``contiguous`` does."""
    from pagedweight.core.placement import read_placement

    freqs = np.random.default_rng(1).zipf(1.5, size=(3, 32)).astype(float)
    balanced = place_experts(freqs, 8, "balanced")
    path = _write_placement(tmp_path / "p.csv", balanced)
    assert np.array_equal(read_placement(path, 8, 3, 32), balanced)
    assert np.array_equal(place_experts(freqs, 8, "file", path), balanced)

    run_scenario(_scenario(tmp_path), tmp_path / "contiguous", report=False)
    _write_placement(tmp_path / "mine.csv", place_experts(np.ones((1, 8)), 8, "contiguous"))
    loaded = _scenario(tmp_path, placement="file", placement_file="mine.csv")  # relative to the scenario
    summary = run_scenario(loaded, tmp_path / "file", report=False)
    assert summary["policies"]["pagedweight"]["ep"]["placement"] == "file"
    for name in ("steps.csv", "ep_steps.csv", "requests.csv"):
        assert (tmp_path / "contiguous" / name).read_bytes() == (tmp_path / "file" / name).read_bytes()


@pytest.mark.parametrize(
    "text, words",
    [
        ("layer,expert\n0,0\n", ["columns gpu missing", "layer, expert, gpu"]),
        ("layer,expert,gpu\n" + "".join(f"0,{e},{e}\n" for e in range(7)) + "0,7,8\n", ["line 9", "gpu '8'", "0 .. 7"]),
        ("layer,expert,gpu\n" + "".join(f"0,{e},{e}\n" for e in range(7)) + "0,x,7\n", ["line 9", "expert 'x'"]),
        ("layer,expert,gpu\n" + "".join(f"0,{e},{e}\n" for e in range(8)) + "0,3,4\n", ["line 10", "placed twice"]),
        ("layer,expert,gpu\n" + "".join(f"0,{e},{e}\n" for e in range(7)), ["expert 7 has no GPU"]),
        ("layer,expert,gpu\n" + "".join(f"0,{e},{min(e, 6)}\n" for e in range(8)), ["gpu 6 holds 2", "holds 1"]),
    ],
)
def test_bad_placement_files_are_one_line_errors(tmp_path, text, words):
    (tmp_path / "p.csv").write_text(text)
    with pytest.raises(ScenarioError) as e:
        _scenario(tmp_path, placement="file", placement_file="p.csv")
    msg = str(e.value)
    assert "\n" not in msg and "parallel.placement_file" in msg and "p.csv" in msg, msg
    assert all(w in msg for w in words), msg
