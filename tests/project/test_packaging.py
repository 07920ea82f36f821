"""The wheel (and so the container image, which installs it) carries every package of the
source tree: pyproject lists them by hand, and an editable install would not notice one
missing (its finder maps the folders), so a new subpackage could work here and crash in
the image with ModuleNotFoundError."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"
