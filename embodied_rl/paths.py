"""Where the shipped configs and assets live, in a source checkout and in an installed wheel.

The repository keeps `configs/` and `assets/` at its root; the wheel installs them as
`embodied_rl/configs` and `embodied_rl/assets` (pyproject's package-dir mapping).
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"embodied_rl: cannot find the shipped '{name}' folder near {_PACKAGE}")


def config_dir() -> Path:
    return _find("configs")


def asset_dir() -> Path:
    return _find("assets")


def sim_dir(name: str) -> Path:
    """The venv `embodied-rl setup-sim <name>` makes for a simulator that needs its own packages
    (LIBERO): $EMBODIED_RL_SIMS/<name>, by default ~/.cache/embodied_rl/sims/<name> (under
    $XDG_CACHE_HOME when set)."""
    import os

    root = os.environ.get("EMBODIED_RL_SIMS")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(cache) / "embodied_rl" / "sims"
    return Path(root).expanduser() / name
