"""Real public projects of each ecosystem, brought in from the package registries once and reused.

Used by tests/test_ecosystems.py and bench/ecosystems.py. Each project is the registry's published source
(a PyPI sdist that ships its tests, an npm tarball whose devDependencies are installed with npm, a crate's
source from Debian's `librust-*-dev` package: crates.io is not always reachable, Debian's archive is),
committed into a fresh git repo, with one real fix and one real break of its own code:

    cachetools 5.5.0  PyPI sdist, src layout, installed editable into a venv (the "active venv")
    six 1.17.0        PyPI sdist, flat layout (one module), installed editable into the repo's own .venv
    cachetools (uv)   the same source made a uv project as `uv init --lib` lays one out: hatchling,
                      `uv.lock` committed, `uv sync` made `.venv` with the project editable (real uv, from
                      the test extra, offline from a wheelhouse; the tests never need uv to run them)
    six (poetry)      six with a `[tool.poetry]` pyproject and a poetry.lock (poetry is never run), its venv
                      where poetry keeps one, outside the checkout
    xtend 4.0.2       npm, devDependency tape, `npm install` in the main checkout, then `npm test`
    itoa 1.0.1        Debian librust-itoa-dev, no dependencies, `cargo test` offline

Downloads go to a cache dir ($PROCTOR_FIXTURE_CACHE, else $XDG_CACHE_HOME/proctor-test-fixtures, else
~/.cache/proctor-test-fixtures) through the registries' own clients (pip, npm, apt-get), are checked against
pinned sha256 sums where the registry publishes a fixed artifact, and are unpacked once. A fetch that fails
raises FetchError; `require()` turns it into a test failure under CI=true, else a skip with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REAL_HOME = Path(os.environ.get("HOME") or Path.home())
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "init.defaultBranch=master",
       "-c", "commit.gpgsign=false"]


def cache_dir() -> Path:
    given = os.environ.get("PROCTOR_FIXTURE_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(REAL_HOME / ".cache")
    return Path(base) / "proctor-test-fixtures"


CACHE = cache_dir()


class FetchError(RuntimeError):
    pass


def require(fn, *args):
    """fn(*args), or the test fails (CI=true) / skips (elsewhere) naming why the fixture is missing."""
    import pytest

    try:
        return fn(*args)
    except FetchError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"fixture fetch failed under CI: {exc}", pytrace=False)
        pytest.skip(f"fixture not available (fetch failed): {exc}")


@contextlib.contextmanager
def _locked(name: str) -> Iterator[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield CACHE


def _run(argv: list[str], what: str, cwd: Path | None = None, env: dict | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"{what}: {exc}") from exc
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
        raise FetchError(f"{what}: exit {res.returncode}: {' | '.join(tail)}")
    return res


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _checked(p: Path, sha: str | None) -> Path:
    if sha is not None and _sha256(p) != sha:
        bad = p.with_suffix(p.suffix + ".bad")
        p.replace(bad)
        raise FetchError(f"{p.name}: sha256 {_sha256(bad)} is not the pinned {sha}")
    return p


def _unpack_tar(archive: Path, dest: Path, top: str) -> Path:
    """Unpack `archive` and move its `top` dir to `dest` (atomically: a half unpack is never reused)."""
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        os.rename(tmp / top, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# -- PyPI -------------------------------------------------------------------------------------------------

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def pypi_sdist(name: str, version: str, sha: str) -> Path:
    """The sdist of name==version, unpacked: the project as published, tests included."""
    with _locked("pypi"):
        d = CACHE / "pypi"
        d.mkdir(exist_ok=True)
        src = d / f"{name}-{version}"
        if src.is_dir():
            return src
        archive = d / f"{name}-{version}.tar.gz"
        if not archive.is_file():
            _run([*PIP, "download", "--no-deps", "--no-binary", ":all:",
                  f"{name}=={version}", "-d", str(d)], f"pip download {name}=={version}")
        if not archive.is_file():
            raise FetchError(f"pip download {name}=={version} left no {archive.name}")
        _checked(archive, sha)
        return _unpack_tar(archive, src, f"{name}-{version}")


WHEELS = ("pytest", "setuptools", "wheel")


def wheelhouse() -> Path:
    """Wheels for a test venv (pytest and its deps, setuptools and wheel for editable installs)."""
    with _locked("wheels"):
        d = CACHE / "wheels"
        stamp = d / ".complete"
        if stamp.is_file():
            return d
        d.mkdir(exist_ok=True)
        _run([*PIP, "download", "--only-binary", ":all:", "-d", str(d), "pytest>=8", "setuptools>=64", "wheel"],
             "pip download pytest setuptools wheel")
        stamp.write_text("ok\n")
        return d


HATCHLING = ("hatchling", "editables")  # a hatchling project's editable build, for `uv lock`/`uv sync`


def uv_wheelhouse() -> Path:
    """wheelhouse() plus hatchling and its dependencies: everything `uv sync` installs for a hatchling
    project with pytest in its dev group, offline (`--no-index --find-links`)."""
    d = wheelhouse()
    with _locked("wheels"):
        stamp = d / ".complete-hatchling"
        if not stamp.is_file():
            _run([*PIP, "download", "--only-binary", ":all:", "-d", str(d), *HATCHLING], "pip download hatchling")
            stamp.write_text("ok\n")
    return d


def uv_binary() -> str:
    """The real uv: on PATH, or beside this interpreter (the test extra installs it into the venv)."""
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if found is None:
        raise FetchError("uv is not installed (it is in the `test` extra: pip install -e '.[test]')")
    # A clone under /tmp has its venv there, which the sandbox replaces with a private tmpfs: a repo's `make
    # test` would not find uv inside (the product says so, with an exit-127 hint). A developer's uv is not
    # under /tmp; the copy in the fixture cache stands for it.
    if any(Path(found).resolve().is_relative_to(d) for d in ("/tmp", "/var/tmp", "/run")):
        kept = CACHE / "bin" / "uv"
        if not kept.is_file() or kept.stat().st_size != Path(found).stat().st_size:
            kept.parent.mkdir(parents=True, exist_ok=True)
            part = kept.with_name(f"uv.{os.getpid()}.part")
            shutil.copy2(found, part)
            os.replace(part, kept)
        return str(kept)
    return found


def _uv(args: list[str], what: str, cwd: Path) -> None:
    """uv offline from the wheelhouse, its cache in the fixture cache, the interpreter the tests run on
    (resolved past this venv: uv makes its venvs from a base interpreter), never a download."""
    env = {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never",
           "UV_NO_CONFIG": "1"}
    env.pop("VIRTUAL_ENV", None)
    _run([uv_binary(), *args, "--offline", "--no-index", "--find-links", str(uv_wheelhouse()),
          "--python", os.path.realpath(sys.executable)], what, cwd=cwd, env=env)


UV_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "cachetools"
dynamic = ["version"]
requires-python = ">={major}.{minor}"

[dependency-groups]
dev = ["pytest>=8"]

[tool.hatch.version]
path = "src/cachetools/__init__.py"

[tool.uv]
environments = ["sys_platform == 'linux'"]
"""


POETRY_PYPROJECT = """[tool.poetry]
name = "six"
version = "1.17.0"
description = "Python 2 and 3 compatibility utilities"
authors = ["Benjamin Peterson <benjamin@python.org>"]
package-mode = false
"""
POETRY_LOCK = """# This file is automatically @generated by Poetry 2.5.1 and should not be changed by hand.
package = []

[metadata]
lock-version = "2.1"
python-versions = "*"
content-hash = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""


def _as_uv_project(repo: Path) -> None:
    """cachetools laid out as a uv project (`uv init --lib`'s shape: hatchling, src layout, pytest in the
    dev group), locked by the real uv (the lock resolves for Linux only: the wheelhouse holds no Windows
    wheels). setuptools' files go: hatchling builds it."""
    for name in ("setup.py", "setup.cfg", "tox.ini", "MANIFEST.in"):
        (repo / name).unlink(missing_ok=True)
    (repo / "pyproject.toml").write_text(UV_PYPROJECT.format(major=sys.version_info.major,
                                                             minor=sys.version_info.minor))
    _uv(["lock"], "uv lock", repo)


def uv_synced(repo: Path) -> Path:
    """`uv sync --frozen` in the main checkout: `.venv` with pytest and the project editable (hatchling's
    `.pth` naming the main checkout's `src`), as the developer's checkout has it."""
    _uv(["sync", "--frozen"], "uv sync", repo)
    venv = repo / ".venv"
    if not (venv / "bin" / "python").exists():
        raise FetchError(f"uv sync made no {venv}")
    return venv


def make_venv(where: Path, editable: Path) -> Path:
    """A venv at `where` with pytest, and `editable` installed editable (pointing at that checkout)."""
    wheels = wheelhouse()
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], f"venv {where}")
    py = where / "bin" / "python"
    _run([*PIP, "--python", str(py), "install", "--no-index", "--find-links", str(wheels), *WHEELS],
         "pip install pytest into the fixture venv")
    _run([*PIP, "--python", str(py), "install", "--no-index", "--no-deps", "--no-build-isolation", "-e",
          str(editable)], f"pip install -e {editable}")
    return py


# -- npm --------------------------------------------------------------------------------------------------

def npm_package(name: str, version: str, sha: str) -> tuple[Path, Path]:
    """(the package as published, unpacked; an npm cache holding its devDependencies) — the cache lets a
    test run `npm install --offline` in its own checkout."""
    if not shutil.which("npm"):
        raise FetchError("npm is not installed")
    with _locked("npm"):
        d = CACHE / "npm"
        d.mkdir(exist_ok=True)
        src, npm_cache, stamp = d / f"{name}-{version}", d / "cache", d / f".{name}-{version}.deps"
        archive = d / f"{name}-{version}.tgz"
        if not archive.is_file():
            _run(["npm", "pack", f"{name}@{version}", "--pack-destination", str(d), "--cache", str(npm_cache),
                  "--no-audit", "--no-fund", "--loglevel=error"], f"npm pack {name}@{version}")
        if not archive.is_file():
            raise FetchError(f"npm pack {name}@{version} left no {archive.name}")
        _checked(archive, sha)
        _unpack_tar(archive, src, "package")
        if not stamp.is_file():
            scratch = Path(tempfile.mkdtemp(prefix=".npm-", dir=d))
            try:
                shutil.copytree(src, scratch / "p")
                _run(["npm", "install", "--cache", str(npm_cache), "--no-audit", "--no-fund", "--loglevel=error"],
                     f"npm install (devDependencies of {name}@{version})", cwd=scratch / "p")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            stamp.write_text("ok\n")
        return src, npm_cache


def npm_install_offline(checkout: Path, npm_cache: Path, env: dict | None = None) -> None:
    _run(["npm", "install", "--offline", "--cache", str(npm_cache), "--no-audit", "--no-fund", "--loglevel=error"],
         f"npm install --offline in {checkout}", cwd=checkout, env=env)


# -- Debian (crates) --------------------------------------------------------------------------------------

def debian_crate(package: str, crate: str) -> Path:
    """The crate's source from Debian's `librust-<crate>-dev` package (apt-get download; apt checks the
    archive's signatures), unpacked with dpkg-deb."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise FetchError("apt-get/dpkg-deb are not available (not a Debian machine)")
    with _locked("deb"):
        d = CACHE / "deb"
        d.mkdir(exist_ok=True)
        found = sorted(p for p in d.glob(f"{crate}-*") if p.is_dir())
        if found:
            return found[-1]
        debs = sorted(d.glob(f"{package}_*.deb"))
        if not debs:
            try:
                _run(["apt-get", "download", "-q", package], f"apt-get download {package}", cwd=d)
            except FetchError:
                if os.geteuid() != 0:
                    raise
                _run(["apt-get", "update", "-qq"], "apt-get update")
                _run(["apt-get", "download", "-q", package], f"apt-get download {package}", cwd=d)
            debs = sorted(d.glob(f"{package}_*.deb"))
        if not debs:
            raise FetchError(f"apt-get download {package} left no .deb")
        tmp = Path(tempfile.mkdtemp(prefix=".deb-", dir=d))
        try:
            _run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], f"dpkg-deb -x {debs[-1].name}")
            srcs = sorted((tmp / "usr/share/cargo/registry").glob(f"{crate}-*"))
            if not srcs:
                raise FetchError(f"{debs[-1].name} holds no usr/share/cargo/registry/{crate}-*")
            dest = d / srcs[-1].name
            os.rename(srcs[-1], dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest


def cargo_registry() -> Path:
    """A directory registry (cargo's `[source.*] directory`, Debian's /usr/share/cargo/registry layout)
    holding the itoa crate: a shared, read-only source a crate depending on itoa builds from offline."""
    crate = debian_crate("librust-itoa-dev", "itoa")
    with _locked("cargo-registry"):
        reg = CACHE / "cargo-registry"
        if not (reg / crate.name / ".cargo-checksum.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".reg-", dir=CACHE))
            shutil.copytree(crate, tmp / crate.name, symlinks=True)
            reg.mkdir(exist_ok=True)
            shutil.rmtree(reg / crate.name, ignore_errors=True)
            os.rename(tmp / crate.name, reg / crate.name)
            shutil.rmtree(tmp, ignore_errors=True)
        return reg


def rust_env() -> dict[str, str]:
    """CARGO_HOME/RUSTUP_HOME pinned to the real home (a rustup proxy finds its toolchain there even when a
    test moves HOME), and cargo's bin dir on PATH. Raises FetchError when there is no cargo."""
    env: dict[str, str] = {}
    for var, rel in (("CARGO_HOME", ".cargo"), ("RUSTUP_HOME", ".rustup")):
        p = Path(os.environ.get(var) or REAL_HOME / rel)
        if p.is_dir():
            env[var] = str(p)
    path = os.environ.get("PATH", "")
    cargo = shutil.which("cargo")
    if cargo is None and (REAL_HOME / ".cargo/bin/cargo").exists():
        path = f"{REAL_HOME / '.cargo/bin'}{os.pathsep}{path}"
        cargo = str(REAL_HOME / ".cargo/bin/cargo")
    if cargo is None:
        raise FetchError("cargo is not installed (Debian: apt-get install cargo)")
    env["PATH"] = path
    probe = subprocess.run([cargo, "--version"], env={**os.environ, **env}, capture_output=True, text=True)
    if probe.returncode != 0:
        raise FetchError(f"cargo --version failed: {probe.stderr.strip()[:200]}")
    return env


def go_env() -> dict[str, str]:
    """Go's toolchain is on PATH (Debian: golang-go, scripts/install-system-deps.sh). Raises FetchError when
    there is no go."""
    go = shutil.which("go")
    if go is None:
        raise FetchError("go is not installed (Debian: apt-get install golang-go)")
    probe = subprocess.run([go, "version"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise FetchError(f"go version failed: {probe.stderr.strip()[:200]}")
    return {"PATH": os.environ.get("PATH", "")}


# -- projects: a repo with a base, a broken base, a fix and a break -----------------------------------------

EDIT = r"""
import pathlib, sys
args = sys.argv[1:]
for i in range(0, len(args), 3):
    p, old, new = pathlib.Path(args[i]), args[i + 1], args[i + 2]
    s = p.read_text()
    if old not in s:
        sys.exit("edit: %r not in %s" % (old, p))
    p.write_text(s.replace(old, new, 1))
"""


@dataclass(frozen=True)
class Edit:
    path: str
    good: str  # the text as published
    bad: str  # the same place broken: a real bug a real test catches

    def script(self, frm: str, to: str) -> str:
        """A shell command that makes this edit (an agent's whole work), failing if the text is absent."""
        import shlex

        # The base interpreter, not this venv's python: the agent runs it inside the sandbox, whose private
        # /tmp hides a venv made in a clone under /tmp (the shell string is opaque to the sandbox's exec
        # roots; measured: every job exited 127, issue 24). EDIT needs nothing but the stdlib.
        python = os.path.realpath(sys.executable)
        return " ".join(shlex.quote(x) for x in (python, "-c", EDIT, self.path, frm, to))

    @property
    def fix(self) -> str:
        return self.script(self.bad, self.good)

    @property
    def breaks(self) -> str:
        return self.script(self.good, self.bad)


@dataclass(frozen=True)
class Project:
    key: str  # python-src | python-flat | python-uv | python-uv-make | python-poetry | node | rust
    name: str
    edit: Edit
    direct: tuple[str, ...]  # the repo's own test command, run directly in a plain clone
    package: str | None = None  # the import / package name under test
    ignore: tuple[str, ...] = field(default=("__pycache__/", "*.egg-info/", "node_modules/", "target/",
                                             ".venv/", "Cargo.lock", "package-lock.json", ".pytest_cache/"))


PROJECTS = {
    "python-src": Project(
        "python-src", "cachetools 5.5.0",
        Edit("src/cachetools/__init__.py",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key)\n",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key, last=False)\n"),
        ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider"), package="cachetools"),
    "python-flat": Project(
        "python-flat", "six 1.17.0",
        Edit("six.py", '    def b(s):\n        return s.encode("latin-1")\n',
             '    def b(s):\n        return s.encode("utf-8")\n'),
        ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider"), package="six"),
    "python-uv": Project(
        "python-uv", "cachetools (uv)",
        Edit("src/cachetools/__init__.py",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key)\n",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key, last=False)\n"),
        ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider"), package="cachetools"),
    # The same, with the test command a uv project often has: `make test` running `uv run pytest`.
    "python-uv-make": Project(
        "python-uv-make", "cachetools (uv run)",
        Edit("src/cachetools/__init__.py",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key)\n",
             "    def __update(self, key):\n        try:\n            self.__order.move_to_end(key, last=False)\n"),
        ("make", "test"), package="cachetools"),
    # six again, as a poetry project whose venv lives where poetry keeps it: outside the checkout.
    "python-poetry": Project(
        "python-poetry", "six (poetry)",
        Edit("six.py", '    def b(s):\n        return s.encode("latin-1")\n',
             '    def b(s):\n        return s.encode("utf-8")\n'),
        ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider"), package="six"),
    "node": Project(
        "node", "xtend 4.0.2",
        Edit("immutable.js", "                target[key] = source[key]\n",
             "                target[key] = source[key] || target[key]\n"),
        ("npm", "test"), package="xtend"),
    "rust": Project(
        "rust", "itoa 1.0.1",
        Edit("src/lib.rs", "*buf_ptr.offset(curr) = b'-';", "*buf_ptr.offset(curr) = b'+';"),
        ("cargo", "test", "--offline"), package="itoa"),
}


def source(key: str) -> Path:
    """The published source tree of PROJECTS[key] (fetched once)."""
    if key in ("python-src", "python-uv", "python-uv-make"):
        return pypi_sdist("cachetools", "5.5.0", "2cc24fb4cbe39633fb7badd9db9ca6295d766d9c2995f245725a46715d050f2a")
    if key in ("python-flat", "python-poetry"):
        return pypi_sdist("six", "1.17.0", "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81")
    if key == "node":
        return npm_package("xtend", "4.0.2", "bd22a01d43c799be7bb53dfa9e775b132045e39525e51efb977528a00041ba48")[0]
    if key == "rust":
        return debian_crate("librust-itoa-dev", "itoa")
    raise KeyError(key)


def _git(*args: str, cwd: Path) -> str:
    res = subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def make_repo(key: str, root: Path) -> Path:
    """A git repo at root/<key> holding the published project: `master` as published, `broken` one commit
    on with the project's edit applied (the base a fix job starts from). The checkout is on master."""
    proj = PROJECTS[key]
    src = source(key)
    repo = root / key
    shutil.copytree(src, repo, symlinks=True,
                    ignore=shutil.ignore_patterns("*.egg-info", "PKG-INFO", "target", "node_modules",
                                                  ".cargo_vcs_info.json", ".cargo-checksum.json"))
    gi = repo / ".gitignore"
    old = gi.read_text() if gi.is_file() else ""
    gi.write_text(old + ("" if old.endswith("\n") or not old else "\n") + "\n".join(proj.ignore) + "\n")
    if key in ("python-uv", "python-uv-make"):
        _as_uv_project(repo)
    if key == "python-uv-make":
        (repo / "Makefile").write_text("test:\n\tuv run pytest -q -p no:cacheprovider\n")
    if key == "python-poetry":
        # What says "poetry" (setuptools still builds it from setup.py; poetry is never run).
        (repo / "pyproject.toml").write_text(POETRY_PYPROJECT)
        (repo / "poetry.lock").write_text(POETRY_LOCK)
    _git("init", "-q", "-b", "master", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", f"{proj.name} as published", cwd=repo)
    _git("checkout", "-q", "-b", "broken", cwd=repo)
    p = repo / proj.edit.path
    text = p.read_text()
    if proj.edit.good not in text:
        raise FetchError(f"{proj.name}: the edit's text is not in {proj.edit.path} (another version?)")
    p.write_text(text.replace(proj.edit.good, proj.edit.bad, 1))
    _git("commit", "-qam", "a bug", cwd=repo)
    _git("checkout", "-q", "master", cwd=repo)
    return repo


def node_modules_installed(checkout: Path, env: dict | None = None) -> None:
    """`npm install` (offline, from the fixture cache) in `checkout`, as the developer ran it."""
    _, npm_cache = npm_package("xtend", "4.0.2", "bd22a01d43c799be7bb53dfa9e775b132045e39525e51efb977528a00041ba48")
    npm_install_offline(checkout, npm_cache, env)


def describe() -> str:
    return json.dumps({k: p.name for k, p in PROJECTS.items()})


# -- issue 38's project shapes: Django, vitest, a pnpm workspace --------------------------------------------

def django_venv(where: Path) -> Path:
    """A venv at `where` with Django (and no pytest: a Django project's own runner is `manage.py test`),
    from wheels fetched once into the fixture cache."""
    with _locked("wheels-django"):
        d = CACHE / "wheels-django"
        stamp = d / ".complete"
        if not stamp.is_file():
            d.mkdir(exist_ok=True)
            _run([*PIP, "download", "--only-binary", ":all:", "-d", str(d), "django>=4.2,<6"], "pip download django")
            stamp.write_text("ok\n")
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], f"venv {where}")
    py = where / "bin" / "python"
    _run([*PIP, "--python", str(py), "install", "--no-index", "--find-links", str(d), "django"],
         "pip install django into the fixture venv")
    return py


def npm_devdeps(key: str, package_json: dict) -> Path:
    """An npm cache holding everything `npm install` needs for `package_json` (fetched once, from the
    registry): a test then runs `npm install --offline` in its own checkout. `key` names the set."""
    if not shutil.which("npm"):
        raise FetchError("npm is not installed")
    with _locked("npm"):
        d = CACHE / "npm"
        d.mkdir(exist_ok=True)
        npm_cache, stamp = d / "cache", d / f".{key}.deps"
        want = json.dumps(package_json, sort_keys=True)
        if not stamp.is_file() or stamp.read_text() != want:
            scratch = Path(tempfile.mkdtemp(prefix=".npm-", dir=d))
            try:
                (scratch / "package.json").write_text(json.dumps(package_json))
                _run(["npm", "install", "--cache", str(npm_cache), "--no-audit", "--no-fund", "--loglevel=error"],
                     f"npm install ({key})", cwd=scratch, timeout=600)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            stamp.write_text(want)
        return npm_cache


def pnpm_binary() -> str:
    """pnpm from the npm registry, installed once into the fixture cache (its own prefix)."""
    with _locked("pnpm"):
        prefix = CACHE / "pnpm"
        exe = prefix / "node_modules" / ".bin" / "pnpm"
        if not exe.exists():
            prefix.mkdir(exist_ok=True)
            _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                  "pnpm@9"], "npm install pnpm@9", timeout=600)
        if not exe.exists():
            raise FetchError("npm install pnpm@9 left no pnpm")
        return str(exe)


def pnpm_install(checkout: Path) -> None:
    """`pnpm install` in the workspace (its store in the fixture cache: the registry is asked once)."""
    exe = pnpm_binary()
    env = {**os.environ, "npm_config_store_dir": str(CACHE / "pnpm-store"), "CI": "true"}
    with _locked("pnpm-store"):
        _run([exe, "install", "--prefer-offline", "--config.confirmModulesPurge=false"],
             f"pnpm install in {checkout}", cwd=checkout, env=env, timeout=600)
