"""Scaf-GRPO: the tasks' tiered hints, the scaffolding of groups that all fail, SFT that teaches
the hints, and `finetune algo=scaf_grpo` end to end."""

import json
import random

import pytest
import torch

import embodied_rl.lm.rl as rl
from embodied_rl.cli import main
from embodied_rl.lm.model import char_tokenizer
from embodied_rl.lm.sampling import Samples, encode_prompt, left_pad
from embodied_rl.lm.tasks import AdditionTask, CountdownTask
from tests.lm.test_lm_rl import RL, TINY, rl_config


def test_addition_hints_carry_pattern_then_leading_digits():
    task = AdditionTask(digits=3)
    problem = task.sample(random.Random(0))
    a, b = (int(x) for x in problem.prompt[:-1].split("+"))
    assert (a, b) == (864, 394)  # the first draw of this seed
    # units 4+4=8: no carry; tens 6+9=15: carry; hundreds 8+3+1=12: carry
    assert [task.hinted_prompt(problem, tier) for tier in range(4)] == [
        "864+394=", "c110 864+394=", "c110 s1 864+394=", "c110 s125 864+394="]
    with pytest.raises(ValueError):
        task.hinted_prompt(problem, 4)


@pytest.mark.parametrize("low, high", [(0, 1), (2, 3), (3, 3)])
def test_addition_carry_filter_keeps_problems_with_that_many_carries(low, high):
    task = AdditionTask(digits=3, min_digits=3, min_carries=low, max_carries=high)
    rng = random.Random(0)
    for _ in range(200):
        problem = task.sample(rng)
        carries = task.hint(problem, 1)[1:].count("1")
        a, b = (int(x) for x in problem.prompt[:-1].split("+"))
        columns = sum((a // 10**c % 10 + b // 10**c % 10 + (1 if c and (a % 10**c + b % 10**c) >= 10**c else 0)) >= 10
                      for c in range(3))
        assert low <= carries <= high and carries == columns


def test_addition_carry_filter_bad_input():
    from embodied_rl.errors import UserError

    with pytest.raises(UserError, match="task.max_carries must be an integer in"):
        AdditionTask(digits=2, max_carries=3)
    with pytest.raises(UserError, match="task.min_carries must be <= task.max_carries"):
        AdditionTask(digits=3, min_carries=2, max_carries=1)


def test_countdown_hints_first_operation_then_skeleton():
    task = CountdownTask()
    rng = random.Random(3)
    for _ in range(50):
        problem = task.sample(rng)
        first, second, third = (task.hint(problem, tier) for tier in (1, 2, 3))
        assert second.startswith(first + " k")
        skeleton, filled = second.split(" k")[1], third[1:]
        # filling the skeleton's n's with the answer's numbers, left to right, gives the answer
        numbers = [int(x) for x in problem.answer.replace("(", " ").replace(")", " ").replace("+", " ")
                   .replace("-", " ").replace("*", " ").replace("/", " ").split()]
        rebuilt = skeleton
        for number in numbers:
            rebuilt = rebuilt.replace("n", str(number), 1)
        assert rebuilt == problem.answer
        assert filled.count("n") == 1 and filled.replace("n", str(numbers[-1])) == problem.answer
        assert first[1:] in problem.answer  # the first operation is written in the answer


def fake_sampler(task, tokenizer, solve_from_tier):
    """A `sample` that answers correctly exactly when the prompt carries a hint of tier >= solve_from_tier."""
    def fake(model, ids, mask, *, max_new_tokens, eos_id, pad_id, temperature, generator):
        rows = []
        for row, keep in zip(ids.tolist(), mask.tolist()):
            prompt = tokenizer.decode([t for t, k in zip(row, keep) if k], skip_special_tokens=True)
            hint = prompt.split(" ")[:-1]  # "c110 s1 864+394=" -> ["c110", "s1"]
            tier = 0 if not hint else 1 if len(hint) == 1 else 2 if len(hint[1]) == 2 else 3
            a, b = (int(x) for x in prompt.split(" ")[-1][:-1].split("+"))
            answer = str(a + b) if tier >= solve_from_tier else "0"
            rows.append(tokenizer.encode(answer, add_special_tokens=False) + [eos_id])
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        return Samples(ids, mask, completion, (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long())
    return fake


def test_scaffold_escalates_tiers_and_replaces_one_failed_completion(monkeypatch):
    tokenizer, task = char_tokenizer(), AdditionTask(digits=3, min_digits=3)
    problems = [task.sample(random.Random(seed)) for seed in range(3)]
    group = 4
    ids, mask = left_pad([encode_prompt(tokenizer, p.prompt) for p in problems for _ in range(group)],
                         tokenizer.pad_token_id)
    completion = torch.full((12, 2), tokenizer.pad_token_id)
    completion[:, 0] = tokenizer.eos_token_id
    samples = Samples(ids, mask, completion, torch.tensor([[1, 0]] * 12))
    score = torch.zeros(12)
    score[5] = 1.0  # problem 1 has a success of its own: not scaffolded
    monkeypatch.setattr(rl, "sample", fake_sampler(task, tokenizer, solve_from_tier=2))
    config = rl_config(algo="scaf_grpo", group_size=group, prompts=3, hint_samples=2)
    out, new_score, metrics = rl.scaffold(config, None, tokenizer, task, problems, samples, score,
                                          torch.Generator(), max_new_tokens=6)
    assert metrics == {"train/stuck_groups": 2 / 3, "train/hinted_groups": 2 / 3, "train/hint_tier": 2.0}
    assert new_score.tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1]  # the last row of groups 0 and 2
    texts = rl.decode_completions(tokenizer, out)
    for g in (0, 2):
        row = out.prompt_ids[4 * g + 3][out.prompt_mask[4 * g + 3].bool()]
        assert tokenizer.decode(row.tolist(), skip_special_tokens=True) == task.hinted_prompt(problems[g], 2)
        assert task.reward(problems[g], texts[4 * g + 3]) == 1.0
    unchanged = [r for r in range(12) if r not in (3, 11)]
    assert all(tokenizer.decode(out.prompt_ids[r][out.prompt_mask[r].bool()].tolist(), skip_special_tokens=True)
               == problems[r // 4].prompt for r in unchanged)
    # no tier helps: nothing replaced
    monkeypatch.setattr(rl, "sample", fake_sampler(task, tokenizer, solve_from_tier=4))
    out, same, metrics = rl.scaffold(config, None, tokenizer, task, problems, samples, score, torch.Generator(), 6)
    assert out is samples and torch.equal(same, score) and metrics["train/hinted_groups"] == 0.0


@pytest.mark.e2e
def test_sft_with_hints_and_scaf_grpo_end_to_end(tmp_path, monkeypatch):
    import embodied_rl.lm.sft as sft

    shown: list[str] = []
    original = sft.training_batch
    monkeypatch.setattr(sft, "training_batch", lambda tokenizer, problems, prompts: (
        shown.extend(prompts), original(tokenizer, problems, prompts))[1])
    sft_dir = tmp_path / "sft"
    assert main(["pretrain", *TINY, "steps=20", "batch_size=32", "lm.lr=3e-3", "eval_episodes=0", "lm.sft_hints=0.5",
                 f"run_dir={sft_dir}"]) == 0
    hinted = [p for p in shown if p.startswith("c")]
    assert 0.4 < len(hinted) / len(shown) < 0.6 and {p.count(" ") for p in hinted} == {1, 2}
    shown.clear()  # lm.sft_hint_tier: always that tier
    assert main(["pretrain", *TINY, "steps=2", "batch_size=8", "eval_episodes=0", "lm.sft_hints=1", "lm.sft_hint_tier=1",
                 f"run_dir={tmp_path / 'tier1'}"]) == 0
    assert len(shown) == 16 and all(p.startswith("c") and p.count(" ") == 1 for p in shown)
    run_dir = tmp_path / "rl"
    assert main(["finetune", *RL, f"checkpoint={sft_dir}", "algo=scaf_grpo", "lm.rl.steps=4", "lm.rl.hint_after=0.5",
                 f"run_dir={run_dir}"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {row["step"]: row for row in rows if "train/reward" in row}
    assert sorted(train) == [1, 2, 3, 4]
    assert all("train/stuck_groups" not in train[s] for s in (1, 2))  # the exemption period: no hints
    assert all("train/stuck_groups" in train[s] for s in (3, 4))
    assert all(row["train/ratio_dev_first"] == 0 for row in train.values() if row["train/updated"])


@pytest.mark.parametrize("args, message", [
    (["finetune", *RL, "checkpoint=/x", "algo=scaf_grpo", "lm.rl.dynamic_sampling=true"], "use one or the other"),
    (["finetune", *RL, "checkpoint=/x", "algo=scaf_grpo", "lm.rl.hint_after=1.5"], "lm.rl.hint_after must be in [0, 1]"),
    (["pretrain", *TINY, "lm.sft_hints=2"], "lm.sft_hints must be a number in [0, 1]"),
    (["pretrain", *TINY, "lm.sft_hints=1", "lm.sft_hint_tier=4"], "lm.sft_hint_tier=4: lm/addition has hint tiers 1..3"),
])
def test_scaf_grpo_bad_input(tmp_path, capsys, args, message):
    assert main([*args, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
