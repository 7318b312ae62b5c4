"""The command lines: help works, errors are one clear line with exit code 2, and a command
whose optional dependency is missing says so instead of breaking the others."""

import subprocess
import sys

import pytest

from pagedweight.cli_util import build_main


@pytest.mark.parametrize("prog", ["pwsim", "pwgpu"])
def test_help(prog):
    out = subprocess.run([sys.executable, "-m", f"{prog}.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage:" in out.stdout


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    from pwsim.cli import main

    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml does not exist" in err and "Traceback" not in err


def test_missing_optional_dependency(tmp_path, capsys, monkeypatch):
    mod = tmp_path / "needs_extra_cmd.py"
    mod.write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = build_main("demo", "demo", {"fancy": "needs_extra_cmd", "specs": "pwsim.commands.specs"})
    assert main(["fancy"]) == 2
    assert "module 'no_such_module_here' is not installed" in capsys.readouterr().err
    assert main(["specs"]) == 0
