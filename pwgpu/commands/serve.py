"""Serve a MoE checkpoint over an OpenAI-compatible HTTP API (completions, chat, SSE streaming).

With no --model, serves the tiny random default model (created on first use). Binds to
127.0.0.1 unless told otherwise. Ctrl-C stops it; with --out the run's results directory
(requests, steps, transitions, summary) is written on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal

from pagedweight.policy.policies import POLICY_NAMES
from pwgpu.commands import core_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the tiny default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    core_options.add_arguments(p, budget_default="64MiB")
    p.add_argument("--policy", default="pagedweight", choices=POLICY_NAMES)
    p.add_argument("--max-pending", type=int, default=64, help="unfinished requests before answering 429")
    p.add_argument("--max-body-bytes", default="1MiB", help="largest request body, e.g. '1MiB' (default: 1MiB)")
    p.add_argument("--history-window", type=int, default=10000,
                   help="request records, steps and precision changes kept for --out (the newest; default: 10000; "
                        "0: all, which grows without bound)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="threads for parsing, tokenizing and detokenizing")
    p.add_argument("--importance", help="importance table CSV (default: a synthetic table)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--api-key", default=os.environ.get("PWGPU_API_KEY"), help="require 'Authorization: Bearer KEY'")
    p.add_argument("--out", help="write the results directory here on shutdown")


def build(args: argparse.Namespace):
    """(engine thread, FastAPI app) from parsed arguments."""
    import dataclasses

    from pagedweight.config.scenario import parse_bytes
    from pagedweight.errors import ConfigError
    from pwgpu.default_model import default_model_dir
    from pwgpu.engine import Engine, EngineConfig
    from pwgpu.engine_thread import EngineThread
    from pwgpu.server import ServerSettings, build_app
    from pwgpu.tokenizer import Tokenizer

    if args.history_window < 0:
        raise ConfigError(f"--history-window(={args.history_window}) must be >= 0 (0: keep everything)")
    if args.workers < 1:
        raise ConfigError(f"--workers(={args.workers}) must be >= 1")
    model_dir = args.model or default_model_dir()
    core = dataclasses.replace(core_options.core_config(args), history_window=args.history_window or None)
    cfg = EngineConfig(core, policy=args.policy, device=args.device, dtype=args.dtype, importance=args.importance)
    engine = Engine(model_dir, cfg)
    try:
        tokenizer = Tokenizer(model_dir)
    except Exception:  # no tokenizer.json: token-id prompts only
        tokenizer = None
    max_len = engine.core.scheduler.config.max_model_len
    settings = ServerSettings(
        model_name=engine.spec.name, api_key=args.api_key, max_pending=args.max_pending,
        max_prompt_tokens=max_len - 1, max_tokens_limit=max_len - 1, max_body_bytes=parse_bytes(args.max_body_bytes),
        num_workers=args.workers,
    )  # fmt: skip
    runner = EngineThread(engine).start()
    return runner, build_app(runner, tokenizer, settings)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    runner, app = build(args)
    eng = runner.engine
    usage = eng.core.pool.usage()
    print(f"pwgpu serve: {eng.spec.name} ({eng.arch.family}) on {eng.device}, policy {args.policy}, "
          f"{eng.core.pool.num_pages} pages of {eng.page_bytes} B: {usage}; http://{args.host}:{args.port}/v1",
          flush=True)  # fmt: skip
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it; exiting through SystemExit
    # instead of the default handler lets the results below be written.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        runner.stop()
        if args.out:
            eng.write_results(args.out)
            print(f"pwgpu serve: results in {args.out}", flush=True)
    return 0
