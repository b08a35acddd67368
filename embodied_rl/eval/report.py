"""Plots and a markdown report for a run: learning curves, before/after success tables, links.

Typical use (the quickstart does this):

    plot_curve(run.read_metrics(), "env_steps", ["success_rate"], run.file("plots", "curve.png"))
    write_report(run.path, "Quickstart: push_t", [
        ("Success", success_table({"pretrained": before["overall"], "finetuned": after["overall"]})),
        ("Learning curve", image_link(run.file("plots", "curve.png"), run.path)),
        ("Videos", video_links(after, run.path)),
    ])
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embodied_rl.runs import atomic_write_bytes, atomic_write_text


def plot_curve(
    metrics_rows: Sequence[Mapping[str, Any]],
    x_key: str,
    y_keys: str | Sequence[str],
    path: str | Path,
    title: str | None = None,
    bands: Mapping[str, tuple[str, str]] | None = None,
) -> Path:
    """Plot `y_keys` against `x_key` from metrics rows (e.g. metrics.jsonl lines) to a PNG.

    Rows without a key are skipped for that series, so rows logged by different loops can be
    mixed. `bands` maps a y key to (low_key, high_key) columns drawn as a shaded interval.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y_keys = [y_keys] if isinstance(y_keys, str) else list(y_keys)
    bands = dict(bands or {})
    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    plotted = 0
    for key in y_keys:
        points = [(row[x_key], row[key]) for row in metrics_rows if _number(row.get(x_key)) and _number(row.get(key))]
        if not points:
            continue
        xs, ys = zip(*sorted(points))
        axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        plotted += 1
        if key in bands:
            low_key, high_key = bands[key]
            rows = [r for r in metrics_rows if all(_number(r.get(k)) for k in (x_key, low_key, high_key))]
            rows.sort(key=lambda r: r[x_key])
            if rows:
                axes.fill_between(
                    [r[x_key] for r in rows], [r[low_key] for r in rows], [r[high_key] for r in rows],
                    alpha=0.2,
                )
    if plotted == 0:
        plt.close(figure)
        raise ValueError(f"no rows hold both '{x_key}' and any of {y_keys}")
    axes.set_xlabel(x_key)
    axes.set_ylabel(y_keys[0] if len(y_keys) == 1 else "value")
    if title:
        axes.set_title(title)
    if plotted > 1 or bands:
        axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _pc(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def success_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table, one row per labelled eval (e.g. {"pretrained": overall, "finetuned": overall}).

    Takes the `overall` blocks of eval_info (or whole eval_info dicts). Reward-only tasks show
    "-" for success and rely on the return column with its interval.
    """
    lines = [
        "| policy | success | 95% CI (Wilson) | avg return | 95% CI (return) | avg length | episodes |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, result in results.items():
        overall = result.get("overall", result)
        ci = overall.get("success_ci95")
        success_ci = "-" if ci is None else f"[{_pc(ci[0])}, {_pc(ci[1])}]"
        ret_ci = overall.get("sum_reward_ci95")
        return_ci = "-" if ret_ci is None else f"[{ret_ci[0]:.3g}, {ret_ci[1]:.3g}]"
        lines.append(
            f"| {label} | {_pc(overall.get('success_rate'))} | {success_ci} | "
            f"{overall['avg_sum_reward']:.3g} | {return_ci} | {overall['avg_episode_length']:.1f} | "
            f"{overall['n_episodes']} |"
        )
    return "\n".join(lines)


def instruction_table(columns: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table of success per instruction (a multi-task suite's tasks), one column per
    labelled evaluation ({"start (step 0)": {instruction: rate}, ...}), rows in the order the
    instructions first appear; "-" where an evaluation had no episode of that instruction."""
    instructions = list(dict.fromkeys(text for rates in columns.values() for text in rates))
    lines = ["| instruction | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for text in instructions:
        lines.append(f"| {text} | " + " | ".join(_pc(rates.get(text)) for rates in columns.values()) + " |")
    return "\n".join(lines)


ALL_INSTRUCTIONS = "(all)"


def training_windows(rows: Sequence[Mapping[str, Any]], window: int | None = None,
                     windows: int = 5) -> dict[str, dict[str, float]]:
    """A multi-task run's training episodes by spans of env steps: for each span (`window` env
    steps, default a round size that makes about `windows` spans of the logged steps) the success
    rate per instruction and over all, each logging row weighted by its episodes
    (rollout/episodes/<instruction>). Columns are labelled with the span and its episodes, as
    instruction_table reads them; {} when no row counts episodes per instruction (one task)."""
    prefix, rates = "rollout/episodes/", "rollout/success_rate/"
    logged = [row for row in rows if any(key.startswith(prefix) for key in row)]
    if not logged:
        return {}
    last = max(int(row["step"]) for row in logged)
    if window is None:  # about `windows` spans, their size rounded up to one significant digit
        size = -(-last // windows)
        magnitude = 10 ** (len(str(size)) - 1)
        window = -(-size // magnitude) * magnitude
    if window < 1:
        raise ValueError(f"window must be >= 1 env step, got {window}")
    tallies: dict[int, dict[str, list[float]]] = {}  # span -> instruction -> [successes, episodes]
    for row in logged:
        span = tallies.setdefault(max(int(row["step"]) - 1, 0) // window, {})
        for key, episodes in row.items():
            if key.startswith(prefix) and episodes:
                text = key.removeprefix(prefix)
                for name in (ALL_INSTRUCTIONS, text):
                    tally = span.setdefault(name, [0.0, 0])
                    tally[0] += row[rates + text] * episodes
                    tally[1] += episodes
    columns = {}
    for index, span in sorted(tallies.items()):
        label = f"{_steps(index * window)}-{_steps(min((index + 1) * window, last))} ({span[ALL_INSTRUCTIONS][1]} ep.)"
        columns[label] = {text: successes / episodes for text, (successes, episodes) in span.items()}
    return columns


def _steps(step: int) -> str:
    return f"{step // 1000}k" if step >= 1000 and step % 1000 == 0 else str(step)


def relative_link(path: str | Path, base: str | Path) -> str:
    """`path` relative to the report's folder, with forward slashes (markdown links)."""
    try:
        return Path(os.path.relpath(Path(path).resolve(), Path(base).resolve())).as_posix()
    except ValueError:  # different drives on Windows
        return Path(path).as_posix()


def image_link(path: str | Path, base: str | Path, alt: str | None = None) -> str:
    return f"![{alt or Path(path).stem}]({relative_link(path, base)})"


def video_links(eval_info: Mapping[str, Any], base: str | Path, video_root: str | Path | None = None) -> str:
    """A markdown list linking each recorded episode's video with its outcome.

    Video paths in eval_info are taken relative to `video_root` (default: `base`) when relative.
    """
    root = Path(video_root if video_root is not None else base)
    items = []
    for episode in eval_info.get("per_episode", []):
        if not episode.get("video"):
            continue
        video = Path(episode["video"])
        video = video if video.is_absolute() else root / video
        if episode.get("success") is None:
            outcome = f"return {episode['return']:.3g}"
        else:
            outcome = "success" if episode["success"] else "fail"
        items.append(
            f"- [episode {episode['episode']}]({relative_link(video, base)}): {outcome}, "
            f"{episode['length']} steps"
        )
    return "\n".join(items) if items else "_no videos recorded_"


def write_report(
    run_dir: str | Path,
    title: str,
    sections: Sequence[tuple[str, str]] | Mapping[str, str],
    name: str = "report.md",
) -> Path:
    """Write `<run_dir>/<name>`: a `# title` and one `## heading` per (heading, markdown) section."""
    items = sections.items() if isinstance(sections, Mapping) else sections
    parts = [f"# {title}", ""]
    for heading, body in items:
        parts += [f"## {heading}", "", body.rstrip(), ""]
    path = Path(run_dir) / name
    atomic_write_text(path, "\n".join(parts))
    return path


def learning_curve(rows: Sequence[Mapping[str, Any]], path: str | Path, base: str | Path, title: str) -> str:
    """Plot a fine-tuning run's evaluations (success rate with its Wilson band, else the return)
    against env steps to `path`; the markdown that shows it, or a note when nothing was evaluated."""
    key = "eval/success_rate" if any("eval/success_rate" in row for row in rows) else "eval/return"
    try:
        plot_curve(rows, "step", [key], path, title=title,
                   bands={"eval/success_rate": ("eval/success_rate_low", "eval/success_rate_high")})
    except ValueError:
        return "_no evaluation was logged (eval_every=0)_"
    return (image_link(path, base, "learning curve") + "\n\nx: env steps of RL; step 0 is the starting policy. "
            "Shaded: 95% Wilson interval.")


def learned_reward_curve(rows: Sequence[Mapping[str, Any]], path: str | Path, base: str | Path) -> str:
    """Plot a learned-reward run's training episodes (reward=model:PATH): the success the
    reward model paid for against the simulator's, per logging window; the markdown that shows it."""
    plot_curve(rows, "step", ["train/learned_success_rate", "rollout/success_rate"], path,
               title="training episodes: learned vs true success")
    return (image_link(path, base, "learned vs true success") + "\n\nx: env steps. The learner is paid the "
            "learned success; the simulator's (rollout/success_rate) is what counts. A learned rate that rises "
            "while the true one falls is reward hacking: the policy games the reward model.")


def command_line() -> str | None:
    """The `embodied-rl ...` command line of this process, when it is the CLI."""
    import sys

    program = Path(sys.argv[0])
    if program.name == "embodied-rl" or (program.name == "__main__.py" and program.parent.name == "embodied_rl"):
        return " ".join(["embodied-rl", *sys.argv[1:]])
    return None


def run_section(tensorboard: bool = False, **wall_s: float | None) -> str:
    """Markdown: the command that made the run (when it came from the CLI), its resolved config,
    wall times (`name=seconds`) and (`tensorboard`) where its scalars are."""
    lines = []
    command = command_line()
    if command:
        lines.append(f"- command: `{command}`")
    lines.append("- resolved config: [config.yaml](config.yaml)")
    lines += [f"- {name.replace('_', ' ')}: {seconds:.1f} s" for name, seconds in wall_s.items() if seconds is not None]
    if tensorboard:
        lines.append("- every logged scalar: metrics.jsonl; in TensorBoard: `tensorboard --logdir <run_dir>/tb`")
    return "\n".join(lines)

