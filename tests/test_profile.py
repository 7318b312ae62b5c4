"""`pwgpu profile` on the CPU (the CPU engine's PyTorch path), small grid, tiny-moe: the table
it writes must load with read_kernel_table and hold full rectilinear grids per op, which is
what pwsim's table latency model needs."""

import sys
from pathlib import Path

import pytest

from pagedweight.config.kernel_table import COLUMNS, read_kernel_table
from pagedweight.core.spec import load_model

import proc

pytest.importorskip("torch")

PRECISIONS = ("bf16", "int8", "int4")
# (op, first key, second key) that must form a full cross product.
GRID_KEYS = [
    ("moe_ffn", "m", "e"),
    ("attn_prefill", "m", "kv_len"),
    ("attn_decode", "batch", "kv_len"),
    ("dense", "m", None),
    ("lm_head", "m", None),
    ("quantize", "n", "k"),
    ("dequantize", "n", "k"),
    ("h2d_copy", "bytes", None),
    ("decode_step", "batch", "kv_len"),
]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "cpu.csv"
    cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--model", "tiny-moe", "--out", str(out), "--grid", "small",
           "--device", "cpu", "--precisions", ",".join(PRECISIONS)]  # fmt: skip
    done = proc.run(cmd, quiet_s=15)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    return read_kernel_table(out)


@pytest.mark.e2e
def test_table_has_schema_meta_and_every_op(table):
    df, meta = table
    assert list(df.columns) == list(COLUMNS)
    assert meta["grid"] == "small" and meta["models"] == ["tiny-moe"] and meta["cuda"] == "none"
    # The CPU engine writes an upgrade inside the step that starts it (no copy stream).
    assert meta["upgrades"] == "synchronous"
    assert set(df["op"]) == {op for op, _, _ in GRID_KEYS}
    assert (df["latency_us_p50"] > 0).all() and (df["samples"] > 0).all()
    assert (df["latency_us_p20"] <= df["latency_us_p50"]).all() and (df["latency_us_p50"] <= df["latency_us_p80"]).all()


@pytest.mark.e2e
@pytest.mark.parametrize("op,x,y", GRID_KEYS)
def test_each_op_is_a_full_grid(table, op, x, y):
    df, _ = table
    rows = df[df["op"] == op]
    groups = rows.groupby("precision") if op in ("moe_ffn", "quantize", "dequantize") else [("-", rows)]
    for _, part in groups:
        xs, ys = part[x].nunique(), part[y].nunique() if y else 1
        assert len(part) == xs * ys, f"{op}: {len(part)} rows for a {xs} x {ys} grid"


@pytest.mark.e2e
def test_moe_rows_cover_precisions_and_expert_counts(table):
    df, _ = table
    spec = load_model("tiny-moe")
    moe = df[df["op"] == "moe_ffn"]
    assert set(moe["precision"]) == set(PRECISIONS)
    assert set(moe["e"]) == {1, spec.top_k, spec.num_experts}
    assert (moe["n"] == spec.expert_ffn_size).all() and (moe["k"] == spec.hidden_size).all()
    # More tokens through more experts cannot be faster by an order of magnitude: catches
    # rows written against the wrong keys.
    # fp32 dense copies of every quantised precision: the same matmuls, so one timing shared;
    # 16-bit experts are copied in their own format and timed apart.
    times = {p: moe[moe["precision"] == p].sort_values(["e", "m"])["latency_us_p50"].to_numpy() for p in PRECISIONS}
    quantised = [p for p in PRECISIONS if p not in ("bf16", "fp16")]
    assert len(quantised) > 1 and all((times[p] == times[quantised[0]]).all() for p in quantised)
    small = moe[(moe["m"] == moe["m"].min()) & (moe["e"] == 1)]["latency_us_p50"].median()
    large = moe[(moe["m"] == moe["m"].max()) & (moe["e"] == spec.num_experts)]["latency_us_p50"].median()
    assert large > small


@pytest.mark.e2e
def test_decode_step_rows_are_whole_steps_on_the_attention_grid(table):
    """Whole decode steps at every (batch, kv_len) of the decode attention grid, experts at the
    ladder's first precision, each longer than that step's decode attention over all layers."""
    df, _ = table
    whole = df[df["op"] == "decode_step"].set_index(["batch", "kv_len"])
    attn = df[df["op"] == "attn_decode"].set_index(["batch", "kv_len"])
    assert sorted(whole.index) == sorted(attn.index) and set(whole["precision"]) == {PRECISIONS[0]}
    layers = load_model("tiny-moe").num_layers
    assert (whole["latency_us_p50"] > layers * attn["latency_us_p50"].reindex(whole.index) * 0.5).all()


@pytest.mark.e2e
def test_dequantize_rows_are_the_cpu_engines_expert_matrices(table):
    df, _ = table
    spec = load_model("tiny-moe")
    deq = df[df["op"] == "dequantize"]
    assert set(deq["precision"]) == set(PRECISIONS)
    sides = {spec.hidden_size, spec.expert_ffn_size}
    assert set(deq["n"]) == sides and set(deq["k"]) == sides


def test_unknown_op_is_a_usage_error(tmp_path):
    cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--model", "tiny-moe", "--out", str(tmp_path / "x.csv"),
           "--ops", "moe_ffn,warp_drive"]  # fmt: skip
    done = proc.run(cmd, quiet_s=5)
    assert done.returncode == 2 and "warp_drive" in done.stderr


def test_fitted_grid_covers_the_scheduler_limits():
    from pwgpu.profile import Grid

    g = Grid.fitted("t", max_batched_tokens=1000, max_num_seqs=12, max_context_tokens=340, copy_bytes=(32768, 10**6))
    assert g.moe_m[0] == 1 and g.moe_m[-2:] == (512, 1000) and g.attn_prefill_m[-1] == 1000
    assert g.attn_decode_batch == (1, 2, 4, 8, 12) and g.attn_prefill_kv[-1] == g.attn_decode_kv[-1] == 340
    assert g.attn_decode_kv[0] == g.attn_prefill_kv[0] == 1
    assert g.h2d_bytes[0] == 32768 and g.h2d_bytes[-1] == 10**6
    assert g.dense_m[-1] == 1000


@pytest.mark.e2e
def test_a_table_fitted_to_a_scenario_times_all_of_it(tmp_path):
    """`pwgpu profile --scenario`: the simulator then never leaves the measured grid."""
    import yaml

    from pagedweight.config.scenario import load_scenario
    from pwsim.run import run_scenario

    root = Path(__file__).resolve().parent.parent
    src = yaml.safe_load((root / "scenarios" / "cpu_validate.yaml").read_text())
    src["workload"]["num_requests"] = 8
    src["scheduler"] = {"max_num_batched_tokens": 256, "max_num_seqs": 8}
    src["policies"] = ["pagedweight"]
    src["latency"]["path"] = "cpu.csv"
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump(src))
    out = tmp_path / "cpu.csv"
    cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--scenario", str(scenario), "--out", str(out),
           "--device", "cpu"]  # fmt: skip
    done = proc.run(cmd, quiet_s=100)
    assert done.returncode == 0, done.stderr
    df, meta = read_kernel_table(tmp_path / "cpu.csv")
    assert meta["grid"].startswith("fitted to") and meta["dtype"] == "bfloat16"
    assert set(df[df["op"] == "moe_ffn"]["precision"]) == set(src["memory"]["precisions"])
    summary = run_scenario(load_scenario(scenario), tmp_path / "run", report=False)
    assert summary["policies"]["pagedweight"]["completed"] == 8
    assert not summary.get("out_of_grid"), summary.get("out_of_grid")


def test_time_us_flushes_caches_before_every_sample(monkeypatch):
    """Each sample starts after every line of the flush buffer was touched (cold caches, as inside
    a step): on a CPU by a read, so the buffer is never written again and the timed op finds no
    dirty lines to write back."""
    import torch

    from pwgpu import profile as prof

    dev = torch.device("cpu")
    reads, seen = [], []
    read_all = prof._read_all
    monkeypatch.setattr(prof, "_read_all", lambda buf: (reads.append(buf.numel() * buf.element_size()), read_all(buf)))

    def fn():
        buf = prof._flush_buffers[dev]
        seen.append((buf.numel(), int(buf[-1]), len(reads)))
        buf.zero_()  # a CPU flush reads: the next sample finds it as this one left it

    p50, p20, p80 = prof.time_us(fn, dev, samples=3, warmup=0, flush_bytes=1 << 16)
    assert seen == [(1 << 16, 1, 1), (1 << 16, 0, 2), (1 << 16, 0, 3)] and p20 <= p50 <= p80
    assert reads == [1 << 16] * 3
    calls = []
    prof.time_us(lambda: calls.append(1), dev, samples=2, warmup=1, flush_bytes=0)  # 0: no flush
    assert len(calls) == 3 and len(reads) == 3


def test_cpu_rows_are_timed_flushed_but_the_dequantisation_and_copy(monkeypatch):
    """On a CPU a step's ops (attention, dense, experts, LM head, a downgrade's write) are timed
    after a flush, as they run inside a step; the dequantisation and the host copy warm, as they
    measured in place."""
    import types

    import torch

    from pwgpu import profile as prof

    flushes = []
    monkeypatch.setattr(prof, "_flush", lambda device, num_bytes: flushes.append(num_bytes))
    p = prof.Profiler.__new__(prof.Profiler)
    p.device, p.rows, p._moe_aliases = torch.device("cpu"), [], []
    p.grid = types.SimpleNamespace(samples=2, warmup=1)
    ops = ["attn_decode", "attn_prefill", "dense", "lm_head", "moe_ffn", "quantize", "dequantize", "h2d_copy"]
    runs = []
    p._pending = [({"op": op}, lambda op=op: runs.append(op)) for op in [*ops, "decode_step"]]
    p.drain()
    assert flushes == [None, None, None, None, None, None, 0, 0] * 2  # None: the device's FLUSH_BYTES
    assert [r["op"] for r in p.rows] == [*ops, "decode_step"]
    # A whole decode step: no flush, and each timed sample right after an untimed run of it.
    assert runs.count("decode_step") == 1 + 2 * 2 and runs.count("dense") == 1 + 2


@pytest.mark.e2e
def test_mla_attention_is_timed_on_the_engines_latent_cache(tmp_path):
    """An MLA spec's attention rows come from the engine's own latent write and absorbed
    attention (pwgpu/mla.py), over the same grid as GQA's."""
    spec = tmp_path / "tiny-mla.yaml"
    spec.write_text(
        "name: tiny-mla\nsource: test\nnum_layers: 2\nhidden_size: 64\nnum_heads: 4\nnum_kv_heads: 4\n"
        "head_dim: 16\nnum_experts: 8\ntop_k: 2\nexpert_ffn_size: 32\nvocab_size: 96\nmax_context_tokens: 512\n"
        "attention: mla\nkv_lora_rank: 32\nqk_rope_head_dim: 8\nqk_nope_head_dim: 16\nv_head_dim: 16\n"
    )
    out = tmp_path / "mla.csv"
    cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--model", str(spec), "--out", str(out), "--grid", "small",
           "--device", "cpu", "--ops", "attention"]  # fmt: skip
    done = proc.run(cmd, quiet_s=15)
    assert done.returncode == 0, done.stderr
    df, meta = read_kernel_table(out)
    assert set(df["op"]) == {"attn_prefill", "attn_decode"} and (df["latency_us_p50"] > 0).all()
    assert any("absorbed latent attention" in n for n in meta["notes"])


@pytest.mark.e2e
def test_ep_adds_all_to_all_rows_of_two_gloo_ranks(tmp_path):
    """`pwgpu profile --ep 2` on the CPU: two gloo ranks time the all-to-all over the CPU's sizes;
    the rows load into the table latency model for 2 ranks."""
    from pagedweight.config.latency import TableLatencyConfig
    from pagedweight.core.spec import load_gpu
    from pwgpu.profile_a2a import A2A_BYTES
    from pwsim.table_latency import TableLatencyModel

    out = tmp_path / "cpu.csv"
    cmd = [sys.executable, "-m", "pwgpu.cli", "profile", "--model", "tiny-moe", "--out", str(out), "--grid", "small",
           "--device", "cpu", "--ops", "h2d_copy", "--ep", "2"]  # fmt: skip
    done = proc.run(cmd, quiet_s=20)
    assert done.returncode == 0, done.stderr
    df, meta = read_kernel_table(out)
    assert meta["all_to_all"] == {"ranks": 2, "backend": "gloo"} and meta["complete"] is True
    assert any(note.startswith("all_to_all") for note in meta["notes"])
    a2a = df[df["op"] == "all_to_all"].sort_values("bytes")
    assert set(df["op"]) == {"h2d_copy", "all_to_all"}
    assert (a2a["batch"] == 2).all() and (a2a["model"] == "tiny-moe").all() and (a2a["precision"] == "-").all()
    assert a2a["bytes"].tolist() == list(A2A_BYTES["cpu"])
    assert (a2a[["m", "e", "kv_len", "n", "k"]] == 0).all().all()
    p50 = a2a["latency_us_p50"].to_numpy()
    assert (p50 > 0).all() and (a2a["latency_us_p20"] <= a2a["latency_us_p50"]).all()
    assert (a2a["latency_us_p50"] <= a2a["latency_us_p80"]).all()
    # 1 MiB per rank against 4 KiB: more bytes, more time (against the small size's fast samples,
    # which a descheduled rank on a loaded machine does not slow down).
    assert p50[-1] > a2a["latency_us_p20"].iloc[0], a2a.to_string()
    cfg = TableLatencyConfig(kind="table", path=str(out))
    lm = TableLatencyModel(cfg, load_model("tiny-moe"), load_gpu("h200"), tmp_path)
    assert set(lm.a2a_grids) == {2}
    assert lm.a2a_grids[2].num_bytes.tolist() == list(A2A_BYTES["cpu"])


@pytest.mark.parametrize(
    "args,words",
    [
        (["--ep", "1"], ["--ep 1", "2 or more ranks"]),
        (["--ep", "64", "--device", "cuda"], ["--ep 64 on cuda needs 64 GPUs", "--device cpu"]),
        (["--ep", "2", "--device", "meta"], ["cpu (gloo) or cuda (NCCL)", "'meta'"]),
        (["--ops", ""], ["--ops is empty", "or --ep"]),
    ],
)
def test_bad_ep_is_a_one_line_error_before_anything_is_timed(tmp_path, capsys, args, words):
    from pwgpu.cli import main

    out = tmp_path / "x.csv"
    assert main(["profile", "--model", "tiny-moe", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(w in err for w in words), err
    assert not out.exists()


def test_cpu_rows_are_timed_in_rounds():
    """On a CPU each round takes one sample of every pending row, so that every row's median
    spans the whole group (the machine's drift does not land on one row); a GPU times each
    row at once."""
    import torch

    from pwgpu.profile import GRIDS, Profiler

    grid = GRIDS["small"]
    calls: list[str] = []
    prof = Profiler(load_model("tiny-moe"), grid, torch.device("cpu"), ("bf16",), torch.float32)
    prof._record("dense", lambda: calls.append("a"), m=1)
    prof._record("dense", lambda: calls.append("b"), m=2)
    assert calls == [] and prof.rows == []  # nothing timed before the drain
    prof.drain()
    rounds = grid.warmup + grid.samples
    assert calls == ["a", "b"] * rounds
    assert [r["m"] for r in prof.rows] == [1, 2] and all(r["samples"] == grid.samples for r in prof.rows)
    assert all(r["latency_us_p20"] <= r["latency_us_p50"] <= r["latency_us_p80"] for r in prof.rows)
    prof.drain()  # nothing pending: nothing more
    assert len(prof.rows) == 2 and len(calls) == 2 * rounds


def test_cpu_moe_rows_of_one_dense_dtype_are_one_timing():
    """In a bf16 run every precision's dense copies are bf16: the same matmuls, timed once and
    written under each precision, also when moe_ffn is the last op group profiled."""
    import torch

    from pwgpu.profile import GRIDS, Profiler

    prof = Profiler(load_model("tiny-moe"), GRIDS["small"], torch.device("cpu"), ("bf16", "int8", "int4"),
                    torch.bfloat16)  # fmt: skip
    prof.moe_ffn()
    prof.drain()
    by = {p: [(r["m"], r["e"], r["latency_us_p50"]) for r in prof.rows if r["precision"] == p] for p in prof.precisions}
    assert by["bf16"] and by["int8"] == by["bf16"] and by["int4"] == by["bf16"]


@pytest.mark.parametrize("group_bytes", [1 << 30, 1])
def test_decode_steps_of_every_batch_size_are_timed_in_one_group(monkeypatch, group_bytes):
    """Whole decode steps of every (batch, kv_len) wait for one drain, so that one group of
    rounds times them all (pwsim reads how a step grows with its batch); only when their KV
    caches together would pass ``DECODE_STEP_GROUP_BYTES`` does a new group start."""
    import torch

    import pwgpu.profile as profile_mod
    from pwgpu.profile import GRIDS, Profiler

    monkeypatch.setattr(profile_mod, "DECODE_STEP_GROUP_BYTES", group_bytes)
    grid = GRIDS["small"]
    prof = Profiler(load_model("tiny-moe"), grid, torch.device("cpu"), ("bf16",), torch.bfloat16)
    groups: list[list[tuple[int, int]]] = []

    def drain() -> None:  # what each drain would time, untimed
        groups.append([(row["batch"], row["kv_len"]) for row, _ in prof._pending])
        prof._pending = []

    monkeypatch.setattr(prof, "drain", drain)
    prof.decode_step()
    drain()  # as profile() drains after each op group
    points = [(b, kv) for b in grid.attn_decode_batch for kv in grid.attn_decode_kv]
    assert [p for g in groups for p in g] == points
    assert groups == ([points] if group_bytes > 1 else [[p] for p in points])
