"""Learning-curve plots and the markdown report."""

import imageio.v2 as imageio

from embodied_rl.eval.report import (
    instruction_table,
    plot_curve,
    success_table,
    training_windows,
    video_links,
    write_report,
)


def overall(rate, n=10, has_success=True):
    return {
        "n_episodes": n,
        "success_rate": rate if has_success else None,
        "success_ci95": [max(0.0, rate - 0.2), min(1.0, rate + 0.2)] if has_success else None,
        "avg_sum_reward": 3.5,
        "sum_reward_ci95": [3.0, 4.0],
        "avg_episode_length": 42.0,
    }


def test_plot_curve_writes_a_png(tmp_path):
    rows = [{"step": s, "success_rate": s / 10, "lo": s / 20, "hi": s / 5} for s in range(5)]
    rows.append({"step": 7, "loss": 1.0})  # rows lacking a key are skipped for that series
    path = plot_curve(rows, "step", ["success_rate", "loss"], tmp_path / "plots" / "curve.png",
                      title="curve", bands={"success_rate": ("lo", "hi")})
    image = imageio.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_plot_curve_without_data_raises(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="no rows"):
        plot_curve([{"step": 1}], "step", "success_rate", tmp_path / "x.png")


def test_report_has_before_after_table_and_links(tmp_path):
    (tmp_path / "plots").mkdir()
    eval_info = {"per_episode": [
        {"episode": 0, "success": True, "return": 1.0, "length": 12, "video": "videos/episode_0.mp4"},
        {"episode": 1, "success": False, "return": 0.0, "length": 30, "video": None},
    ]}
    table = success_table({"pretrained": overall(0.3), "finetuned": {"overall": overall(0.8)},
                           "hopper": overall(0.0, has_success=False)})
    path = write_report(tmp_path, "Quickstart", [
        ("Success", table),
        ("Learning curve", f"![curve]({'plots/curve.png'})"),
        ("Videos", video_links(eval_info, tmp_path)),
    ])
    text = path.read_text()
    assert text.startswith("# Quickstart\n")
    assert "| pretrained | 30.0% | [10.0%, 50.0%] | 3.5 | [3, 4] | 42.0 | 10 |" in text
    assert "| finetuned | 80.0% | [60.0%, 100.0%] |" in text
    assert "| hopper | - | - | 3.5 |" in text
    assert "- [episode 0](videos/episode_0.mp4): success, 12 steps" in text
    assert "episode 1" not in text
    assert "## Learning curve" in text


def test_instruction_table_lines_up_each_instructions_success_across_evaluations():
    table = instruction_table({"start (step 0)": {"open the drawer": 0.3, "push the block": 1.0},
                               "fine-tuned (step 50)": {"push the block": 0.9, "stack the cubes": 0.55}})
    assert table.splitlines() == ["| instruction | start (step 0) | fine-tuned (step 50) |", "|---|---|---|",
                                  "| open the drawer | 30.0% | - |", "| push the block | 100.0% | 90.0% |",
                                  "| stack the cubes | - | 55.0% |"]


def test_training_windows_weigh_each_logging_row_by_its_episodes():
    rows = [{"step": 0, "eval/success_rate": 0.5},  # an evaluation row: no training episodes
            {"step": 100, "rollout/success_rate/push": 1.0, "rollout/episodes/push": 1,
             "rollout/success_rate/reach": 0.0, "rollout/episodes/reach": 3},
            {"step": 200, "rollout/success_rate/push": 0.5, "rollout/episodes/push": 4},
            {"step": 300, "rollout/success_rate/push": 0.0, "rollout/episodes/push": 2,
             "rollout/success_rate/reach": 1.0, "rollout/episodes/reach": 2}]
    columns = training_windows(rows, window=200)
    # steps 1-200: push 1 + 2 successes of 5, reach 0 of 3; 201-300: push 0 of 2, reach 2 of 2
    assert columns == {"0-200 (8 ep.)": {"(all)": 3 / 8, "push": 3 / 5, "reach": 0.0},
                       "200-300 (4 ep.)": {"(all)": 0.5, "push": 0.0, "reach": 1.0}}
    # the default span: about five of the logged steps, rounded up to one significant digit (300 / 5 -> 60)
    assert list(training_windows(rows)) == ["60-120 (4 ep.)", "180-240 (4 ep.)", "240-300 (4 ep.)"]
    assert list(training_windows([{**row, "step": 1000 * row["step"]} for row in rows], window=100_000)) == \
        ["0-100k (4 ep.)", "100k-200k (4 ep.)", "200k-300k (4 ep.)"]
    # a single-task run logs no episodes per instruction
    assert training_windows([{"step": 100, "rollout/success_rate": 1.0, "rollout/episodes": 3}]) == {}
