"""Starting an expert-parallel group from a command (``pwgpu run --ep N``, ``pwgpu serve --ep N``).

The command checks what it can before anything starts (``ep_backend``: N divides the experts of
every MoE layer; on CUDA there is a GPU per rank, else gloo ranks on the CPU), then ``launch``
spawns the N rank processes (``pwgpu.ep.spawn_ranks``). Every rank builds the same engine over
its share of the experts (``rank_engine``); rank 0 leads and the others follow
(``pwgpu.ep_agree``). A project error on any rank (bad input, nothing fits) comes back as the
command's one-line error; the other ranks are stopped with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from pathlib import Path

from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.policies import PolicyInfeasible


def ep_backend(world: int, model_dir: str | Path, device: str | None) -> str:
    """The process group's backend for ``world`` ranks of ``model_dir`` on ``device`` (None:
    CUDA if there is any, else the CPU): ``nccl`` with a GPU per rank, ``gloo`` on the CPU."""
    import torch

    from pwgpu.arch_config import read_arch

    if world < 1:
        raise ConfigError(f"--ep(={world}) must be >= 1")
    experts = read_arch(model_dir).num_experts
    if experts % world:
        divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise ConfigError(
            f"--ep {world}: {model_dir} has {experts} routed experts per MoE layer, which do not split "
            f"across {world} ranks; allowed: {divisors}"
        )
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return "gloo"
    if kind != "cuda":
        raise ConfigError(f"--ep {world} --device {device}: expert parallelism runs on cpu or cuda")
    found = torch.cuda.device_count()
    if found < world:
        raise ConfigError(
            f"--ep {world} on CUDA needs {world} GPUs (one per rank); {found} found "
            "(--device cpu runs the ranks on the CPU)"
        )
    return "nccl"


def rank_device(rank: int, backend: str) -> str:
    """This rank's torch device: its own GPU under NCCL, else the CPU."""
    if backend != "nccl":
        return "cpu"
    import torch

    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def launch(world: int, backend: str, fn, args: tuple, forward_signals: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; returns when all are done. A project
    error on any rank is raised here as one ``PagedWeightError`` (the lowest rank's).
    ``forward_signals``: SIGTERM and SIGINT to this process become a SIGTERM to rank 0, which
    then stops the others in order (a server: ``pwgpu serve --ep N``)."""
    from pwgpu.ep import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="pwgpu-ep-") as tmp:
        ctx = spawn_ranks(world, _guarded, (fn, args, tmp), str(Path(tmp) / "init"), backend, join=False)

        def to_rank0(signum, frame) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ctx.processes[0].pid, signal.SIGTERM)

        caught = (signal.SIGTERM, signal.SIGINT) if forward_signals else ()
        before = {sig: signal.signal(sig, to_rank0) for sig in caught}
        try:
            while not ctx.join():
                pass
        except Exception:
            said = sorted(Path(tmp).glob("error.rank*"), key=lambda p: int(p.name[len("error.rank") :]))
            if said:
                raise PagedWeightError(said[0].read_text()) from None
            raise
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def _guarded(rank: int, world: int, fn, args: tuple, err_dir: str) -> None:
    try:
        fn(rank, world, *args)
    except (PagedWeightError, OSError) as e:
        where = "" if rank == 0 else f"expert-parallel rank {rank}: "
        (Path(err_dir) / f"error.rank{rank}").write_text(f"{where}{e}")
        raise SystemExit(2) from None


def rank_engine(model_dir, cfg, table=None, clock=None):
    """This rank's engine, agreeing with the other ranks (``pwgpu.ep_agree``), without prefix
    caching (each rank's cache could keep other blocks, so a prefix hit could differ). A policy
    that cannot run on some rank's budget is infeasible on all (``PolicyInfeasible`` everywhere,
    with the first such rank's reason)."""
    import dataclasses

    from pwgpu.engine import Engine
    from pwgpu.ep import EpGroup
    from pwgpu.ep_agree import Channel, attach

    group = EpGroup.current()
    cfg = dataclasses.replace(cfg, core=dataclasses.replace(cfg.core, prefix_caching=False))
    engine, why = None, None
    try:
        engine = Engine(model_dir, cfg, table, clock, ep=group)
    except PolicyInfeasible as e:
        why = str(e)
    import torch

    reasons = Channel(torch.device(cfg.device or "cpu")).gather(why)
    bad = [(r, w) for r, w in enumerate(reasons) if w is not None]
    if bad:
        r, w = bad[0]
        raise PolicyInfeasible(w if r == 0 else f"on expert-parallel rank {r}: {w}")
    attach(engine)
    return engine


def follow_policies(model_dir, base, policies, table=None, tables=None) -> None:
    """A following rank's part of ``pwgpu.offline.run_policies(..., ep=True)``: the same
    engines, in the same order, each stepping as rank 0 says until it is done."""
    import dataclasses

    for policy in policies:
        cfg = dataclasses.replace(base, policy=policy)
        try:
            engine = rank_engine(model_dir, cfg, (tables or {}).get(policy, table))
        except PolicyInfeasible:
            continue
        engine.agreement.follow()
        del engine
