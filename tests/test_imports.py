"""The core stays pure: importing it must load neither torch, nor simpy, nor triton."""

import subprocess
import sys

CHECK = "import sys, {mods}; print([m for m in ('torch', 'simpy', 'triton') if m in sys.modules])"


def test_core_imports_no_runtime():
    mods = ", ".join(
        f"pagedweight.{m}"
        for m in ("spec", "pool", "pagetable", "scheduler", "metrics", "scenario", "kernel_table", "step", "policy")
    )
    out = subprocess.run([sys.executable, "-c", CHECK.format(mods=mods)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plain_import_as_in_the_readme():
    out = subprocess.run([sys.executable, "-c", CHECK.format(mods="pagedweight")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]"
