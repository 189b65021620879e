"""What of the host reaches a job's agent: a declared environment, a HOME of the job's own, and a per-job
copy of its adapter's state dirs (DESIGN.md 9a: nothing of the host's reaches a job unless declared).

Owns four things, as data and small functions:

    declared_env(host_env, spec, env_pass) -> Declared     the basics, the adapter's credentials and the
                        user's `env_pass`, never the host's whole environment (issue 21: a key exported for
                        proctor reached every agent and the code under test)
    hidden_home(user_home, keep) -> paths to hide           the user's home, expanded around what the job
                        needs from it (toolchains, the agent's install, `read_home`)
    copy_state(job_home, user_home, spec) -> StateCopy | str   the adapter's state dirs copied under the
                        job's HOME (its private tmp, so their growth counts toward the disk limit)
    settle(copy) -> Settled                                 after the agent: a change to its login said
                        (never written back), to the CLI's config, hooks or extensions a risk; all dropped

Why a copy (issue 21, 22): a job appended an MCP server to the shared ~/.codex/config.toml and the next job,
another ticket, ran it at session start, before any gated call. It never spawns and never confines: the
host hands the paths to proctor.mechanisms.confine.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.confine.roots import around
from proctor.mechanisms.validation.environment import HOME_TOOLS
from proctor.mechanisms.validation.capped import read_capped

# Passed from the host whatever the adapter: what a CLI needs to find programs, speak the user's language
# and draw its output. Never proxies (the confinement gives its own), never GIT_* (proctor.mechanisms.git.command).
BASICS = ("PATH", "LANG", "LANGUAGE", "TERM", "COLORTERM", "NO_COLOR", "TZ", "USER", "LOGNAME", "SHELL")
# A state dir larger than this is refused rather than copied for every job: `state_skip` its history.
COPY_CAP = 256 << 20
COPY_ENTRIES = 20_000
KEEP_CAP = 1 << 20  # a login file is small; a larger one is not read for whose it is
MAX_HIDDEN = 2000
# Never hidden as a whole, whatever $HOME says (root's HOME may be /).
_SYSTEM = frozenset(Path(p) for p in ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/var",
                                      "/tmp", "/proc", "/dev", "/sys", "/run"))


# -- the environment --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Declared:
    env: dict[str, str]
    names: tuple[str, ...]  # passed from the host, sorted (the result lists these, never values)
    credentials: tuple[str, ...]  # of those, the adapter's login: the agent's process only


def credential_names(spec: AdapterSpec) -> tuple[str, ...]:
    """The variables that carry the adapter's login or pick its credential pool."""
    names = [*spec.credentials, *spec.pool_env, *([spec.api_key_env] if spec.api_key_env else [])]
    return tuple(dict.fromkeys(names))


def declared_env(host: Mapping[str, str], spec: AdapterSpec, env_pass: Sequence[str] = ()) -> Declared:
    wanted = [*BASICS, *(k for k in host if k.startswith("LC_")), *credential_names(spec), *spec.env_pass,
              *env_pass]
    env = {k: host[k] for k in dict.fromkeys(wanted) if k in host}
    env.update({k: v for k, v in toolchains(host).items() if k not in env})
    creds = tuple(k for k in credential_names(spec) if k in env)
    return Declared(env, tuple(sorted(env)), creds)


def toolchains(host: Mapping[str, str]) -> dict[str, str]:
    """The toolchain homes found through $HOME (environment.HOME_TOOLS), pinned to the user's: HOME is the
    job's, and a rustup proxy or pyenv shim on PATH finds its toolchain only through these."""
    home = host.get("HOME") or str(Path.home())
    out = {}
    for var, rel in HOME_TOOLS:
        if host.get(var):
            out[var] = host[var]
        elif os.path.isabs(home) and os.path.isdir(os.path.join(home, rel)):
            out[var] = os.path.join(home, rel)
    return out


# -- the user's home, hidden around what the job needs -------------------------------------------------------

def user_home(host: Mapping[str, str]) -> Path | None:
    """The home proctor's user keeps secrets in ($HOME), or None when hiding it would hide the system."""
    raw = host.get("HOME") or str(Path.home())
    if not os.path.isabs(raw) or not os.path.isdir(raw):
        return None
    home = Path(os.path.realpath(raw))
    return None if home in _SYSTEM else home


def home_keep(home: Path, host: Mapping[str, str], read_home: Sequence[str], programs: Iterable[str]) -> list[Path]:
    """What stays readable inside the hidden home: the toolchains validation needs (environment.HOME_TOOLS,
    at their variable's path or the default), the PATH's folders in it and the agent program's install
    root (an npm prefix, a venv), and the user's `read_home` entries ("~/x" or relative to the home)."""
    cands: list[Path] = []
    for var, rel in HOME_TOOLS:
        cands.append(Path(host[var]) if os.path.isabs(host.get(var, "")) else home / rel)
    cands += [Path(d) for d in host.get("PATH", "").split(os.pathsep) if os.path.isabs(d)]
    for prog in programs:
        cands += install_roots(prog)
    for entry in read_home:
        rel = entry[2:] if entry.startswith("~/") else entry
        cands.append(Path(rel) if os.path.isabs(rel) else home / rel)
    keep: list[Path] = []
    for c in cands:
        if not os.path.lexists(c):
            continue
        for p in (Path(os.path.abspath(c)), Path(os.path.realpath(c))):
            if p != home and p.is_relative_to(home) and p not in keep:
                keep.append(p)
    return keep


def install_roots(program: str) -> list[Path]:
    """What running `program` needs to read: `<root>/bin/<exe>` keeps `<root>`; a file inside an npm tree
    keeps the folder holding its outermost node_modules (the package's dependencies sit beside it)."""
    roots: list[Path] = []
    for p in (Path(os.path.abspath(program)), Path(os.path.realpath(program))):
        parts = p.parts
        if "node_modules" in parts:
            roots.append(Path(*parts[:parts.index("node_modules")]))
        roots.append(p.parent.parent if p.parent.name == "bin" else p.parent)
    return roots


# What an install root (a prefix, a venv, an npm tree) holds; anything else in it is the person's own files,
# which keeping the root readable shows the agent too.
INSTALL_ENTRIES = frozenset(("bin", "sbin", "lib", "lib32", "lib64", "libexec", "share", "include", "etc", "man",
                             "node_modules", "pyvenv.cfg", "package.json", "package-lock.json", "conda-meta", "pkgs",
                             "LICENSE", "README.md", ".bin", "Scripts", "cfg"))


def exposes_more(program: str, home: Path) -> str | None:
    """Why running `program` shows the agent more of the home than its install: its root (`X` of `X/bin/p`)
    holds entries no install has (`X/notes`, `X/.env`), all readable by the job. None when it does not."""
    for root in dict.fromkeys(install_roots(program)):
        if root == home or not root.is_relative_to(home):
            continue
        try:
            others = sorted(e.name for e in os.scandir(root) if e.name not in INSTALL_ENTRIES)
        except OSError:
            continue
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            return (f"the agent's program {program} keeps all of {root} readable to the job (it runs from "
                    f"{root}'s bin/), and {root} holds more than an install: {shown}; move the program to a "
                    "folder of its own")
    return None


def hidden_home(home: Path, keep: Sequence[Path]) -> tuple[Path, ...] | str:
    """`home` as the paths to hide: itself, or its other entries along the way down to each kept path
    (confine hides those: an empty mount under bwrap, no read rule under Landlock). A str when the home
    holds too many entries around them to name."""
    inside = [k for k in keep if k == home or k.is_relative_to(home)]
    if home in inside:
        return ()
    if not inside:
        return (home,)
    out: list[Path] = []
    for p in around(home, inside):
        out.append(p)
        if len(out) > MAX_HIDDEN:
            return f"the home {home} holds more than {MAX_HIDDEN} entries around what the job needs"
    return tuple(out)


# -- the state copy ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StateDir:
    raw: str  # "~/.codex", as the adapter declares it
    source: Path  # the user's
    copy: Path  # the job's, under its HOME


@dataclass
class StateCopy:
    home: Path
    user_home: Path
    dirs: tuple[StateDir, ...]
    keep: dict[str, str | None]  # "~/x" -> the digest both sides had when copied (None: absent)
    watch: dict[str, str]  # "~/x[#key]" -> digest, of the copy as the job got it
    spec: AdapterSpec
    copied_bytes: int = 0
    copied_files: int = 0
    ms: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, object]:
        return {"dirs": [d.raw for d in self.dirs], "home": str(self.home), "copied_bytes": self.copied_bytes,
                "copied_files": self.copied_files, "ms": round(self.ms, 1), "skipped": self.skipped[:20],
                "keep": list(self.keep)}


def _under(home: Path, raw: str) -> Path:
    return home if raw == "~" else home / raw[2:]


def copy_state(job_home: Path, home: Path, spec: AdapterSpec) -> StateCopy | str:
    """The adapter's state dirs (and files) copied from `home` into `job_home` at the same relative paths;
    what `state_skip` names is left out. A str (why) when a state dir is over the copy cap."""
    start = time.monotonic()
    job_home.mkdir(mode=0o700, parents=True, exist_ok=True)
    budget = _Budget()
    dirs: list[StateDir] = []
    skipped: list[str] = []
    for raw in spec.state_dirs:
        if not (raw == "~" or raw.startswith("~/")):
            continue  # an absolute state path is the user's choice to share; granted as it is
        src, dst = _under(home, raw), _under(job_home, raw)
        dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            if os.path.isfile(src):
                budget.take(src, os.path.getsize(src))
                shutil.copyfile(src, dst)
                os.chmod(dst, stat.S_IMODE(os.stat(src).st_mode) | 0o600)
            elif os.path.isdir(src):
                _copy_tree(src, dst, raw, spec.state_skip, budget, skipped)
            else:
                dst.mkdir(mode=0o700, exist_ok=True)
        except _OverCap as exc:
            return (f"the state dir {raw} of agent {spec.name!r} is over the per-job copy cap ({exc}): name its "
                    "session records and caches in the adapter's state_skip")
        except OSError as exc:
            return f"the state dir {raw} of agent {spec.name!r} could not be copied for the job: {exc}"
        dirs.append(StateDir(raw, src, dst))
    try:
        _seed(job_home, spec.state_seed)
    except OSError as exc:
        return f"the state of agent {spec.name!r} could not be seeded for the job: {exc}"
    keep = {raw: _digest(_under(job_home, raw)) for raw in spec.state_keep}
    watch = _watch(job_home, spec.state_watch, spec.state_skip)
    return StateCopy(job_home, home, tuple(dirs), keep, watch, spec, budget.bytes, budget.files,
                     (time.monotonic() - start) * 1000, skipped)


def _seed(job_home: Path, seeds: Mapping[str, str]) -> None:
    """The adapter's `state_seed` entries the copy lacks: a folder for a path ending in "/", else a file."""
    for raw, text in seeds.items():
        target = _under(job_home, raw.rstrip("/"))
        if os.path.lexists(target):
            continue
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if raw.endswith("/"):
            target.mkdir(mode=0o700)
        else:
            target.write_text(text)


class _OverCap(Exception):
    pass


class _Budget:
    def __init__(self) -> None:
        self.bytes = self.files = 0

    def take(self, path: Path | str, size: int) -> None:
        self.bytes += size
        self.files += 1
        if self.bytes > COPY_CAP or self.files > COPY_ENTRIES:
            raise _OverCap(f"{COPY_CAP >> 20} MiB or {COPY_ENTRIES} files; reached at {path}")


def _copy_tree(src: Path, dst: Path, raw: str, skip: Sequence[str], budget: _Budget, skipped: list[str]) -> None:
    """Regular files and folders; a symlink to a file is copied as the file (a dotfile manager's link),
    anything else (a link to a folder, a socket, a FIFO) is left out and named."""
    dst.mkdir(mode=0o700, exist_ok=True)
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        rel = f"{raw}/{e.name}"
        if any(fnmatch.fnmatchcase(rel, pat) for pat in skip):
            continue
        target = dst / e.name
        if e.is_dir(follow_symlinks=False):
            _copy_tree(Path(e.path), target, rel, skip, budget, skipped)
        elif e.is_file(follow_symlinks=True) and not (e.is_symlink() and os.path.isdir(e.path)):
            st = os.stat(e.path)
            budget.take(e.path, st.st_size)
            shutil.copyfile(e.path, target)
            os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777 | 0o600)
        else:
            skipped.append(rel)


def _digest(path: Path, key: str | None = None) -> str | None:
    """sha256 of a regular file's bytes (or one top-level JSON key's value), read no-follow and capped;
    None when absent; a marker when it is not a regular file or too large."""
    if not os.path.lexists(path):
        return None
    data = read_capped(path, KEEP_CAP if key is None else 16 * KEEP_CAP)
    if data is None:
        try:
            st = os.lstat(path)
            return f"unreadable:{stat.S_IFMT(st.st_mode)}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            return None
    if key is not None:
        try:
            doc = json.loads(data)
        except ValueError:
            return "not-json:" + hashlib.sha256(data).hexdigest()
        value = doc.get(key) if isinstance(doc, dict) else None
        if value in (None, {}, []):
            return None  # a CLI that writes its state file on first run with an empty table added nothing
        data = json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def _watch(home: Path, entries: Sequence[str], skip: Sequence[str] = ()) -> dict[str, str]:
    """Every watched file under `home` with its digest: a folder entry stands for every file below it, but
    what `skip` names (the CLI's own, regenerated each run: codex's bundled `skills/.system`)."""
    out: dict[str, str] = {}
    for entry in entries:
        raw, _, key = entry.partition("#")
        path = _under(home, raw)
        if key:
            d = _digest(path, key)
            if d is not None:
                out[entry] = d
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            for root, dirnames, files in os.walk(path):
                dirnames.sort()
                for name in sorted(files):
                    p = Path(root) / name
                    rel = f"{raw}/{p.relative_to(path)}"
                    if any(fnmatch.fnmatchcase(rel, pat) or rel.startswith(pat.rstrip("/") + "/") for pat in skip):
                        continue
                    d = _digest(p)
                    if d is not None:
                        out[rel] = d
        else:
            d = _digest(path)
            if d is not None:
                out[raw] = d
    return out


# -- after the agent ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settled:
    login_changed: tuple[str, ...] = ()  # login files the job changed: never written back to the user's
    rotated: tuple[str, ...] = ()  # of those, the ones whose refresh token changed (the user's may be spent)
    other_account: tuple[str, ...] = ()  # of those, the ones that now name another account: a risk
    changed_config: tuple[str, ...] = ()  # watched entries the job changed: a risk each


# Fields of a login file that say whose it is (at any depth), and a JWT's claims that do: a refresh changes
# the tokens, never these. A key (`OPENAI_API_KEY`) is one too: a refresh never replaces one.
IDENTITY_KEY = re.compile(r"account|email|^sub$|user|org|tenant|workspace|api_?key|client_id|project", re.I)
JWT_CLAIMS = ("sub", "email", "iss", "aud", "org_id", "account_id")


def _claims(token: str) -> dict[str, object] | None:
    parts = token.split(".")
    if len(parts) != 3 or len(token) > 16384:
        return None
    try:
        body = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return None
    return {k: body.get(k) for k in JWT_CLAIMS} if isinstance(body, dict) else None


def _fields(data: bytes, wanted: Callable[[str], bool]) -> object:
    """The JSON fields of `data` whose key `wanted` takes, with their paths (the bytes' digest when it is not
    JSON: then only an unchanged file has the same ones)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return hashlib.sha256(data).hexdigest()
    found: list[tuple[str, object]] = []

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict):
            for k, v in sorted(value.items()):
                if isinstance(v, (dict, list)):
                    walk(v, f"{path}.{k}")
                elif wanted(str(k)):
                    found.append((f"{path}.{k}", v))
                elif isinstance(v, str) and v.count(".") == 2 and wanted("#claims") and (claims := _claims(v)):
                    found.append((f"{path}.{k}#claims", claims))
        elif isinstance(value, list):
            for i, v in enumerate(value[:100]):
                walk(v, f"{path}[{i}]")

    walk(doc, "")
    return found


def identity(data: bytes) -> object:
    """Whose login `data` says it is: its identity fields and its JWTs' identity claims (never the tokens).
    Only what the file says: the agent writes the job's copy, so a match proves nothing, and a mismatch
    is a risk."""
    return _fields(data, lambda k: k == "#claims" or (
        IDENTITY_KEY.search(k) is not None and re.search(r"token|expir|refresh", k, re.I) is None))


def settle(copy: StateCopy) -> Settled:
    """After the job: its changes to the login files (`state_keep`) and to watched config, said; nothing
    of its state is written back, and everything it wrote there goes with its private tmp.

    A login the job changed is never written back (issue 39): whose it is can be judged only on something
    the agent cannot write, a signature checked against the issuer's keys or the issuer's own answer to
    the host, and the job's copy is the agent's (found in review: an attacker's tokens paired with the
    user's copied id_token, an opaque token with no identity in it, and a refresh the agent made itself
    through the allowed issuer all passed the checks that read the copy). A refresh that rotated the
    refresh token leaves the user's spent: said, so the person logs in again."""
    changed, rotated, other = [], [], []
    for raw, before in copy.keep.items():
        now = _digest(_under(copy.home, raw))
        if now == before or now is None or now.startswith("unreadable:"):
            continue
        changed.append(raw)
        data = read_capped(_under(copy.home, raw), KEEP_CAP)
        target = _under(copy.user_home, raw)
        theirs = read_capped(target, KEEP_CAP) if os.path.lexists(target) else None
        if data is None or theirs is None:
            continue
        if identity(data) != identity(theirs):
            other.append(raw)
        if _fields(data, _refresh) != _fields(theirs, _refresh):
            rotated.append(raw)
    after = _watch(copy.home, copy.spec.state_watch, copy.spec.state_skip)
    watched = sorted(k for k in set(after) | set(copy.watch) if after.get(k) != copy.watch.get(k))
    return Settled(tuple(changed), tuple(rotated), tuple(other), tuple(watched))


def _refresh(key: str) -> bool:
    return re.search(r"refresh", key, re.I) is not None
