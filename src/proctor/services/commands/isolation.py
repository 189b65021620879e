"""What a command may not read, and the minimal sandbox that hides it when the entry runs unconfined.

Owns three things. `hidden_paths`: `$PROCTOR_HOME` (keys, ledger, policy, trust files) always; the user's
home (`$HOME` and the uid's login home) and `$XDG_RUNTIME_DIR` unless the entry says `read_home = true`.
A hidden folder that holds something the command needs (the project, its git dirs, the program's install
root, the entry's exec paths) is hidden entry by entry around it, so Landlock (which cannot re-grant a read
under a hidden path) and bwrap see the same set. `unconfined`: an entry without a confined profile still
runs inside bwrap (reusing `proctor.mechanisms.confine`, bwrap layer only, network on, host /tmp and /var/tmp shared),
with the hidden paths empty, `/` read-only but for the project, its git dirs and the temp dirs, and the
git dirs' `config`/`hooks` read-only; where bwrap cannot run, it runs as before and the result says what
stayed readable. `HomeWatch`: without a mount namespace, the host still fingerprints the home's startup and
credential files, so a write to `~/.bashrc` is at least seen.
It never spawns anything and never decides whether a run passed.
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.services.commands.allowlist import Entry
from proctor.services.commands.controlplane import ControlPlane, Fingerprint, fingerprint, real
from proctor.mechanisms.confine import Capabilities, ConfineRequest, LayeredConfiner, Unavailable, detect
from proctor.mechanisms.confine.bwrap import tmpfs_dirs
from proctor.mechanisms.confine.roots import around

# Folders hiding which would hide the system itself: never hidden as a whole, whatever $HOME says.
_SYSTEM = tuple(Path(p) for p in ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/var",
                                  "/tmp", "/proc", "/dev", "/sys", "/run"))
# Expanding a hidden folder around the paths it must keep: at most this many entries (then refused).
MAX_HIDDEN = 2000
# Startup and credential files of a home, and folders whose every entry runs or authenticates something,
# whose change, without a mount namespace, is reported. Not the whole top level, nor ~/.config itself: other
# programs of the user's change those all the time, and a false alarm fails the run.
HOME_WATCH = (".bashrc", ".bash_profile", ".bash_login", ".profile", ".zshrc", ".zshenv", ".zprofile",
              ".zlogin", ".bash_logout", ".inputrc", ".gitconfig", ".ssh", ".ssh/authorized_keys", ".ssh/config",
              ".ssh/rc", ".config/git/config", ".config/git/attributes", ".config/autostart",
              ".config/systemd/user", ".config/fish/config.fish", ".local/bin", ".pypirc", ".npmrc", ".netrc",
              ".docker/config.json", ".aws/credentials", ".aws/config", ".kube/config", ".gnupg/gpg.conf",
              ".gnupg/gpg-agent.conf")


def user_homes() -> list[Path]:
    """`$HOME` and the login home of this uid, real paths, without the system folders."""
    found: list[Path] = []
    raw = [os.environ.get("HOME")]
    try:
        raw.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    for h in raw:
        if h and os.path.isabs(h) and os.path.isdir(h):
            p = real(h)
            if p not in _SYSTEM and p not in found:
                found.append(p)
    return found


def exec_keep(program: Path) -> list[Path]:
    """What running `program` needs to read: its install root (`<root>/bin/<exe>` keeps `<root>`, a venv
    needs its pyvenv.cfg and lib/), the same for what its symlink and its `#!` line point to."""
    paths = [Path(os.path.abspath(program)), real(program)]
    try:
        with open(program, "rb") as fh:
            head = fh.readline(512)
    except OSError:
        head = b""
    if head.startswith(b"#!"):
        interp = head[2:].strip().split(b" ")[0].decode("utf-8", "replace")
        if interp.startswith("/"):
            paths += [Path(interp), real(interp)]
    keep: list[Path] = []
    for p in paths:
        root = p.parent.parent if p.parent.name == "bin" else p.parent
        if root in _SYSTEM:
            root = p.parent
        if root not in keep:
            keep.append(root)
    return keep


class TooManyToHide(Exception):
    pass


def expand(hide: Path, keep: Iterable[Path]) -> list[Path]:
    """`hide` as paths to hide: itself, or, when it holds a path in `keep`, its other entries (recursively
    along the way down to each kept path). Symlinks are left alone: they point at what is hidden, or at
    what is not ours to hide."""
    keeps = [k for k in keep if k == hide or k.is_relative_to(hide)]
    if not keeps:
        return [hide]
    if hide in keeps:
        return []
    out: list[Path] = []
    for p in around(hide, keeps):
        out.append(p)
        if len(out) > MAX_HIDDEN:
            raise TooManyToHide(f"{hide} holds more than {MAX_HIDDEN} entries around {keeps[:3]}")
    return out


@dataclass(frozen=True)
class Hiding:
    roots: tuple[Path, ...]
    """What the command may not read, as the user would name it ($PROCTOR_HOME, the home)."""
    paths: tuple[Path, ...]
    """The same, expanded around what the command needs; what the confiner is given."""
    home_hidden: bool
    readable_homes: tuple[Path, ...] = ()
    """With `read_home`: the homes, to be mounted read-only (readable, never writable)."""


def hidden_paths(entry: Entry, plane: ControlPlane, home: Path, program: Path, git_dirs: Sequence[Path],
                 extra_keep: Sequence[Path] = ()) -> Hiding:
    keep = [plane.project, *git_dirs, *exec_keep(program), *(real(p) for p in entry.confinement.exec_paths),
            *(real(p) for p in extra_keep)]
    roots: list[Path] = [real(home)]
    if not entry.read_home:
        roots += user_homes()
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isabs(runtime) and os.path.isdir(runtime) and real(runtime) not in _SYSTEM:
            roots.append(real(runtime))
    roots = list(dict.fromkeys(roots))
    paths: list[Path] = []
    for r in roots:
        if not os.path.lexists(r):
            continue
        # $PROCTOR_HOME is hidden whole, always: nothing the command needs may live in it.
        for p in (expand(r, keep) if r != real(home) else [r]):
            if p not in paths:
                paths.append(p)
    # A hidden path inside another hidden path adds nothing (and bwrap would mount into an empty tmpfs).
    paths = [p for p in paths if not any(o != p and p.is_relative_to(o) for o in paths)]
    readable = tuple(h for h in user_homes() if h not in paths) if entry.read_home else ()
    return Hiding(tuple(roots), tuple(paths), home_hidden=not entry.read_home, readable_homes=readable)


def git_pinned_readonly(git_dirs: Iterable[Path], project: Path) -> list[Path]:
    """The git files that run code at the user's next `git` (config: core.fsmonitor, hooksPath, filters,
    pagers; hooks/), and those that redirect a git dir, mounted read-only where they exist."""
    out: list[Path] = []
    for d in git_dirs:
        for name in ("config", "config.worktree", "hooks", "commondir", "gitdir"):
            p = d / name
            if os.path.lexists(p) and not os.path.islink(p) and p not in out:
                out.append(p)
    dotgit = project / ".git"
    if os.path.isfile(dotgit) and not os.path.islink(dotgit):
        out.append(dotgit)
    return out


@dataclass(frozen=True)
class UnconfinedRun:
    argv: list[str]
    env: dict[str, str]
    isolation: str
    """`bwrap` (a mount namespace hid the hidden paths) or `none` (nothing could)."""
    details: dict[str, object] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)


def capabilities() -> Capabilities:
    """The machine's confinement layers (a seam: tests replace it to measure the fallback)."""
    return detect()


def unconfined(argv: Sequence[str], cwd: Path, plane: ControlPlane, hiding: Hiding, git_dirs: Sequence[Path],
               tmpdir: Path) -> UnconfinedRun:
    """The argv of an entry that runs without its confined profile: bwrap's mount namespace only."""
    caps = capabilities()
    common_gaps = ["unconfined: no Landlock, network open, writes under the shared /tmp and /var/tmp are not "
                   "tracked (the host cannot see them among everyone else's)"]
    if caps.bwrap is None:
        shown = ", ".join(str(r) for r in hiding.roots)
        return UnconfinedRun(
            list(argv), {}, "none", {"hidden": "none", "bwrap": caps.bwrap_reason},
            [f"nothing hidden: without a mount namespace ({caps.bwrap_reason}) the command could read {shown}",
             "writes outside the project are seen only in the home's startup and credential files "
             "(~/.bashrc, ~/.profile, ~/.ssh, ...) and in proctor's own files (which are put back); "
             "anywhere else they are not seen",
             *common_gaps])
    shared = tuple(Path(d) for d in tmpfs_dirs() if d in ("/tmp", "/var/tmp"))
    dotgit = plane.project / ".git"
    keep_ro = [p for p in plane.protected if os.path.lexists(p) and not _under(p, hiding.paths)
               and p not in git_dirs and p != dotgit]
    req = ConfineRequest(
        worktree=plane.project, git_paths=tuple(git_dirs), tmpdir=tmpdir, state_dirs=shared, network=True,
        readonly=tuple(dict.fromkeys([*git_pinned_readonly(git_dirs, plane.project), *keep_ro,
                                      *hiding.readable_homes])),
        hidden=hiding.paths,
    )
    env_prog = shutil.which("env", path=os.defpath) or "/usr/bin/env"
    plan = LayeredConfiner(caps, use_bwrap=True, use_landlock=False).wrap(
        [env_prog, "-C", str(cwd), *argv], req)
    if isinstance(plan, Unavailable):  # say so, and run as before
        return UnconfinedRun(list(argv), {}, "none", {"hidden": "none", "bwrap": plan.reason},
                             [f"nothing hidden: {plan.reason}", *common_gaps])
    details = {"hidden": "bwrap", "files": "read-only but the project, its git dirs and /tmp, /var/tmp",
               "network": "open", "bwrap_version": caps.bwrap_version, "cleanup": "pidns"}
    return UnconfinedRun(plan.argv, plan.env, "bwrap", details, common_gaps)


def _under(p: Path, roots: Iterable[Path]) -> bool:
    return any(p == r or p.is_relative_to(r) for r in roots)


@dataclass(frozen=True)
class HomeWatch:
    """Fingerprints of the home's top level and startup files, for a run nothing could hide them from."""

    before: dict[Path, Fingerprint]

    homes: tuple[Path, ...]
    skip: tuple[Path, ...]

    @classmethod
    def take(cls, homes: Iterable[Path], skip: Iterable[Path]) -> HomeWatch:
        h, s = tuple(homes), tuple(skip)
        return cls(_home_prints(h, s), h, s)

    def changed(self) -> list[str]:
        after = _home_prints(self.homes, self.skip)
        return sorted(str(p) for p in self.before.keys() | after.keys() if self.before.get(p) != after.get(p))


def _home_prints(homes: Iterable[Path], skip: tuple[Path, ...]) -> dict[Path, Fingerprint]:
    """`skip`: the project, its git dirs, $PROCTOR_HOME (watched as tamper), whose own changes are not this."""
    out: dict[Path, Fingerprint] = {}
    for h in homes:
        for p in (h / n for n in HOME_WATCH):
            if not _under(p, skip):
                out[p] = fingerprint(p)
    return out
