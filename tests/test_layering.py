"""The import layering (docs/architecture.md), read from the source without importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import embodied_rl
from embodied_rl.commands.finetune import ALGOS

PACKAGE = Path(embodied_rl.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every embodied_rl module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("embodied_rl.")}


def test_no_algorithm_imports_another():
    algorithms = set(ALGOS.values()) | {"embodied_rl.algos.bc"}
    for module in sorted(algorithms):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        others = imported_modules(path) & (algorithms - {module})
        assert not others, f"{module} imports the algorithm(s) {sorted(others)}; share code through algos/common.py or algos/offpolicy.py"
