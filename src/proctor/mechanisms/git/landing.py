"""The tree that would land: built by the host from the content the agent left, committed, checked out fresh.

Owns the step between the agent's exit and validation (DESIGN.md 9a). The agent's directory is hostile
input by then: the host looks at it only with lstat and through git's own hashing of file content, in a
git dir the host made (proctor.mechanisms.git.command says why that runs nothing the agent wrote). It never reads the
agent's git dir, index, HEAD or refs, and never executes anything from the agent's directory.

    scan(agent_dir)                          -> Scan: special files, nested repos, files over the size cap, and
                                                the lstat of every entry (the job's one walk of the directory)
    build(agent_dir, git_dir, wt, ...)       -> Landing | Failure: the job's commit on its branch in a git dir
                                                the host made, and the directory made exactly its tree
    materialise(dir, git_dir, tree, index)   -> make a directory exactly a tree, in place (for validation,
                                                the frozen tree, and the review checkout)

Why the content and not the agent's index or stat data: the agent's index can hide an edit
(`--skip-worktree`), and stat data lied in review: a same-size rewrite within the checkout's second was
missing from `changed_files` (the demo's own fix), because git compares mtimes to the second and a copied
index no longer looks racy. So the agent's stat data is never evidence. The host's own is: the index its
checkout wrote, kept in memory before the agent ran (proctor.mechanisms.git.worktree), says what each file was right
after the host wrote it, and a file whose lstat still matches it to the nanosecond, ctime included, with a
ctime before the record's stamp, is that file (proctor.mechanisms.git.vouch says why an agent cannot fake one). Only
the rest is hashed: what differs, the racy entries, what the agent added. Without a usable record (none
kept, an index format not read here) every file is hashed, as before issue 25.

One walk (issue 25): `scan` lstats every entry once; `build` decides from that what git hashes (named paths,
no walk of its own) and what the directory needs to be the tree (what to remove, chmod and write fresh),
without walking again. After validation (agent code ran there) `materialise` walks once more, keeps what
the record of the landing still vouches for and writes the rest from the objects: the review checkout is the
validated directory itself, renamed into place, never a second copy.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.git import vouch
from proctor.mechanisms.git.command import git
from proctor.mechanisms.git.vouch import GITLINK as GITLINK_MODE
from proctor.mechanisms.git.vouch import Known
from proctor.mechanisms.git.worktree import Failure, Worktree, init_git_dir, set_ref

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
    # path -> lstat of every entry the walk saw (special and unreadable ones aside), each directory before
    # what is in it; the root's `.git` and nested repos are listed, never entered.
    seen: dict[str, os.stat_result] | None = field(default=None, compare=False, repr=False)

    @property
    def left_out(self) -> tuple[str, ...]:
        return (*self.special, *self.nested, *(p for p, _ in self.oversized), *self.unreadable)


def scan(root: Path, *, max_file_bytes: int = MAX_FILE_BYTES, max_entries: int = MAX_ENTRIES) -> Scan | Failure:
    """One lstat pass over the agent's directory (never following a link, never opening a file): each
    directory opened beneath the root with no symlink on the way."""
    special: list[str] = []
    nested: list[str] = []
    oversized: list[tuple[str, int]] = []
    unreadable: list[str] = []
    seen: dict[str, os.stat_result] = {}
    entries = 0
    try:
        root_fd = beneath.open_root(root)
    except OSError as exc:
        return Failure(f"cannot open the agent's directory {root}: {exc.strerror}")
    try:
        stack = [""]
        while stack:
            rel = stack.pop()
            listed = _list_dir(root_fd, rel)
            if listed is None:
                unreadable.append(rel)
                continue
            fd, children = listed
            try:
                names = {c.name for c in children}
                if rel and (".git" in names or BARE_REPO <= names):
                    # A `.git` inside: git would record a gitlink and look into the nested repo for its HEAD.
                    # A bare repo's layout: a reviewer's git run inside it would read its config (embedded
                    # bare repos).
                    nested.append(rel)
                    continue
                for entry in children:
                    entries += 1
                    if entries > max_entries:
                        return Failure(f"the agent's worktree holds more than {max_entries} entries")
                    path = f"{rel}/{entry.name}" if rel else entry.name
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        unreadable.append(path)
                        continue
                    mode = st.st_mode
                    if stat.S_ISDIR(mode):
                        seen[path] = st
                        if rel or entry.name != ".git":  # the agent's own git dir: never read
                            stack.append(path)
                    elif stat.S_ISREG(mode):
                        seen[path] = st
                        if st.st_size > (MAX_CONTROL_BYTES if entry.name in CONTROL_FILES else max_file_bytes):
                            oversized.append((path, st.st_size))
                    elif stat.S_ISLNK(mode):
                        seen[path] = st
                    elif not rel and entry.name == ".git":
                        seen[path] = st  # whatever it is, never read; removed from the tree's checkout
                    else:
                        special.append(path)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return Scan(tuple(sorted(special)), tuple(sorted(nested)), tuple(sorted(oversized)), tuple(sorted(unreadable)),
                seen)


@dataclass(frozen=True)
class Landing:
    commit: str
    tree: str
    base_sha: str
    git_dir: Path  # the job's own git dir: its objects are the job's objects
    index: Path  # the tree, with the stat data of the hashing that made it (the host's own, trusted)
    changed: list[str] = field(default_factory=list)
    left_out_ignored: tuple[str, ...] = ()  # oversized files that were ignored anyway
    # What the host knows of the work directory it made exactly the tree (None: nothing, every later pass
    # reads every file); materialise keeps it current.
    known: Known | None = field(default=None, compare=False, repr=False)


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
    """Commit what the agent left (tracked and untracked, not ignored; hashed from content unless the host's
    record vouches for it) on the job's branch in `git_dir` (made here, by the host), parent the base, and
    make `agent_dir` exactly that commit's tree.

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
    compared = vouch.compare(wt.recorded, found.seen) if wt.recorded is not None and found.seen is not None else None
    if compared is not None:
        return _build_vouched(agent_dir, git_dir, wt, index, found, wt.recorded, compared, message)
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
    built = _commit(agent_dir, git_dir, wt, index, found, message)
    if isinstance(built, Failure):
        return built
    landed, _diff = built
    return materialise(agent_dir, git_dir, landed.tree, index, trusted_index=True) or landed


def _commit(agent_dir: Path, git_dir: Path, wt: Worktree, index: Path, found: Scan, message: str,
            base_tree: str | None = None) -> tuple[Landing, list[tuple[int, str, str]]] | Failure:
    """The index's tree committed on the job's branch; what it changes against the base (mode, oid, path).
    `base_tree`: the index is the base's, untouched, and this its tree (nothing to write, nothing changed)."""
    if base_tree is None:
        written = git(["write-tree"], git_dir=git_dir, index_file=index)
        if not written.ok:
            return Failure(f"git write-tree failed: {written.err}")
    tree = base_tree or written.text
    commit = git(["commit-tree", tree, "-p", wt.base_sha, "-m", message], git_dir=git_dir, env=COMMIT_ENV)
    if not commit.ok:
        return Failure(f"git commit-tree failed: {commit.err}")
    failure = set_ref(git_dir, f"refs/heads/{wt.branch}", commit.text)
    if failure:
        return failure
    diff = tree_diff(git_dir, wt.base_sha, commit.text) if base_tree is None else []
    if isinstance(diff, Failure):
        return diff
    ignored = _ignored(git_dir, agent_dir, index, [p for p, _ in found.oversized])
    changed = [path for _, _, path in diff]
    return Landing(commit.text, tree, wt.base_sha, git_dir, index, changed, ignored), diff


def _build_vouched(agent_dir: Path, git_dir: Path, wt: Worktree, index: Path, found: Scan, rec: vouch.Recorded,
                   compared: vouch.Compared, message: str) -> Landing | Failure:
    """`build` from the scan and the host's record of its checkout: git hashes only the paths the record does
    not vouch for (named, so git walks nothing) and the directory is made the tree from the scan alone."""
    seen = found.seen or {}
    modes = compared.modes
    excluded = {*found.left_out, *(p for p, m in modes.items() if m == GITLINK_MODE)}
    cut: dict[str, bool] = {"": False}  # directory -> is it, or one above it, left out

    def left_out(path: str) -> bool:
        parent = path.rpartition("/")[0]
        hit = cut.get(parent)
        if hit is None:
            hit = cut[parent] = parent in excluded or left_out(parent)
        return hit or path in excluded

    # Tracked and left out (under a nested repo, oversized, special, unreadable): the base's version stays,
    # written fresh. Tracked and gone (or a directory now): removed. Tracked and not vouched for: hashed.
    rewrite = {p for p in compared.gone if left_out(p)} | {p for p, _, _ in compared.changed if left_out(p)}
    removed = [p for p in compared.gone if p not in rewrite]
    rehash = [entry for entry in compared.changed if entry[0] not in rewrite]  # (path, mode, entry's offset)
    added = [path for path, st in seen.items()
             if path not in modes and not stat.S_ISDIR(st.st_mode) and path != ".git" and not left_out(path)]
    try:
        index.write_bytes(vouch.smudged(rec, [off for _, _, off in rehash]) if rehash else rec.data)
    except OSError as exc:
        return Failure(f"cannot write the job's index {index}: {exc}")
    if added:
        ignored = _check_ignore(git_dir, agent_dir, index, added, modes)
        if isinstance(ignored, Failure):
            return ignored
        added = [p for p in added if p not in ignored]
    if removed:  # named to git as entries, not paths: a path beyond a symlink now is no error
        zero = "0" * (rec.hash_len * 2)
        res = git(["update-index", "-z", "--index-info"], git_dir=git_dir, index_file=index,
                  input_bytes=_nul([f"0 {zero}\t{p}" for p in removed]))
        if not res.ok:
            return Failure(f"git update-index failed: {res.err}")
    if rehash or added:
        # Each entry to hash again lost its stat data above (vouch.smudged): git cannot take it as clean.
        res = git(["update-index", "--add", "-z", "--stdin"], git_dir=git_dir, work_tree=agent_dir, cwd=agent_dir,
                  index_file=index, input_bytes=_nul([*(p for p, _, _ in rehash), *added]))
        refused = [line[len("Ignoring path "):] for line in res.err.splitlines() if line.startswith("Ignoring path ")]
        if not res.ok or refused:
            # git names paths it refuses (`.GIT/x`, `a\\b`): `git add` failed the job on them, so does this.
            return Failure(f"git update-index of the agent's files failed: {res.err[-500:]}")
    untouched = not (removed or rehash or added)  # the index is the checkout's: its cached tree is the base's
    built = _commit(agent_dir, git_dir, wt, index, found, message, compared.tree if untouched else None)
    if isinstance(built, Failure):
        return built
    landed, diff = built
    tree_modes = dict(modes) if diff else modes
    for mode, _oid, path in diff:
        if mode:
            tree_modes[path] = mode
        else:
            tree_modes.pop(path, None)
    broken = {*found.nested, *(p for p in found.unreadable if p in seen)}
    # Vouched for: unchanged since the host's checkout wrote it (so one link, git's mode, the tree's blob).
    vouched = set(modes).difference(compared.gone, (p for p, _, _ in compared.changed), excluded)
    try:
        known = _settle(agent_dir, git_dir, index, landed.tree, tree_modes, seen.items(), broken, rewrite,
                        [p for p in found.unreadable if p not in seen], trusted=vouched)
    except OSError as exc:
        return Failure(f"cannot make {agent_dir} the job's tree: {exc}")
    if isinstance(known, Failure):
        return known
    return Landing(landed.commit, landed.tree, landed.base_sha, git_dir, index, landed.changed,
                   landed.left_out_ignored, known)


def _nul(items: Sequence[str]) -> bytes:
    return b"".join(i.encode("utf-8", "surrogateescape") + b"\0" for i in items)


def _check_ignore(git_dir: Path, work_tree: Path, index: Path, paths: list[str],
                  modes: dict[str, int]) -> set[str] | Failure:
    """Which of the agent's new files `git add --all` would leave out as ignored: git's own rules, asked of
    named paths. A new directory that is ignored is asked once for all below it (git never looks inside
    one), the others' files one by one."""
    base_dirs = vouch.tree_dirs(modes)
    tops: dict[str, list[str]] = {}  # the topmost new directory -> new files beneath it
    ask: list[str] = []
    for path in paths:
        top, head = "", path.rpartition("/")[0]
        while head and head not in base_dirs:
            top, head = head, head.rpartition("/")[0]
        if top:
            tops.setdefault(top, []).append(path)
        else:
            ask.append(path)
    first = _ignored_of(git_dir, work_tree, index, [*ask, *tops])
    if isinstance(first, Failure):
        return first
    out = {p for p in ask if p in first}
    again: list[str] = []
    for top, files in tops.items():
        if top in first:
            out.update(files)
        else:
            again.extend(files)
    more = _ignored_of(git_dir, work_tree, index, again) if again else set()
    return more if isinstance(more, Failure) else out | more


def _ignored_of(git_dir: Path, work_tree: Path, index: Path, paths: list[str]) -> set[str] | Failure:
    # check-ignore reads its arguments as pathspecs and takes no `literal` magic: `./` first keeps a name
    # that starts with `:` a name (git drops the `./` before matching, and says the path as given).
    res = git(["check-ignore", "-z", "--stdin"], git_dir=git_dir, work_tree=work_tree, cwd=work_tree,
              index_file=index, input_bytes=_nul([f"./{p}" for p in paths]))
    if res.code not in (0, 1):
        return Failure(f"git check-ignore failed: {res.err[-500:]}")
    return {p.decode("utf-8", "surrogateescape").removeprefix("./") for p in res.out.split(b"\0") if p}


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


def tree_diff(git_dir: Path, old: str, new: str) -> list[tuple[int, str, str]] | Failure:
    """Every entry that differs between two trees (or commits): (its mode in `new`, 0 where gone; its oid
    there; its path), from objects alone."""
    res = git(["diff-tree", "-r", "-z", "--no-renames", "--no-commit-id", old, new], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git diff-tree failed: {res.err}")
    out = []
    fields = res.out.split(b"\0")
    for i in range(0, len(fields) - 1, 2):
        meta = fields[i].split(b" ")  # :old-mode new-mode old-oid new-oid status
        if len(meta) < 5 or not meta[0].startswith(b":"):
            return Failure(f"git diff-tree said something unexpected: {fields[i][:80]!r}")
        out.append((int(meta[1], 8), meta[3].decode(), fields[i + 1].decode("utf-8", "surrogateescape")))
    return out


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
                      input_bytes=_nul([f"{mode:o} {oid}\t{path}" for mode, oid, path in diff]))
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
        made = _settle(work_tree, git_dir, index, tree, modes, _walk(work_tree, dirs | gitlinks, broken, strays),
                       broken, set(), strays, known, changed, dirs)
    except OSError as exc:
        return Failure(f"cannot make {work_tree} the tree {tree[:12]}: {exc}")
    if isinstance(made, Failure):
        return made
    known.tree, known.modes, known.stats, known.since, known._dirs = made.tree, made.modes, made.stats, made.since, dirs
    known.lost = False
    return None


def _walk(root: Path, walked: frozenset[str] | set[str], broken: set[str],
          strays: list[str]) -> Iterator[tuple[str, os.stat_result]]:
    """One lstat pass over a directory the host once made a tree, entering only the directories in `walked`
    (a tree's own, gitlinks included): whatever else is there goes whole. Each directory is opened beneath
    the root with no symlink on the way. Yields each entry and its lstat, each directory before what is in
    it; adds to `broken` the directories that could not be read, to `strays` the entries that could not be
    stat'ed."""
    root_fd = beneath.open_root(root)
    try:
        stack = [""]
        while stack:
            rel = stack.pop()
            listed = _list_dir(root_fd, rel)
            if listed is None:
                if not rel:
                    raise OSError(f"cannot read {root}")
                broken.add(rel)
                continue
            fd, children = listed
            try:
                for entry in children:
                    path = f"{rel}/{entry.name}" if rel else entry.name
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        strays.append(path)
                        continue
                    if path in walked and stat.S_ISDIR(st.st_mode):
                        stack.append(path)
                    yield path, st
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def _list_dir(root_fd: int, rel: str) -> tuple[int, list[os.DirEntry]] | None:
    """`rel` opened beneath the root (no symlink on the way) and listed; its fd stays open for the entries'
    lstat (the caller closes it). None when it cannot be opened or read."""
    try:
        fd = beneath.open_beneath(root_fd, rel, beneath.DIR_FLAGS) if rel else os.dup(root_fd)
    except OSError:
        return None
    try:
        with os.scandir(fd) as it:
            return fd, list(it)
    except OSError:
        os.close(fd)
        return None


GIT_MODES = frozenset({0o100644, 0o100755, 0o120777})  # a file or symlink exactly as a checkout (umask 022) makes it
FILE_KIND = {0o100644: stat.S_IFREG, 0o100755: stat.S_IFREG, 0o120000: stat.S_IFLNK}
FILE_PERM = {0o100644: 0o644, 0o100755: 0o755}


def _settle(root: Path, git_dir: Path, index: Path, tree: str, modes: dict[str, int],
            seen: Iterable[tuple[str, os.stat_result]], broken: set[str], rewrite: set[str], strays: list[str],
            known: Known | None = None, changed: frozenset[str] = frozenset(),
            dirs: frozenset[str] | None = None, trusted: frozenset[str] | set[str] = frozenset()) -> Known | Failure:
    """Make `root` exactly `tree` (whose entries are `modes`, and which `index` holds) from `seen`, each of
    its entries with its lstat, each directory before what is in it, from the caller's one walk (a scan's,
    or `_walk` as it goes): no walk here. What is not the tree's goes (the directories in `broken`, unread,
    too: nested repos, unreadable ones; and `strays`, entries that could not be stat'ed); so does a file of the tree with other links or another owner, one in `rewrite` or
    `changed`, and, given `known`, one it does not vouch for: each is written fresh from the objects, with
    every file the directory lacks. Without `known` every other file of the tree is kept (right after
    `build`, whose hashing read each file the record would not vouch for); those in `trusted` (the record
    vouches for them: as git wrote them, one link, git's mode) with no check at all. Modes are git's (no setuid, no
    world-writable dir), the root's own included (an agent's `chmod 0777` of its worktree survived into the
    review checkout); a submodule's dir stays empty, as a checkout leaves it. Every operation is beneath the
    root with no symlink on the way (proctor.mechanisms.confine.beneath). Returns what the host now knows: the lstat of
    each file after, and a stamp taken after the last write."""
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
        if (path in trusted and mode in GIT_MODES) or (
                unchanged is not None and path not in changed and unchanged(path, st)):
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
                      index_file=index, input_bytes=_nul(write), umask=0o022)
            if not res.ok:
                return Failure(f"git checkout-index failed: {res.err[-500:]}")
            for path in write:
                kept[path] = beneath.lstat(root_fd, path)
        since = vouch.stamp(root_fd)
    finally:
        os.close(root_fd)
    return Known(tree, modes, kept, since, dirs)


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
