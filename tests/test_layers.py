"""The house (docs/INTERFACES.md): imports point down only (surfaces -> services -> mechanisms -> contract),
no module imports itself back through others, and src/proctor holds no loose module but the face, the
contract and the home. Drawn from the code's own imports, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import proctor

ROOT = Path(proctor.__file__).resolve().parent
LAYER = {"surfaces": 3, "services": 2, "mechanisms": 1}


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the proctor modules it imports (a `from m import name` counts m.name when it is a module)."""
    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for mod, (path, package) in mods.items():
        base = mod if package else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                top = base
                for _ in range(node.level - 1):
                    top = top.rpartition(".")[0]
                src = (top + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                names = [src, *(f"{src}.{a.name}" for a in node.names)]
            else:
                continue
            found |= {resolve(n) for n in names if n.startswith("proctor")}
        edges[mod] = {t for t in found if t and t != mod}
    return edges


def layer(mod: str) -> int:
    parts = mod.split(".")
    return LAYER.get(parts[1], 0) if len(parts) > 1 else 0


def test_imports_point_down_only() -> None:
    edges = imports(modules())
    assert len(edges) > 100, "the walk found too few modules to mean anything"
    up = sorted(f"{a} -> {b}" for a, bs in edges.items() if a != "proctor" for b in bs if layer(b) > layer(a))
    assert up == []


def test_no_module_circles() -> None:
    edges = imports(modules())
    # A package's members may import its face (__init__); the face importing them is not a circle.
    graph = {a: {b for b in bs if not a.startswith(b + ".")} for a, bs in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(n: str) -> None:  # Tarjan's strongly connected components
        index[n] = low[n] = len(index)
        stack.append(n)
        on.add(n)
        for w in graph.get(n, ()):
            if w not in index:
                visit(w)
                low[n] = min(low[n], low[w])
            elif w in on:
                low[n] = min(low[n], index[w])
        if low[n] == index[n]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == n:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for n in sorted(graph):
        if n not in index:
            visit(n)
    assert circles == []


def test_the_checker_sees_an_import_that_points_up(tmp_path: Path) -> None:
    """The control: the same walk over a planted module that reaches up reports it."""
    planted = tmp_path / "proctor" / "mechanisms"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text("from proctor.surfaces.cli import main\n")
    mods = {**modules(), "proctor.mechanisms.bad": (planted / "bad.py", False)}
    assert "proctor.surfaces.cli" in imports(mods)["proctor.mechanisms.bad"]


def test_no_loose_module_in_the_package_root() -> None:
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "contract.py", "home.py"]
