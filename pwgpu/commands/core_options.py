"""The core's settings as command-line options, shared by ``pwgpu serve`` and ``pwgpu run``.
An option left out keeps the core's own default (``CoreConfig``, ``SchedulerConfig``): no
default is repeated here."""

from __future__ import annotations

import argparse

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import SchedulerConfig


def add_arguments(p: argparse.ArgumentParser, budget_default: str | None = None) -> None:
    budget_help = "arena size for weights and KV, e.g. '64MiB', '70GiB'"
    p.add_argument("--mem-budget", default=budget_default,
                   help=budget_help + (f" (default: {budget_default})" if budget_default else ""))  # fmt: skip
    p.add_argument("--page-bytes", help="pool page size, a power of two (default: >= 32KiB, one KV block at least)")
    p.add_argument("--kv-block-tokens", type=int, help=f"tokens per KV block (default: {CoreConfig.kv_block_tokens})")
    p.add_argument("--max-num-seqs", type=int, help=f"requests per step (default: {SchedulerConfig.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help=f"tokens per step (default: {SchedulerConfig.max_num_batched_tokens})")  # fmt: skip
    p.add_argument("--max-model-len", type=int, help="context limit (default: the checkpoint's)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of cached prompt prefixes "
                   f"(default: {'on' if CoreConfig.prefix_caching else 'off'})")  # fmt: skip


def core_config(args: argparse.Namespace) -> CoreConfig:
    """The options given, on top of the core's defaults."""
    from pagedweight.config.scenario import parse_bytes

    limits = {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len")}
    core = {"page_bytes": parse_bytes(args.page_bytes) if args.page_bytes else None}
    if args.kv_block_tokens is not None:
        core["kv_block_tokens"] = args.kv_block_tokens
    if args.prefix_caching is not None:
        core["prefix_caching"] = args.prefix_caching
    return CoreConfig(
        budget_bytes=parse_bytes(args.mem_budget),
        scheduler=SchedulerConfig(**{k: v for k, v in limits.items() if v is not None}),
        **core,
    )
