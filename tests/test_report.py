"""The report from a small real run: every section and image, the numbers it shows, the
precision map rebuilt from the tables, sim-vs-real errors, and the page in headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest

from pagedweight.core.pagetable import expert_pages_by_id
from pagedweight.core.spec import PRECISION_ID, load_model
from pagedweight.results.report import write_report
from pagedweight.results.report_data import load_run, precision_timeline, signed_error_perc, sim_real_pairs
from pwsim.cli import main

import proc

# tiny-moe under KV pressure: 1500-token prompts at 40 req/s in 34 MiB make pagedweight
# downgrade and later upgrade experts, so every section of the report has something to draw.
PRESSURE_YAML = """\
name: pressure
model: tiny-moe
gpu: h200
memory: {budget: 34 MiB, page_bytes: 64 KiB, kv_block_tokens: 16}
workload:
  kind: synthetic
  arrival: {kind: poisson, rate_qps: 40.0}
  lengths: {kind: fixed, prompt_tokens: 1500, output_tokens: 60}
  num_requests: 120
policies: [static-fp16, static-int4, pagedweight]
slo: {ttft_ms: 500}
"""
CAPTIONS = (
    "Memory over time per policy",
    "Precision of every routed expert over time",
    "Latency CDFs, throughput, goodput and preemptions",
    "TTFT by arrival time: flat keeps up, rising is a growing queue",
    "Quality proxy over time, and quality against throughput",
    "Precision transitions: bytes per second moved",
    "Prefix caching: prefill saved by hits, evictions, cached memory",  # its requests are preempted
)
IMG_SRC = re.compile(r'<img[^>]*\ssrc="([^"]*)"')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("report")
    scenario = base / "pressure.yaml"
    scenario.write_text(PRESSURE_YAML)
    out = base / "run"
    assert main(["run", str(scenario), "--out", str(out), "--no-progress"]) == 0
    return out


def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(io.BytesIO(data), format="png")


def test_run_writes_report_with_every_section(run_dir):
    page = (run_dir / "report.html").read_text()
    assert "<h3>Summary</h3>" in page
    for caption in CAPTIONS:
        assert f"<figcaption>{caption}" in page, caption
    srcs = IMG_SRC.findall(page)
    assert len(srcs) == len(CAPTIONS)
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        img = _decode_png(base64.b64decode(src.removeprefix("data:image/png;base64,"), validate=True))
        assert img.shape[0] > 200 and img.shape[1] > 400
        assert img.reshape(-1, img.shape[-1]).std(axis=0).max() > 0.05  # not one flat colour
    for name in ("memory", "precision_map", "latency", "queue", "quality", "transitions", "prefix"):
        _decode_png((run_dir / f"{run_dir.name}_{name}.png").read_bytes())
    # nothing to fetch: every src is a data: URI, every link an anchor in the page, no CSS url()
    assert all(src.startswith("data:") for src in re.findall(r'\ssrc="([^"]*)"', page))
    assert all(href.startswith("#") for href in re.findall(r'\shref="([^"]*)"', page))
    assert "url(" not in page and "@import" not in page


def test_summary_table_shows_change_against_static_fp16(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())["policies"]
    page = (run_dir / "report.html").read_text()
    base, dyn = summary["static-fp16"], summary["pagedweight"]
    change = (dyn["output_throughput"] - base["output_throughput"]) / base["output_throughput"] * 100
    assert change > 50  # the scenario is KV-bound at full precision
    row = re.search(r"<tr><th>output throughput \(tok/s\)</th>(.*?)</tr>", page).group(1)
    assert f"{dyn['output_throughput']:.1f}" in row
    assert f'<span class="d better">{change:+.1f}%</span>' in row
    quality = re.search(r"<tr><th>quality proxy, mean dloss.*?</th>(.*?)</tr>", page).group(1)
    # the baseline's proxy is exactly 0: the change is an absolute difference, and worse
    assert f'<span class="d worse">+{dyn["mean_quality_proxy"]:.4g}</span>' in quality
    assert "pagedweight</b> against static-fp16" in page  # the headline


def test_precision_map_rebuilt_from_tables_matches_every_step(run_dir):
    run = load_run(run_dir)
    model = load_model(run.summary["model"])
    pages = expert_pages_by_id(model, run.summary["page_bytes"])
    steps = run.steps[run.steps["policy"] == "pagedweight"]
    transitions = run.transitions[run.transitions["policy"] == "pagedweight"]
    assert (transitions["kind"] == "downgrade").any() and (transitions["kind"] == "upgrade").any()
    # Rows are recorded at the end of each step; the state just before it is what they count.
    end_s = (steps["start_s"] + steps["duration_s"]).to_numpy() - 1e-9
    initial = run.initial_precisions[run.initial_precisions["policy"] == "pagedweight"]
    assert len(initial) == model.num_experts_total
    grid, names = precision_timeline(initial, transitions, end_s)
    for i, name in enumerate(names):
        rebuilt = (grid == i).sum(axis=0) * pages[PRECISION_ID[name]]
        np.testing.assert_array_equal(rebuilt, steps[f"weight_pages_{name}"].to_numpy(), err_msg=name)


def test_sim_vs_real_section_has_signed_errors(run_dir, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(run_dir, real)
    # A run measured at the client (pwgpu replay) has only requests.csv and summary.json.
    for name in ("steps.csv", "transitions.csv", "initial_precisions.csv", "scenario.resolved.yaml"):
        (real / name).unlink()
    summary = json.loads((real / "summary.json").read_text())
    summary["runtime"] = "pwgpu"
    sim_tput = summary["policies"]["pagedweight"]["output_throughput"]
    summary["policies"]["pagedweight"]["output_throughput"] = sim_tput / 1.25  # the simulator is 25% high
    (real / "summary.json").write_text(json.dumps(summary))
    out = write_report([run_dir, real], tmp_path / "both.html")
    page = out.read_text()
    assert "Simulated vs real: pressure" in page
    section = page[page.index("Simulated vs real: pressure") :]
    row = re.search(r"<tr><th>pagedweight</th><th>output throughput \(tok/s\)</th>(.*?)</tr>", section).group(1)
    assert f"<td>{sim_tput:.1f}</td><td>{sim_tput / 1.25:.1f}</td>" in row
    assert "+25.0%" in row
    assert re.search(r"<tr><th>static-fp16</th><th>output throughput \(tok/s\)</th>.*?\+0\.0%", section)
    real_section = page[page.index('<h2 id="run1">') : page.index("Simulated vs real: pressure")]
    assert "No steps.csv" in real_section and "<figcaption>Latency CDFs" in real_section
    assert "<figcaption>Memory over time" not in real_section
    assert "<figcaption>TTFT and TPOT distributions, simulated (dashed) and real (solid)." in section
    for src in IMG_SRC.findall(page):
        assert src.startswith("data:image/png;base64,")
    # two simulated runs are not a sim-vs-real pair; a real run pairs with a simulated one
    runs = [load_run(run_dir, tables=False), load_run(real, tables=False)]
    assert sim_real_pairs(runs[:1] * 2) == []
    assert [(s.name, r.name) for s, r in sim_real_pairs(runs)] == [(run_dir.name, "real")]


def test_signed_error():
    assert signed_error_perc(110.0, 100.0) == pytest.approx(10.0)
    assert signed_error_perc(90.0, 100.0) == pytest.approx(-10.0)
    assert signed_error_perc(0.0, 0.0) == 0.0
    assert signed_error_perc(1.0, 0.0) == float("inf")
    assert np.isnan(signed_error_perc(None, 1.0))


def test_report_command(run_dir, tmp_path, capsys):
    out = tmp_path / "r" / "index.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert out.is_file() and (out.parent / f"{run_dir.name}_memory.png").is_file()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "not a results directory (no summary.json)" in capsys.readouterr().err


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        shutil.which("chromium"),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        *extra,
        page.as_uri(),
    ]
    return proc.run(cmd, quiet_s=12)


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    page = run_dir / "report.html"
    # A copy with a probe script: after load it writes into the DOM each image's decoded width
    # and every resource the page fetched (Resource Timing lists network and file loads, not
    # data: URIs), which --dump-dom then prints.
    probe = tmp_path / "probe.html"
    script = (
        "<script>window.addEventListener('load',()=>{const b=document.body;"
        "b.setAttribute('data-widths',Array.from(document.images).map(i=>i.complete?i.naturalWidth:0).join(','));"
        "b.setAttribute('data-fetched',performance.getEntriesByType('resource').map(e=>e.name).join(' '))});"
        "</script>"
    )
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    dom = _chromium(probe, tmp_path / "profile1", "--dump-dom", "--virtual-time-budget=5000")
    assert dom.returncode == 0, dom.stderr[-2000:]
    widths = re.search(r'data-widths="([^"]*)"', dom.stdout).group(1).split(",")
    assert len(widths) == len(CAPTIONS) and all(int(w) > 400 for w in widths), widths
    assert re.search(r'data-fetched="([^"]*)"', dom.stdout).group(1) == "", "the page fetched resources"
    shot = tmp_path / "shot.png"
    res = _chromium(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,3000")
    assert res.returncode == 0, res.stderr[-2000:]
    img = _decode_png(shot.read_bytes())
    assert img.shape[:2] == (3000, 1280)
    pixels = img[..., :3].reshape(-1, 3)
    assert len(np.unique((pixels[::97] * 255).astype(np.uint8), axis=0)) > 50  # text, tables, plots: not blank


def test_precision_timeline_by_hand():
    initial = pd.DataFrame({"expert": [1, 0], "layer": [0, 0], "precision": ["bf16", "bf16"]})
    transitions = pd.DataFrame(
        [
            (1.0, 0, 0, "bf16", "int4", "downgrade", 10),
            (2.0, 0, 0, "int4", "bf16", "abort", 0),  # an aborted upgrade changes nothing
            (3.0, 1, 0, "bf16", "int8", "downgrade", 20),
            (4.0, 0, 0, "int4", "int8", "upgrade", 20),
        ],
        columns=["time_s", "expert", "layer", "from_precision", "to_precision", "kind", "bytes"],
    )
    grid, names = precision_timeline(initial, transitions, np.array([0.0, 1.0, 2.5, 3.5, 5.0]))
    assert names == ["bf16", "int8", "int4"]
    assert [[names[i] for i in row] for row in grid] == [
        ["bf16", "int4", "int4", "int4", "int8"],
        ["bf16", "bf16", "bf16", "int8", "int8"],
    ]


def test_step_table_is_read_compactly_with_the_same_values(tmp_path, monkeypatch):
    """steps.csv is read in chunks into typed columns: the values pandas would read, less memory."""
    import numpy as np
    import pandas as pd

    from pagedweight.results import report_data

    rng = np.random.default_rng(0)
    n = 1000
    df = pd.DataFrame({"policy": np.repeat(["static-fp16", "pagedweight", "kv-swap"], [400, 350, 250])})
    df["step"] = np.arange(n)
    df["start_s"] = np.cumsum(rng.random(n))
    df["kv_pages"] = rng.integers(0, 50_000, n)
    df["bytes_upgraded"] = rng.integers(0, 2**40, n)
    df["quality_proxy"] = rng.random(n)
    df.to_csv(tmp_path / "steps.csv", index=False)
    monkeypatch.setattr(report_data, "_CHUNK_ROWS", 128)
    got = report_data._steps_csv(tmp_path / "steps.csv")
    want = pd.read_csv(tmp_path / "steps.csv")
    assert list(got.columns) == list(want.columns) and len(got) == n
    assert got["policy"].astype(str).tolist() == want["policy"].tolist()
    for c in want.columns[1:]:
        assert np.array_equal(got[c].to_numpy(), want[c].to_numpy()), c
    assert got["kv_pages"].dtype == np.int32 and got["policy"].dtype == "category"


def test_cdf_of_many_values_is_drawn_through_a_bounded_number_of_ranks():
    """A cluster's hour is ~800,000 requests a policy: the CDF line keeps CDF_POINTS ranks, and
    its ends are the exact minimum (at 1/n) and maximum (at 1)."""
    from matplotlib.figure import Figure

    from pagedweight.results.report_plots import CDF_POINTS, _cdf

    rng = np.random.default_rng(0)
    for n in (10, CDF_POINTS, 200_000):
        values = np.concatenate([rng.lognormal(5.0, 1.0, n), [np.nan, np.inf]])
        ax = Figure().subplots()
        _cdf(ax, values)
        x, y = ax.lines[0].get_data()
        finite = np.sort(values[np.isfinite(values)])
        assert len(x) == min(n, CDF_POINTS)
        assert x[0] == finite[0] and y[0] == 1 / n and x[-1] == finite[-1] and y[-1] == 1.0
        assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0)
        # Every drawn point lies on the exact CDF.
        np.testing.assert_array_equal(finite[np.round(y * n).astype(int) - 1], x)


def test_step_arrays_give_the_frame_the_csv_gives(tmp_path):
    """A run's report takes its step table from the arrays its policies' rows were written
    from: the same frame (values, types, policy categories in order) as reading steps.csv, or
    None where the CSV reader's types would not hold the values."""
    from pagedweight.config.scenario import load_scenario
    from pagedweight.results import report_data
    from pagedweight.results.writer import STEP_ARRAYS, ResultsWriter
    from pwsim.run import scenario_run, simulate_policy

    scenario = tmp_path / "pressure.yaml"
    scenario.write_text(PRESSURE_YAML)
    loaded = load_scenario(scenario)
    run = scenario_run(loaded)
    writer = ResultsWriter(tmp_path / "out", {})
    for i, policy in enumerate(run.policies):
        r = simulate_policy(loaded, run, policy, str(writer.parts_root / str(i)), step_arrays=True)
        writer.add_parts(policy, Path(r["parts_dir"]), r["summary"])
    arrays = writer.step_arrays()
    assert [p for p, _ in arrays] == list(run.policies)
    simulate_policy(loaded, run, "static-fp16", str(tmp_path / "plain"))  # no report: no arrays
    assert (tmp_path / "plain" / "steps.csv").is_file() and not (tmp_path / "plain" / STEP_ARRAYS).exists()
    held = report_data.steps_from_arrays(arrays)
    cols = {k: np.load(v) for k, v in report_data.step_array_files(arrays[0][1]).items()}
    first = tmp_path / "first"
    report_data.save_step_arrays(first, cols)
    writer.write()
    read = report_data._steps_csv(tmp_path / "out" / "steps.csv")
    pd.testing.assert_frame_equal(held, read)
    assert len(held) > 100 and list(held["policy"].cat.categories) == list(run.policies)

    # A value the CSV reader's int32 would not hold: no arrays, and the report reads the CSV.
    cols["kv_pages"] = cols["kv_pages"].astype(np.int64) + 2**31
    assert report_data.report_step_arrays(cols) is None
    # Parts whose columns differ: the CSV too.
    path = tmp_path / "fewer"
    report_data.save_step_arrays(path, {k: v for k, v in cols.items() if k != "kv_pages"})
    assert report_data.steps_from_arrays([("static-fp16", first), ("x", path)]) is None
    # A part whose arrays were not all written (no column list yet): the CSV.
    (first / report_data.STEP_ARRAY_COLUMNS).unlink()
    assert report_data.step_array_files(first) is None
    assert report_data.steps_from_arrays([("static-fp16", first)]) is None


def test_policy_steps_are_the_rows_a_mask_selects():
    """``RunResults.policy_steps``: a slice where a policy's rows are together, the mask's rows
    where they are not, nothing for a policy without rows; recomputed for a new table."""
    from pagedweight.results.report_data import RunResults

    policy = pd.Categorical(["a", "a", "b", "b", "b", "c", "a"])
    steps = pd.DataFrame({"policy": policy, "step": np.arange(7)})
    run = RunResults(Path("x"), {}, steps, pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), {})
    for p in ("a", "b", "c", "d"):
        pd.testing.assert_frame_equal(run.policy_steps(p), steps[steps["policy"] == p])
    run.steps = steps.iloc[2:5]
    pd.testing.assert_frame_equal(run.policy_steps("b"), steps.iloc[2:5])
    assert run.policy_steps("a").empty


def test_run_report_does_not_parse_its_step_table_again(tmp_path, monkeypatch):
    """``pwsim run`` hands its report the step arrays its policies saved: steps.csv is written,
    not read back."""
    from pagedweight.results import report_data

    def refuse(path):
        raise AssertionError(f"{path} parsed again")

    monkeypatch.setattr(report_data, "_steps_csv", refuse)
    scenario = tmp_path / "pressure.yaml"
    scenario.write_text(PRESSURE_YAML)
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "--no-progress", "--jobs", "1"]) == 0
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "steps.csv").stat().st_size > 0
    assert not list((tmp_path / "run").glob(".parts-*"))  # the arrays went with the parts
