"""The tree that would land: built by the host from the content the agent left, committed, checked out fresh.

Owns the step between the agent's exit and validation (DESIGN.md 9a). The agent's directory is hostile
input by then: the host looks at it only with lstat and through git's own hashing of file content, in a
git dir the host made (proctor.job.git says why that runs nothing the agent wrote). It never reads the
agent's git dir, index, HEAD or refs, and never executes anything from the agent's directory.

    scan(agent_dir)                          -> Scan: special files, nested repos, files over the size cap
    build(agent_dir, git_dir, wt, ...)       -> Landing | Failure: the job's commit on its branch in a git dir
                                                the host made
    materialise(dir, git_dir, tree, index)   -> make a directory exactly a tree, in place (for validation,
                                                the frozen tree, and the review checkout)

Why the content and not the agent's index or stat data: the agent's index can hide an edit
(`--skip-worktree`), and stat data lied in review: a same-size rewrite within the checkout's second was
missing from `changed_files` (the demo's own fix), because git compares mtimes to the second and a copied
index no longer looks racy. The index here starts from the base's tree with no stat data at all, so git
hashes every file.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.confine import beneath
from proctor.job.git import git
from proctor.job.worktree import Failure, Worktree, init_git_dir, set_ref

MAX_FILE_BYTES = 100 * 1024 * 1024  # a larger file is left out of the job's tree, and said so
MAX_ENTRIES = 2_000_000
COMMIT_ENV = {"GIT_AUTHOR_NAME": "proctor", "GIT_AUTHOR_EMAIL": "proctor@localhost",
              "GIT_COMMITTER_NAME": "proctor", "GIT_COMMITTER_EMAIL": "proctor@localhost"}
GITLINK = "160000"
# Files git reads whole for its rules wherever it walks (a pathspec exclusion does not stop it reading a
# directory's .gitignore): a special or oversized one is removed before git runs.
CONTROL_FILES = frozenset({".gitignore", ".gitattributes", ".gitmodules"})
MAX_CONTROL_BYTES = 1024 * 1024
BARE_REPO = frozenset({"HEAD", "objects", "refs"})  # what git's discovery takes for a git dir
# A tree entry's mode -> the file type it must be on disk, and the permission bits a checkout gives it.
KIND = {"040000": stat.S_IFDIR, "160000": stat.S_IFDIR, "120000": stat.S_IFLNK, "100644": stat.S_IFREG,
        "100755": stat.S_IFREG}
PERM = {"040000": 0o755, "100644": 0o644, "100755": 0o755}


@dataclass(frozen=True)
class Scan:
    special: tuple[str, ...] = ()  # FIFOs, sockets, devices: tamper (a FIFO hung the host in review)
    nested: tuple[str, ...] = ()  # directories holding a `.git` of their own: left out
    oversized: tuple[tuple[str, int], ...] = ()
    unreadable: tuple[str, ...] = ()

    @property
    def left_out(self) -> tuple[str, ...]:
        return (*self.special, *self.nested, *(p for p, _ in self.oversized), *self.unreadable)


def scan(root: Path, *, max_file_bytes: int = MAX_FILE_BYTES, max_entries: int = MAX_ENTRIES) -> Scan | Failure:
    """One lstat pass over the agent's directory (never following a link, never opening a file)."""
    special: list[str] = []
    nested: list[str] = []
    oversized: list[tuple[str, int]] = []
    unreadable: list[str] = []
    entries = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(root / rel if rel else root)
        except OSError:
            unreadable.append(rel)
            continue
        with it:
            children = list(it)
        names = {c.name for c in children}
        if rel and (".git" in names or BARE_REPO <= names):
            # A `.git` inside: git would record a gitlink and look into the nested repo for its HEAD. A bare
            # repo's layout: a reviewer's git run inside it would read its config (embedded bare repos).
            nested.append(rel)
            continue
        for entry in children:
            entries += 1
            if entries > max_entries:
                return Failure(f"the agent's worktree holds more than {max_entries} entries")
            path = f"{rel}/{entry.name}" if rel else entry.name
            if not rel and entry.name == ".git":
                continue  # the agent's own git dir: never read
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                unreadable.append(path)
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > (MAX_CONTROL_BYTES if entry.name in CONTROL_FILES else max_file_bytes):
                    oversized.append((path, st.st_size))
            elif not stat.S_ISLNK(st.st_mode):
                special.append(path)
    return Scan(tuple(sorted(special)), tuple(sorted(nested)), tuple(sorted(oversized)), tuple(sorted(unreadable)))


@dataclass(frozen=True)
class Landing:
    commit: str
    tree: str
    base_sha: str
    git_dir: Path  # the job's own git dir: its objects are the job's objects
    index: Path  # the tree, with the stat data of the hashing that made it (the host's own, trusted)
    changed: list[str] = field(default_factory=list)
    left_out_ignored: tuple[str, ...] = ()  # oversized files that were ignored anyway


def _exclude_spec(paths: Sequence[str]) -> bytes:
    specs = ["."] + [f":(exclude,literal,top){p}" for p in paths]
    return b"\0".join(s.encode("utf-8", "surrogateescape") for s in specs)


def _gitlinks(git_dir: Path, index: Path) -> list[str]:
    res = git(["ls-files", "--stage", "-z"], git_dir=git_dir, index_file=index)
    out = []
    for entry in res.out.split(b"\0"):
        if entry.startswith(GITLINK.encode() + b" "):
            out.append(entry.split(b"\t", 1)[1].decode("utf-8", "surrogateescape"))
    return out


def build(agent_dir: Path, git_dir: Path, wt: Worktree, private_dir: Path, found: Scan,
          message: str) -> Landing | Failure:
    """Commit what the agent left (tracked and untracked, not ignored; hashed from content) on the job's
    branch in `git_dir` (made here, by the host), parent the base.

    Left out, whatever the agent did: the scan's special files, nested repos and oversized files, and
    every gitlink of the base (a submodule pointer never moves through a job). Special files and oversized
    control files are first removed from `agent_dir` (the host's now: the agent's tree is dead), since git
    opens every .gitignore it walks past: a FIFO there hung git in review."""
    doomed = (*found.special, *(p for p, _ in found.oversized if Path(p).name in CONTROL_FILES))
    failure = _unlink_all(agent_dir, doomed) if doomed else None
    if failure:
        return failure
    failure = init_git_dir(git_dir.parent, wt.repo, wt.branch)
    if failure:
        return failure
    index = private_dir / "landing.index"
    index.unlink(missing_ok=True)
    read = git(["read-tree", wt.base_sha], git_dir=git_dir, index_file=index)
    if not read.ok:
        return Failure(f"git read-tree of the base failed: {read.err}")
    excluded = [*found.left_out, *_gitlinks(git_dir, index)]
    spec = private_dir / "landing.pathspec"
    spec.write_bytes(_exclude_spec(excluded))
    add = git(["add", "--all", f"--pathspec-from-file={spec}", "--pathspec-file-nul"],
              git_dir=git_dir, work_tree=agent_dir, cwd=agent_dir, index_file=index)
    if not add.ok:
        return Failure(f"git add of the agent's files failed: {add.err[-500:]}")
    tree = git(["write-tree"], git_dir=git_dir, index_file=index)
    if not tree.ok:
        return Failure(f"git write-tree failed: {tree.err}")
    commit = git(["commit-tree", tree.text, "-p", wt.base_sha, "-m", message], git_dir=git_dir, env=COMMIT_ENV)
    if not commit.ok:
        return Failure(f"git commit-tree failed: {commit.err}")
    failure = set_ref(git_dir, f"refs/heads/{wt.branch}", commit.text)
    if failure:
        return failure
    changed = changed_paths(git_dir, wt.base_sha, commit.text)
    if isinstance(changed, Failure):
        return changed
    ignored = _ignored(git_dir, agent_dir, index, [p for p, _ in found.oversized])
    return Landing(commit.text, tree.text, wt.base_sha, git_dir, index, changed, ignored)


def _unlink_all(root: Path, paths: Sequence[str]) -> Failure | None:
    """Unlink each path beneath `root` (unlink never opens: a FIFO cannot block it; nor is a directory the
    agent turned into a link on the way followed)."""
    try:
        root_fd = beneath.open_root(root)
    except OSError as exc:
        return Failure(f"cannot open the agent's directory {root}: {exc.strerror}")
    try:
        for rel in paths:
            try:
                beneath.unlink(root_fd, rel)
            except OSError as exc:
                return Failure(f"cannot remove {rel!r} from the agent's directory: {beneath.why(exc)}")
    finally:
        os.close(root_fd)
    return None


def changed_paths(git_dir: Path, old: str, new: str) -> list[str] | Failure:
    """Every path whose entry differs between two commits (both sides of a rename), from objects alone."""
    res = git(["diff-tree", "-r", "-z", "--no-renames", "--name-only", "--no-commit-id", old, new], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git diff-tree failed: {res.err}")
    return [p.decode("utf-8", "surrogateescape") for p in res.out.split(b"\0") if p]


def _ignored(git_dir: Path, work_tree: Path, index: Path, paths: list[str]) -> tuple[str, ...]:
    if not paths:
        return ()
    res = git(["check-ignore", "-z", "--", *paths], git_dir=git_dir, work_tree=work_tree, cwd=work_tree,
              index_file=index)
    return tuple(p.decode("utf-8", "surrogateescape") for p in res.out.split(b"\0") if p)


def tree_entries(git_dir: Path, tree: str) -> dict[str, str] | Failure:
    """path -> mode for every entry of `tree`, directories included."""
    res = git(["ls-tree", "-r", "-t", "-z", "--full-tree", tree], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git ls-tree failed: {res.err}")
    out = {}
    for entry in res.out.split(b"\0"):
        if entry:
            meta, name = entry.split(b"\t", 1)
            out[name.decode("utf-8", "surrogateescape")] = meta.split(b" ", 1)[0].decode()
    return out


def _prune(root: Path, entries: dict[str, str]) -> None:
    """Make `root` hold nothing but `entries`' paths, each of the right type: what is not in the tree goes
    (ignored files, nested repos, the agent's `.git`), a file with other links or another owner goes (it
    is written fresh later), modes are git's (no setuid, no world-writable dir), the root's own included
    (an agent's `chmod 0777` of its worktree survived into the review checkout). Every directory is opened
    beneath the root with no symlink on the way (proctor.confine.beneath), so a directory swapped for a link
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


def materialise(work_tree: Path, git_dir: Path, tree: str, index: Path, *, trusted_index: bool = False) -> Failure | None:
    """Make `work_tree` exactly `tree`, in place: prune what is not the tree's, hash every file that is
    (an index with no stat data: content decides), write fresh what differs or is missing. `index` ends
    holding the tree with the stat data of files just verified.

    `trusted_index`: `index` already holds `tree` with stat data the host's own hashing recorded, and
    nothing but the host wrote `work_tree` since (right after `build`): only files whose stat moved are
    hashed again. Never after validation, which runs agent code that can put an mtime back.

    This is how the host turns the directory an agent (or validation, which runs agent code) wrote into a
    checkout of the job's commit without writing every file again: a fresh checkout of each tree was
    1.6 s for 2,000 files on this machine, and a job needs three."""
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
                  index_file=index, input_bytes=b"\0".join(stale) + b"\0")
        if not res.ok:
            return Failure(f"git checkout-index failed: {res.err}")
    return None


def fresh_index_copy(index: Path, git_dir: Path) -> Failure | None:
    try:
        shutil.copyfile(index, git_dir / "index")
    except OSError as exc:
        return Failure(f"cannot write {git_dir / 'index'}: {exc}")
    return None


def scratch_git_dir(work_tree: Path, landing: Landing, wt: Worktree, index: Path) -> Failure | None:
    """A throw-away `.git` for validation (some builds ask git for a version): HEAD on the job's commit,
    objects borrowed from the job's git dir, which stays out of validation's reach."""
    return (init_git_dir(work_tree, wt.repo, wt.branch, alternates=(landing.git_dir / "objects",))
            or set_ref(work_tree / ".git", f"refs/heads/{wt.branch}", landing.commit)
            or fresh_index_copy(index, work_tree / ".git"))
