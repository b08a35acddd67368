"""`embodied-rl pretrain` and `eval` on a language task, end to end through the CLI."""

import json
import re

import pytest

from embodied_rl.cli import main

TINY = ["task=lm/addition", "task.digits=2", "lm.model.hidden_size=32", "lm.model.num_layers=1",
        "lm.model.num_heads=2", "lm.model.intermediate_size=64", "batch_size=16", "log_every=2"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm") / "sft"
    assert main(["pretrain", *TINY, "steps=4", "eval_every=2", "eval_episodes=8", f"run_dir={run_dir}"]) == 0
    return run_dir


@pytest.mark.e2e
def test_pretrain_writes_a_hugging_face_checkpoint(pretrained):
    last = pretrained / "checkpoints" / "last"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "lm_task.json"):
        assert (last / name).is_file(), name
    assert (pretrained / "checkpoints" / "2" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [2, 4]
    assert [row["step"] for row in rows if "eval/pass@1" in row] == [2, 4]
    info = json.loads((pretrained / "eval_info.json").read_text())
    assert info["overall"]["n_problems"] == 8 and len(info["per_problem"]) == 8
    assert (pretrained / "report.md").read_text().startswith("# SFT: lm/addition")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(last)
    assert tokenizer.decode(tokenizer.encode("12+30=", add_special_tokens=False)) == "12+30="
    assert AutoModelForCausalLM.from_pretrained(last).config.hidden_size == 32


@pytest.mark.e2e
def test_eval_records_every_problem(pretrained, tmp_path, capsys):
    args = ["eval", "task=lm/addition", "task.digits=2", f"checkpoint={pretrained}", "lm.problems=6",
            "lm.samples=4", "lm.temperature=1.0"]
    assert main([*args, f"run_dir={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^pass@1: [\d.]+% \[[\d.]+, [\d.]+\]$", out, re.M) and "pass@4:" in out, out
    info = json.loads((tmp_path / "a" / "eval_info.json").read_text())
    overall = info["overall"]
    assert overall["n_problems"] == 6 and overall["samples"] == 4
    assert 0 <= overall["pass@1"] <= overall["pass@2"] <= overall["pass@4"] <= 1
    assert all(len(p["completions"]) == 4 and len(p["rewards"]) == 4 for p in info["per_problem"])
    assert 1 <= overall["mean_length"] <= 8
    # deterministic: the same seed gives the same completions
    assert main([*args, f"run_dir={tmp_path / 'b'}"]) == 0
    again = json.loads((tmp_path / "b" / "eval_info.json").read_text())
    assert again["per_problem"] == info["per_problem"]


@pytest.mark.parametrize("args, message", [
    (["pretrain", *TINY, "data=/x"], "data= does not apply to language tasks"),
    (["pretrain", *TINY, "policy=flow"], "policy= does not apply"),
    (["pretrain", *TINY, "lm.lr=0"], "lm.lr must be a number > 0"),
    (["pretrain", *TINY, "model=/does/not/exist"], "model directory '/does/not/exist' does not exist"),
    (["pretrain", *TINY, "task.max_new_tokens=100", "steps=1", "eval_episodes=2"], "does not fit the model's context"),
    (["eval", "task=lm/addition", "checkpoint=/nope"], "checkpoint '/nope' does not exist"),
    (["eval", "task=lm/addition", "checkpoint=/nope", "videos=2"], "videos= does not apply"),
    (["eval", "task=lm/addition", "checkpoint=/nope", "lm.samples=3"], "needs lm.temperature > 0"),
    (["finetune", "task=lm/addition", "checkpoint=/nope", "sampler_steps=4"], "sampler_steps is for denoising robot"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    assert main([*args, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_eval_refuses_a_model_without_weights_or_tokenizer(pretrained, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(pretrained / "checkpoints" / "last", broken)
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    assert main(["eval", "task=lm/addition", f"checkpoint={broken}", f"run_dir={tmp_path / 'r'}"]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
    (broken / "model.safetensors").unlink()
    assert main(["eval", "task=lm/addition", f"checkpoint={broken}", f"run_dir={tmp_path / 'r'}"]) == 2
    assert "has no weights" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_robot_commands_name_the_task_of_a_language_checkpoint(pretrained, tmp_path, capsys):
    for args in (["eval"], ["finetune", "task=reach"]):
        assert main([*args, f"checkpoint={pretrained}", f"run_dir={tmp_path / 'r'}"]) == 2
        assert "is a language model trained on lm/addition; pass task=lm/addition" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_sft_divergence_exits_3_and_checkpoints_last_stays_finite(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    run_dir = tmp_path / "sft"
    assert main(["pretrain", *TINY, "steps=4", "eval_every=1", "eval_episodes=0", "lm.lr=1e30", "lm.warmup_steps=0",
                 f"run_dir={run_dir}"]) == 3
    err = capsys.readouterr().err
    # one line (transformers may log a deprecation notice of its own before it)
    assert err.strip().splitlines()[-1].startswith("error: training diverged at step") and err.count("error:") == 1
    last = run_dir / "checkpoints" / "last"
    if last.exists():
        assert all(torch.isfinite(t).all() for t in load_file(last / "model.safetensors").values())
    else:
        assert "no checkpoint was written" in err


def test_a_truncated_model_file_is_one_line(pretrained, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(pretrained / "checkpoints" / "last", copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    assert main(["eval", "task=lm/addition", "task.digits=2", f"checkpoint={copy}", "lm.problems=2",
                 f"run_dir={tmp_path / 'eval'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: cannot load model") and err.count("error:") == 1
    assert "SafetensorError" in err
    assert not (tmp_path / "eval").exists()


def test_pretrain_on_a_fixed_problem_set_runs_epochs_over_it(tmp_path, capsys, monkeypatch):
    import embodied_rl.lm.sft as sft

    seen: list[list[str]] = []
    original = sft.training_batch
    monkeypatch.setattr(sft, "training_batch", lambda tokenizer, problems, prompts: (
        seen.append([p.key for p in problems]), original(tokenizer, problems, prompts))[1])
    args = ["pretrain", *TINY, "batch_size=5", "steps=4", "eval_episodes=0", "lm.sft_problems=10"]
    assert main([*args, f"run_dir={tmp_path / 'fixed'}"]) == 0
    assert "(10 fixed problems, 2.0 epochs)" in capsys.readouterr().out
    drawn = [key for batch in seen for key in batch]
    assert len(set(drawn[:10])) == 10 and set(drawn[10:]) == set(drawn[:10])  # each epoch is the whole set, once
    assert drawn[10:] != drawn[:10]  # in a new order
    assert main([*args[:-1], "lm.sft_problems=0", f"run_dir={tmp_path / 'bad'}"]) == 2
    assert "lm.sft_problems must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
