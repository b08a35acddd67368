"""A multi-task fine-tuning run's training episodes per instruction, by spans of env steps.

Reads a run directory's metrics.jsonl (finished or still running) and prints the training
rollouts' success rate per instruction and over all of them for each span of `--window` env
steps, each logging row weighted by its episodes: the table report.md holds at the end of a run,
and the "training episodes" column of docs/BENCHMARKS.md's RL rows.

    python benchmarks/training_windows.py runs/vla_libero_retry_k10/dsrl_na_utd20 --window 20000

The last line printed is one JSON object: {span label: {instruction: rate}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from embodied_rl.eval.report import instruction_table, training_windows
from embodied_rl.runs import read_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finetune run directory")
    parser.add_argument("--window", type=int, default=None,
                        help="env steps per span (default: a round size that makes about five)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir} has no metrics.jsonl: not a run directory", file=sys.stderr)
        return 2
    try:
        columns = training_windows(read_metrics(args.run_dir), window=args.window)
    except ValueError as error:  # a window below one env step
        print(f"error: --{error}", file=sys.stderr)
        return 2
    if not columns:
        print(f"error: {args.run_dir} logged no training episodes per instruction (a single-task run, or no "
              "episode ended yet)", file=sys.stderr)
        return 2
    print(instruction_table(columns))
    print(json.dumps(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
