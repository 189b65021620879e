"""Making a directory exactly a tree, in place: for validation, the frozen tree, and the review checkout.

Owns `materialise` (prune what is not the tree's, keep what is, write fresh what differs or is missing) and
`settle`, the one pass that makes a directory a tree from a walk already made (a scan's, or `walk` as it
goes). Every operation is beneath the root with no symlink on the way (proctor.mechanisms.confine.beneath); modes
are git's, the root's own included. It never commits and never decides what lands (proctor.mechanisms.git.landing).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.git import vouch
from proctor.mechanisms.git.command import git, nul_terminated
from proctor.mechanisms.git.scan import walk
from proctor.mechanisms.git.trees import tree_diff, tree_entries
from proctor.mechanisms.git.vouch import GITLINK as GITLINK_MODE
from proctor.mechanisms.git.vouch import Known
from proctor.mechanisms.git.worktree import Failure

# A tree entry's mode -> the file type it must be on disk, and the permission bits a checkout gives it.
KIND = {"040000": stat.S_IFDIR, "160000": stat.S_IFDIR, "120000": stat.S_IFLNK, "100644": stat.S_IFREG,
        "100755": stat.S_IFREG}
PERM = {"040000": 0o755, "100644": 0o644, "100755": 0o755}


GIT_MODES = frozenset({0o100644, 0o100755, 0o120777})  # a file or symlink exactly as a checkout (umask 022) makes it
FILE_KIND = {0o100644: stat.S_IFREG, 0o100755: stat.S_IFREG, 0o120000: stat.S_IFLNK}
FILE_PERM = {0o100644: 0o644, 0o100755: 0o755}


def materialise(work_tree: Path, git_dir: Path, tree: str, index: Path, *, trusted_index: bool = False,
                known: Known | None = None) -> Failure | None:
    """Make `work_tree` exactly `tree` (a tree or a commit), in place: prune what is not the tree's, keep
    what is, write fresh what differs or is missing. `index` ends holding the tree, with the stat data of
    the files as they are.

    `known`: what the host knew of `work_tree` when it last made it a tree (proctor.mechanisms.git.vouch), whatever ran
    there since (validation runs agent code): one walk, and a file is kept when the rule still vouches for
    it and the two trees have the same entry at its path; `index` holds `known.tree` on the way in. `known`
    is brought up to date; after a pass that failed half way it is `lost`, and the next reads everything.

    Without it, every file of the tree is hashed (an index with no stat data: content decides), unless
    `trusted_index`: `index` already holds `tree` with stat data the host's own hashing recorded, and
    nothing but the host wrote `work_tree` since: only files whose stat moved are hashed again. Never after
    validation, which runs agent code that can put an mtime back.

    This is how the host turns the directory an agent (or validation, which runs agent code) wrote into a
    checkout of the job's commit without writing every file again: a fresh checkout of each tree was
    1.6 s for 2,000 files on this machine, and a job needs three."""
    if known is not None and not known.lost:
        return _materialise_known(work_tree, git_dir, tree, index, known)
    entries = tree_entries(git_dir, tree)
    if isinstance(entries, Failure):
        return entries
    try:
        _prune(work_tree, entries)
    except OSError as exc:
        return Failure(f"cannot prune {work_tree}: {exc}")
    if not trusted_index:
        index.unlink(missing_ok=True)
        read = git(["read-tree", tree], git_dir=git_dir, index_file=index)
        if not read.ok:
            return Failure(f"git read-tree failed: {read.err}")
    git(["update-index", "-q", "--refresh"], git_dir=git_dir, work_tree=work_tree, cwd=work_tree, index_file=index)
    diff = git(["diff-files", "-z", "--name-only"], git_dir=git_dir, work_tree=work_tree, cwd=work_tree,
               index_file=index)
    if not diff.ok:
        return Failure(f"git diff-files failed: {diff.err}")
    stale = [p for p in diff.out.split(b"\0") if p]
    if stale:
        res = git(["checkout-index", "-f", "-z", "--stdin"], git_dir=git_dir, work_tree=work_tree, cwd=work_tree,
                  index_file=index, input_bytes=b"\0".join(stale) + b"\0", umask=0o022)
        if not res.ok:
            return Failure(f"git checkout-index failed: {res.err}")
    return None


def _materialise_known(work_tree: Path, git_dir: Path, tree: str, index: Path, known: Known) -> Failure | None:
    known.lost = True  # until this pass ends well: a pass that failed half way leaves the next to read everything
    modes, changed, dirs = known.modes, frozenset[str](), known.dirs
    if tree != known.tree:
        diff = tree_diff(git_dir, known.tree, tree)
        if isinstance(diff, Failure):
            return diff
        if diff:
            res = git(["update-index", "-z", "--index-info"], git_dir=git_dir, index_file=index,
                      input_bytes=nul_terminated([f"{mode:o} {oid}\t{path}" for mode, oid, path in diff]))
            if not res.ok:
                return Failure(f"git update-index failed: {res.err}")
            modes = dict(modes)
            for mode, _oid, path in diff:
                if mode:
                    modes[path] = mode
                else:
                    modes.pop(path, None)
            changed = frozenset(path for _, _, path in diff)
            dirs = vouch.tree_dirs(modes)
    gitlinks = {p for p, m in modes.items() if m == GITLINK_MODE}
    broken: set[str] = set()
    strays: list[str] = []
    try:
        made = settle(work_tree, git_dir, index, tree, modes, walk(work_tree, dirs | gitlinks, broken, strays),
                      broken, set(), strays, known, changed, dirs)
    except OSError as exc:
        return Failure(f"cannot make {work_tree} the tree {tree[:12]}: {exc}")
    if isinstance(made, Failure):
        return made
    known.tree, known.modes, known.stats, known.since, known._dirs = made.tree, made.modes, made.stats, made.since, dirs
    known.lost = False
    return None


def settle(root: Path, git_dir: Path, index: Path, tree: str, modes: dict[str, int],
           seen: Iterable[tuple[str, os.stat_result]], broken: set[str], rewrite: set[str], strays: list[str],
           known: Known | None = None, changed: frozenset[str] = frozenset(),
           dirs: frozenset[str] | None = None, trusted: dict[str, os.stat_result] | None = None
           ) -> Known | Failure:
    """Make `root` exactly `tree` (whose entries are `modes`, and which `index` holds) from `seen`, each of
    its entries with its lstat, each directory before what is in it, from the caller's one walk (a scan's,
    or `walk` as it goes): no walk here. What is not the tree's goes (the directories in `broken`, unread,
    too: nested repos, unreadable ones; and `strays`, entries that could not be stat'ed); so does a file of
    the tree with other links or another owner, one in `rewrite` or `changed`, and, given `known`, one it
    does not vouch for: each is written fresh from the objects, with every file the directory lacks.
    Without `known` every other file of the tree is kept (right after `build`, whose hashing read each file
    the record would not vouch for). `trusted`: files the record vouches for (as git wrote them, one link,
    git's mode), with their lstat, and not in `seen`: kept with no check and no pass over them (100,000 of
    them cost 0.3 s in the loop), unless a directory above one goes. Modes are git's (no setuid, no
    world-writable dir), the root's own included (an agent's `chmod 0777` of its worktree survived into the
    review checkout); a submodule's dir stays empty, as a checkout leaves it. Every operation is beneath the
    root with no symlink on the way (proctor.mechanisms.confine.beneath). Returns what the host now knows:
    the lstat of each file after, and a stamp taken after the last write."""
    uid = os.geteuid()
    dirs = vouch.tree_dirs(modes) if dirs is None else dirs
    gitlinks = {p for p, m in modes.items() if m == GITLINK_MODE}
    fenced = set(gitlinks)  # directories whose entries are not the tree's: gitlinks, and those removed whole
    remove: list[str] = []
    chmods: list[tuple[str, int]] = []
    links_ok: set[str] = set()
    occupied: set[str] = set()
    kept: dict[str, os.stat_result] = {}
    mode_of, kind_of, perm_of = modes.get, FILE_KIND.get, FILE_PERM.get
    unchanged = known.unchanged if known is not None else None
    isdir, ifmt, imode = stat.S_ISDIR, stat.S_IFMT, stat.S_IMODE
    dir_perm = PERM["040000"]
    for path, st in seen:
        mode = st.st_mode
        parent = path.rpartition("/")[0]
        if parent in fenced:
            if parent in gitlinks:
                occupied.add(parent)
            if isdir(mode):
                fenced.add(path)
            continue
        if unchanged is not None and path not in changed and unchanged(path, st):
            # The record vouches for it: nothing changed it since the host wrote (or kept) it as the tree's.
            kept[path] = st
            continue
        if isdir(mode):
            if (path in dirs or path in gitlinks) and path not in broken and st.st_uid == uid:
                if imode(mode) != dir_perm:
                    chmods.append((path, dir_perm))
                if path in gitlinks:
                    links_ok.add(path)
            else:
                remove.append(path)
                fenced.add(path)
            continue
        want = mode_of(path, 0)
        kind = kind_of(want)
        if (unchanged is None and kind == ifmt(mode) and path not in rewrite
                and (kind == stat.S_IFLNK or (st.st_uid == uid and st.st_nlink == 1))):
            kept[path] = st
            perm = perm_of(want)
            if perm is not None and imode(mode) != perm:
                chmods.append((path, perm))
        else:
            remove.append(path)
    remove += strays
    remove += [d for d in broken if d not in fenced]  # found unreadable only once listed: removed whole
    if trusted:
        # A trusted file beneath a directory that goes whole is written fresh, as the rest. Its directories
        # are the tree's: one that goes and is not (the agent's `.git`) has none beneath it.
        gone_dirs = {d for d in fenced if d in dirs}
        if gone_dirs:
            trusted = {p: st for p, st in trusted.items() if not _beneath(p, gone_dirs)}
        kept.update(trusted)
    write = [] if len(kept) + len(gitlinks) == len(modes) else [
        path for path, mode in modes.items() if mode != GITLINK_MODE and path not in kept]
    make = [g for g in gitlinks if g not in links_ok or g in occupied]
    root_fd = beneath.open_root(root)
    try:
        st = os.fstat(root_fd)
        if st.st_uid != uid:
            raise PermissionError(f"{root} belongs to uid {st.st_uid}, not to this user")
        if imode(st.st_mode) != dir_perm:
            os.fchmod(root_fd, dir_perm)
        for path in [*remove, *(g for g in make if g in links_ok)]:
            try:
                beneath.rmtree(root_fd, path)
            except FileNotFoundError:
                pass
        for path in make:
            os.close(beneath.makedirs(root_fd, path, dir_perm))
        for path, perm in chmods:
            head, _, name = path.rpartition("/")
            try:
                fd = beneath.open_beneath(root_fd, head, beneath.DIR_FLAGS) if head else os.dup(root_fd)
            except FileNotFoundError:
                continue  # beneath a directory removed whole
            try:
                os.chmod(name, perm, dir_fd=fd, follow_symlinks=False)
                if path in kept:
                    kept[path] = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        if write:
            res = git(["checkout-index", "-f", "-u", "-z", "--stdin"], git_dir=git_dir, work_tree=root, cwd=root,
                      index_file=index, input_bytes=nul_terminated(write), umask=0o022)
            if not res.ok:
                return Failure(f"git checkout-index failed: {res.err[-500:]}")
            for path in write:
                kept[path] = beneath.lstat(root_fd, path)
        since = vouch.stamp(root_fd)
    finally:
        os.close(root_fd)
    return Known(tree, modes, kept, since, dirs)


def _beneath(path: str, dirs: set[str]) -> bool:
    parent = path.rpartition("/")[0]
    while parent:
        if parent in dirs:
            return True
        parent = parent.rpartition("/")[0]
    return False


def _prune(root: Path, entries: dict[str, str]) -> None:
    """Make `root` hold nothing but `entries`' paths, each of the right type: what is not in the tree goes
    (ignored files, nested repos, the agent's `.git`), a file with other links or another owner goes (it
    is written fresh later), modes are git's (no setuid, no world-writable dir), the root's own included
    (an agent's `chmod 0777` of its worktree survived into the review checkout). Every directory is opened
    beneath the root with no symlink on the way (proctor.mechanisms.confine.beneath), so a directory swapped for a link
    is never walked into."""
    uid = os.geteuid()
    root_fd = beneath.open_root(root)
    try:
        st = os.fstat(root_fd)
        if st.st_uid != uid:
            raise PermissionError(f"{root} belongs to uid {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) != PERM["040000"]:
            os.fchmod(root_fd, PERM["040000"])
        stack = [""]
        while stack:
            rel = stack.pop()
            dir_fd = beneath.open_beneath(root_fd, rel, beneath.DIR_FLAGS) if rel else os.dup(root_fd)
            try:
                stack += _prune_dir(dir_fd, rel, entries, uid)
            finally:
                os.close(dir_fd)
    finally:
        os.close(root_fd)


def _prune_dir(dir_fd: int, rel: str, entries: dict[str, str], uid: int) -> list[str]:
    """One directory of _prune, by its fd; the tree's subdirectories in it, to walk next."""
    subdirs = []
    with os.scandir(dir_fd) as it:
        children = list(it)
    for entry in children:
        path = f"{rel}/{entry.name}" if rel else entry.name
        mode = entries.get(path)
        st = entry.stat(follow_symlinks=False)
        kind = stat.S_IFMT(st.st_mode)
        want = KIND.get(mode or "")
        if want is None or kind != want or (kind != stat.S_IFLNK and st.st_uid != uid) or (
                kind == stat.S_IFREG and st.st_nlink != 1):
            beneath.rmtree(dir_fd, entry.name)
            continue
        if mode == "160000":
            sub = beneath.open_beneath(dir_fd, entry.name, beneath.DIR_FLAGS)
            try:
                occupied = bool(os.listdir(sub))
            finally:
                os.close(sub)
            if occupied:  # a submodule's dir stays empty, as a checkout leaves it
                beneath.rmtree(dir_fd, entry.name)
                os.mkdir(entry.name, 0o755, dir_fd=dir_fd)
            continue
        perm = PERM.get(mode or "")
        if perm is not None and stat.S_IMODE(st.st_mode) != perm:
            os.chmod(entry.name, perm, dir_fd=dir_fd, follow_symlinks=False)
        if mode == "040000":
            subdirs.append(path)
    return subdirs
