"""`embodied-rl quickstart` end to end at tiny scale on `reach`, and its stage skipping."""

import json
import re

import pytest

from embodied_rl.cli import main

pytestmark = pytest.mark.e2e

# the shipped fine-tuner (residual TD3, what `make demo` runs), with stages short enough to reach actor updates
TINY = ["task=reach", "demos=6", "pretrain_steps=20", "finetune_env_steps=200",
        "finetune_num_envs=4", "finetune_eval_every=100", "finetune_eval_episodes=2", "eval_episodes=2", "videos=1",
        "finetune_overrides.residual_offpolicy=['algo.warmup_env_steps=40','algo.critic_only_steps=40','algo.batch_size=32','log_every=40']"]


def test_quickstart_writes_a_report_and_skips_finished_stages(tmp_path, capsys):
    run_dir = tmp_path / "qs"
    assert main(["quickstart", *TINY, f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^success: [\d.]+% \[[\d.]+, [\d.]+\] -> [\d.]+% \[[\d.]+, [\d.]+\]$", out, re.M), out
    report = (run_dir / "report.md").read_text()
    assert "| pretrained (flow BC) |" in report and "| fine-tuned (residual_offpolicy) |" in report
    assert "plots/learning_curve.png" in report and (run_dir / "plots" / "learning_curve.png").exists()
    assert "3_eval_pretrained/videos/episode_0.mp4" in report
    for stage in ("1_collect", "2_pretrain", "3_eval_pretrained", "4_finetune", "5_eval_finetuned"):
        assert (run_dir / stage / "config.yaml").exists()
    # finetune_overrides apply per algo: the ones given for residual_offpolicy reach its finetune stage
    assert "warmup_env_steps: 40" in (run_dir / "4_finetune" / "config.yaml").read_text()
    metrics = [json.loads(line) for line in (run_dir / "4_finetune" / "metrics.jsonl").open()]
    assert any(row.get("train/phase") == 2 for row in metrics)  # the actor was trained, not only warmed up
    info = json.loads((run_dir / "quickstart_info.json").read_text())
    assert info["before"]["n_episodes"] == 2 and info["after"]["n_episodes"] == 2

    for stage in ("", "1_collect", "2_pretrain", "3_eval_pretrained", "4_finetune", "5_eval_finetuned"):
        assert (run_dir / stage / "done.json").exists()  # written last by each command

    # a re-run after a kill during fine-tuning: finetune's periodic eval_info.json is no done-marker,
    # so the finetune stage resumes (and says so) and the last evaluation runs again
    for stage in ("2_pretrain", "4_finetune", "5_eval_finetuned"):
        (run_dir / stage / "done.json").unlink()
    assert main(["quickstart", *TINY, f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "resuming this run_dir: 1_collect done, 2_pretrain stopped at its checkpoint of step 20, " \
           "3_eval_pretrained done, 4_finetune stopped at its checkpoint of step 200, 5_eval_finetuned stopped" in out
    assert "collect: done already" in out and "resuming from step 20 of 20" in out
    assert "finetune -> " in out and "resuming from" in out
    assert "eval: stopped before its end last time; starting it again" in out


def test_quickstart_rejects_bad_counts(capsys):
    assert main(["quickstart", "demos=0"]) == 2
    assert "demos" in capsys.readouterr().err


def test_quickstart_refuses_a_finetune_that_never_trains_the_actor(tmp_path, capsys):
    run_dir = tmp_path / "qs"
    assert main(["quickstart", "finetune_env_steps=10000", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "env_steps=10000 ends before the actor's first update (algo.warmup_env_steps=5000 + " \
           "algo.critic_only_steps=10000" in err
    assert not run_dir.exists()
