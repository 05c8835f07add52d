"""The module map in docs/design.md ("The package") is the import order: each module imports only modules above
it in that table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def map_order() -> list[str]:
    """The modules and packages of the table under "The package" in docs/design.md, top to bottom."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("### The package: `forge_load/`"):]
    section = section[:section.index("\n#")]
    return re.findall(r"^\| `forge_load/([a-z_]+)(?:\.py|/)` \|", section, re.M)  # a module, or a package


def imports_of(path: Path) -> set[str]:
    """forge_load modules this file imports, lazy and type-checking imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forge_load."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "forge_load":
            found.update(alias.name for alias in node.names if alias.name != "__version__")
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("forge_load."))
    return found


def sources(name: str) -> list[Path]:
    """A module's file, or every file of a package."""
    package = ROOT / "forge_load" / name
    return sorted(package.glob("*.py")) if package.is_dir() else [ROOT / "forge_load" / f"{name}.py"]


def test_the_map_lists_every_module_once() -> None:
    modules = sorted([p.stem for p in (ROOT / "forge_load").glob("*.py") if not p.stem.startswith("__")]
                     + [p.parent.name for p in (ROOT / "forge_load").glob("*/__init__.py")])
    assert sorted(map_order()) == modules


def test_every_import_points_up_the_map() -> None:
    order = {name: i for i, name in enumerate(map_order())}
    upward = [(module, imported) for module in order for path in sources(module)
              for imported in imports_of(path) if imported != module and order[imported] >= order[module]]
    assert upward == []
