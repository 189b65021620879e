"""What of the main checkout the validated tree gets: shares (its dependency dirs, read-only, and only when
the lockfiles that pin them are byte-identical in both trees: dependencies installed for another lockfile
would test something else) and copies (untracked files, `.env`). Each path is reached beneath its root with
no symlink followed; it decides and says why not (risks), and never creates, links nor copies (apply does).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.validation.capped import MAX_READ, read_capped, tree_size

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


@dataclass(frozen=True)
class Share:
    source: Path  # in the main checkout
    target: Path  # in the validated checkout
    lockfiles: tuple[str, ...] = ()
    # A layer, not a mount: the target a directory of the job's own whose entries link to the source's
    # (read-only through them), so what a runner writes at its top (vite's `.vite` and `.vite-temp`, babel's
    # `.cache`) is the job's, over what the person's dir holds (issue 38: vitest failed with EROFS writing
    # `node_modules/.vite` though 13 of 13 tests passed). The runner caches are copied in, so a warm one
    # is reused and what the job writes never reaches another job.
    layer: bool = False


# node's runners write these at the top of node_modules; a layer copies them in (warm) up to CACHE_BYTES.
NODE_CACHES = frozenset({".vite", ".vite-temp", ".cache", ".vitest"})
CACHE_BYTES = 64 * 1024 * 1024


def _same(a: Path, b: Path, name: str) -> bool | None:
    """True identical, False different, None absent on both sides."""
    x, y = read_capped(a / name, 64 * MAX_READ), read_capped(b / name, 64 * MAX_READ)
    if x is None and y is None:
        return None
    return x == y


def lockfiles_unchanged(checkout: Path, main: Path, names: Sequence[str]) -> tuple[bool, list[str]]:
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


def node_modules_dirs(main: Path) -> list[str]:
    """The `node_modules` dirs of a workspace's packages in the main checkout, one and two levels down
    (`packages/a/node_modules`), never one inside another node_modules or a dot dir; at most 200."""
    out = []
    for pattern in ("*/node_modules", "*/*/node_modules"):
        for d in sorted(main.glob(pattern)):
            rel = d.relative_to(main).as_posix()
            if "node_modules" in rel.split("/")[:-1] or rel.split("/")[0].startswith("."):
                continue
            if d.is_dir() and not d.is_symlink():
                out.append(rel)
    return out[:200]


def _members(checkout: Path, main: Path) -> list[str]:
    """The workspace packages' own node_modules the main checkout has, where the validated tree has that
    package: a pnpm or yarn workspace's member runs its own `.bin` (issue 38: `vitest: not found` in one)."""
    return [rel for rel in node_modules_dirs(main) if (checkout / rel).parent.joinpath("package.json").is_file()]


def shares_for(checkout: Path, main: Path, cfg: RepoSettings) -> tuple[list[Share], list[str]]:
    """The main checkout's dirs shared into the validated tree `checkout`, and why each other wanted was not."""
    risks: list[str] = []
    # Shares: configured, else autodetected (dirs the main checkout has that the tree lacks: the root's
    # node_modules and its workspace packages').
    root_modules = (main / "node_modules").is_dir()
    wanted = cfg.share if cfg.share is not None else tuple(
        (["node_modules", *_members(checkout, main)] if root_modules else []))
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
            # A member's dependencies are pinned by the workspace's lockfile at the root and its own manifest.
            member = str(Path(rel).parent) if Path(rel).parent != Path(".") else ""
            ok, differ = lockfiles_unchanged(checkout, main, names)
            if ok and member:
                ok, differ = lockfiles_unchanged(checkout, main, (f"{member}/package.json",))
            if not ok:
                why = (f"the lockfile changed ({', '.join(differ)})" if differ
                       else f"no lockfile ({', '.join(names[:3])}) pins it")
                risks.append(f"{rel} of the main checkout not shared: {why}; validation runs without it")
                continue
        shares.append(Share(src, dst, tuple(n for n in names if (checkout / n).exists()),
                            layer=Path(rel).name == "node_modules"))
    return shares, risks


def copies_for(checkout: Path, main: Path, cfg: RepoSettings) -> tuple[list[tuple[Path, Path]], list[str]]:
    """(source in the main checkout, target in `checkout`) of each configured copy, and why each other was not."""
    risks: list[str] = []
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
    return copies, risks


def lay_layer(tree_fd: int, share: Share, rel: str) -> None:
    """The layer of `share` at `rel` beneath the checkout: a directory of the job's, one symlink per entry
    of the source (scoped `@org` dirs whole), the runner caches copied (when small) instead of linked.
    Raises OSError (the caller says which share)."""
    fd = beneath.makedirs(tree_fd, rel, 0o755)
    try:
        with os.scandir(share.source) as entries:
            for e in entries:
                if e.name in NODE_CACHES:
                    if e.is_dir(follow_symlinks=False) and tree_size(Path(e.path), CACHE_BYTES) <= CACHE_BYTES:
                        _copy_tree(Path(e.path), fd, e.name)
                    continue
                os.symlink(e.path, e.name, dir_fd=fd)
    finally:
        os.close(fd)


def _copy_tree(src: Path, parent_fd: int, name: str) -> None:
    """A copy of a cache dir (regular files and dirs only; links are not followed nor copied)."""
    os.mkdir(name, 0o755, dir_fd=parent_fd)
    fd = beneath.open_beneath(parent_fd, name, beneath.DIR_FLAGS)
    try:
        with os.scandir(src) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    _copy_tree(Path(e.path), fd, e.name)
                elif e.is_file(follow_symlinks=False):
                    with open(e.path, "rb") as fh:
                        data = fh.read(CACHE_BYTES)
                    out = os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
                    with os.fdopen(out, "wb") as w:
                        w.write(data)
    finally:
        os.close(fd)
