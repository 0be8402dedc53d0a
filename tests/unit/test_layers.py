"""The layers point one way (README, "Development"; issue 11 item 4).

    sal_core      pure contracts (/stats schema, LARRY, policies, beta, percentile): stdlib only
    sal_gateway   the product; uses sal_core; never the engine patch, simulator or benchmarks
    engine_patch  the vLLM patch; uses sal_core; never the gateway, simulator or benchmarks
    engine_sim    emulator, simulator, demo, fake vLLM server; may use all of the above
    bench         benchmarks and experiments, on top

Every ``.py`` file of a package is parsed (not imported): ``import x``, ``from x import y``
(relative ones resolved), including imports under ``if TYPE_CHECKING:`` and inside functions,
and ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = frozenset({"sal_core", "sal_gateway", "engine_patch", "engine_sim", "bench", "tests"})

FORBIDDEN = {
    "sal_core": OURS - {"sal_core"},
    "sal_gateway": frozenset({"engine_patch", "engine_sim", "bench", "tests"}),
    "engine_patch": frozenset({"sal_gateway", "engine_sim", "bench", "tests"}),
    "engine_sim": frozenset({"bench", "tests"}),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name `source` (the text of `module`) imports, statically or by a literal
    ``import_module``/``__import__`` call."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                called in {"import_module", "__import__"}
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.add(first.value)
    return found


def _top_levels(path: Path) -> set[str]:
    module = _module_name(path)
    names = imported_modules(path.read_text(), module, is_package=path.name == "__init__.py")
    return {name.split(".")[0] for name in names if name}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"{package}: no source files found"
    violations = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in files
        for name in sorted(_top_levels(path) & FORBIDDEN[package])
    ]
    assert violations == []


def test_core_uses_the_standard_library_only() -> None:
    """sal_core must import without vLLM, FastAPI, httpx or numpy installed."""
    outside = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / "sal_core").rglob("*.py"))
        for name in sorted(_top_levels(path))
        if name not in sys.stdlib_module_names and name != "sal_core"
    ]
    assert outside == []


def test_the_scan_sees_every_form_of_import() -> None:
    """The checker itself: a violation in any of these forms would be caught."""
    source = """
from __future__ import annotations
from typing import TYPE_CHECKING
import engine_sim.emulator
from bench import tables
from . import sibling
from ..other import thing
if TYPE_CHECKING:
    from engine_patch.scheduler import LarryScheduler
def later():
    import importlib
    importlib.import_module("engine_sim.demo")
    __import__("bench.cli")
"""
    tops = {n.split(".")[0] for n in imported_modules(source, "sal_gateway.sub.mod") if n}
    assert {"engine_sim", "bench", "engine_patch", "importlib", "typing"} <= tops
    names = imported_modules(source, "sal_gateway.sub.mod")
    assert {"sal_gateway.sub.sibling", "sal_gateway.other.thing"} <= names
