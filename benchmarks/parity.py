"""Our model against transformers, per family, on tiny random checkpoints (the parity tests' own,
``tests/gpu_engine/tiny_models.py``), and what INT8 / INT4 experts cost DeepSeek-V3 tiny.

    python benchmarks/parity.py            # CPU, about two minutes; prints the README's tables

Per family: the largest logit error relative to the largest logit, in fp32 (over 3 prompts of
20-64 tokens) and in bf16 (both sides in bf16, transformers keeping what it keeps in fp32 when
loading in bf16), next to transformers' own bf16 error against its fp32 for scale; the share of
positions whose top token agrees in bf16; greedy tokens equal to ``generate`` (32 new tokens
from each of 3 prompts, EOS masked on both sides). DeepSeek-V3 tiny is also written as an FP8
block-scaled checkpoint and compared with transformers holding its dequantised weights.

KL: mean over the positions of 4 prompts of 64 tokens of KL(reference || every routed expert at
the precision), nats per token; the reference is the checkpoint's own experts (bf16-exact
values, or the FP8 ones). Random weights: these numbers describe these tiny models only, not
DeepSeek-V3's sensitivity.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu_engine"))

from tiny_models import (  # noqa: E402
    FAMILIES,
    bf16_like_transformers_loads_it,
    build,
    greedy,
    make_checkpoint,
    run,
    write_fp8_checkpoint,
)

from pwgpu.kernels.reference import dequantize_ref, quantize_ref  # noqa: E402

PROMPT_LENGTHS = (37, 64, 20)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def _rel(ours, ref):
    return float((ours - ref).abs().max() / ref.abs().max())


def measure(path, hf) -> dict:
    out = {"fp32": 0.0, "bf16": 0.0, "hf_bf16": 0.0, "bf16_top1": [], "greedy": [0, 0]}
    model, kv, blocks = build(path, torch.float32)
    refs32 = []
    for prompt in _prompts(PROMPT_LENGTHS):
        with torch.no_grad():
            refs32.append(hf(torch.tensor([prompt])).logits[0].float())
        out["fp32"] = max(out["fp32"], _rel(run(model, kv, blocks, prompt, 0), refs32[-1]))
    for prompt in _prompts((8, 13, 21), seed=3):
        ours = greedy(model, kv, blocks, prompt, 32)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out["greedy"][0] += sum(a == b for a, b in zip(ours, ref[0, len(prompt) :].tolist(), strict=True))
        out["greedy"][1] += 32
    model, kv, blocks = build(path, torch.bfloat16)
    hf16 = bf16_like_transformers_loads_it(hf)
    for prompt, ref32 in zip(_prompts(PROMPT_LENGTHS), refs32, strict=True):
        ours = run(model, kv, blocks, prompt, 0)
        with torch.no_grad():
            ref = hf16(torch.tensor([prompt])).logits[0].float()
        out["bf16"] = max(out["bf16"], _rel(ours, ref))
        out["hf_bf16"] = max(out["hf_bf16"], _rel(ref, ref32))  # transformers' own bf16 rounding
        out["bf16_top1"].append(float((ours.argmax(-1) == ref.argmax(-1)).float().mean()))
    hf.to(torch.float32)
    return out


def kl_per_precision(path, precisions) -> dict[str, float]:
    """Mean KL(reference || all routed experts at p), fp32 compute."""
    model, kv, blocks = build(path, torch.float32)
    prompts = _prompts((64,) * 4, seed=7)
    ref = [torch.log_softmax(run(model, kv, blocks, p, 0), -1) for p in prompts]
    dense = model.experts
    masters = (dense.w1, dense.w3, dense.w2)
    out = {}
    for prec in precisions:
        dense.w1, dense.w3, dense.w2 = (
            [torch.stack([dequantize_ref(quantize_ref(w, prec), prec, *w.shape, torch.float32) for w in layer])
             for layer in ws]
            for ws in masters
        )  # fmt: skip
        kls = []
        for p, r in zip(prompts, ref, strict=True):
            q = torch.log_softmax(run(model, kv, blocks, p, 0), -1)
            kls.append(float((r.exp() * (r - q)).sum(-1).mean()))
        out[prec] = sum(kls) / len(kls)
    dense.w1, dense.w3, dense.w2 = masters
    return out


def main() -> None:
    rows, kl = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            path = Path(tmp) / family
            rows.append((family, measure(path, make_checkpoint(family, path))))
            if family == "deepseek_v3":
                kl["deepseek_v3 (bf16 experts)"] = kl_per_precision(path, ("int8", "int4"))
        path = Path(tmp) / "fp8"
        shape = dict(hidden_size=128, moe_intermediate_size=160, intermediate_size=192)
        rows.append(("deepseek_v3, FP8 checkpoint", measure(path, write_fp8_checkpoint("deepseek_v3", path, **shape))))
        kl["deepseek_v3 (FP8 experts)"] = kl_per_precision(path, ("int4",))
    print(
        "| family | fp32 max rel. error | bf16 max rel. error | transformers' bf16 vs its fp32 "
        "| bf16 top-1 agreement (worst prompt) | greedy tokens equal |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for family, m in rows:
        print(
            f"| {family} | {m['fp32']:.1e} | {m['bf16']:.1e} | {m['hf_bf16']:.1e} | {100 * min(m['bf16_top1']):.0f}% "
            f"| {m['greedy'][0]}/{m['greedy'][1]} |"
        )
    print()
    print("| model | KL int8 (nats/token) | KL int4 (nats/token) |")
    print("|---|---:|---:|")
    for name, values in kl.items():
        int8 = f"{values['int8']:.2e}" if "int8" in values else "not on the ladder"
        print(f"| {name} | {int8} | {values['int4']:.2e} |")


if __name__ == "__main__":
    main()
