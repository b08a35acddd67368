"""`embodied-rl tasks`: every registered task in one aligned table, no run directory."""

from embodied_rl.cli import main
from embodied_rl.envs import registry


def test_tasks_lists_every_task_with_its_columns(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0]
    assert header.split()[:3] == ["task", "gymnasium", "id"] and "success criterion" in header
    rows = {line.split()[0]: line for line in lines[1:len(registry.TASKS) + 1]}
    assert set(rows) == set(registry.TASKS)
    # aligned: every column starts at the same offset in every row
    start = header.index("max steps")
    for name, row in rows.items():
        task = registry.task_class(name)
        assert row[start:].split()[0] == str(task.max_episode_steps)
        assert registry.gym_id(name) in row and "mujoco_warp" in row
        assert task.success_criterion and row.endswith(task.success_criterion)
    assert rows["push_t"][header.index("expert"):].startswith("yes")
    # the number of instructions, and the texts of a language-conditioned task after the table
    assert rows["reach_choice"][header.index("instructions"):].split()[0] == "2"
    assert rows["reach"][header.index("instructions"):].split()[0] == "-"
    assert "reach_choice instructions: 0: 'reach the red target'; 1: 'reach the blue target'" in out
    assert "run_dir" not in out
    assert not any(tmp_path.iterdir())  # no run directory written


def test_tasks_refuses_options(capsys):
    assert main(["tasks", "backend=mujoco"]) == 2
    assert "backend" in capsys.readouterr().err


def test_tasks_lists_the_language_tasks_and_an_unknown_task_names_the_families(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "\nlm/addition " in out and "\nlm/countdown " in out
    assert main(["collect", "task=nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope' (choose from: " in err and "lm/<task>, metaworld/<task>" in err
