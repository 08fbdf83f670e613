"""The package's imports: no cycle at run time, every deferred (function-local) import says why, and the modules that must stay light import no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "rlix"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported rlix module, line, inside a function) for every import that runs at some point
    (those under `if TYPE_CHECKING:` never do)."""
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(child)
                for alias in child.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in known else target, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_import_cycle_inside_the_package():
    mods = modules()
    known = set(mods)
    graph = {m: sorted({t for t, _, _ in runtime_imports(p, m, known) if t in known and t != m})
             for m, p in mods.items()}
    # a package's own submodules importing it back through its __init__ is how Python packages
    # work, not a cycle: drop edges from a module to the packages that contain it
    for m, targets in graph.items():
        graph[m] = [t for t in targets if not m.startswith(t + ".")]
    cycles = strongly_connected(graph)
    assert cycles == [], f"import cycles: {cycles}"


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_cycle_check_finds_a_cycle():
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_every_deferred_import_says_why():
    """A function-local import is allowed only to defer a heavy (or optional) import on purpose,
    and then carries a comment on its line or the line above saying so."""
    mods = modules()
    silent = []
    for name, path in mods.items():
        lines = path.read_text().splitlines()
        for _, lineno, in_function in runtime_imports(path, name, set(mods)):
            if not in_function:
                continue
            here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                silent.append(f"{path.relative_to(PKG.parent)}:{lineno}: {here.strip()}")
    assert silent == [], "function-local imports without a reason:\n" + "\n".join(sorted(set(silent)))


# Modules that must load without torch (or transformers), and why: each second of a torch import
# there is paid where it shows.
LIGHT = {
    # Ray loads an actor handle's class module in the process that receives it, before the
    # call runs: the scheduler receives a pipeline's handle with its registration (with torch
    # imported there every registration waited for it: 14 s measured at a GPU run's start)
    "rlix.pipeline.actor": "the scheduler imports it with every registration",
    # the driver of every `rlix run` (it computes nothing)
    "rlix.run": "every rlix run's driver",
}


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_light_modules_import_no_torch(module):
    import subprocess
    import sys

    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            f"assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"{module} ({LIGHT[module]}): {done.stderr[-500:]}"
