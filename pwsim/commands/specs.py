"""List the built-in models, GPUs and precisions with the sizes PagedWeight derives from them."""

from __future__ import annotations

import argparse

from pagedweight.core.spec import PRECISIONS, list_gpus, list_models, load_gpu, load_model

GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="show one model (name or YAML path) in detail")


def run(args: argparse.Namespace) -> int:
    if args.model:
        m = load_model(args.model)
        print(f"{m.name}: {m.source}")
        print(
            f"  params {m.total_params() / 1e9:.2f} B; routed experts {m.num_experts_total} "
            f"({m.num_moe_layers} MoE layers x {m.num_experts}, top-{m.top_k})"
        )
        print(f"  pinned (attention, embeddings, routers, shared/dense FFN) {m.pinned_bytes() / GiB:.2f} GiB")
        if m.attention == "mla":  # the compressed latent and the shared RoPE key, per layer
            per_layer = f"(kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim})"
        else:
            per_layer = f"2 x {m.num_kv_heads} KV heads x {m.head_dim}"
        print(
            f"  KV cache {m.kv_bytes_per_token():,} B = {m.kv_bytes_per_token() / 1024:.1f} KiB per token "
            f"({m.attention}: {m.num_layers} layers x {per_layer} x {m.dtype_bytes} B)"
        )
        _, n, k = m.expert_matrices[0]
        for p in sorted(PRECISIONS.values(), key=lambda p: -p.rank):  # most precise first
            print(
                f"  {p.name:8s} {p.bits_per_weight(n, k):6.3f} bit/weight  expert {m.expert_bytes(p) / 2**20:9.2f} MiB"
                f"  all weights {m.weight_bytes(p) / GiB:8.2f} GiB"
            )
        return 0
    print("models:")
    for name in list_models():
        m = load_model(name)
        print(
            f"  {name:20s} {m.total_params() / 1e9:8.2f} B params  {m.num_experts_total:6d} experts  "
            f"bf16 {m.weight_bytes('bf16') / GiB:8.2f} GiB  int4 {m.weight_bytes('int4') / GiB:7.2f} GiB"
        )
    print("gpus:")
    for name in list_gpus():
        g = load_gpu(name)
        print(
            f"  {name:10s} {g.hbm_bytes / GiB:7.1f} GiB  {g.hbm_bandwidth_bytes_per_s / 1e12:5.2f} TB/s  "
            f"h2d {g.h2d_bandwidth_bytes_per_s / 1e9:5.1f} GB/s"
        )
    return 0
