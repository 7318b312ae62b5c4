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
def step():  # four 4 MiB temporaries, freed together, as an engine step's ops leave them
    a = x * 2.0; b = a + 1.0; c = b * 3.0; d = c - 1.0
    return float(d[0])
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
    # 16 MiB of temporaries is 4,096 pages a step: glibc's own settings give some or all of them
    # back (trim) and fault them in again every step (4,064 a step here; 506 with Triton's
    # interpreter loaded, which moves the heap); kept, a step faults none.
    assert faults_off > 200
    assert faults_on < 50
