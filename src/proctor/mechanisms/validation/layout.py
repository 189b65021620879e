"""Where a project's code under test is: the Python import root and its top-level packages and modules,
the Node package's name. Read from the tree's own files (capped, never followed through a symlink); it never
runs the project nor its tools.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from proctor.mechanisms.validation.capped import parse_toml, read_capped

NOT_PACKAGES = frozenset({"tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks",
                          "bench", "scripts", "tools", "build", "dist", "site-packages", "node_modules"})
NOT_MODULES = frozenset({"setup", "conftest", "noxfile", "fabfile", "tasks", "manage", "docs_conf"})


def _is_ident(name: str) -> bool:
    return name.isidentifier() and not name.startswith(".")


def python_layout(checkout: Path) -> tuple[Path | None, tuple[str, ...]]:
    """(import root, top-level packages/modules) of the Python project at `checkout`, or (None, ())."""
    py = parse_toml(read_capped(checkout / "pyproject.toml"))
    has_py = bool(py) or any((checkout / f).is_file() for f in ("setup.py", "setup.cfg"))
    if not has_py:
        return None, ()
    where = None
    tool = py.get("tool", {}) if isinstance(py.get("tool"), dict) else {}
    st = tool.get("setuptools", {}) if isinstance(tool.get("setuptools"), dict) else {}
    pk = st.get("packages")
    if isinstance(pk, dict) and isinstance(pk.get("find"), dict):
        w = pk["find"].get("where")
        if isinstance(w, list) and w and isinstance(w[0], str):
            where = w[0]
    pdir = st.get("package-dir")
    if isinstance(pdir, dict) and isinstance(pdir.get(""), str):
        where = pdir[""]
    cfg = read_capped(checkout / "setup.cfg") or b""
    if where is None and b"package_dir" in cfg and b"=src" in cfg.replace(b" ", b""):
        where = "src"
    if where is None and (checkout / "src").is_dir() and not (checkout / "src" / "__init__.py").exists():
        where = "src"
    root = (checkout / where) if where else checkout
    if not root.is_dir() or root.is_symlink():
        return None, ()
    names: list[str] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return root, ()
    for e in entries:
        if e.is_symlink():
            continue
        if e.is_dir() and _is_ident(e.name) and e.name not in NOT_PACKAGES and (
                (Path(e.path) / "__init__.py").is_file() or where):
            if where or (Path(e.path) / "__init__.py").is_file():
                names.append(e.name)
        elif e.is_file() and e.name.endswith(".py"):
            stem = e.name[:-3]
            if _is_ident(stem) and stem not in NOT_MODULES and not stem.startswith("test_") \
                    and not stem.endswith("_test"):
                names.append(stem)
    project = py.get("project", {}) if isinstance(py.get("project"), dict) else {}
    pname = project.get("name")
    if isinstance(pname, str):
        norm = pname.replace("-", "_").replace(".", "_").lower()
        if norm in names:  # the distribution's own package first: the one that matters
            names.remove(norm)
            names.insert(0, norm)
    return root, tuple(names[:20])


def node_package(checkout: Path) -> str | None:
    try:
        data = json.loads((read_capped(checkout / "package.json") or b"").decode("utf-8", "replace"))
    except ValueError:
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name and len(name) < 215 else None

