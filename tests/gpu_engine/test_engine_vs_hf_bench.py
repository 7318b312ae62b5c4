"""``benchmarks/engine_vs_hf.py --lengths azure``: requests of a trace's lengths, continuous
batching against transformers' padded static batches, on the default model."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def bench():
    spec = importlib.util.spec_from_file_location("engine_vs_hf", ROOT / "benchmarks" / "engine_vs_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, rows: list[tuple[int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i:02d}.0,{p},{n}" for i, (p, n) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_azure_lengths_are_seeded_rows_with_prompts_clipped(tmp_path):
    rows = [(5, 3), (3000, 7), (40, 0), (12, 9), (8, 2)]
    trace = write_trace(tmp_path / "t.csv", rows)
    lengths = bench().azure_lengths(trace, 4, max_prompt=100, seed=1)
    assert lengths == bench().azure_lengths(trace, 4, max_prompt=100, seed=1)
    assert len(lengths) == 4
    allowed = {(min(p, 100), max(n, 1)) for p, n in rows}  # a 0-token output still generates one
    assert set(lengths) <= allowed and len(set(lengths)) == 4


def test_azure_lengths_without_the_trace_names_it(tmp_path):
    with pytest.raises(SystemExit, match="needs the Azure trace at .*absent.csv"):
        bench().azure_lengths(tmp_path / "absent.csv", 4, max_prompt=100, seed=1)


def test_varied_lengths_run_both_sides_to_the_same_greedy_tokens(tmp_path, capsys):
    """Three requests of different lengths, batch 2: the engine keeps two running and admits the
    third when one ends; transformers runs a left-padded batch of two, then one. Every request's
    own tokens agree, and the ratio line counts only the requests' own tokens."""
    trace = write_trace(tmp_path / "t.csv", [(9, 5), (17, 2), (4, 7)])
    argv = ["--lengths", "azure", "--trace", str(trace), "--batches", "2", "--requests", "3", "--reps", "1"]
    assert bench().main([*argv, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 2: 3 requests, prompt tokens mean 10 max 17, output tokens mean 5 max 7" in out
    assert "same greedy tokens 3/3" in out
    assert "ratio" in out
