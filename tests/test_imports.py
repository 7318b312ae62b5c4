"""The core stays pure: importing any of its modules must load neither torch, nor simpy, nor triton."""

import pkgutil
import sys

import pagedweight

import proc

CHECK = "import sys, {mods}; print([m for m in ('torch', 'simpy', 'triton') if m in sys.modules])"


def core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(pagedweight.__path__, "pagedweight."))


def test_every_core_module_is_covered():
    mods = core_modules()
    for sub in ("core", "policy", "workload", "config", "results"):
        assert f"pagedweight.{sub}" in mods
    assert len(mods) > 30


def test_core_imports_no_runtime():
    mods = ", ".join(core_modules())
    out = proc.run([sys.executable, "-c", CHECK.format(mods=mods)], quiet_s=3, check=True)
    assert out.stdout.strip() == "[]"


def test_plain_import_as_in_the_readme():
    out = proc.run([sys.executable, "-c", CHECK.format(mods="pagedweight")], quiet_s=3)
    assert out.returncode == 0 and out.stdout.strip() == "[]"
