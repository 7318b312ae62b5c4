"""Per-call cost of the simulator's latency models and routing sampler (microseconds).

The simulator calls ``step_time_s`` and ``RoutingSampler.sample`` once per engine step, about
150,000 times for a one-hour trace, so together they must stay within a few tens of us.
Each figure is the best of several repeats (other processes on a shared machine only add time).

    python benchmarks/latency_model.py [--repeats 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import timeit
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from pagedweight.config.kernel_table import write_kernel_table
from pagedweight.config.latency import AnalyticLatencyConfig, ConstantLatencyConfig, TableLatencyConfig
from pagedweight.core.spec import PRECISION_ID, load_gpu, load_model
from pagedweight.core.step import StepShape
from pwsim.latency import build_latency_model
from pwsim.roofline import AnalyticLatencyModel
from pwsim.routing import RoutingSampler

CASES = (("mixtral-8x7b", "h200"), ("qwen3-30b-a3b", "h100-sxm"), ("deepseek-v3", "h200"))
TOKENS = (1, 8, 64, 512, 2048)


def best_us(fn, repeats: int, number: int) -> float:
    return min(timeit.repeat(fn, repeat=repeats, number=number)) / number * 1e6


def synthetic_table(model, gpu, path: Path) -> None:
    """A table covering the benchmark's shapes, with analytic values (the lookup cost is what counts)."""
    am = AnalyticLatencyModel(AnalyticLatencyConfig(), model, gpu)
    rows = []
    for prec in ("bf16", "fp8", "int8", "int4"):
        pid = PRECISION_ID[prec]
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            for e in sorted({1, 2, 4, 8, 16, 32, 64, 128, model.num_experts} & set(range(1, model.num_experts + 1))):
                rows.append(("moe_ffn", prec, m, e, 0, 0, float(am.moe_class_s(pid, m, e)) * 1e6))
    for m in (1, 64, 256, 1024, 4096, 8192):
        for kv in (1, 1024, 4096, 16384, 65536):
            rows.append(("attn_prefill", "bf16", m, 0, 0, kv, float(am.attn_prefill_s(m, max(kv, m))) * 1e6))
        rows.append(("dense", "bf16", m, 0, 0, 0, float(am.dense_s(m)) * 1e6))
        rows.append(("lm_head", "bf16", m, 0, 0, 0, float(am.lm_head_s(m)) * 1e6))
    for b in (1, 8, 64, 256, 1024):
        for kv in (1, 1024, 4096, 16384, 65536):
            rows.append(("attn_decode", "bf16", 0, 0, b, kv, float(am.attn_decode_s(b, b * kv)) * 1e6))
    df = pd.DataFrame(rows, columns=["op", "precision", "m", "e", "batch", "kv_len", "latency_us_p50"])
    df["model"] = model.name
    df["latency_us_p20"] = df["latency_us_p50"]
    df["latency_us_p80"] = df["latency_us_p50"]
    df["samples"] = 1
    meta = {"device": gpu.name, "date": "synthetic", "torch": "-", "triton": "-", "cuda": "-"}
    write_kernel_table(df, path, {**meta, "models": [model.name], "grid": "benchmark"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    print(f"{'model':16} {'what':34} {'us/call':>8}")
    for model_name, gpu_name in CASES:
        model, gpu = load_model(model_name), load_gpu(gpu_name)
        sampler = RoutingSampler(model, None, "zipf", 1.0, rng)
        for num_tokens in TOKENS:
            us = best_us(lambda s=sampler, t=num_tokens: s.sample(t), args.repeats, args.number)
            print(f"{model_name:16} {f'routing sample T={num_tokens}':34} {us:8.1f}")
        # A typical mixed step: 64 decodes of 100-4000 tokens context and one 512-token chunk,
        # with half the experts downgraded to INT4 (three precision classes per layer).
        shape = StepShape(np.array([512]), np.array([2048]), rng.integers(100, 4000, 64))
        ids = np.full((model.num_moe_layers, model.num_experts), PRECISION_ID["bf16"], dtype=np.int8)
        ids[:, ::2] = PRECISION_ID["int4"]
        ids[:, 1::4] = PRECISION_ID["fp8"]
        tokens_per_expert = sampler.sample(shape.num_tokens)
        decode_shape = StepShape(np.zeros(0, np.int64), np.zeros(0, np.int64), rng.integers(100, 4000, 8))
        decode_tokens = sampler.sample(decode_shape.num_tokens)
        synthetic_table(model, gpu, tmp / f"{model_name}.csv")
        configs = {
            "analytic": AnalyticLatencyConfig(),
            "table": TableLatencyConfig(kind="table", path=f"{model_name}.csv"),
            "constant": ConstantLatencyConfig(kind="constant", step_time_s=0.02),
        }
        for kind, cfg in configs.items():
            lm = build_latency_model(cfg, model, gpu, tmp)
            mixed = (shape, tokens_per_expert, ids)
            decode = (decode_shape, decode_tokens, ids)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                us = best_us(lambda lm=lm, a=mixed: lm.step_time_s(*a), args.repeats, args.number)
                us_dec = best_us(lambda lm=lm, a=decode: lm.step_time_s(*a), args.repeats, args.number)
            print(f"{model_name:16} {f'step_time_s {kind} (64 dec + 512 pf)':34} {us:8.1f}")
            print(f"{model_name:16} {f'step_time_s {kind} (8 decodes)':34} {us_dec:8.1f}")
            if kind == "table" and lm.out_of_grid:
                print(f"{'':16} out of grid: {dict(lm.out_of_grid)}")


if __name__ == "__main__":
    main()
