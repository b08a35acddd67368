"""ReMix on the language RL loop: replayed iterations, the KL-convex term, reincarnation, and a
run that resumes as if never stopped with its replay history and its reincarnated base."""

import os

import pytest
import torch
from safetensors.torch import load_file

from embodied_rl.cli import main
from embodied_rl.runs import read_metrics

from .test_lm_rl import RL, interrupt_at, metric_rows, sft_run  # noqa: F401 (sft_run: the fixture)

REMIX = ["algo=grpo", "lm.rl.steps=6", "lm.rl.checkpoint_every=2", "lm.rl.reuse_iterations=3", "lm.rl.kl_coef=0.1",
         "lm.rl.kl_convex=0.5", "lm.rl.reincarnate_at=3", "lm.rl.ent_coef=0.01"]


@pytest.mark.e2e
@pytest.mark.parametrize("stop_in", [3, 5])  # before the reincarnation (history saved) and after it (its base saved)
def test_an_interrupted_remix_run_resumes_as_if_never_stopped(sft_run, tmp_path, monkeypatch, stop_in):  # noqa: F811
    args = ["finetune", *RL, f"checkpoint={sft_run}", *REMIX]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main([*args, f"run_dir={straight}"]) == 0
    interrupt_at(monkeypatch, stop_in)
    assert main([*args, f"run_dir={interrupted}"]) == 130
    assert os.readlink(interrupted / "checkpoints" / "last") == str(stop_in - 1)
    monkeypatch.undo()
    assert main([*args, f"run_dir={interrupted}"]) == 0
    assert metric_rows(interrupted) == metric_rows(straight)
    weights = [load_file(run / "checkpoints" / "last" / "model.safetensors") for run in (straight, interrupted)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    train = [row for row in read_metrics(straight) if "train/reward" in row]
    # 4 prompts x 4 completions per iteration; up to two earlier iterations replayed until the
    # reincarnation after step 3, on-policy from step 4
    assert [row.get("train/replayed_completions", 0) for row in train] == [0, 16, 32, 0, 0, 0]
    assert all(row["train/completions"] == 16 for row in train)
    assert all(row["train/ratio_dev_first"] == 0 for row in train)  # against the weights before each update
    assert all("train/kl_precedent" in row for row in train)
    # the reincarnated base is the model of step 3: the KL to it starts again from 0 at step 4
    assert train[3]["train/kl_to_reference"] == 0 < train[2]["train/kl_to_reference"]


@pytest.mark.parametrize("extra, message", [
    (["lm.rl.kl_convex=0.5"], "lm.rl.kl_convex=0.5 weighs the KL loss term"),
    (["lm.rl.kl_convex=0.5", "lm.rl.kl_coef=0.1", "lm.rl.kl_in_reward=true"], "lm.rl.kl_convex=0.5 weighs"),
    (["lm.rl.reuse_iterations=0"], "lm.rl.reuse_iterations must be an integer >= 1"),
    (["lm.rl.reincarnate_at=1.5"], "lm.rl.reincarnate_at must be an integer >= 0"),
])
def test_remix_bad_input(sft_run, tmp_path, capsys, extra, message):  # noqa: F811
    assert main(["finetune", *RL, f"checkpoint={sft_run}", "algo=grpo", *extra, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
