"""The ``all_to_all`` op of the latency table (``pwgpu profile --ep N``): the expert-parallel
engine's token exchange (``pwgpu.ep``) timed on N ranks, for ``pwsim``'s EP steps.

N processes joined by ``pwgpu.ep.spawn_ranks`` (gloo on a CPU, NCCL with one GPU per rank)
each time ``torch.distributed.all_to_all_single`` of a uint8 buffer over a grid of sizes. The
engine's calls split a rank's rows by where their experts live; here every rank sends an equal
share to every rank (its own included, as the engine's calls do), so one size stands for one
exchange. A size is the table's ``bytes`` key: what each rank sends to the *other* ranks (and
receives from them), which is what the simulator computes for the busiest rank of a layer
(``pwsim.parallel``). Each sample starts after a barrier and ends when the call returns (on a GPU,
when the device is done); a sample's time is the slowest rank's, since an MoE layer waits for
every rank. The rows keep the median and the 20th/80th percentiles of those times.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedweight.config.kernel_table import KEY_COLUMNS
from pagedweight.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20
# Powers of four: on a GPU from a few KiB (latency-bound) to tens of MiB (a large prefill's
# dispatch); on a CPU gloo goes through loopback TCP at about 1 GB/s (benchmarks/RESULTS.md), so
# stop at 1 MiB to keep the run short.
A2A_BYTES = {
    "cuda": tuple(4 * KiB * 4**i for i in range(8)),  # 4 KiB .. 64 MiB
    "cpu": tuple(4 * KiB * 4**i for i in range(5)),  # 4 KiB .. 1 MiB
}
A2A_SAMPLES, A2A_WARMUP = 10, 3


def a2a_bytes_grid(device_type: str, largest_bytes: int | None = None) -> tuple[int, ...]:
    """The sizes measured: the device's default, or powers of four from 4 KiB up to
    ``largest_bytes`` (which ends the axis) when given."""
    if largest_bytes is None:
        return A2A_BYTES["cuda" if device_type == "cuda" else "cpu"]
    vals, v = [], 4 * KiB
    while v < largest_bytes:
        vals.append(v)
        v *= 4
    return (*vals, max(int(largest_bytes), 4 * KiB))


def check_world(world: int, device_type: str) -> str:
    """The process-group backend for ``world`` ranks on this device; a ConfigError when it
    cannot run here."""
    if world < 2:
        raise ConfigError(f"--ep {world}: the all-to-all needs 2 or more ranks")
    if device_type == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < world:
            raise ConfigError(
                f"--ep {world} on cuda needs {world} GPUs (one per rank) and this machine has {have}; "
                "use --device cpu for gloo ranks"
            )
        return "nccl"
    if device_type != "cpu":
        raise ConfigError(f"--ep: the all-to-all runs on cpu (gloo) or cuda (NCCL), not {device_type!r}")
    return "gloo"


def profile_all_to_all(
    world: int,
    device_type: str,
    sizes: tuple[int, ...],
    model_name: str,
    samples: int = A2A_SAMPLES,
    warmup: int = A2A_WARMUP,
) -> list[dict]:
    """Time the all-to-all of ``world`` ranks at each size; the latency-table rows."""
    backend = check_world(world, device_type)
    from pwgpu.ep import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="pwgpu-a2a-") as tmp:
        out = Path(tmp) / "times.json"
        args = (device_type, [int(s) for s in sizes], samples, warmup, str(out))
        spawn_ranks(world, _measure, args, str(Path(tmp) / "init"), backend)
        times_us = json.loads(out.read_text())  # per size: the slowest rank's time per sample
    rows = []
    for size, ts in zip(sizes, times_us, strict=True):
        sent = -(-size // (world - 1)) * (world - 1)  # the size rounded up to equal shares
        p20, p50, p80 = np.percentile(ts, [20, 50, 80])
        keys = {**dict.fromkeys(KEY_COLUMNS[3:], 0), "batch": world, "bytes": int(sent)}  # unused keys: 0
        rows.append(
            dict(model=model_name, op="all_to_all", precision="-", **keys, latency_us_p50=float(p50),
                 latency_us_p20=float(p20), latency_us_p80=float(p80), samples=samples)
        )  # fmt: skip
    return rows


def _measure(rank: int, world: int, device_type: str, sizes: list[int], samples: int, warmup: int, out: str) -> None:
    """One rank's part (in a process of ``spawn_ranks``): rank 0 writes every size's samples."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")

        def sync() -> None:
            pass

    # Gloo and NCCL set up their connections on first use: once at the largest size, untimed.
    warm = torch.ones(-(-max(sizes) // (world - 1)) * world, dtype=torch.uint8, device=device)
    dist.all_to_all_single(torch.empty_like(warm), warm)
    del warm
    result = []
    for size in sizes:
        share = -(-size // (world - 1))  # bytes to each rank; the rank's own share too
        src = torch.ones(share * world, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = []
        for i in range(warmup + samples):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_to_all_single(dst, src)
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result.append(slowest.cpu().tolist())
    if rank == 0:
        Path(out).write_text(json.dumps(result))
