"""No import circle: no module of the product or of the CPU backend imports, at any depth, a module that imports it.

Read with ``ast`` from the source: every ``import`` and ``from ... import`` (at the top or inside a function:
a deferred import is still a dependency) and every ``importlib.import_module("literal")``. A package's
``__init__`` that an import passes through is not counted as imported (Python runs it, but the arrow a
reader follows is to the module named). Stdlib + pytest only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"verl_lrstab": ROOT / "verl_lrstab", "verl_lrstab_cpu": ROOT / "cpu_backend" / "verl_lrstab_cpu"}


def modules() -> dict[str, Path]:
    out = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported(module: str, path: Path, known) -> set[str]:
    """The modules of ``known`` that ``module`` (at ``path``) imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # ``from pkg import x``: the module ``pkg.x``, or ``pkg`` itself when x is a name it defines
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    out = set()
    for name in names:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):  # the longest prefix that is a module: a name imported from it is not one
            if ".".join(parts[:n]) in known:
                out.add(".".join(parts[:n]))
                break
    out.discard(module)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_finds_a_circle_and_passes_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_read_relative_deferred_and_by_name(tmp_path):
    path = tmp_path / "agentic.py"
    path.write_text("from .agentic_script import NAME\n"
                    "def later():\n    import importlib\n    from verl_lrstab_cpu import agentic_loop\n"
                    "    importlib.import_module('verl_lrstab_cpu.rollout')\n")
    known = {"verl_lrstab_cpu", "verl_lrstab_cpu.agentic_script", "verl_lrstab_cpu.agentic_loop",
             "verl_lrstab_cpu.rollout", "verl_lrstab_cpu.agentic"}
    assert imported("verl_lrstab_cpu.agentic", path, known) == {
        "verl_lrstab_cpu.agentic_script", "verl_lrstab_cpu.agentic_loop", "verl_lrstab_cpu.rollout"}


def test_the_graph_is_read():
    known = modules()
    graph = {m: imported(m, p, known) for m, p in known.items()}
    assert "verl_lrstab.guard.errors" in graph["verl_lrstab.guard.overrides"]
    assert "verl_lrstab_cpu.agentic_loop" in graph["verl_lrstab_cpu.agentic"]  # by name, when verl loads
    assert sum(map(len, graph.values())) > 100


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package):
    known = modules()
    graph = {m: imported(m, p, known) for m, p in known.items() if m.split(".")[0] == package}
    found = circles(graph)
    assert not found, "modules that import each other (move what both need into a module of its own):\n" + "\n".join(
        " <-> ".join(group) for group in found)
