"""The CLI's plumbing: help, config validation, run directories."""

import subprocess
import sys

import pytest

from embodied_rl.cli import COMMANDS, main
from embodied_rl.config import compose
from embodied_rl.errors import UserError


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("collect", "pretrain", "eval", "finetune", "quickstart"):
        assert command in out


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "embodied_rl.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "finetune" in result.stdout


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("tasks", "setup-sim")])  # these write no run dir
def test_every_command_composes_and_accepts_run_dir(command, tmp_path):
    cfg = compose(command, [f"run_dir={tmp_path / 'r'}"])
    assert cfg.run_dir == str(tmp_path / "r")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_unknown_key_is_one_line_exit_2(command, capsys):
    assert main([command, "no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "no_such_key" in err


def test_bad_value_type_names_the_key(capsys):
    assert main(["eval", "episodes=many"]) == 2
    err = capsys.readouterr().err.strip()
    assert "episodes" in err and "integer" in err


def test_unknown_task_lists_choices(capsys):
    assert main(["collect", "task=nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "push_t" in err


def test_unknown_command_exit_2(capsys):
    assert main(["fly"]) == 2
    assert "fly" in capsys.readouterr().err


def test_compose_rejects_bad_float():
    with pytest.raises(UserError, match="quality"):
        compose("collect", ["quality=high"])
