"""The command lines: help works, errors are one clear line with exit code 2, and a command
whose optional dependency is missing says so instead of breaking the others."""

import sys

import pytest

from pagedweight.cli_util import build_main

import proc


@pytest.mark.parametrize("prog", ["pwsim", "pwgpu"])
def test_help(prog):
    out = proc.run([sys.executable, "-m", f"{prog}.cli", "--help"], quiet_s=3)
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


def _bad(tmp_path):
    """Malformed inputs of several kinds, each with the words its error must contain."""
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    table = tmp_path / "kernels.csv"
    table.write_text('model,op\n"unclosed,moe_ffn\n')
    (tmp_path / "kernels.meta.yaml").write_text("device: x\n")
    scen = tmp_path / "table.yaml"
    cpu = (root / "scenarios" / "cpu_validate.yaml").read_text()
    scen.write_text(cpu.replace("../traces/kernels/cpu.csv", str(table)))
    imp = tmp_path / "imp.csv"
    imp.write_text("layer,expert,routing_freq,routing_weight_mass,importance,dloss_bf16,bytes_bf16\n"
                   "100000000,0,1,1,1,0,10\n")  # fmt: skip
    longctx = str(root / "scenarios" / "longctx.yaml")
    return [
        (["run", str(binary)], "not a text (UTF-8) file"),
        (["run", longctx, "--set", "memory.budget=1e999"], "finite number"),
        (["run", longctx, "--set", "seed=[unclosed"], "not valid YAML"),
        (["run", str(scen)], "not a CSV latency table"),
        (["importance", "check", str(imp)], "missing from a 100000001 x 1 table"),
        (["allocate", "--synthetic-model", "mixtral-8x7b", "--budget-fraction", "0.5", "--out",
          str(tmp_path / "no" / "p.csv")], "No such file or directory"),
    ]  # fmt: skip


def test_malformed_inputs_get_one_clear_line(tmp_path, capsys):
    from pwsim.cli import main

    for argv, words in _bad(tmp_path):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, (argv, code, err)
