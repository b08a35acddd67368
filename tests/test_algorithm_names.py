"""The algorithm names are written once: `commands.finetune.ALGOS` (robot) and `lm.rl.ADVANTAGES`
(language). Every other list of them (configs/algo/, quickstart's overrides, the docs, the README)
is checked against those two here."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from embodied_rl.commands.finetune import ALGOS
from embodied_rl.lm.rl import ADVANTAGES
from embodied_rl.paths import config_dir

ROOT = Path(__file__).resolve().parent.parent


def test_every_algo_config_is_an_algorithm_and_every_algorithm_has_one():
    configs = {path.stem for path in (config_dir() / "algo").glob("*.yaml") if not path.stem.startswith("_")}
    assert configs == set(ALGOS) | set(ADVANTAGES)


def test_quickstart_has_an_override_entry_for_every_robot_algorithm():
    overrides = OmegaConf.load(config_dir() / "quickstart.yaml").finetune_overrides
    assert set(overrides) == set(ALGOS)


def test_the_docs_describe_every_algorithm():
    finetuning = (ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8")
    language = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    for name in ALGOS:
        assert f"`{name}`" in finetuning or f"algo={name}" in finetuning, f"docs/finetuning.md does not name algo={name}"
    for name in ADVANTAGES:
        assert re.search(rf"\b{name}\b", language), f"docs/language.md does not name algo={name}"


def test_the_readme_lists_the_language_algorithms():
    listed = re.search(r"finetune algo=([\w|]+)`", (ROOT / "README.md").read_text(encoding="utf-8")).group(1)
    assert listed.split("|") == list(ADVANTAGES)
