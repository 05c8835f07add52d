"""The package's map in docs/design.md ("The package") against the code: every module listed once, in the order
of the layers that pyproject.toml declares to import-linter; and the benchmark's map ("The benchmark"): every module
of bench/ listed once. The imports themselves are checked by `lint-imports` (scripts/test.sh), against those
contracts, not here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "forge_load"
BENCH = ROOT / "bench"


def design_section(heading: str) -> str:
    """The text of docs/design.md's section `heading`, up to the next heading."""
    text = (ROOT / "docs" / "design.md").read_text()
    return re.split(r"^##", text[text.index(heading) + len(heading):], maxsplit=1, flags=re.M)[0]


def mapped() -> list[str]:
    """The modules and packages of the tables under "The package" in docs/design.md, top to bottom, as paths under
    forge_load/ ("control/policy.py", "podresources/")."""
    section = design_section("### The package: `forge_load/`")
    return re.findall(r"^\| `forge_load/([a-z_/]+\.py|[a-z_]+/)` \|", section, re.M)


def layers() -> list[str]:
    """The layers contract, bottom to top, each layer's modules as paths under forge_load/."""
    text = (ROOT / "pyproject.toml").read_text()  # read by hand: tomllib is not in Python 3.10
    (block,) = re.findall(r'^type = "layers"\nlayers = \[\n(.*?)^\]', text, re.M | re.S)
    return [[name.strip() for name in layer.split("|")] for layer in reversed(re.findall(r'"([^"]+)"', block))]


def layer_of(path: str, bottom_up: list[list[str]]) -> int:
    dotted = "forge_load." + path.removesuffix(".py").removesuffix("/").removesuffix("/__init__").replace("/", ".")
    for i, layer in enumerate(bottom_up):
        if any(dotted == name or dotted.startswith(name + ".") for name in layer):
            return i
    return len(bottom_up)  # above every layer: __main__.py, which only starts cli


def test_the_map_lists_every_module_once() -> None:
    generated = PACKAGE / "podresources"
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if generated not in p.parents and p.name != "__init__.py")
    assert sorted(m for m in mapped() if m != "podresources/") == modules
    assert "podresources/" in mapped()


def test_the_map_is_in_the_order_of_the_layers_contract() -> None:
    bottom_up = layers()
    order = [layer_of(path, bottom_up) for path in mapped()]
    assert order == sorted(order), list(zip(mapped(), order))


def test_every_package_is_in_a_layer() -> None:
    bottom_up = layers()
    packages = [p.parent.name + "/" for p in PACKAGE.glob("*/__init__.py")]
    assert [p for p in packages if layer_of(p, bottom_up) == len(bottom_up)] == []


def test_the_bench_map_lists_every_module_once() -> None:
    listed = re.findall(r"^\| `bench/([a-z_]+\.py)` \|", design_section("### The benchmark: `bench/`"), re.M)
    assert sorted(listed) == sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")
