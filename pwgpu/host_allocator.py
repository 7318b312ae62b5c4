"""Host allocator settings shared by the engine and the profiler: large temporaries are reused,
not handed back to the kernel after every op.

glibc's malloc serves a request above its mmap threshold (128 KiB at start, raised dynamically
up to 32 MiB as such blocks are freed) with a fresh ``mmap``, and every page of it faults on
first write. How far the threshold has risen depends on the process's history, so the same op
costs different times in different processes: measured on the 2-core VM, the CPU engine's
decode attention at 16 requests allocated ~12 MB of temporaries a layer from fresh mappings
(~3,000 page faults, 6-7 ms) where the profiler, whose threshold had risen, took 1.9 ms; a
batch-16 decode step cost 40 ms against 20 ms once both processes kept their temporaries. A
fixed threshold (and a trim threshold far above a step's peak) makes every process allocate a
step's temporaries from memory it already has, so both are faster and the profiler's latency
table times what the engine does.

Only the host heap changes: device memory (the page arena on a GPU) is untouched. Other
allocators (jemalloc or tcmalloc preloaded, musl) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a larger value is refused.
MMAP_THRESHOLD_BYTES = 32 * 2**20
# Free memory at the top of the heap is returned to the system only above this (a step's
# temporaries come and go every few milliseconds; giving them back costs the faults again).
TRIM_THRESHOLD_BYTES = 1 * 2**30
OPT_OUT_ENV = "PWGPU_KEEP_SYSTEM_MALLOC"

_configured: bool | None = None


def keep_host_temporaries() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once). Returns whether the
    settings are in force: False off Linux/glibc, or with ``PWGPU_KEEP_SYSTEM_MALLOC=1``."""
    global _configured
    if _configured is not None:
        return _configured
    _configured = False
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting the mmap threshold also stops its dynamic growth.
    _configured = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _configured
