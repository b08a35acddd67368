"""RL on language tasks: the ratio before the first update, the robot and language GRPO paths
agree, and `finetune` end to end through the CLI (every algorithm, resume, eval)."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from embodied_rl import core
from embodied_rl.algos.common import read_best
from embodied_rl.cli import main
from embodied_rl.lm.rl import (
    RLConfig,
    completion_logprobs,
    compute_advantages,
    informative_groups,
    last_token_rewards,
    select,
)
from embodied_rl.lm.sampling import encode_prompt, left_pad, sample
from embodied_rl.runs import read_metrics

TINY = ["task=lm/addition", "task.digits=2", "lm.model.hidden_size=32", "lm.model.num_layers=1",
        "lm.model.num_heads=2", "lm.model.intermediate_size=64"]
RL = ["task=lm/addition", "task.digits=2", "lm.rl.prompts=4", "lm.rl.group_size=4", "lm.rl.eval_problems=8",
      "lm.rl.eval_every=0"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm_rl") / "sft"
    assert main(["pretrain", *TINY, "steps=30", "batch_size=32", "lm.lr=3e-3", "log_every=10", "eval_episodes=0",
                 f"run_dir={run_dir}"]) == 0
    return run_dir


def rl_config(**overrides):
    values = dict(steps=1, prompts=2, group_size=4, temperature=1.0, lr=1e-4, critic_lr=1e-4, update_epochs=1,
                  minibatches=1, clip_low=0.2, clip_high=0.2, dual_clip=3.0, loss_agg="token-mean",
                  normalize_std=True, kl_coef=0.0, kl_kind="k3", kl_in_reward=False, ent_coef=0.0,
                  dynamic_sampling=False, max_refills=0, gamma=1.0, lam=0.95, value_clip=None, max_grad_norm=1.0,
                  log_every=1, eval_every=0, eval_problems=1, checkpoint_every=0, hint_after=0.15, hint_samples=4,
                  reuse_iterations=1, kl_convex=1.0, reincarnate_at=None)
    values.update(overrides)
    algo = values.pop("algo", "grpo")
    return RLConfig.from_cfg(algo, values)


def test_ratio_is_exactly_one_before_the_first_update(sft_run):
    from embodied_rl.lm.model import load_model

    model, tokenizer = load_model(sft_run / "checkpoints" / "last")
    prompts = [encode_prompt(tokenizer, f"{a}+{a + 3}=") for a in range(12) for _ in range(4)]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    samples = sample(model.eval(), ids, mask, max_new_tokens=6, eos_id=tokenizer.eos_token_id,
                     pad_id=tokenizer.pad_token_id, temperature=1.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        old_logp = completion_logprobs(model, samples)["logp"]
    model.train()
    logp = completion_logprobs(model, samples)["logp"]  # the first minibatch, gradients on
    valid = samples.completion_mask.bool()
    assert torch.equal(torch.exp(logp.detach() - old_logp)[valid], torch.ones(int(valid.sum())))
    advantages = torch.randn(logp.shape[0])[:, None] * valid
    loss, info = core.policy_loss(logp, old_logp, advantages, valid, clip_low=0.2, clip_high=0.28)
    assert float(info["clipfrac"]) == 0 and float(info["approx_kl"]) == 0
    assert torch.allclose(loss, -advantages[valid].mean())
    # a minibatch of other rows sees the same log-probs up to rounding
    rows = torch.tensor([5, 1, 30, 2])
    part = completion_logprobs(model, select(samples, rows))["logp"].detach()
    assert torch.allclose(part[valid[rows]], old_logp[rows][valid[rows]], atol=1e-5)


def test_robot_and_language_grpo_paths_agree():
    torch.manual_seed(0)
    group_size, groups, length = 4, 3, 6
    n = group_size * groups
    scores = torch.tensor([1., 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])  # group 1 is all equal: no signal
    lengths = torch.randint(1, length + 1, (n,))
    mask = torch.arange(length)[None] < lengths[:, None]  # [B, L] token rows
    logp = -torch.rand(n, length)
    old_logp = logp + 0.1 * torch.randn(n, length)

    # The robot GRPO path (embodied_rl/algos/ppo.py): env rollouts [T, N], the episode return's
    # group advantage on every valid step, groups with one return for all masked out, token-mean
    # clipped loss with the symmetric clip.
    valid = mask.T.float()
    group_ids = torch.arange(n) // group_size
    advantages = core.group_advantages(scores, group_ids)
    per_group = scores.view(-1, group_size)
    informative = ((per_group.max(dim=1).values - per_group.min(dim=1).values) > 1e-6)[group_ids]
    valid = valid * informative.float()[None]
    robot_advantage = advantages[None].expand_as(valid) * valid
    robot_loss, robot_info = core.policy_loss(logp.T, old_logp.T, robot_advantage, valid, clip_low=0.2,
                                              clip_high=0.2, dual_clip=3.0)

    # The language GRPO path with dynamic sampling: the same groups kept, token rows [B, L].
    config = rl_config(clip_low=0.2, clip_high=0.2, dynamic_sampling=True)
    rows = informative_groups(scores, group_size).repeat_interleave(group_size)
    kept_ids = torch.arange(int(rows.sum()) // group_size).repeat_interleave(group_size)
    lm_advantage, _ = compute_advantages(config, last_token_rewards(scores[rows], mask[rows]), mask[rows], kept_ids)
    lm_loss, lm_info = core.policy_loss(logp[rows], old_logp[rows], lm_advantage, mask[rows],
                                        clip_low=config.clip_low, clip_high=config.clip_high,
                                        dual_clip=config.dual_clip, agg=config.loss_agg)

    assert torch.equal(lm_advantage, robot_advantage.T[rows])
    assert torch.equal(lm_loss, robot_loss)
    for key in ("clipfrac", "approx_kl"):
        assert torch.allclose(lm_info[key], robot_info[key])


def test_advantages_of_every_algorithm():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = last_token_rewards(scores, mask)
    assert rewards.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]]
    ids = torch.tensor([0, 0, 1, 1])
    grpo, _ = compute_advantages(rl_config(), rewards, mask, ids)
    assert torch.allclose(grpo[0, :3], torch.full((3,), 0.5 / (0.5 ** 0.5 + 1e-6)))  # (1 - 0.5) / std 0.707
    assert grpo[2].abs().max() == 0 and grpo[0, 3] == 0  # an all-correct group; the padding
    dr_grpo, _ = compute_advantages(rl_config(normalize_std=False), rewards, mask, ids)
    assert torch.allclose(dr_grpo[0, :3], torch.full((3,), 0.5))
    rloo, _ = compute_advantages(rl_config(algo="rloo"), rewards, mask, ids)
    assert torch.allclose(rloo[0, :3], torch.ones(3)) and torch.allclose(rloo[1, :2], -torch.ones(2))
    reinforce, _ = compute_advantages(rl_config(algo="reinforce_pp", group_size=1), rewards, mask, ids)
    expected = core.masked_whiten(core.discounted_returns(rewards, mask, 1.0), mask) * mask
    assert torch.equal(reinforce, expected)
    values = torch.rand(4, 4)
    ppo, returns = compute_advantages(rl_config(algo="ppo"), rewards, mask, ids, values)
    gae, gae_returns = core.masked_gae(rewards, values, mask, 1.0, 0.95)
    assert torch.equal(ppo, core.masked_whiten(gae, mask) * mask) and torch.equal(returns, gae_returns)


@pytest.mark.e2e
def test_finetune_resumes_exactly_and_evaluates(sft_run, tmp_path, capsys):
    args = ["finetune", *RL, f"checkpoint={sft_run}", "algo=grpo", "lm.rl.checkpoint_every=1",
            "lm.rl.ent_coef=0.01"]  # the entropy bonus makes every step change the weights
    assert main([*args, "lm.rl.steps=4", f"run_dir={tmp_path / 'straight'}"]) == 0
    assert main([*args, "lm.rl.steps=2", f"run_dir={tmp_path / 'resumed'}"]) == 0
    assert main([*args, "lm.rl.steps=4", f"run_dir={tmp_path / 'resumed'}"]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out
    assert re.search(r"^pass@1: [\d.]+% \[[\d.]+, [\d.]+\] -> [\d.]+% \[[\d.]+, [\d.]+\]$", out, re.M), out
    straight = load_file(tmp_path / "straight" / "checkpoints" / "last" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "checkpoints" / "last" / "model.safetensors")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    base = load_file(sft_run / "checkpoints" / "last" / "model.safetensors")
    assert any(not torch.equal(base[k], straight[k]) for k in base)  # it trained
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/reward" in row]
    assert [row["step"] for row in train] == [1, 2, 3, 4]
    assert all(row["train/ratio_dev_first"] == 0 and row["train/approx_kl"] == 0 for row in train)
    last = tmp_path / "resumed" / "checkpoints" / "last"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "lm_task.json"):
        assert (last / name).is_file(), name
    assert "RL fine-tuning (grpo)" in (tmp_path / "resumed" / "report.md").read_text()
    assert main(["eval", "task=lm/addition", "task.digits=2", f"checkpoint={tmp_path / 'resumed'}",
                 "lm.problems=8", f"run_dir={tmp_path / 'eval'}"]) == 0
    assert json.loads((tmp_path / "eval" / "eval_info.json").read_text())["overall"]["n_problems"] == 8
    # another setting in the same run_dir is refused, nothing overwritten
    assert main([*args, "lm.rl.steps=5", "lm.rl.lr=1e-3", f"run_dir={tmp_path / 'resumed'}"]) == 2
    assert "holds a run with other settings" in capsys.readouterr().err


def metric_rows(run_dir):
    """The metrics rows without their timings (what a resumed run must repeat exactly)."""
    rows = [{key: value for key, value in row.items() if not key.endswith("_s")} for row in read_metrics(run_dir)]
    return [row for row in rows if len(row) > 1]


def interrupt_at(monkeypatch, call):
    """Make the `call`-th iteration of the language RL loop stop the run as a kill would."""
    from embodied_rl.lm import rl

    calls, original = [], rl.iteration

    def iteration(*args):
        calls.append(None)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(rl, "iteration", iteration)


@pytest.mark.e2e
def test_an_interrupted_run_resumes_as_if_never_stopped_and_keeps_its_best(sft_run, tmp_path, monkeypatch, capsys):
    # the logging window (3 steps) spans a checkpoint (every 2): it is saved with the checkpoint
    args = ["finetune", *RL, f"checkpoint={sft_run}", "algo=grpo", "lm.rl.steps=6", "lm.rl.eval_every=2",
            "lm.rl.checkpoint_every=2", "lm.rl.log_every=3", "lm.rl.ent_coef=0.01"]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main([*args, f"run_dir={straight}"]) == 0
    interrupt_at(monkeypatch, 5)  # killed in step 5: checkpoints/last holds step 4, step 3's row is written
    assert main([*args, f"run_dir={interrupted}"]) == 130
    assert os.readlink(interrupted / "checkpoints" / "last") == "4"
    monkeypatch.undo()
    assert main([*args, f"run_dir={interrupted}"]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out

    assert metric_rows(interrupted) == metric_rows(straight)
    assert [row["step"] for row in metric_rows(straight) if "train/reward" in row] == [3, 6]
    weights = [load_file(run / "checkpoints" / "last" / "model.safetensors") for run in (straight, interrupted)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    # checkpoints/best: the model of the best evaluation (ties to the later one), kept across the stop
    evaluations = [(row["step"], row["eval/pass@1"]) for row in read_metrics(straight) if "eval/pass@1" in row]
    assert [step for step, _ in evaluations] == [0, 2, 4, 6]
    best = read_best(straight / "checkpoints")
    assert (best["step"], best["pass@1"]) == max(evaluations, key=lambda e: (e[1], e[0]))
    assert read_best(interrupted / "checkpoints") == best
    assert json.loads((straight / "checkpoints" / "best" / "lm_task.json").read_text())["step"] == best["step"]
    assert f"best: {100 * best['pass@1']:.1f}% [" in out and f"] at step {best['step']}\n" in out
    # `eval` of it with best.json's problems and seed scores the number it was kept with
    assert main(["eval", "task=lm/addition", "task.digits=2", f"checkpoint={straight / 'checkpoints' / 'best'}",
                 f"lm.problems={best['problems']}", f"seed={best['seed']}", f"run_dir={tmp_path / 'eval'}"]) == 0
    assert json.loads((tmp_path / "eval" / "eval_info.json").read_text())["overall"]["pass@1"] == best["pass@1"]


@pytest.mark.e2e
def test_a_checkpoint_of_the_older_layout_evaluates_and_starts_a_run(sft_run, tmp_path, capsys):
    """A language checkpoint written before the loop ran on FinetuneLoop (its own state.pt, no
    optimizers.pt) loads for eval and as checkpoint=; resuming it is refused in one line, and the
    checkpoint stays where it is."""
    old = tmp_path / "old"
    args = ["finetune", *RL, "algo=grpo"]
    assert main([*args, f"checkpoint={sft_run}", "lm.rl.steps=1", f"run_dir={old}"]) == 0
    state = old / "checkpoints" / "1" / "training_state"
    torch.save({"step": 1, "problems_drawn": 4, "optimizer": {}, "generator": torch.Generator().get_state(), "rng": {}},
               state / "state.pt")
    (state / "optimizers.pt").unlink()
    (state / "counters.json").write_text(json.dumps({"step": 1, "problems_drawn": 4}))
    assert main(["eval", "task=lm/addition", "task.digits=2", f"checkpoint={old}", "lm.problems=4",
                 f"run_dir={tmp_path / 'eval'}"]) == 0
    assert main([*args, f"checkpoint={old}", "lm.rl.steps=1", f"run_dir={tmp_path / 'next'}"]) == 0
    capsys.readouterr()
    assert main([*args, f"checkpoint={sft_run}", "lm.rl.steps=2", f"run_dir={old}"]) == 2
    err = capsys.readouterr().err
    assert "was written by an older version and cannot be resumed" in err.strip().splitlines()[-1]
    assert err.count("error:") == 1
    assert (old / "checkpoints" / "1" / "training_state" / "state.pt").is_file()  # not set aside


@pytest.mark.parametrize("extra", [
    ["algo=rloo", "lm.rl.loss_agg=seq-mean-token-sum", "lm.rl.update_epochs=2", "lm.rl.minibatches=2"],
    ["algo=reinforce_pp", "lm.rl.kl_coef=0.1", "lm.rl.kl_in_reward=true", "lm.rl.kl_kind=k1"],
    ["algo=ppo", "lm.rl.loss_agg=seq-mean-token-mean", "lm.rl.value_clip=0.2", "lm.rl.gamma=0.99"],
    ["algo=grpo", "lm.rl.normalize_std=false", "lm.rl.loss_agg=seq-mean-token-sum-norm", "lm.rl.kl_coef=0.1",
     "lm.rl.dynamic_sampling=true", "lm.rl.max_refills=2", "lm.rl.ent_coef=0.01", "lm.rl.clip_high=0.28",
     "lm.rl.temperature=0.7"],
])
@pytest.mark.e2e
def test_every_algorithm_runs(sft_run, tmp_path, extra):
    assert main(["finetune", *RL, f"checkpoint={sft_run}", "lm.rl.steps=2", *extra, f"run_dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/reward" in row]
    assert len(train) == 2
    if "lm.rl.minibatches=2" not in extra:  # one minibatch: the old log-probs are the first forward pass's
        assert all(row["train/ratio_dev_first"] == 0 for row in train if row["train/updated"])
    if "algo=ppo" in extra:
        assert all("train/value_loss" in row for row in train)
    if "lm.rl.kl_coef=0.1" in extra:
        assert all("train/kl_to_reference" in row for row in train if row["train/updated"])


@pytest.mark.parametrize("extra, message", [
    (["algo=residual_ppo"], "algo=residual_ppo does not apply to language tasks"),
    (["algo=grpo", "algo.group_size=4"], "algo.group_size does not apply to language tasks"),
    (["algo=grpo", "env_steps=5"], "env_steps= does not apply to language tasks"),
    (["algo=rloo", "lm.rl.group_size=1"], "lm.rl.group_size must be >= 2"),
    (["algo=grpo", "lm.rl.loss_agg=mean"], "lm.rl.loss_agg must be one of"),
    (["algo=grpo", "lm.rl.kl_kind=k9"], "lm.rl.kl_kind must be one of"),
    (["algo=grpo", "lm.rl.dual_clip=1.0"], "lm.rl.dual_clip must be a number > 1"),
])
def test_finetune_bad_input(sft_run, tmp_path, capsys, extra, message):
    assert main(["finetune", *RL, f"checkpoint={sft_run}", *extra, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_robot_finetune_refuses_language_algorithms(tmp_path, capsys):
    assert main(["finetune", "task=reach", "algo=rloo", "checkpoint=/x", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "unknown algo 'rloo'" in capsys.readouterr().err


@pytest.mark.e2e
def test_divergence_exits_3_and_checkpoints_last_stays_finite(sft_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["finetune", *RL, f"checkpoint={sft_run}", "algo=ppo", "lm.rl.steps=4", "lm.rl.lr=1e30", "lm.rl.critic_lr=1e30",
                 "lm.rl.checkpoint_every=1", f"run_dir={run_dir}"]) == 3
    err = capsys.readouterr().err
    # one line (transformers may log a deprecation notice of its own before it)
    assert err.strip().splitlines()[-1].startswith("error: training diverged at step") and err.count("error:") == 1
    assert " is not finite (" in err
    last = run_dir / "checkpoints" / "last"
    if last.exists():  # only finite weights are ever written
        assert all(torch.isfinite(t).all() for t in load_file(last / "model.safetensors").values())
    else:
        assert "no checkpoint was written" in err
