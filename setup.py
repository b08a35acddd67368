"""Packaging detail pyproject.toml cannot express: configs/ and assets/ sit at the repository
root but ship inside the wheel as the data packages embodied_rl.configs and embodied_rl.assets
(embodied_rl/paths.py finds them in either place). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup


def data_packages(package: str, folder: str) -> list[str]:
    root = Path(folder)
    return [package] + [
        f"{package}." + ".".join(path.relative_to(root).parts)
        for path in sorted(root.rglob("*"))
        if path.is_dir() and not path.name.startswith((".", "_"))
    ]


setup(
    packages=find_packages(include=["embodied_rl", "embodied_rl.*"])
    + data_packages("embodied_rl.configs", "configs")
    + data_packages("embodied_rl.assets", "assets"),
    package_dir={"embodied_rl.configs": "configs", "embodied_rl.assets": "assets"},
)
