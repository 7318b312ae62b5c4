"""Serve a MoE checkpoint over an OpenAI-compatible HTTP API (completions, chat, SSE streaming).

With no --model, serves the tiny random default model (created on first use). Binds to
127.0.0.1 unless told otherwise. Ctrl-C stops it; with --out the run's results directory
(requests, steps, transitions, summary) is written on the way out. --ep N serves on N
expert-parallel rank processes: rank 0 answers HTTP and decides every step, the others follow.
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
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism: N rank processes, each holding 1/N of every MoE layer's experts in its own "
        "--mem-budget; rank 0 serves HTTP (gloo ranks on the CPU, NCCL with a GPU per rank)",
    )


def _engine(args: argparse.Namespace, ep: bool = False):
    """The engine the options describe; ``ep``: this rank's, agreeing with the other ranks
    (``pwgpu.ep_launch.rank_engine``)."""
    import dataclasses

    from pagedweight.errors import ConfigError
    from pwgpu.default_model import default_model_dir
    from pwgpu.engine import Engine, EngineConfig

    if args.history_window < 0:
        raise ConfigError(f"--history-window(={args.history_window}) must be >= 0 (0: keep everything)")
    if args.workers < 1:
        raise ConfigError(f"--workers(={args.workers}) must be >= 1")
    model_dir = args.model or default_model_dir()
    core = dataclasses.replace(core_options.core_config(args), history_window=args.history_window or None)
    cfg = EngineConfig(core, policy=args.policy, device=args.device, dtype=args.dtype, importance=args.importance)
    if ep:
        from pwgpu.ep_launch import rank_engine

        return model_dir, rank_engine(model_dir, cfg)
    return model_dir, Engine(model_dir, cfg)


def build(args: argparse.Namespace, ep: bool = False):
    """(engine thread, FastAPI app) from parsed arguments; ``ep``: rank 0 of ``--ep N``."""
    from pagedweight.config.scenario import parse_bytes
    from pwgpu.engine_thread import EngineThread
    from pwgpu.server import ServerSettings, build_app
    from pwgpu.tokenizer import Tokenizer

    model_dir, engine = _engine(args, ep)
    try:
        tokenizer = Tokenizer(model_dir)
    except Exception:  # no tokenizer.json: token-id prompts only
        tokenizer = None
    max_len = engine.core.scheduler.config.max_model_len
    settings = ServerSettings(
        model_name=engine.model_dir.name, api_key=args.api_key, max_pending=args.max_pending,
        max_prompt_tokens=max_len - 1, max_tokens_limit=max_len - 1, max_body_bytes=parse_bytes(args.max_body_bytes),
        num_workers=args.workers,
    )  # fmt: skip
    runner = EngineThread(engine).start()
    return runner, build_app(runner, tokenizer, settings)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    if args.ep == 1:
        return _serve(args)
    from pagedweight.errors import ConfigError
    from pwgpu.default_model import default_model_dir
    from pwgpu.ep_launch import ep_backend, launch

    if args.ep < 1:
        raise ConfigError(f"--ep(={args.ep}) must be >= 1")
    backend = ep_backend(args.ep, args.model or default_model_dir(), args.device)
    launch(args.ep, backend, _rank, (args, backend), forward_signals=True)
    return 0


def _rank(rank: int, world: int, args: argparse.Namespace, backend: str) -> None:
    """One rank of ``pwgpu serve --ep N``. Only rank 0 heeds SIGTERM and SIGINT: it stops
    serving, then tells the others to stop (``pwgpu.ep_agree``), so no rank leaves a step half done."""
    from pwgpu.ep_launch import rank_device

    args = argparse.Namespace(**{**vars(args), "device": rank_device(rank, backend)})
    if rank == 0:
        _serve(args, ep=True)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _, engine = _engine(args, ep=True)
    engine.agreement.follow()


def _serve(args: argparse.Namespace, ep: bool = False) -> int:
    import uvicorn

    runner, app = build(args, ep)
    eng = runner.engine
    usage = eng.core.pool.usage()
    ranks = f" (rank 0 of {args.ep} expert-parallel ranks)" if ep else ""
    print(f"pwgpu serve: {eng.spec.name} ({eng.arch.family}) on {eng.device}{ranks}, policy {args.policy}, "
          f"{eng.core.pool.num_pages} pages of {eng.page_bytes} B: {usage}; http://{args.host}:{args.port}/v1",
          flush=True)  # fmt: skip
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it; exiting through SystemExit
    # instead of the default handler lets the results below be written.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the results short
        runner.stop()
        if eng.agreement is not None:
            eng.agreement.close()
        if args.out:
            eng.write_results(args.out)
            print(f"pwgpu serve: results in {args.out}", flush=True)
    return 0
