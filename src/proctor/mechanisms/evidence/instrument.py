"""How one validation run is made to leave evidence, and how it is read back.

    instrument(plugin_dir, writable_dir, env[, select]) -> Instrument
                lay out the host's hooks (a name of the host's making, outside the tree, read-only to the run)
                and the env every step gets: pytest's plugin (PYTEST_ADDOPTS), unittest's hook (a
                `sitecustomize` on PYTHONPATH), node's runners' reporters (NODE_OPTIONS=--require), `go test -v`
                (GOFLAGS)
    collect(instrument, kinds, stdout, stderr, root) -> {kind: Evidence}
                read back what the step's runners left, kind by kind: every kind the host's channels hold
                and the stdout kinds named (`kinds` None: every host channel, for the base's own run)
    expects(argv) -> kind | None    the evidence a step of proctor's own choosing must leave
    strip_bytecode(checkout[, tree]) -> count   remove every `.pyc`/`.pyo` and `__pycache__` of the tree

Why env and not argv: a repo's own command (`make test`, a script, tox, `pnpm -r test`) runs the runner
somewhere below, and the environment reaches it there too. Why strip bytecode: a planted unchecked-hash
`.pyc` in `__pycache__` is imported in place of its `.py`, and a sourceless `calc.pyc` without its `.py`
(found in review); the tree's bytecode is removed before each run and PYTHONDONTWRITEBYTECODE keeps one
run from leaving any for the next. Not PYTHONPYCACHEPREFIX: a fresh prefix recompiles pytest and every
installed module on every run (1.22x a 1,000-test run here, against 1.04x for the plugin alone).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.evidence import readers

PLUGIN_SOURCE = Path(__file__).with_name("pytest_plugin.py")
PRELOAD_SOURCE = Path(__file__).with_name("node_preload.cjs")
MAX_REPORT = 64 * 1024 * 1024
MAX_NODE_REPORTS = 256
NODE_KINDS = ("vitest", "jest", "mocha")
MAX_NODE_BYTES = 64 * 1024 * 1024  # every node report of one step together
# The sitecustomize the host lays beside its plugin: the unittest hook, then whatever sitecustomize the
# interpreter would have found without it (a venv's, the distribution's), so nothing of theirs is lost.
SITECUSTOMIZE = """import sys
import {hook} as _proctor
_proctor.unittest_hook()
del _proctor
_here = {here!r}
_machinery = sys.modules["_frozen_importlib_external"]
_spec = _machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p != _here])
if _spec is not None and _spec.loader is not None:
    _mod = sys.modules["_frozen_importlib"].module_from_spec(_spec)
    sys.modules["sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
"""


@dataclass(frozen=True)
class Instrument:
    plugin_dir: Path  # host-owned, read-only to validation
    report: Path  # where pytest's plugin and unittest's hook append; validation must be able to create it
    node_dir: Path  # where node's runners write their reports
    module: str
    env: Mapping[str, str]


def _append(env: Mapping[str, str], key: str, value: str, sep: str = " ") -> str:
    return sep.join(x for x in (env.get(key, ""), value) if x)


def instrument(plugin_dir: Path, writable_dir: Path, env: Mapping[str, str], *,
               select: Sequence[str] | None = None, root: Path | None = None) -> Instrument:
    """`env` is what validation would otherwise get (its PYTHONPATH, PYTEST_ADDOPTS, NODE_OPTIONS and
    GOFLAGS are kept). `select`: run only these pytest ids or files, named from the checkout `root` (a
    failure run again; the held-out files)."""
    module = f"_proctor_evidence_{secrets.token_hex(8)}"
    report = writable_dir / f"{module}.jsonl"
    node_dir = writable_dir / f"{module}-node"
    plugin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    writable_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    node_dir.mkdir(mode=0o700, exist_ok=True)
    source = PLUGIN_SOURCE.read_text(encoding="utf-8")
    source = source.replace("REPORT = None  #", f"REPORT = {str(report)!r}  #", 1)
    if select is not None:
        source = source.replace("SELECT = None  #", f"SELECT = {tuple(select)!r}  #", 1)
        if root is not None:
            source = source.replace("ROOT = None  #", f"ROOT = {str(root)!r}  #", 1)
    preload = PRELOAD_SOURCE.read_text(encoding="utf-8").replace("const OUT = null;", f"const OUT = {_js(str(node_dir))};", 1)
    # The unittest hook is the same source under a second name: importing the `-p` module at start-up made
    # pytest warn it could not rewrite it, which a project's `filterwarnings = error` turned into a crash.
    hook = f"{module}_unittest"
    for name, text in ((f"{module}.py", source), (f"{hook}.py", source), ("sitecustomize.py", SITECUSTOMIZE.format(
            hook=hook, here=str(plugin_dir))), (f"{module}.cjs", preload)):
        target = plugin_dir / name
        target.write_text(text, encoding="utf-8")
        os.chmod(target, 0o444)
    os.chmod(plugin_dir, 0o755)  # validation may run as the same user only; no one but the host writes it
    goflags = env.get("GOFLAGS", "")
    extra = {
        "PYTEST_ADDOPTS": _append(env, "PYTEST_ADDOPTS", f"-p {module}"),
        # Last on the path: the names are unguessable but `sitecustomize`, so order cannot let the tree
        # shadow the plugin, and the tree's own import order (the validated root first) stays the job
        # environment's. A tree whose root holds a `sitecustomize` hides unittest's hook: its evidence is
        # then missing, which fails a step whose base left some (and the file is a risk of its own).
        "PYTHONPATH": _append(env, "PYTHONPATH", str(plugin_dir), os.pathsep),
        "PYTHONDONTWRITEBYTECODE": "1",
        "NODE_OPTIONS": _append(env, "NODE_OPTIONS", f'--require "{plugin_dir / f"{module}.cjs"}"'),
        # `go test -v` names each test; GOFLAGS reaches a `go test` a script or Makefile runs (-json would
        # also change `go list`'s output, so not that; -v is known to build, test and vet only).
        "GOFLAGS": goflags if re.search(r"(^|\s)-(v|json)\b", goflags) else _append(env, "GOFLAGS", "-v"),
    }
    return Instrument(plugin_dir, report, node_dir, module, extra)


def _js(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


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
    """The evidence a step must leave when proctor knows its runner from the argv itself (a step with no
    baseline to say what the base's left); None for a command proctor did not choose."""
    words = [Path(a).name for a in argv]
    if "pytest" in words or "py.test" in words:
        return "pytest"
    if words[:2] == ["go", "test"]:
        return "go-json" if "-json" in words else "go"
    if words[:2] == ["cargo", "test"]:
        return "libtest"
    return None


def _take(path: Path, cap: int = MAX_REPORT) -> bytes:
    """A report file's bytes, and the file gone, so the next step starts empty. Read with O_NOFOLLOW,
    non-blocking and capped: validation could have replaced it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(max(0, min(cap, MAX_REPORT))) if stat.S_ISREG(os.fstat(fh.fileno()).st_mode) else b""
    except OSError:
        data = b""
    try:
        os.unlink(path)
    except OSError:
        pass
    return data


def _node(inst: Instrument) -> dict[str, tuple[int, list[bytes]]]:
    """Per node runner: the processes the preload saw start, and the reports they wrote (at most
    MAX_NODE_BYTES of reports in all: a flood of sparse files never reaches the host's memory)."""
    out: dict[str, tuple[int, list[bytes]]] = {}
    try:
        names = sorted(os.listdir(inst.node_dir))[:MAX_NODE_REPORTS * 2]
    except OSError:
        return out
    budget = MAX_NODE_BYTES
    for name in names:
        m = re.fullmatch(r"(start-)?(vitest|jest|mocha)-(\d+)(\.json)?", name)
        if not m:
            continue
        starts, reports = out.get(m[2], (0, []))
        if m[1]:
            starts += 1
            try:
                os.unlink(inst.node_dir / name)
            except OSError:
                pass
        elif m[4]:
            data = _take(inst.node_dir / name, budget)
            budget -= len(data)
            reports = [*reports, data]
        out[m[2]] = (starts, reports)
    return out


def collect(inst: Instrument, kinds: Iterable[str] | None, stdout: bytes, stderr: bytes,
            root: Path) -> dict[str, readers.Evidence]:
    """What the step's runners reported, by kind. `kinds`: the kinds to read (the base's run decided
    them); None reads every host channel and no stdout kind (the caller adds those it identified)."""
    wanted = None if kinds is None else set(kinds)
    report = _take(inst.report)
    node = _node(inst) if wanted is None or wanted & set(NODE_KINDS) else {}
    found: dict[str, readers.Evidence | None] = {}
    if wanted is None or "pytest" in wanted:
        found["pytest"] = readers.read_pytest(report, str(root))
    if wanted is None or "unittest" in wanted:
        found["unittest"] = readers.read_unittest(report)
    for kind in ("vitest", "jest", "mocha"):
        if wanted is None or kind in wanted:
            starts, reports = node.get(kind, (0, []))
            found[kind] = (readers.read_mocha_json(starts, reports, str(root)) if kind == "mocha"
                           else readers.read_jest_json(kind, starts, reports, str(root)))
    for kind in sorted((wanted or set()) & set(STDOUT_KINDS)):
        found[kind] = stdout_evidence(kind, stdout, stderr)
    return {k: _relative(ev, root) for k, ev in found.items() if ev is not None}


STDOUT_KINDS = ("go-json", "go", "libtest", "tap", "ctest")


def stdout_evidence(kind: str, stdout: bytes, stderr: bytes) -> readers.Evidence | None:
    if kind == "go-json":
        return readers.read_go_json(stdout)
    if kind == "go":
        return readers.read_go_verbose(stdout)
    if kind == "libtest":
        return readers.read_libtest(stdout, stderr)
    if kind == "ctest":
        return readers.read_ctest(stdout)
    return readers.read_tap(stdout) if kind == "tap" else None


def _relative(ev: readers.Evidence, root: Path) -> readers.Evidence:
    """Files named absolute by the runner (pytest's fspath, jest's file) made relative to the checkout, and
    the checkout's own path taken out of test ids (a test parametrized over a glob of its files carries
    it): the base's run and the job's run in different checkouts name the same test alike."""
    prefix = str(root).rstrip("/") + "/"
    if not any(f.startswith(prefix) for f in ev.files.values()) and not any(prefix in t for t in ev.tests):
        return ev
    files = {t.replace(prefix, "./"): (f[len(prefix):] if f.startswith(prefix) else f) for t, f in ev.files.items()}
    tests: dict[str, str] = {}
    for t, o in ev.tests.items():
        key = t.replace(prefix, "./")
        tests[key] = o if key not in tests or readers.RANK[o] > readers.RANK[tests[key]] else tests[key]
    return readers.Evidence(**{**ev.__dict__, "files": files, "tests": tests})
