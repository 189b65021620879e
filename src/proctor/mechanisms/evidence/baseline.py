"""What the base's own validation did, kept: each step's runners and every test's outcome by id.

    StepBase / Baseline           the value (one per plan step), and to/from its JSON
    Cache(dir).load(key) / store(key, baseline)
                                  baselines kept under $PROCTOR_HOME/baselines/, each sealed with a key only
                                  the host holds (HMAC-SHA256), written atomically; an entry that fails its
                                  seal is not one (a key anyone can compute names it, so its content must
                                  prove the host wrote it). A job run with confinement off ran as the
                                  person and could read the seal key too: only confined runs are kept, and
                                  after an unconfined job nothing in $PROCTOR_HOME is beyond its reach
    identity(path) / digest(path) what a cache key holds of things that change a run without a new commit:
                                  a toolchain's executable, a shared dependency dir, a copied file
    diagnose(...) -> Cause        why a base's step cannot run, read from the runner's own output, and the
                                  one line of config that fixes it when the host can tell

It runs nothing and decides no verdict: proctor.services.job.baseline runs the base and refuses a job whose
base cannot run; proctor.mechanisms.evidence.verdict holds the job's run to it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import fcntl
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from proctor.home import PrivateFileError, private_secret
from proctor.mechanisms import atomic
from proctor.mechanisms.evidence.readers import FAILING, PASSING, Evidence
from proctor.mechanisms.validation.capped import read_capped
from proctor.mechanisms.validation.shares import node_modules_dirs

VERSION = 2  # the entry's shape; with the hooks' own source in every key, an older proctor's entry never matches
MAX_ENTRY = 64 * 1024 * 1024
LOCK_POLL_S = 0.1  # how often a job waiting for another's run of the same base looks again (and at its stop)
MAX_LISTED = 2000  # a shared dir's top-level entries a key holds (name, inode, mtime)


@dataclass(frozen=True)
class StepBase:
    label: str
    exit_code: int | None
    kinds: tuple[str, ...] = ()  # evidence kinds the base's run left whole: the job's run is read for these
    tests: Mapping[str, str] = field(default_factory=dict)  # id -> outcome, every kind's
    files: Mapping[str, str] = field(default_factory=dict)  # id -> defining file, when the runner said
    runners: tuple[str, ...] = ()  # the runners the step was seen to run (proctor.mechanisms.evidence.runners)
    setup: bool = False  # a repo's setup step: run, never read for tests
    duration_s: float = 0.0

    def counts(self) -> dict[str, int]:
        return {"tests": len(self.tests), "passed": sum(1 for o in self.tests.values() if o in PASSING),
                "failing": sum(1 for o in self.tests.values() if o in FAILING)}

    def view(self) -> dict[str, object]:
        """For the result: what ran and what the base's run said, no ids (they are in the comparison)."""
        return {"label": self.label, "exit_code": self.exit_code, "runners": list(self.runners),
                "evidence": list(self.kinds), **self.counts(), "duration_s": round(self.duration_s, 3)}


@dataclass(frozen=True)
class Baseline:
    steps: tuple[StepBase, ...]
    source: str = "ran"  # "ran" (this job ran it) | "cached"
    confinement: str = ""
    key: str = ""  # the cache key it was kept under (not part of its JSON): its build caches' key too

    def step(self, label: str) -> StepBase | None:
        return next((s for s in self.steps if s.label == label), None)

    def view(self) -> dict[str, object]:
        return {"source": self.source, "confinement": self.confinement, "steps": [s.view() for s in self.steps]}

    def to_json(self) -> bytes:
        return json.dumps({"version": VERSION, "steps": [asdict(s) for s in self.steps],
                           "confinement": self.confinement}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Baseline | None:
        try:
            raw = json.loads(data)
            if raw.get("version") != VERSION:
                return None
            steps = tuple(StepBase(**{**s, "kinds": tuple(s["kinds"]), "runners": tuple(s["runners"])})
                          for s in raw["steps"])
            return cls(steps, "cached", str(raw.get("confinement", "")))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def step_base(label: str, exit_code: int | None, found: Mapping[str, Evidence], runners: Sequence[str], *,
              setup: bool = False, duration_s: float = 0.0) -> StepBase:
    """One step of the base's run: the kinds whose every session ended are the step's (a kind that never
    ended on the base cannot be held against the job: the step then rests on what is left)."""
    whole = {k: ev for k, ev in found.items() if ev.sessions and ev.ended >= ev.sessions}
    tests: dict[str, str] = {}
    files: dict[str, str] = {}
    for ev in whole.values():
        tests.update(ev.tests)
        files.update(ev.files)
    return StepBase(label, exit_code, tuple(sorted(whole)), tests, files, tuple(runners), setup, duration_s)


# -- the cache ----------------------------------------------------------------------------------------------

class Cache:
    """Baselines under `root` ($PROCTOR_HOME/baselines), each `<key>.json` = seal (64 hex) + "\\n" + JSON."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _seal_key(self) -> bytes | None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            return private_secret(self.root / ".seal", secrets.token_hex(32)).encode()
        except (OSError, PrivateFileError):
            return None

    def _seal(self, key: str, body: bytes, secret: bytes) -> str:
        return hmac.new(secret, key.encode() + b"\n" + body, hashlib.sha256).hexdigest()

    def load(self, key: str) -> Baseline | None:
        secret = self._seal_key()
        if secret is None:
            return None
        try:
            fd = os.open(self.root / f"{key}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            data = fh.read(MAX_ENTRY + 1)
        seal, _, body = data.partition(b"\n")
        if len(data) > MAX_ENTRY or not hmac.compare_digest(seal, self._seal(key, body, secret).encode()):
            return None
        return Baseline.from_json(body)

    @contextmanager
    def running(self, key: str, stop: Callable[[], str | None]) -> Iterator[bool]:
        """Held while one job runs the base for `key`: jobs on the same base at once (a race's, a fleet's
        batch) wait for the first instead of each running the base's tests, then load what it stored. An
        exclusive lock on `<key>.lock` (the kernel drops it when a holder dies); the wait ends early when
        `stop` says why, and the job then runs unlocked (its own run is stopped the same way). Yields whether
        it waited for another: a waiter that then finds nothing kept (that run could not be kept) runs the
        base without the lock, so the rest are not made to run it one after another."""
        fd, waited = None, False
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = True
                    if stop():
                        break
                    time.sleep(LOCK_POLL_S)
        except OSError:
            pass  # no lock: the job runs the base itself, as it would with no other job about
        try:
            yield waited
        finally:
            if fd is not None:
                os.close(fd)  # closing drops the lock

    def store(self, key: str, baseline: Baseline) -> str | None:
        """None, or why it was not kept (uncached, the next job runs the base again)."""
        secret = self._seal_key()
        if secret is None:
            return f"the baselines' seal key in {self.root} cannot be used"
        body = baseline.to_json()
        path = self.root / f"{key}.json"
        try:
            atomic.write(path, self._seal(key, body, secret).encode() + b"\n" + body)
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror}"
        return None


def key(parts: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def identity(path: Path) -> list[object] | None:
    """What changes when a file or dir is replaced, upgraded or (a dir) gains or loses an entry: the real
    path, its inode, size, mtime and ctime, and for a dir its top-level entries' names, inodes and mtimes.
    A dependency installed into a shared `node_modules` or venv changes its dir's entries; a toolchain
    upgraded in place changes its executable's inode or times."""
    try:
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except OSError:
        return None
    out: list[object] = [str(real), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    if stat.S_ISDIR(st.st_mode):
        try:
            with os.scandir(real) as it:
                entries = sorted(((e.name, e.inode(), _mtime(e)) for e in it))[:MAX_LISTED]
        except OSError:
            entries = []
        out.append(entries)
    return out


def _mtime(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0


def digest(path: Path, cap: int = 16 * 1024 * 1024) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        return hashlib.sha256(fh.read(cap)).hexdigest()


# -- why a base cannot run ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cause:
    what: str  # read from the runner's output, in a person's words
    fix: str | None = None  # the one config line that fixes it, when the host can tell

    def line(self) -> str:
        return f"{self.what}; fix: {self.fix}" if self.fix else self.what


NOT_FOUND = re.compile(r"(?:^|[\s:])([\w.@/+-]+): (?:command )?not found", re.M)
NO_MODULE = re.compile(r"No module named ['\"]?([\w.]+)['\"]?")
CANNOT_FIND = re.compile(r"Cannot find (?:module|package) ['\"]([^'\"]+)['\"]")
NO_FILE = re.compile(r"No such file or directory: ['\"]([^'\"]+)['\"]|ENOENT[^'\"\n]*['\"]([^'\"]+)['\"]")
READ_ONLY = re.compile(r"(?:Read-only file system|EROFS|EACCES|Permission denied)[^'\"\n]*?['\"]?(/[^'\"\s,)]+)?",
                       re.I)
TEST_FILE = re.compile(r"(^|/)(test_[^/]*\.py|[^/]*_test\.py|tests\.py)$")


@dataclass(frozen=True)
class Facts:
    """What diagnose may look at besides the output: the base's tracked paths, the main checkout (the
    person's, where a generated or ignored file lives), the validated checkout, what is shared."""

    tracked: frozenset[str]
    main_checkout: Path
    checkout: Path
    shared: tuple[str, ...] = ()  # shared dirs, relative
    import_roots: tuple[str, ...] = ("", "src")


def _untracked_in_main(facts: Facts, rel: str) -> bool:
    rel = rel.strip("/")
    if not rel or rel in facts.tracked or ".." in PurePosixPath(rel).parts:
        return False
    p = facts.main_checkout / rel
    return p.is_file() and not p.is_symlink()


def _module_file(facts: Facts, module: str) -> str | None:
    """An untracked file of the main checkout that would be `module` (a generated `_version.py`)."""
    parts = module.split(".")
    for root in facts.import_roots:
        for rel in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            full = f"{root}/{rel}" if root else rel
            if _untracked_in_main(facts, full):
                return full
    return None


def _bin_dirs(facts: Facts, name: str) -> list[str]:
    """`node_modules` dirs of the main checkout (the root's and its packages') whose `.bin` holds `name`
    and that validation does not share."""
    dirs = ["node_modules", *node_modules_dirs(facts.main_checkout)]
    return [rel for rel in dirs if rel not in facts.shared and (facts.main_checkout / rel / ".bin" / name).exists()]


def diagnose(label: str, exit_code: int | None, output: str, found: Mapping[str, Evidence], facts: Facts, *,
             argv: Sequence[str] = (), django: bool = False) -> Cause | None:
    """Why the base's step `label` cannot run (None: it ran, whatever its tests said). `output` is the
    step's stdout and stderr as the runner kept them. Only what no job could change is a cause: a runner or
    a declared dependency missing, a generated file the main checkout has, a tool not on PATH, a path the
    runner must write and cannot, no test found where the repo has tests. A failure the job may be there
    to fix (a module the task creates, a failing test) is the base's outcome, held against the job's."""
    whole = {k: ev for k, ev in found.items() if ev.sessions}
    tests = {t: o for ev in whole.values() for t, o in ev.tests.items()}
    ran = [t for t, o in tests.items() if o != "error"]
    # A node runner that wrote no report at all (mocha before 9.2 ignores the reporter's `output`) leaves the
    # step to its exit code; one that began writing and did not finish did not reach its end.
    broken_ends = [k for k, ev in whole.items() if ev.ended < ev.sessions and not (k in NODE and ev.ended == 0)]
    if exit_code is None:
        return Cause(f"`{label}` did not start")
    if broken_ends and not ran:
        cause = _from_output(label, exit_code, output, facts, argv, django)
        return cause or Cause(f"`{label}`: the {', '.join(broken_ends)} run never reached its end (exit {exit_code})")
    if not tests and whole and (exit_code == 0 or (exit_code == 5 and "pytest" in whole)):
        has = [p for p in test_files(facts.tracked) if _defines_tests(facts.checkout / p)][:3]
        if not has:
            return None  # a repo with no test yet: it ran, and found none (the job's verdict says so)
        fix = 'validate = "python manage.py test"' if django else None
        return Cause(f"`{label}` found no test though the repo has test files ({', '.join(has)})", fix)
    if exit_code == 0 or ran:
        return None  # it ran: failing tests are the base's own, held as pre-existing
    return _from_output(label, exit_code, output, facts, argv, django)


def _runner_modules(argv: Sequence[str], django: bool) -> set[str]:
    words = [PurePosixPath(w).name for w in " ".join(argv).split()]
    mods = {words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"}
    return mods | {"pytest", "_pytest"} | ({"django"} if django else set())


def _from_output(label: str, exit_code: int, output: str, facts: Facts, argv: Sequence[str],
                 django: bool) -> Cause | None:
    head = f"`{label}` => exit {exit_code}"
    m = NO_MODULE.search(output)
    if m:
        module = m[1]
        top = module.split(".")[0]
        generated = _module_file(facts, module)
        if generated:
            return Cause(f"{head}: the module {module} is a file the main checkout has and the base does not "
                         f"track ({generated}: generated, or ignored)", f'copy = ["{generated}"]')
        if top in ("pytest", "_pytest") and django:
            return Cause(f"{head}: pytest is not installed where validation runs, and this is a Django project",
                         'validate = "python manage.py test"')
        if top in _runner_modules(argv, django) or _canon(top) in declared_python(facts):
            return Cause(f"{head}: the module {module} is not installed in the Python validation uses (the active "
                         "venv, else the main checkout's .venv, else PATH's python)")
    m = CANNOT_FIND.search(output)
    if m and not m[1].startswith((".", "/")) and _npm_name(m[1]) in declared_node(facts):
        return Cause(f"{head}: node cannot find the package {m[1]!r} the repo depends on (its node_modules is "
                     "not where validation looks)")
    m = NOT_FOUND.search(output)
    if m and "/" not in m[1]:
        name = m[1]
        dirs = _bin_dirs(facts, name)
        if dirs:
            share = ", ".join(f'"{d}"' for d in dict.fromkeys([*facts.shared, *dirs]))
            return Cause(f"{head}: `{name}` is not found; the main checkout has it in {dirs[0]}/.bin, which "
                         "validation does not share", f"share = [{share}]")
        return Cause(f"{head}: `{name}` is not found on validation's PATH")
    m = NO_FILE.search(output)
    if m:
        rel = _relative_to(m[1] or m[2], facts)
        if rel and _untracked_in_main(facts, rel):
            return Cause(f"{head}: it reads {rel}, which the main checkout has and the base does not track",
                         f'copy = ["{rel}"]')
    m = READ_ONLY.search(output)
    if m:
        where = f" ({m[1]})" if m[1] else ""
        return Cause(f"{head}: the runner writes where validation cannot{where}: a shared or read-only dir")
    return None


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _npm_name(spec: str) -> str:
    parts = spec.split("/")
    return "/".join(parts[:2]) if spec.startswith("@") else parts[0]


REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def declared_python(facts: Facts) -> set[str]:
    """The distribution names the base declares it needs (pyproject's dependencies, optional ones and
    dependency groups; requirements*.txt), canonical: a missing one is the environment's, not the job's."""
    import tomllib

    names: list[str] = []
    raw = _read_main(facts, "pyproject.toml")
    if raw:
        try:
            py = tomllib.loads(raw)
        except tomllib.TOMLDecodeError:
            py = {}
        project = py.get("project") if isinstance(py.get("project"), dict) else {}
        groups = [project.get("dependencies") or []]
        groups += list((project.get("optional-dependencies") or {}).values())
        groups += list((py.get("dependency-groups") or {}).values())
        poetry = ((py.get("tool") or {}).get("poetry") or {}) if isinstance(py.get("tool"), dict) else {}
        names += [k for k in (poetry.get("dependencies") or {}) if k != "python"]
        names += [k for g in (poetry.get("group") or {}).values() if isinstance(g, dict) for k in g.get("dependencies") or {}]
        names += [d for g in groups if isinstance(g, list) for d in g if isinstance(d, str)]
    for req in sorted(p for p in facts.tracked if PurePosixPath(p).name.startswith("requirements")
                      and p.endswith(".txt"))[:10]:
        names += (_read_main(facts, req) or "").splitlines()
    return {_canon(m[1]) for n in names if (m := REQUIREMENT.match(n)) and not n.lstrip().startswith(("#", "-"))}


def declared_node(facts: Facts) -> set[str]:
    raw = _read_main(facts, "package.json")
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return set()
    out: set[str] = set()
    for key in ("dependencies", "devDependencies", "peerDependencies", "optionalDependencies"):
        table = data.get(key) if isinstance(data, dict) else None
        if isinstance(table, dict):
            out |= set(table)
    return out


def _read_main(facts: Facts, rel: str) -> str | None:
    """A file of the base as the validated checkout has it (the checkout is the base's, read before the
    agent), capped."""
    data = read_capped(facts.checkout / rel, 4 * 1024 * 1024)
    return data.decode("utf-8", "replace") if data is not None else None


def _relative_to(raw: str, facts: Facts) -> str | None:
    p = PurePosixPath(raw)
    if not p.is_absolute():
        return p.as_posix()
    for root in (facts.checkout, facts.main_checkout):
        try:
            return p.relative_to(root.as_posix()).as_posix()
        except ValueError:
            continue
    return None


def test_files(paths: Iterable[str]) -> list[str]:
    return sorted(p for p in paths if TEST_FILE.search(p))


NODE = frozenset({"vitest", "jest", "mocha"})
DEFINES_TEST = re.compile(rb"^\s*(?:async\s+)?def\s+test|^\s*class\s+\w*Test|unittest\.TestCase|TestCase\)", re.M)


def _defines_tests(path: Path) -> bool:
    """A test file of the base that defines a test (a file of imports only, or none yet, is no test)."""
    try:
        with open(path, "rb") as fh:
            return bool(DEFINES_TEST.search(fh.read(1024 * 1024)))
    except OSError:
        return True
