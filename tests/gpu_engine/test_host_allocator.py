"""The host allocator settings: in force on glibc Linux, idempotent, off by the opt-out variable,
and they stop large temporaries from being mapped (and faulted in) afresh on every call."""

import os
import subprocess
import sys

import pytest

from pwgpu.host_allocator import OPT_OUT_ENV

CHILD = """
import resource, torch
torch.set_num_threads(1)
from pwgpu.host_allocator import keep_host_temporaries
on = keep_host_temporaries()
assert keep_host_temporaries() == on  # once per process, same answer
x = torch.ones(2**20)  # 4 MiB
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # eight 4 MiB temporaries alive at once, freed together, as a step's ops leave them
    t = [x * float(i) for i in range(8)]
    return float(sum(v[0] for v in t))
for _ in range(3):
    step()
before = faults()
for _ in range(20):
    step()
print(int(on), (faults() - before) / 20)
"""


def _child(env_extra: dict) -> tuple[bool, float]:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    on, faults = out.stdout.split()
    return on == "1", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_temporaries_reuse_memory_and_opt_out():
    on, faults_on = _child({OPT_OUT_ENV: "0"})
    off, faults_off = _child({OPT_OUT_ENV: "1"})
    assert on and not off
    # 32 MiB of temporaries is 8,192 pages a step: glibc's own settings give some or all of them
    # back (trim) and fault them in again every step (thousands a step; fewer with Triton's
    # interpreter loaded, which moves the heap); kept, a step faults (almost) none: 0 on a quiet
    # machine, ~100 seen under memory pressure from other processes.
    assert faults_off > 1000
    assert faults_on * 5 < faults_off
