"""evaluate() on a task with instructions (reach_choice): the agent sees the dict observations,
each record names its episode's instruction, and the overall block breaks success down by it."""

import torch

from embodied_rl.envs import make, make_expert
from embodied_rl.eval import evaluate
from embodied_rl.eval.evaluate import summarize

INSTRUCTIONS = ["reach the red target", "reach the blue target"]


def test_records_and_success_by_instruction():
    env = make("reach_choice", num_envs=8, seed=0, threads=1)
    expert = make_expert("reach_choice", env, generator=torch.Generator().manual_seed(0))
    seen = []
    act = expert.act

    def recording_act(obs):
        seen.append(obs)
        return act(obs)

    expert.act = recording_act
    result = evaluate(env, expert, episodes=16, seed=0, progress=False)
    env.close()
    assert all(set(obs) == {"state", "instruction"} for obs in seen)
    records = result["per_episode"]
    assert all(record["instruction"] in INSTRUCTIONS for record in records)
    by_instruction = result["overall"]["success_by_instruction"]
    assert set(by_instruction) == {record["instruction"] for record in records}
    assert sum(entry["n_episodes"] for entry in by_instruction.values()) == 16
    for text, entry in by_instruction.items():
        outcomes = [record["success"] for record in records if record["instruction"] == text]
        assert entry == {"n_episodes": len(outcomes), "n_success": sum(outcomes),
                         "success_rate": sum(outcomes) / len(outcomes)}
    # round 0's records match the instructions the envs drew at that round's reset
    obs, _ = make("reach_choice", num_envs=8, seed=0, threads=1).reset(seed=0)
    assert [records[i]["instruction"] for i in range(8)] == [INSTRUCTIONS[i] for i in obs["instruction"].tolist()]


def test_tasks_without_instructions_keep_their_report():
    records = [{"success": True, "return": 1.0, "max_reward": 1.0, "length": 3}]
    assert "success_by_instruction" not in summarize(records)
