"""How one validation run is made to leave evidence: the host's pytest plugin, runner flags, no bytecode.

    instrument(plugin_dir, writable_dir, env) -> Instrument   lay the plugin out (a name of the host's
                                             making, outside the tree) and the env every step gets
    expects(argv) -> source | None           which runner a step is, when proctor can tell from its argv
    collect(instrument, argv, stdout, stderr) -> Evidence | None   read what the step's runner reported

    strip_bytecode(checkout[, tree]) -> count   remove every `.pyc`/`.pyo` and `__pycache__` of the tree

Why env and not argv for pytest: a repo's own command (`make test`, a script, tox) runs pytest somewhere
below, and PYTEST_ADDOPTS reaches it there too. Why strip bytecode: a planted unchecked-hash `.pyc` in
`__pycache__` is imported in place of its `.py`, and a sourceless `calc.pyc` without its `.py` (found in
review); the tree's bytecode is removed before each run and PYTHONDONTWRITEBYTECODE keeps one run from
leaving any for the next. Not PYTHONPYCACHEPREFIX: a fresh prefix recompiles pytest and every installed
module on every run (1.22x a 1,000-test run here, against 1.04x for the plugin alone: bench/evidence.py).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.evidence import readers

PLUGIN_SOURCE = Path(__file__).with_name("pytest_plugin.py")
MAX_REPORT = 64 * 1024 * 1024


@dataclass(frozen=True)
class Instrument:
    plugin_dir: Path  # host-owned, read-only to validation
    report: Path  # where the plugin appends; validation must be able to create it
    module: str
    env: Mapping[str, str]


def instrument(plugin_dir: Path, writable_dir: Path, env: Mapping[str, str]) -> Instrument:
    """`env` is what validation would otherwise get (its PYTHONPATH and PYTEST_ADDOPTS are kept)."""
    module = f"_proctor_evidence_{secrets.token_hex(8)}"
    report = writable_dir / f"{module}.jsonl"
    plugin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    writable_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    source = PLUGIN_SOURCE.read_text(encoding="utf-8")
    source = source.replace("REPORT = None  #", f"REPORT = {str(report)!r}  #", 1)
    target = plugin_dir / f"{module}.py"
    target.write_text(source, encoding="utf-8")
    os.chmod(target, 0o444)
    os.chmod(plugin_dir, 0o755)  # validation may run as the same user only; no one but the host writes it
    extra = {
        "PYTEST_ADDOPTS": " ".join(x for x in (env.get("PYTEST_ADDOPTS", ""), f"-p {module}") if x),
        # Last on the path: the name is unguessable, so order cannot let the tree shadow it, and the
        # tree's own import order (the validated root first) stays what the job environment made it.
        "PYTHONPATH": os.pathsep.join(x for x in (env.get("PYTHONPATH", ""), str(plugin_dir)) if x),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return Instrument(plugin_dir, report, module, extra)


BYTECODE = (".pyc", ".pyo")


def strip_bytecode(checkout: Path, tree: Iterable[str] | None = None) -> int:
    """Remove the tree's bytecode, beneath the checkout and following no link (it is the agent's tree).
    `tree`: the paths of every entry of the checkout, when the host just made it exactly a tree and knows
    them: the bytecode is picked from them, with no walk (100,000 files: 0.11 s less a job)."""
    removed = 0
    root_fd = beneath.open_root(checkout)
    try:
        if tree is not None:
            for rel in _bytecode_of(tree):
                beneath.rmtree(root_fd, rel)
                removed += 1
            return removed
        for dirpath, dirnames, filenames in os.walk(checkout, followlinks=False):
            rel = Path(dirpath).relative_to(checkout)
            for name in [d for d in dirnames if d == "__pycache__"]:
                beneath.rmtree(root_fd, str(rel / name))
                dirnames.remove(name)
                removed += 1
            for name in filenames:
                if name.endswith(BYTECODE):
                    beneath.unlink(root_fd, str(rel / name))
                    removed += 1
    finally:
        os.close(root_fd)
    return removed


def _bytecode_of(paths: Iterable[str]) -> list[str]:
    """The topmost `__pycache__` above each path that has one, and each other `.pyc`/`.pyo`: what the walk
    above removes, once each."""
    out: dict[str, None] = {}
    for path in paths:
        if "__pycache__" in path:
            parts = path.split("/")
            if "__pycache__" in parts:
                out["/".join(parts[:parts.index("__pycache__") + 1])] = None
                continue
        if path.endswith(BYTECODE):
            out[path] = None
    return list(out)


def expects(argv: Sequence[str]) -> str | None:
    """The evidence a step must leave when proctor knows its runner from the argv itself; None for a
    command proctor did not choose (which may still leave some: collect reads whatever is there)."""
    words = [Path(a).name for a in argv]
    if "pytest" in words or "py.test" in words:
        return "pytest"
    if words[:2] == ["go", "test"] and "-json" in words:
        return "go-json"
    if words[:2] == ["cargo", "test"]:
        return "libtest"
    return None


def _take_report(inst: Instrument) -> bytes:
    """The plugin's lines for the step that just ran, and the file gone, so the next step starts empty.
    Read with O_NOFOLLOW and capped: validation could have replaced it."""
    try:
        fd = os.open(inst.report, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_REPORT)
    except OSError:
        data = b""
    try:
        os.unlink(inst.report)
    except OSError:
        pass
    return data


def collect(inst: Instrument, argv: Sequence[str], stdout: bytes, stderr: bytes) -> readers.Evidence | None:
    report = _take_report(inst)
    kind = expects(argv)
    if kind == "pytest":
        return readers.read_pytest(report)
    if kind == "go-json":
        return readers.read_go_json(stdout)
    if kind == "libtest":
        return readers.read_libtest(stdout, stderr)
    return readers.read_any(report, stdout, stderr)
