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

It composes the folder's parts and is the face the services use: the value (job_environment), where the
code under test is (layout), the repo's venv (venvs), what of the main checkout is shared or copied
(shares), the import probe (probe), files read capped (capped).

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

import os
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.validation import plan as validate
from proctor.mechanisms.config.settings import RepoSettings, parse_settings
from proctor.mechanisms.git.command import git
from proctor.mechanisms.validation.capped import MAX_READ, parse_toml, read_capped, toml_table
from proctor.mechanisms.validation.job_environment import JobEnvironment
from proctor.mechanisms.validation.layout import node_package, python_layout
from proctor.mechanisms.validation.shares import LOCKFILES, copies_for, lay_layer, lockfiles_unchanged, shares_for
from proctor.mechanisms.validation.venvs import PythonEnv, python_env, venv_roots

PROCTOR_TOML = ".proctor.toml"
MAX_COPY = 16 * 1024 * 1024

# Toolchain homes found through $HOME: pinned to the real path when HOME moves (read-only to the job).
HOME_TOOLS = (("CARGO_HOME", ".cargo"), ("RUSTUP_HOME", ".rustup"), ("PYENV_ROOT", ".pyenv"),
              ("NVM_DIR", ".nvm"), ("GOPATH", "go"), ("PYTHONUSERBASE", ".local"), ("ASDF_DATA_DIR", ".asdf"),
              ("VOLTA_HOME", ".volta"), ("BUN_INSTALL", ".bun"), ("DENO_DIR", ".cache/deno"))


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


# -- prepare ---------------------------------------------------------------------------------------------

def _target_dir_setting(config_dir: Path) -> str | None:
    for name in ("config.toml", "config"):
        raw = toml_table(parse_toml(read_capped(config_dir / name)), "build").get("target-dir")
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
            readonly += [p for p in venv_roots(penv.venv, main)
                         if not any(p == r or p.is_relative_to(r) for r in readonly)]  # ~/.pyenv: there already
            # Installed for the main checkout's lockfile: for another, the verdict would rest on dependencies
            # this tree does not declare (the LOCKFILES rule that holds for a share).
            _, differ = lockfiles_unchanged(checkout, main, LOCKFILES[".venv"])
            if differ:
                risks.append(f"the venv {penv.venv} was installed for the main checkout's {', '.join(differ)}, "
                             "which the validated tree changed: validation ran with dependencies that may not be "
                             "this tree's")
    active = env.get("VIRTUAL_ENV") or host.get("VIRTUAL_ENV")
    if penv is None and active and Path(active).is_dir():
        # The venv proctor was started in, used through PATH: shown read-only to the sandbox, so a command
        # that names `python` inside a shell string (`validate = "python manage.py test"`, a project with no
        # pyproject) finds it where a private /tmp or a hidden home would otherwise hide it.
        readonly += [p for p in venv_roots(Path(active), main)
                     if not any(p == r or p.is_relative_to(r) for r in readonly)]
    npkg = node_package(checkout)

    shares, not_shared = shares_for(checkout, main, cfg)
    copies, not_copied = copies_for(checkout, main, cfg)
    risks += not_shared + not_copied
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
        for s in jenv.shares:
            rel = str(s.target.relative_to(jenv.checkout))
            try:
                if s.layer:
                    lay_layer(tree_fd, s, rel)
                elif not jenv.bind:
                    beneath.symlink(tree_fd, rel, s.source)
            except OSError as exc:
                return f"share {rel!r} not laid in: {beneath.why(exc)}"
    finally:
        os.close(main_fd)
        os.close(tree_fd)
    return None


def describe(jenv: JobEnvironment) -> dict:
    """For the ledger: what the environment was (never secrets' contents)."""
    penv = jenv.python_env
    return {"shares": [f"{s.source} -> {s.target}" for s in jenv.shares], "bind": jenv.bind,
            "copies": [str(d) for _, d in jenv.copies], "python_packages": list(jenv.python_packages),
            "node_package": jenv.node_package, "setup": [shlex.quote(c) for c in jenv.setup],
            "env": sorted(jenv.env),
            "python_env": {"venv": str(penv.venv), "manager": penv.manager, "found": penv.how} if penv else None,
            "cargo_target": jenv.env.get("CARGO_TARGET_DIR") or "cargo's default (the workspace's target/)"}
