"""The job's environment: what validation (and, later, the agent) needs to run the repo's own tests as the
developer does, without trusting the agent.

Owns three things, as data and small functions (no host state):

    settings(config, repo, git_dir, base_sha) -> RepoSettings | str   the per-repo keys: config.toml's
                        [repos."<abs path>"] over the `.proctor.toml` committed at the base (read from git
                        objects, never the agent's copy); a str is why it could not be read
    prepare(checkout, main_checkout, plan, settings, ...) -> JobEnvironment   extra env, read-only shares,
                        copied files, the known risks
    apply(jenv)  /  check(jenv, probe)   make the dirs, copies and links; probe where the code under test
                        resolves, in the same confined environment, and name every escape as a risk

Why (issue 12, measured on real projects): a src-layout package installed editable in the active venv was
imported from the main checkout, so a breaking diff came back `completed`; `npm test` could never pass
without the main checkout's `node_modules`, and `$HOME` was not writable. The rules:

- Writable caches are the job's own: `HOME`, `XDG_CACHE_HOME`, `npm_config_cache`, `GOCACHE` live under
  the job's private tmp. Toolchains found through `$HOME` (`~/.cargo`, `~/.rustup`, `~/.pyenv`, `~/go`,
  `~/.local`) stay reachable, pinned to the real paths and read-only.
- Cargo builds where it builds by default, `<workspace>/target` inside the validated checkout (or the
  repo's own `build.target-dir` there): a build script that writes into `target/` failed with the target
  dir under the job's tmp (issue 24). The checkout is the host's own copy, its tree already taken
  (proctor.mechanisms.git.landing) and pruned back to the job's commit after validation, so `target/` never lands.
  Setup before the agent builds under the job's tmp: it runs in the agent's worktree, which is the diff.
- Python: `PYTHONPATH` puts the validated tree's import root (`src/` or the root) first, ahead of any
  editable install (a `.pth` path or setuptools' finder, which sits after the path finder).
- Python's environment is the one the repo's own manager made for the main checkout (python_env: `uv.lock`
  -> uv, `poetry.lock` -> poetry, `pdm.lock` -> pdm, `hatch.toml` -> hatch, else a plain `.venv`), found
  the way that tool finds it, without running it; used read-only (VIRTUAL_ENV, PATH, and the switches
  that keep `uv run`/`poetry run`/`pdm run` on it, offline, never syncing). An outside tester needed
  `share` and `validate = "uv run --frozen ..."` for a uv project: `uv run` built a venv of its own in
  the checkout and went to the network (issue 24).
- Shares (`node_modules`, `.venv`, ...) come from the main checkout, read-only (a bwrap bind, or a symlink
  that Landlock keeps read-only), and only when the lockfile is byte-identical between the validated tree
  and the main checkout: dependencies installed for another lockfile would test something else. The
  repo's venv is held to the same rule: a lockfile that differs is a risk naming it.
"""

from __future__ import annotations

import ast
import base64
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.validation import plan as validate
from proctor.mechanisms.config.settings import RepoSettings, parse_settings
from proctor.mechanisms.git.command import git

PROCTOR_TOML = ".proctor.toml"
MAX_READ = 1024 * 1024
MAX_COPY = 16 * 1024 * 1024
# Lockfiles that pin a share's content; a share is used only when each is identical on both sides.
LOCKFILES = {
    "node_modules": ("package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "bun.lockb",
                     "package.json"),
    ".venv": ("uv.lock", "poetry.lock", "pdm.lock", "Pipfile.lock", "requirements.txt", "pyproject.toml",
              "setup.cfg", "setup.py"),
    "venv": ("uv.lock", "poetry.lock", "pdm.lock", "Pipfile.lock", "requirements.txt", "pyproject.toml",
             "setup.cfg", "setup.py"),
    "vendor": ("go.sum", "go.mod", "composer.lock"),
}
# Toolchain homes found through $HOME: pinned to the real path when HOME moves (read-only to the job).
HOME_TOOLS = (("CARGO_HOME", ".cargo"), ("RUSTUP_HOME", ".rustup"), ("PYENV_ROOT", ".pyenv"),
              ("NVM_DIR", ".nvm"), ("GOPATH", "go"), ("PYTHONUSERBASE", ".local"), ("ASDF_DATA_DIR", ".asdf"),
              ("VOLTA_HOME", ".volta"), ("BUN_INSTALL", ".bun"), ("DENO_DIR", ".cache/deno"))
NOT_PACKAGES = frozenset({"tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks",
                          "bench", "scripts", "tools", "build", "dist", "site-packages", "node_modules"})
NOT_MODULES = frozenset({"setup", "conftest", "noxfile", "fabfile", "tasks", "manage", "docs_conf"})


@dataclass(frozen=True)
class Share:
    source: Path  # in the main checkout
    target: Path  # in the validated checkout
    lockfiles: tuple[str, ...] = ()


@dataclass(frozen=True)
class PythonEnv:
    """The venv the repo's own environment manager made for the main checkout (python_env)."""

    venv: Path
    manager: str | None  # uv | poetry | pdm | hatch; None: a plain `.venv` of the main checkout
    how: str  # how it was found, for the ledger ("in-project .venv", "poetry's cache venv", ...)
    env: tuple[tuple[str, str], ...] = ()  # the manager's own switches: use this venv, offline, no sync


@dataclass(frozen=True)
class JobEnvironment:
    checkout: Path
    main_checkout: Path
    env: dict[str, str] = field(default_factory=dict)
    shares: tuple[Share, ...] = ()
    bind: bool = True  # shares as read-only bind mounts (bwrap); else symlinks (kept read-only by Landlock)
    copies: tuple[tuple[Path, Path], ...] = ()  # (source in the main checkout, target in the checkout)
    dirs: tuple[Path, ...] = ()  # private dirs to create (HOME, caches)
    readonly: tuple[Path, ...] = ()  # toolchain homes that must stay visible and unwritable
    risks: tuple[str, ...] = ()
    python_packages: tuple[str, ...] = ()
    node_package: str | None = None
    setup: tuple[str, ...] = ()
    python: str | None = None  # the autodetected plan's interpreter (`python`/`python3`): the probe runs it too
    python_env: PythonEnv | None = None  # the repo's venv, when one is used

    @property
    def ro_binds(self) -> tuple[tuple[Path, Path], ...]:
        return tuple((s.source, s.target) for s in self.shares) if self.bind else ()


# -- reading files the agent may have written: regular file only, no-follow, non-blocking, capped ------

def read_capped(path: Path, cap: int = MAX_READ) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            return None
        chunks, total = [], 0
        while total <= cap:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
            total += len(b)
        return b"".join(chunks) if total <= cap else None
    finally:
        os.close(fd)


def _toml(data: bytes | None) -> dict:
    if not data:
        return {}
    try:
        out = tomllib.loads(data.decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError:
        return {}
    return out if isinstance(out, dict) else {}


# -- settings --------------------------------------------------------------------------------------------

SETUP_LABEL = validate.SETUP_LABEL  # how a validation plan's setup steps are told from its tests


def base_file(git_dir: Path, base_sha: str, name: str = PROCTOR_TOML) -> bytes | None:
    """`name` as committed at the base, from git objects (never a checkout the agent could write)."""
    res = git(["cat-file", "blob", f"{base_sha}:{name}"], git_dir=git_dir)
    return res.out if res.ok and len(res.out) <= MAX_READ else None


def settings(repo_tables: Mapping[str, Mapping] | None, repo: Path, git_dir: Path,
             base_sha: str) -> RepoSettings | str:
    """config.toml's `[repos."<repo>"]` keys over the base's `.proctor.toml` keys, key by key (the
    operator's config wins). A str: why they could not be read (a risk; the defaults apply)."""
    committed: dict = {}
    raw = base_file(git_dir, base_sha)
    if raw is not None:
        try:
            committed = tomllib.loads(raw.decode("utf-8", "replace"))
        except tomllib.TOMLDecodeError as exc:
            return f"{PROCTOR_TOML} at the base is not valid TOML ({exc}): its keys were not used"
    mine = {}
    for key, table in (repo_tables or {}).items():
        if Path(key).resolve() == repo.resolve():
            mine = dict(table)
    merged = {**{k: v for k, v in committed.items()}, **mine}
    origin = " + ".join(x for x, on in ((f"{PROCTOR_TOML} at the base", bool(committed)),
                                         (f'config [repos."{repo}"]', bool(mine))) if on) or "defaults"
    try:
        return parse_settings(merged, origin)
    except ValueError as exc:
        return f"{exc}: the repo's keys were not used"


# -- detection -------------------------------------------------------------------------------------------

def _is_ident(name: str) -> bool:
    return name.isidentifier() and not name.startswith(".")


def python_layout(checkout: Path) -> tuple[Path | None, tuple[str, ...]]:
    """(import root, top-level packages/modules) of the Python project at `checkout`, or (None, ())."""
    py = _toml(read_capped(checkout / "pyproject.toml"))
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


# -- the repo's Python environment: found the way its manager finds it, without running the manager ------

POETRY_UNSAFE = re.compile(r'[ $`!*@"\\\r\n\t]')  # what poetry's EnvManager.generate_env_name replaces with "_"


def _canonical(name: str) -> str:
    """A project name as poetry-core and hatchling normalise it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _path_hash(path: Path) -> str:
    """poetry's and hatch's key for a project dir: urlsafe base64 of its path's sha256, 8 characters."""
    return base64.urlsafe_b64encode(hashlib.sha256(str(path).encode("utf-8")).digest()).decode()[:8]


def _xdg(host: Mapping[str, str], var: str, home: Path, default: str) -> Path:
    """An XDG base dir as platformdirs (poetry's, hatch's) finds it on Linux."""
    return Path(host[var]) if os.path.isabs(host.get(var, "")) else home / default


def _is_venv(p: Path) -> bool:
    return (p / "bin" / "python").exists()  # what the tools look for (a conda env has no pyvenv.cfg)


def _table(data: object, *keys: str) -> dict:
    for k in keys:
        data = data.get(k) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else {}


def _under(base: Path, raw: object) -> Path | None:
    """A configured path: absolute as is, else relative to `base`; None for anything but a non-empty str."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    return Path(raw) if os.path.isabs(raw) else base / raw


def _manager(main: Path, py: dict) -> tuple[str, str] | None:
    """(manager, what in the main checkout says so): the lockfile each tool writes first, then its own
    config (a library may leave poetry.lock uncommitted; the developer's checkout has it all the same).
    A build backend alone says nothing: hatchling and poetry-core build projects uv manages."""
    for manager, name in (("uv", "uv.lock"), ("poetry", "poetry.lock"), ("pdm", "pdm.lock"),
                          ("pdm", ".pdm-python"), ("hatch", "hatch.toml")):
        if (main / name).is_file():
            return manager, name
    if isinstance(_table(py, "tool").get("poetry"), dict):
        return "poetry", "[tool.poetry] in pyproject.toml"
    if _table(py, "tool", "hatch", "envs"):
        return "hatch", "[tool.hatch.envs] in pyproject.toml"
    return None


def _uv_venv(main: Path, py: dict, host: Mapping[str, str], home: Path) -> list[tuple[Path, str]]:
    given = _under(main, host.get("UV_PROJECT_ENVIRONMENT"))
    return [(given, "UV_PROJECT_ENVIRONMENT")] if given else [(main / ".venv", "in-project .venv")]


def poetry_env_name(name: str, project: Path) -> str:
    """poetry's EnvManager.generate_env_name: the project's name, then a hash of its dir (its venvs add
    `-py<X.Y>`). Checked against poetry 2.5.1 (tests/test_ecosystems.py)."""
    where = Path(os.path.normcase(os.path.realpath(project)))
    return f"{POETRY_UNSAFE.sub('_', _canonical(name))[:42]}-{_path_hash(where)}"


def hatch_env_path(data: Path, name: str, project: Path, home: Path, env_name: str = "default") -> Path:
    """hatch's VirtualEnvironment path for `env_name` of the project at `project`, its venvs under `data`
    (`<data>/<name>/<hash of the project dir>/<venv>`, flat when `data` is inside the project or is
    ~/.virtualenvs). Checked against hatch 1.18.2 (tests/test_ecosystems.py)."""
    name = _canonical(name)
    venv = name if env_name == "default" else env_name
    if Path(os.path.realpath(project)) in Path(os.path.realpath(data)).parents or data == home / ".virtualenvs":
        return data / venv
    return data / name / _path_hash(project) / venv


def _poetry_venv(main: Path, py: dict, host: Mapping[str, str], home: Path) -> list[tuple[Path, str]]:
    """In-project `.venv` (unless virtualenvs.in-project is false), then `{virtualenvs.path}/<name>-<hash>-
    py<X.Y>`: poetry's EnvManager.get, its settings read from the environment, the project's poetry.toml
    and the user's config.toml, in that order."""
    config_dir = Path(host.get("POETRY_CONFIG_DIR") or _xdg(host, "XDG_CONFIG_HOME", home, ".config") / "pypoetry")
    files = [_toml(read_capped(main / "poetry.toml")), _toml(read_capped(config_dir / "config.toml"))]

    def setting(var: str, *keys: str) -> object:
        if var in host:
            return host[var]
        for f in files:
            table = _table(f, *keys[:-1]) if len(keys) > 1 else f
            if keys[-1] in table:
                return table[keys[-1]]
        return None

    out: list[tuple[Path, str]] = []
    in_project = setting("POETRY_VIRTUALENVS_IN_PROJECT", "virtualenvs", "in-project")
    if str(in_project).lower() not in ("false", "0"):
        out.append((main / ".venv", "in-project .venv"))
    name = _table(py, "tool", "poetry").get("name") or _table(py, "project").get("name")
    if not isinstance(name, str) or not name:
        return out
    cache = setting("POETRY_CACHE_DIR", "cache-dir")
    if not isinstance(cache, str) or not cache:
        cache = str(_xdg(host, "XDG_CACHE_HOME", home, ".cache") / "pypoetry")
    where = setting("POETRY_VIRTUALENVS_PATH", "virtualenvs", "path")
    where = (where if isinstance(where, str) and where else "{cache-dir}/virtualenvs").replace("{cache-dir}", cache)
    venvs = Path(str(home) + where[1:] if where.startswith("~/") else where)
    base = poetry_env_name(name, main)
    # Which Python: the one `poetry env use` recorded in envs.toml, else the only one there is.
    minor = _table(_toml(read_capped(venvs / "envs.toml")), base).get("minor")
    found = sorted(venvs.glob(f"{glob.escape(base)}-py*")) if venvs.is_dir() else []
    if isinstance(minor, str):
        out.append((venvs / f"{base}-py{minor}", "poetry's venv (envs.toml)"))
    elif len(found) == 1:
        out.append((found[0], "poetry's venv"))
    elif found:
        which = f"one of poetry's {len(found)} venvs for it (envs.toml names none)"
        out.append((venvs / f"{base}-py?", which))
    else:
        out.append((venvs / f"{base}-py*", "poetry's venv"))  # none: named, so the risk says where
    return out


def _pdm_venv(main: Path, py: dict, host: Mapping[str, str], home: Path) -> list[tuple[Path, str]]:
    """The interpreter `pdm use` recorded in `.pdm-python` (its venv), then the in-project `.venv`."""
    out = []
    recorded = (read_capped(main / ".pdm-python", 4096) or b"").decode("utf-8", "replace").strip()
    if recorded and os.path.isabs(recorded):
        out.append((Path(recorded).parent.parent, ".pdm-python"))
    return [*out, (main / ".venv", "in-project .venv")]


def _hatch_venv(main: Path, py: dict, host: Mapping[str, str], home: Path) -> list[tuple[Path, str]]:
    """The default environment's venv: its `path` (hatch.toml, then pyproject's [tool.hatch]), else
    `<data>/env/virtual/<name>/<hash of the project dir>/<name>` (hatch's VirtualEnvironment)."""
    conf = _toml(read_capped(main / "hatch.toml"))
    given = (host.get("HATCH_ENV_TYPE_VIRTUAL_PATH") or _table(conf, "envs", "default").get("path")
             or _table(py, "tool", "hatch", "envs", "default").get("path"))
    if _under(main, given):
        return [(_under(main, given), "the default environment's path")]
    name = _table(py, "project").get("name")
    if not isinstance(name, str) or not name:
        return []
    config = _toml(read_capped(_xdg(host, "XDG_CONFIG_HOME", home, ".config") / "hatch" / "config.toml"))
    data = _under(main, _table(config, "dirs", "env").get("virtual"))
    if data is None:
        root = Path(host.get("HATCH_DATA_DIR") or _xdg(host, "XDG_DATA_HOME", home, ".local/share") / "hatch")
        data = root / "env" / "virtual"
    return [(hatch_env_path(data, name, main, home), "hatch's default environment")]


VENV_FINDERS = {"uv": _uv_venv, "poetry": _poetry_venv, "pdm": _pdm_venv, "hatch": _hatch_venv}


def _manager_switches(manager: str, venv: Path) -> tuple[tuple[str, str], ...]:
    """What keeps the manager's own `run` on this venv, offline and never syncing: `uv run` made a venv of
    its own in the checkout and went to the network (issue 24); poetry uses an active venv; pdm the
    interpreter it is given."""
    if manager == "uv":
        return (("UV_PROJECT_ENVIRONMENT", str(venv)), ("UV_NO_SYNC", "1"), ("UV_FROZEN", "1"), ("UV_OFFLINE", "1"),
                ("UV_PYTHON_DOWNLOADS", "never"))
    if manager == "poetry":
        return (("POETRY_VIRTUALENVS_CREATE", "false"),)
    if manager == "pdm":
        return (("PDM_PYTHON", str(venv / "bin" / "python")), ("PDM_CHECK_UPDATE", "false"))
    return ()


def python_env(main: Path, host: Mapping[str, str], home: Path) -> tuple[PythonEnv | None, str | None]:
    """The venv the repo's own manager made for the main checkout, as that tool would find it (read from
    files, never by running the tool), or a plain `.venv` there; (None, why) when the repo names a manager
    whose venv is not there. `host` is the user's environment (the tools' settings), `home` the user's."""
    py = _toml(read_capped(main / "pyproject.toml"))
    said = _manager(main, py)
    if said is not None:
        manager, because = said
        tried = VENV_FINDERS[manager](main, py, host, home)
        for venv, how in tried:
            if _is_venv(venv):
                return PythonEnv(venv, manager, f"{manager} ({because}): {how}", _manager_switches(manager, venv)), None
        looked = "; ".join(f"{how} {venv}" for venv, how in tried) or "its project has no name to find it by"
        why = (f"the repo uses {manager} ({because}) but its venv for the main checkout was not found "
               f"(looked for {looked})")
    else:
        why = None
    if _is_venv(main / ".venv"):
        return PythonEnv(main / ".venv", None, "the main checkout's .venv"), why
    return None, why


def _same(a: Path, b: Path, name: str) -> bool | None:
    """True identical, False different, None absent on both sides."""
    x, y = read_capped(a / name, 64 * MAX_READ), read_capped(b / name, 64 * MAX_READ)
    if x is None and y is None:
        return None
    return x == y


def _unchanged(checkout: Path, main: Path, names: Sequence[str]) -> tuple[bool, list[str]]:
    """Every named lockfile the validated tree has is byte-identical in the main checkout, and the tree has
    at least one. One only the main checkout has is not a difference: `npm install` in a repo that commits
    no lockfile writes an untracked `package-lock.json`, from the same manifest (`package.json`, itself in
    the list and compared)."""
    present, differ = [], []
    for n in names:
        if not os.path.lexists(checkout / n):
            continue
        present.append(n)
        if not _same(checkout, main, n):
            differ.append(n)
    return bool(present) and not differ, differ


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


# `copy` and `share` name paths in two trees others shape: the main checkout holds what the base branch
# committed (a committed `ph -> $PROCTOR_HOME` made `copy = ["ph/keys/host.key"]` copy the listener's key),
# the job's tree what the agent left (a tracked dir turned symlink had the host write a secret through it).
# Both are reached beneath their root with no symlink followed at any component (proctor.mechanisms.confine.beneath).

def _entry_beneath(root: Path, rel: str, want: int | None = None) -> str | None:
    """None when `rel` is absent beneath `root` (want=None) or is a `want` entry; "" when it is there (or
    not a `want`); else why it cannot be reached safely."""
    try:
        fd = beneath.open_root(root)
    except OSError as exc:
        return f"{root} cannot be opened: {exc.strerror}"
    try:
        st = beneath.lstat(fd, rel)
    except FileNotFoundError:
        return None if want is None else ""
    except OSError as exc:
        return f"{rel!r} cannot be reached: {beneath.why(exc)}"
    finally:
        os.close(fd)
    if want is None:
        return ""
    return None if stat.S_IFMT(st.st_mode) == want else ""


def _dir_beneath(root: Path, rel: str) -> bool:
    try:
        fd = beneath.open_root(root)
    except OSError:
        return False
    try:
        os.close(beneath.open_beneath(fd, rel, beneath.DIR_FLAGS))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- prepare ---------------------------------------------------------------------------------------------

def _target_dir_setting(config_dir: Path) -> str | None:
    for name in ("config.toml", "config"):
        raw = _table(_toml(read_capped(config_dir / name)), "build").get("target-dir")
        if isinstance(raw, str) and raw.strip():
            return raw
    return None


def cargo_target(checkout: Path, env: Mapping[str, str], cargo_home: Path) -> Path | None:
    """The CARGO_TARGET_DIR validation sets, or None: cargo's own choice, `<workspace>/target` wherever the
    workspace is in the checkout (a build script that writes there found no `target/` with the target dir
    under the job's tmp, issue 24), or the repo's `build.target-dir` inside it. Set only over a target dir
    validation cannot write: the repo's pointing outside the checkout, or the user's (CARGO_TARGET_DIR
    passed in, `build.target-dir` in CARGO_HOME's config: a shared dir, read-only or hidden to the job)."""
    raw = _target_dir_setting(checkout / ".cargo")
    if raw is not None:
        own = Path(os.path.normpath(checkout / raw))  # relative to the dir holding .cargo/
        if own == checkout or not own.is_relative_to(checkout):
            return checkout / "target"
        return own if "CARGO_TARGET_DIR" in env else None
    if "CARGO_TARGET_DIR" in env or _target_dir_setting(cargo_home) is not None:
        return checkout / "target"
    return None


def _venv_roots(venv: Path, main: Path) -> list[Path]:
    """What a venv outside the main checkout needs visible (read-only) in the sandbox, where the user's
    home is hidden: the venv (poetry's and hatch's live under ~/.cache and ~/.local/share) and the Python
    it was made from (`home` in its pyvenv.cfg: a pyenv or uv-managed install)."""
    out = [] if venv.resolve().is_relative_to(main) else [venv]
    cfg = (read_capped(venv / "pyvenv.cfg", 65536) or b"").decode("utf-8", "replace")
    for line in cfg.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home" and os.path.isabs(value.strip()):
            bindir = Path(os.path.realpath(value.strip()))
            prefix = bindir.parent if bindir.name == "bin" else bindir
            if prefix != Path("/") and prefix.parts[1:2] not in (("usr",), ("bin",), ("opt",)):
                out.append(prefix)
    return out



def prepare(checkout: Path, main_checkout: Path, plan: validate.Plan, base_config: RepoSettings | None = None,
            *, tmp: Path, env: Mapping[str, str] | None = None, bind: bool = True,
            host: Mapping[str, str] | None = None) -> JobEnvironment:
    """What validation of `checkout` (a tree the host made) needs, mirroring `main_checkout` (the user's).

    `tmp` is the job's private, writable dir for this run; `env` the environment validation would get
    otherwise (the agent's: the user's PATH, the job's HOME); `bind`: shares as bind mounts (bwrap) rather
    than symlinks; `host` the user's own environment (default: this process's), where the repo's tools
    put their venvs. Reads the checkout's files only as capped regular files; creates nothing (apply() does)."""
    cfg = base_config or RepoSettings()
    env = dict(env or os.environ)
    host = os.environ if host is None else host
    checkout, main = Path(checkout), Path(main_checkout).resolve()
    risks: list[str] = []
    extra: dict[str, str] = {}
    real_home = Path(env.get("HOME") or str(Path.home()))
    home = tmp / "home"
    cache = home / ".cache"
    dirs = [home, cache]
    readonly: list[Path] = []
    for var, rel in HOME_TOOLS:
        if var in env:
            continue
        p = real_home / rel
        if p.is_dir():
            extra[var] = str(p)
            readonly.append(p)
    extra.update({"HOME": str(home), "XDG_CACHE_HOME": str(cache), "XDG_CONFIG_HOME": str(home / ".config"),
                  "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_STATE_HOME": str(home / ".local" / "state")})
    dirs += [home / ".config", home / ".local" / "share", home / ".local" / "state"]
    # Writable caches: the job's own.
    extra["npm_config_cache"] = str(tmp / "npm-cache")
    extra["npm_config_update_notifier"] = "false"
    extra["npm_config_fund"] = "false"
    extra["npm_config_audit"] = "false"
    cargo_home = Path(env.get("CARGO_HOME") or Path(host.get("HOME") or Path.home()) / ".cargo")
    target = cargo_target(checkout, env, cargo_home)
    if target is not None:
        extra["CARGO_TARGET_DIR"] = str(target)
    extra["CARGO_NET_OFFLINE"] = "true"  # fail at once, not after a resolver's timeout
    extra["GOCACHE"] = str(tmp / "go-build")
    extra["GOPROXY"] = "off"  # the module cache is read-only and the network is off: fail at once
    extra["GOTOOLCHAIN"] = env.get("GOTOOLCHAIN", "local")
    extra["PIP_NO_INDEX"] = "1"
    dirs += [tmp / "npm-cache", tmp / "go-build"]
    if "GOMODCACHE" not in env:
        gm = Path(env.get("GOPATH") or str(real_home / "go")) / "pkg" / "mod"
        if gm.is_dir():
            extra["GOMODCACHE"] = str(gm)
            readonly.append(gm)

    # Python: the validated tree's import root first.
    root, pkgs = python_layout(checkout)
    penv: PythonEnv | None = None
    if root is not None:
        prior = env.get("PYTHONPATH", "")
        extra["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), prior) if x)
        extra["PYTHONDONTWRITEBYTECODE"] = "1"
        extra["PYTHONNOUSERSITE"] = env.get("PYTHONNOUSERSITE", "")
        if not extra["PYTHONNOUSERSITE"]:
            del extra["PYTHONNOUSERSITE"]
        penv, why = python_env(main, host, Path(host.get("HOME") or str(Path.home())))
        if penv is not None and penv.manager is None and "VIRTUAL_ENV" in env:
            penv = None  # a plain .venv of the main checkout gives way to a venv the caller made active
        if penv is not None and os.path.lexists(checkout / ".venv"):
            if penv.manager is not None:
                risks.append(f"{penv.manager}'s venv {penv.venv} not used: the job's tree has its own .venv")
            penv = None
        if why:
            risks.append(f"{why}: validation ran with " + (f"the main checkout's {penv.venv.name}" if penv
                                                           else "the interpreter on PATH"))
        if penv is not None:
            # The repo's own venv, used as the developer would (its interpreter, read-only): `python` on PATH
            # is its python, and the manager's own `run` stays on it.
            extra["VIRTUAL_ENV"] = str(penv.venv)
            extra["PATH"] = os.pathsep.join(x for x in (str(penv.venv / "bin"), env.get("PATH", "")) if x)
            extra.update(penv.env)
            readonly += [p for p in _venv_roots(penv.venv, main)
                         if not any(p == r or p.is_relative_to(r) for r in readonly)]  # ~/.pyenv: there already
            # Installed for the main checkout's lockfile: for another, the verdict would rest on dependencies
            # this tree does not declare (the LOCKFILES rule that holds for a share).
            _, differ = _unchanged(checkout, main, LOCKFILES[".venv"])
            if differ:
                risks.append(f"the venv {penv.venv} was installed for the main checkout's {', '.join(differ)}, "
                             "which the validated tree changed: validation ran with dependencies that may not be "
                             "this tree's")
    npkg = node_package(checkout)

    # Shares: configured, else autodetected (dirs the main checkout has that the tree lacks).
    wanted = cfg.share if cfg.share is not None else tuple(
        n for n in ("node_modules",) if (main / n).is_dir())
    shares: list[Share] = []
    for rel in wanted:
        src, dst = main / rel, checkout / rel
        if not _dir_beneath(main, rel):
            if cfg.share is not None:
                risks.append(f"share {rel!r} is not a directory inside the main checkout (reached with no "
                             "symlink on the way): not shared")
            continue
        there = _entry_beneath(checkout, rel)
        if there is not None:
            risks.append(f"share {rel!r} not used: " + (f"the job's tree has its own {rel}" if there == ""
                                                          else f"in the job's tree {there}"))
            continue
        names = LOCKFILES.get(Path(rel).name, ())
        if names:
            ok, differ = _unchanged(checkout, main, names)
            if not ok:
                why = (f"the lockfile changed ({', '.join(differ)})" if differ
                       else f"no lockfile ({', '.join(names[:3])}) pins it")
                risks.append(f"{rel} of the main checkout not shared: {why}; validation runs without it")
                continue
        shares.append(Share(src, dst, tuple(n for n in names if (checkout / n).exists())))
    copies: list[tuple[Path, Path]] = []
    for rel in cfg.copy:
        there = _entry_beneath(checkout, rel)
        if there is not None:
            risks.append(f"copy {rel!r} skipped: " + ("the job's tree has that path" if there == ""
                                                       else f"in the job's tree {there}; not copied"))
            continue
        source = _entry_beneath(main, rel, want=stat.S_IFREG)
        if source is not None:
            risks.append(f"copy {rel!r} skipped: " + ("not a regular file in the main checkout" if source == ""
                                                       else f"in the main checkout {source}; not copied"))
            continue
        copies.append((main / rel, checkout / rel))
    return JobEnvironment(checkout=checkout, main_checkout=main, env=extra, shares=tuple(shares), bind=bind,
                          copies=tuple(copies), dirs=tuple(dirs), readonly=tuple(readonly), risks=tuple(risks),
                          python_packages=pkgs, node_package=npkg, setup=cfg.setup,
                          python=next((st.argv[0] for st in plan.steps if st.argv
                                       and Path(st.argv[0]).name.startswith("python")), None),
                          python_env=penv if root is not None else None)


# Validation's own: its private HOME (before the agent, HOME stays the agent's, so what setup installs there
# the agent finds), and the switches that tell tools the network is off (a setup with `registries` has one).
NOT_BEFORE_THE_AGENT = frozenset({"HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"})
OFFLINE = {"PIP_NO_INDEX": "1", "CARGO_NET_OFFLINE": "true", "GOPROXY": "off", "UV_OFFLINE": "1"}
# With a network, setup may install (`uv sync`): into a venv of its own, never the main checkout's, which
# is read-only to it; these keep a manager on that venv and from installing, so they go too.
INSTALLS = frozenset({"UV_PROJECT_ENVIRONMENT", "UV_NO_SYNC", "UV_FROZEN", "POETRY_VIRTUALENVS_CREATE"})


def setup_env(jenv: JobEnvironment, *, network: bool) -> tuple[dict[str, str], tuple[Path, ...]]:
    """The variables the repo's setup gets before the agent, and the dirs they name: validation's own
    (PATH with the repo's `.venv/bin`, VIRTUAL_ENV, the tools' caches and settings), so a command runs the
    same before the agent as before validation (issue 24: `tox: not found` before the agent, found after),
    but for HOME, with a network the offline switches, and cargo's target dir: setup runs in the agent's
    worktree, whose content is the job's diff, so its build goes to the job's tmp (validation's builds in
    a checkout of its own, already taken)."""
    out = {k: v for k, v in jenv.env.items() if k not in NOT_BEFORE_THE_AGENT
           and not (network and (OFFLINE.get(k) == v or k in INSTALLS))}
    home = jenv.env.get("HOME")
    dirs = tuple(d for d in jenv.dirs if not (home and (d == Path(home) or Path(home) in d.parents)))
    if home:
        target = Path(home).parent / "cargo-target"  # home is <the run's tmp>/home (prepare)
        out["CARGO_TARGET_DIR"] = str(target)
        dirs = (*dirs, target)
    return out, dirs


def plan_for(plan: validate.Plan, cfg: RepoSettings | None, *, given: bool) -> validate.Plan:
    """The validation plan with the repo's `setup` steps first and its `validate` over autodetect (a
    request's own --validate-cmd, `given`, stays)."""
    if cfg is None:
        return plan
    steps = list(plan.steps)
    if cfg.validate and not given:
        steps = list(validate.given(cfg.validate).steps)
    if not steps:
        return plan
    setup = [validate.Step(f"{SETUP_LABEL}{c}", ("/bin/sh", "-c", c)) for c in cfg.setup]
    return validate.Plan(tuple(setup + steps))


def apply(jenv: JobEnvironment) -> str | None:
    """Create the private dirs, copy the copied files, and (without binds) link the shares. A str is why not."""
    try:
        for d in jenv.dirs:
            d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot prepare the job's environment: {exc}"
    # Checked in prepare() and again here, each open beneath its root: either tree may have changed since.
    try:
        main_fd, tree_fd = beneath.open_root(jenv.main_checkout), beneath.open_root(jenv.checkout)
    except OSError as exc:
        return f"cannot prepare the job's environment: {exc}"
    try:
        for src, dst in jenv.copies:
            rel = str(dst.relative_to(jenv.checkout))
            try:
                data = beneath.read_regular(main_fd, str(src.relative_to(jenv.main_checkout)), MAX_COPY)
            except OSError as exc:
                return f"copy {rel!r} not made: cannot read {src}: {beneath.why(exc)}"
            try:
                beneath.create_excl(tree_fd, rel, data)
            except OSError as exc:
                return f"copy {rel!r} not made: cannot write {dst}: {beneath.why(exc)}"
        if not jenv.bind:
            for s in jenv.shares:
                rel = str(s.target.relative_to(jenv.checkout))
                try:
                    beneath.symlink(tree_fd, rel, s.source)
                except OSError as exc:
                    return f"share {rel!r} not linked: {beneath.why(exc)}"
    finally:
        os.close(main_fd)
        os.close(tree_fd)
    return None


# -- check -----------------------------------------------------------------------------------------------

# The probe runs with the tree first on the import path: a root-level `json.py` answered it and removed the
# editable-install risk (found in review). So it imports nothing a file can shadow: `sys` is built in, the
# finder is the frozen importlib already loaded, and its answer is a Python literal (repr, a builtin) that
# the host reads with ast.literal_eval. Node's probe: `fs` and `path` are core modules, never from the tree.
PY_PROBE = """
import sys
find = sys.modules["_frozen_importlib"]._find_spec
out = {}
for name in sys.argv[1:]:
    try:
        spec = find(name, None)
    except Exception as exc:
        out[name] = {"error": repr(exc)[:300]}
        continue
    if spec is None:
        out[name] = {"missing": True}
        continue
    locs = list(spec.submodule_search_locations or [])
    out[name] = {"origin": spec.origin, "locations": locs}
print("PROCTOR-PROBE " + repr(out))
"""

NODE_PROBE = """
const fs = require('fs'), path = require('path');
const out = {self: null, entry: null, links: []};
const name = process.argv[1];
if (name) { try { out.self = fs.realpathSync(require.resolve(name, {paths: [process.cwd()]})); } catch (e) {} }
try { out.entry = fs.realpathSync(require.resolve(process.cwd())); } catch (e) {}
const nm = path.join(process.cwd(), 'node_modules');
function scan(dir, depth) {
  let ents = []; try { ents = fs.readdirSync(dir, {withFileTypes: true}); } catch (e) { return; }
  for (const e of ents) {
    const p = path.join(dir, e.name);
    if (e.name.startsWith('@') && e.isDirectory() && depth === 0) { scan(p, 1); continue; }
    if (e.isSymbolicLink()) { try { out.links.push([p, fs.realpathSync(p)]); } catch (err) {} }
  }
}
scan(nm, 0);
console.log('PROCTOR-PROBE ' + JSON.stringify(out));
"""

Probe = Callable[[list[str]], "tuple[int | None, bytes]"]


def probes(jenv: JobEnvironment, env: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(kind, argv) of each probe to run confined, in the checkout, with the job environment."""
    out = []
    path = {**env, **jenv.env}.get("PATH", "")
    if jenv.python_packages:
        py = (shutil.which(jenv.python, path=path) if jenv.python else None) \
            or shutil.which("python", path=path) or shutil.which("python3", path=path)
        if py:
            out.append(("python", [py, "-c", PY_PROBE, *jenv.python_packages]))
    if jenv.node_package is not None or jenv.shares:
        node = shutil.which("node", path=path)
        if node and (jenv.checkout / "package.json").exists():
            out.append(("node", [node, "-e", NODE_PROBE, jenv.node_package or ""]))
    return out


def _parse(raw: bytes) -> dict | None:
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("PROCTOR-PROBE "):
            text = line[len("PROCTOR-PROBE "):]
            try:
                val = json.loads(text) if text.startswith("{\"") or text == "{}" else ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            return val if isinstance(val, dict) else None
    return None


def judge(jenv: JobEnvironment, kind: str, raw: bytes) -> tuple[list[str], dict]:
    """Risks from one probe's output: the code under test resolving outside the validated tree."""
    data = _parse(raw)
    if data is None:
        return [f"the {kind} import probe gave no answer: where the code under test resolves is unknown"], {}
    checkout = jenv.checkout.resolve()
    shared = [s.source.resolve() for s in jenv.shares]
    # A share is mounted (or linked) into the tree, but it is the main checkout's dependencies, not the
    # job's code: a package under test found there (a copy installed into node_modules or .venv) is outside.
    mounted = [base / s.target.relative_to(jenv.checkout) for s in jenv.shares
               if s.target.is_relative_to(jenv.checkout) for base in (jenv.checkout, checkout)]

    def job_code(p: Path) -> bool:
        lexical = Path(os.path.normpath(p))
        return _inside(p.resolve(), checkout) and not any(_inside(lexical, m) for m in mounted)

    risks: list[str] = []
    if kind == "python":
        for name, info in data.items():
            if not isinstance(info, dict) or "origin" not in info:
                continue
            where = [p for p in [info.get("origin"), *(info.get("locations") or [])] if isinstance(p, str)
                     and p not in ("built-in", "frozen", "namespace")]
            outside = [p for p in where if not job_code(Path(p))]
            if outside:
                risks.append(f"the package under test {name!r} resolves outside the validated tree "
                             f"({outside[0]}): validation did not test the job's code")
        return risks, data
    for key in ("self", "entry"):  # `require(name)` (a stale copy?), and the package's own entry point
        found = data.get(key)
        if isinstance(found, str) and not job_code(Path(found)):
            risks.append(f"the package under test {jenv.node_package!r} resolves outside the validated tree "
                         f"({found}): validation did not test the job's code")
    main = jenv.main_checkout
    for link in data.get("links") or []:
        if not (isinstance(link, list) and len(link) == 2 and isinstance(link[1], str)):
            continue
        real = Path(link[1])
        if _inside(real, main) and not any(_inside(real, s) for s in shared):
            risks.append(f"node_modules links back into the main checkout: {link[0]} -> {real}")
    return risks[:5], data


def check(jenv: JobEnvironment, env: Mapping[str, str], probe: Probe) -> tuple[list[str], dict]:
    """Run each probe (`probe(argv) -> (exit, stdout)`, confined by the caller, cwd the checkout, env the
    job's) and judge it. Returns the risks and what each probe found (for the result's details)."""
    risks: list[str] = []
    found: dict = {}
    for kind, argv in probes(jenv, env):
        code, out = probe(argv)
        r, data = judge(jenv, kind, out if code == 0 else b"")
        risks += r
        found[kind] = data
    return risks, found


def describe(jenv: JobEnvironment) -> dict:
    """For the ledger: what the environment was (never secrets' contents)."""
    penv = jenv.python_env
    return {"shares": [f"{s.source} -> {s.target}" for s in jenv.shares], "bind": jenv.bind,
            "copies": [str(d) for _, d in jenv.copies], "python_packages": list(jenv.python_packages),
            "node_package": jenv.node_package, "setup": [shlex.quote(c) for c in jenv.setup],
            "env": sorted(jenv.env),
            "python_env": {"venv": str(penv.venv), "manager": penv.manager, "found": penv.how} if penv else None,
            "cargo_target": jenv.env.get("CARGO_TARGET_DIR") or "cargo's default (the workspace's target/)"}
