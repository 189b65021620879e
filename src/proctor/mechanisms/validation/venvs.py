"""The repo's Python environment: the venv its own manager (uv, poetry, pdm, hatch) made for the main
checkout, found the way that tool finds it, from files only (`uv.lock` -> uv, `poetry.lock` -> poetry,
`pdm.lock` -> pdm, `hatch.toml` -> hatch, else a plain `.venv`), with the manager's switches that keep its
`run` on it, offline, never syncing; and what of it must stay visible to the sandbox. It never runs the
manager and never creates nor changes a venv.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.validation.capped import parse_toml, read_capped, toml_table


@dataclass(frozen=True)
class PythonEnv:
    """The venv the repo's own environment manager made for the main checkout (python_env)."""

    venv: Path
    manager: str | None  # uv | poetry | pdm | hatch; None: a plain `.venv` of the main checkout
    how: str  # how it was found, for the ledger ("in-project .venv", "poetry's cache venv", ...)
    env: tuple[tuple[str, str], ...] = ()  # the manager's own switches: use this venv, offline, no sync


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
    if isinstance(toml_table(py, "tool").get("poetry"), dict):
        return "poetry", "[tool.poetry] in pyproject.toml"
    if toml_table(py, "tool", "hatch", "envs"):
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
    files = [parse_toml(read_capped(main / "poetry.toml")), parse_toml(read_capped(config_dir / "config.toml"))]

    def setting(var: str, *keys: str) -> object:
        if var in host:
            return host[var]
        for f in files:
            table = toml_table(f, *keys[:-1]) if len(keys) > 1 else f
            if keys[-1] in table:
                return table[keys[-1]]
        return None

    out: list[tuple[Path, str]] = []
    in_project = setting("POETRY_VIRTUALENVS_IN_PROJECT", "virtualenvs", "in-project")
    if str(in_project).lower() not in ("false", "0"):
        out.append((main / ".venv", "in-project .venv"))
    name = toml_table(py, "tool", "poetry").get("name") or toml_table(py, "project").get("name")
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
    minor = toml_table(parse_toml(read_capped(venvs / "envs.toml")), base).get("minor")
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
    conf = parse_toml(read_capped(main / "hatch.toml"))
    given = (host.get("HATCH_ENV_TYPE_VIRTUAL_PATH") or toml_table(conf, "envs", "default").get("path")
             or toml_table(py, "tool", "hatch", "envs", "default").get("path"))
    if _under(main, given):
        return [(_under(main, given), "the default environment's path")]
    name = toml_table(py, "project").get("name")
    if not isinstance(name, str) or not name:
        return []
    config = parse_toml(read_capped(_xdg(host, "XDG_CONFIG_HOME", home, ".config") / "hatch" / "config.toml"))
    data = _under(main, toml_table(config, "dirs", "env").get("virtual"))
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
    py = parse_toml(read_capped(main / "pyproject.toml"))
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


def venv_roots(venv: Path, main: Path) -> list[Path]:
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

