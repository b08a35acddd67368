"""Learned rewards (docs/rewards.md): reward models that judge a frame (plus the robot's state and
the instruction) for success and progress, trained here on labelled rollouts (`embodied-rl
train-reward`), and the training env of `finetune reward=model:PATH`, whose reward is theirs.

    model.py    the contract (`judge(frames, state, instruction) -> success_prob, progress`), the
                kinds (REWARD_MODELS) and checkpoints (config.json + model.safetensors)
    data.py     a collected dataset's reached states with success and progress pseudo-labels
    metrics.py  ROC-AUC, precision/recall at a threshold, Spearman, value-order correlation
    train.py    the training loop and the held-out scores
    env.py      LearnedReward (finetune's keys) and LearnedRewardEnv (the learner's env)
"""

from embodied_rl.rewards.env import KINDS, LearnedReward, LearnedRewardEnv, learned_reward_path
from embodied_rl.rewards.model import (
    REWARD_MODELS,
    CNNRewardModel,
    FiLMRewardModel,
    RewardOutput,
    load_reward_model,
    make_reward_model,
    save_reward_model,
)

__all__ = [
    "KINDS", "REWARD_MODELS", "CNNRewardModel", "FiLMRewardModel", "LearnedReward", "LearnedRewardEnv",
    "RewardOutput", "learned_reward_path", "load_reward_model", "make_reward_model", "save_reward_model",
]
