"""checkpoints/best (algos/common.py): the agent of the best periodic evaluation, ties to the
later one, kept through pruning and resume; the finetune headline prints it, and `eval` of it
scores the number it was kept with."""

import json
import os

import pytest
from omegaconf import OmegaConf

from embodied_rl.algos.common import EnvEvaluation, FinetuneLoop, read_best, write_best
from embodied_rl.cli import main
from embodied_rl.runs import Run, read_metrics
from tests.test_finetune_cli import TINY, checkpoints  # noqa: F401  (a module fixture)


class Scores(EnvEvaluation):
    """Evaluations that score `scores[step]`, without an env."""

    def __init__(self, cfg, run, scores):
        super().__init__(cfg, run, make_agent=None)
        self.scores = scores

    def __call__(self, step):
        rate = self.scores[step]
        info = {"overall": {"success_rate": rate, "success_ci95": [rate / 2, (1 + rate) / 2], "avg_sum_reward": rate,
                            "n_episodes": 4, "num_envs": 4, "seed": 12345}}
        return info, {"eval/success_rate": rate}


def loop_with_scores(run_dir, scores):
    """A FinetuneLoop whose evaluations score `scores[step]` and whose agent files record the
    env step they were written at."""
    cfg = OmegaConf.create({"env_steps": 1000, "checkpoint_every": 10, "log_every": 10, "save_replay": True,
                            "eval_every": 10})
    run = Run(run_dir, allow_existing=True)
    loop = FinetuneLoop(cfg, run, Scores(cfg, run, scores))

    def write_agent(directory):
        (directory / "agent.json").write_text(json.dumps({"written_at": loop.env_steps}))

    loop.resume({}, {}, write_agent)
    return loop


def run_to(loop, steps):
    """Evaluate and checkpoint at each of `steps`, as `boundary` does."""
    for step in steps:
        loop.counters["env_steps"] = step
        loop.evaluate(step)
        loop.save({})


def best_agent_step(run_dir):
    return json.loads((run_dir / "checkpoints" / "best" / "agent.json").read_text())["written_at"]


def test_the_best_evaluation_is_kept_ties_go_to_the_later_and_pruning_never_deletes_it(tmp_path):
    run_dir = tmp_path / "run"
    scores = {0: 0.5, 10: 0.75, 20: 0.25, 30: 0.5, 40: 0.5, 50: 0.75, 60: 0.5}
    loop = loop_with_scores(run_dir, scores)
    run_to(loop, [0, 10, 20, 30, 40])
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["20", "30", "40", "best", "last"]
    best = read_best(root)  # step 10's checkpoint was pruned; its agent lives on as best
    assert best == {"step": 10, "success_rate": 0.75, "success_ci95": [0.375, 0.875], "return": 0.75,
                    "episodes": 4, "num_envs": 4, "seed": 12345}
    assert best_agent_step(run_dir) == 10
    assert os.readlink(root / "best").startswith(".best.")  # one hidden directory, swapped by a symlink
    assert len(list(root.glob(".best.*"))) == 1
    run_to(loop, [50, 60])  # 0.75 again: the later one wins
    assert read_best(root)["step"] == 50 and best_agent_step(run_dir) == 50
    assert len(list(root.glob(".best.*"))) == 1
    loop.run.close()


def test_a_resumed_run_keeps_its_best(tmp_path):
    run_dir = tmp_path / "run"
    scores = {0: 0.5, 10: 0.75, 20: 0.25, 30: 0.5, 40: 0.75}
    first = loop_with_scores(run_dir, scores)
    run_to(first, [0, 10, 20])
    first.run.close()
    resumed = loop_with_scores(run_dir, scores)  # resumes from step 20
    assert resumed.env_steps == 20 and resumed.best["step"] == 10
    run_to(resumed, [30])  # below the best found before the stop
    assert read_best(run_dir / "checkpoints")["step"] == 10
    run_to(resumed, [40])
    assert read_best(run_dir / "checkpoints")["step"] == 40 and best_agent_step(run_dir) == 40
    resumed.run.close()


def test_a_kill_between_the_evaluation_and_its_best_is_made_good_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    scores = {0: 0.5, 10: 0.25, 20: 0.75}
    first = loop_with_scores(run_dir, scores)
    run_to(first, [0, 10])
    first.counters["env_steps"] = 20
    first.save({})  # the end of a run: its last checkpoint, then the final evaluation...
    first.evaluator.maybe_evaluate(20)  # ...writes eval_info.json, killed before its best was written
    first.run.close()
    resumed = loop_with_scores(run_dir, scores)
    resumed.start("finetune")  # the evaluation at step 20 is recalled, not run again
    assert read_best(run_dir / "checkpoints")["step"] == 20 and best_agent_step(run_dir) == 20
    resumed.run.close()


def test_a_write_cut_short_leaves_the_previous_best(tmp_path):
    write_best(tmp_path, {"step": 10, "return": 1.0}, lambda directory: None)

    def killed(directory):
        (directory / "agent.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_best(tmp_path, {"step": 20, "return": 2.0}, killed)
    assert read_best(tmp_path)["step"] == 10 and len(list(tmp_path.glob(".best.*"))) == 1


@pytest.mark.e2e
def test_finetune_prints_its_best_and_eval_of_it_scores_the_recorded_number(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    code = main(["finetune", "algo=residual_ppo", f"checkpoint={checkpoints / 'flow'}", "env_steps=160",
                 "eval_every=32", "checkpoint_every=32", "seed=3", f"run_dir={run_dir}", *TINY,
                 "algo.num_steps=8", "algo.actor_kwargs.hidden=16", "algo.actor_kwargs.action_scale=1.0"])
    out = capsys.readouterr().out
    assert code == 0, out
    evaluations = [(row["step"], row["eval/success_rate"], row["eval/return"])
                   for row in read_metrics(run_dir) if "eval/success_rate" in row]
    assert [step for step, _, _ in evaluations] == [0, 32, 64, 96, 128, 160]
    step, rate, ret = max(evaluations, key=lambda e: (e[1], e[0]))  # the highest rate, the later on ties
    best = read_best(run_dir / "checkpoints")
    assert (best["step"], best["success_rate"], best["return"]) == (step, rate, pytest.approx(ret))
    assert f"best: {100 * rate:.1f}% [" in out and f"] at env step {step}\n" in out
    assert f"best_checkpoint: {run_dir / 'checkpoints' / 'best'}" in out
    done = json.loads((run_dir / "done.json").read_text())["headline"]
    assert done["best"].endswith(f"at env step {step}")

    # the recorded seed, episodes and envs score the same episodes again
    code = main(["eval", f"checkpoint={run_dir / 'checkpoints' / 'best'}", f"seed={best['seed']}",
                 f"episodes={best['episodes']}", f"num_envs={best['num_envs']}", "videos=0",
                 f"run_dir={tmp_path / 'eval_best'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"checkpoint: {run_dir / 'checkpoints' / 'best'} (env step {step})" in out
    overall = json.loads((tmp_path / "eval_best" / "eval_info.json").read_text())["overall"]
    assert overall["success_rate"] == best["success_rate"] and overall["avg_sum_reward"] == pytest.approx(best["return"])

    # a run directory stands for its checkpoints/last, and the headline says so
    assert main(["eval", f"checkpoint={run_dir}", "episodes=2", "videos=0", f"run_dir={tmp_path / 'eval_last'}"]) == 0
    assert f"checkpoint: {run_dir / 'checkpoints' / 'last'} (env step 160)" in capsys.readouterr().out


def test_the_last_checkpoint_acts_with_what_the_final_evaluation_decided(tmp_path):
    """finish evaluates before it writes the last checkpoint, as boundary does: an evaluation may set what the
    agent acts with (residual TD3's judged reach), and checkpoints/last must agree with the number reported."""
    run_dir = tmp_path / "run"
    cfg = OmegaConf.create({"env_steps": 15, "checkpoint_every": 10, "log_every": 10, "save_replay": True,
                            "eval_every": 10})
    run = Run(run_dir, allow_existing=True)

    class Deciding(Scores):
        decided_at = None

        def __call__(self, step):
            self.decided_at = step
            return super().__call__(step)

    evaluation = Deciding(cfg, run, {0: 0.5, 15: 0.75})
    loop = FinetuneLoop(cfg, run, evaluation)
    loop.resume({}, {}, lambda directory: (directory / "agent.json").write_text(
        json.dumps({"decided_at": evaluation.decided_at})))
    loop.start("test")
    loop.counters["env_steps"] = 15
    headline = loop.finish(lambda: {})
    assert headline["success_rate"] == 0.75
    assert json.loads((run_dir / "checkpoints" / "last" / "agent.json").read_text()) == {"decided_at": 15}
    run.close()
