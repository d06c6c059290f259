"""The package's imports follow its layering (docs/architecture.md): read from the source with
`ast`, every import counted wherever it sits (module level, inside a function, under
TYPE_CHECKING), so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import ddserve

PACKAGE = Path(ddserve.__file__).parent
ABOVE_THE_MODEL = ("ddserve.engine", "ddserve.actors", "ddserve.serve")


def _unit(module: str) -> str:
    """The top-level part a module belongs to: `ddserve.engine.runner` -> `ddserve.engine`."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n == "ddserve" or n.startswith("ddserve.")}


@cache
def _imports() -> dict[str, set[str]]:
    """ddserve module -> the ddserve modules it imports."""
    return {
        _module_name(p): _imported(ast.parse(p.read_text(), str(p))) for p in PACKAGE.rglob("*.py")
    }


def _unit_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, imported in _imports().items():
        edges[_unit(module)].update(_unit(m) for m in imported if _unit(m) != _unit(module))
    return edges


def _importers_of(unit: str, targets: tuple[str, ...]) -> list[str]:
    """`module imports target` lines for modules of `unit` importing any of `targets`."""
    return sorted(
        f"{module} imports {m}"
        for module, imported in _imports().items()
        if _unit(module) == unit
        for m in imported
        if _unit(m) in targets
    )


def test_the_model_imports_nothing_of_the_engine_or_serving():
    assert _importers_of("ddserve.model", ABOVE_THE_MODEL) == []


def test_the_model_config_imports_no_model_code():
    assert _importers_of("ddserve.config", ("ddserve.model",)) == []


def test_the_communicators_import_nothing_of_ddserve():
    assert _imports()["ddserve.distributed"] == set()


def test_drafters_import_nothing_of_the_engine_or_serving():
    assert _importers_of("ddserve.drafter", ABOVE_THE_MODEL) == []


def test_the_engine_imports_nothing_of_serving():
    assert _importers_of("ddserve.engine", ("ddserve.actors", "ddserve.serve")) == []


def test_no_import_cycle_between_top_level_parts():
    edges = _unit_edges()
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            cycle = path[path.index(unit) :] + [unit]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if unit in done:
            return
        for dep in sorted(edges.get(unit, ())):
            visit(dep, [*path, unit])
        done.add(unit)

    for unit in sorted(edges):
        visit(unit, [])


def test_the_layering_check_sees_lazy_imports():
    # ddserve/__init__.py imports the LLM inside a function: the check must count it
    assert "ddserve.engine.llm" in _imports()["ddserve"]
