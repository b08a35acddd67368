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


def layer_of(module: str) -> str:
    """The package layer a module belongs to: its first name below embodied_rl (algos, lm, cli, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_graph() -> dict[str, set[str]]:
    """layer -> the layers its modules import (lazy imports inside functions included)."""
    layers = {p.stem for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        targets = {layer_of(module) for module in imported_modules(path)} & layers
        graph.setdefault(source, set()).update(targets - {source, "__init__"})
    return graph


def test_no_import_cycle_between_layers():
    graph = layer_graph()
    for start in graph:  # walk from every layer; reaching it again is a cycle
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier:
            layer = frontier.pop()
            for target in graph.get(layer, ()):
                if target == start:
                    path = [layer]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    raise AssertionError(f"import cycle: {' -> '.join([*reversed(path), start])}")
                if target not in came_from:
                    came_from[target] = layer
                    frontier.append(target)


def test_only_the_command_line_imports_the_commands():
    for layer, targets in layer_graph().items():
        if layer not in ("cli", "commands", "__main__"):
            assert "commands" not in targets and "cli" not in targets, f"embodied_rl.{layer} imports the commands or the CLI"
