"""Block sizes of the MoE kernel, kept as data: ``configs/<device>.json`` holds tuned entries
keyed ``"<precision>,<N>,<K>,<m bucket>"``; ``configs/default.json`` the fallback per precision
family and tokens-per-expert bucket. Each value is ``[BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
num_stages, split_k]`` (split_k optional, default 1; used by the down projection only).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pagedweight.core.spec import get_precision

CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # K slices of the down projection (atomic fp32 adds); 1 = none

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}(={v}) must be a power of two >= 16 (tl.dot's smallest tile)")
        if self.split_k < 1:
            raise ValueError(f"split_k(={self.split_k}) must be >= 1")


def device_key(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200': the file name of a device's tuned table."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def m_bucket(tokens_per_expert: int) -> int:
    return next((b for b in M_BUCKETS if b >= tokens_per_expert), M_BUCKETS[-1])


@cache
def _load(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _family(precision: str) -> str:
    bits = get_precision(precision).weight_bits
    return "16bit" if bits == 16 else ("8bit" if bits == 8 else "subbyte")


def get_config(precision: str, n: int, k: int, tokens_per_expert: int, device_name: str = "cpu") -> BlockConfig:
    bucket = m_bucket(tokens_per_expert)
    tuned = _load(device_key(device_name)).get(f"{precision},{n},{k},{bucket}")
    if tuned is not None:
        return BlockConfig(*tuned)
    rows = _load("default")[_family(precision)]
    for limit, value in rows.items():
        if limit == "max" or bucket <= int(limit):
            return BlockConfig(*value)
    raise AssertionError("default.json must end each family with a 'max' row")
