"""The tree that would land: built by the host from the content the agent left, committed, checked out fresh.

Owns the step between the agent's exit and validation (DESIGN.md 9a). The agent's directory is hostile
input by then: the host looks at it only with lstat and through git's own hashing of file content, in a
git dir the host made (proctor.mechanisms.git.command says why that runs nothing the agent wrote). It never reads the
agent's git dir, index, HEAD or refs, and never executes anything from the agent's directory.

    scan(agent_dir)                          -> Scan: special files, nested repos, files over the size cap, and
                                                the lstat of every entry (the job's one walk of the directory;
                                                proctor.mechanisms.git.scan)
    build(agent_dir, git_dir, wt, ...)       -> Landing | Failure: the job's commit on its branch in a git dir
                                                the host made, and the directory made exactly its tree (here)
    materialise(dir, git_dir, tree, index)   -> make a directory exactly a tree, in place (for validation,
                                                the frozen tree, and the review checkout;
                                                proctor.mechanisms.git.materialise)

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.git import vouch
from proctor.mechanisms.git.command import git, nul_terminated
from proctor.mechanisms.git.materialise import GIT_MODES, materialise, settle
from proctor.mechanisms.git.scan import CONTROL_FILES, Scan
from proctor.mechanisms.git.trees import tree_diff
from proctor.mechanisms.git.vouch import GITLINK as GITLINK_MODE
from proctor.mechanisms.git.vouch import Known
from proctor.mechanisms.git.worktree import Failure, Worktree, init_git_dir, set_ref

# Still imported from here by services (job/land.py: scan; review: changed_paths, tree_entries) until they
# import them from proctor.mechanisms.git.scan and proctor.mechanisms.git.trees.

COMMIT_ENV = {"GIT_AUTHOR_NAME": "proctor", "GIT_AUTHOR_EMAIL": "proctor@localhost",
              "GIT_COMMITTER_NAME": "proctor", "GIT_COMMITTER_EMAIL": "proctor@localhost"}
GITLINK = "160000"


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
                  input_bytes=nul_terminated([f"0 {zero}\t{p}" for p in removed]))
        if not res.ok:
            return Failure(f"git update-index failed: {res.err}")
    if rehash or added:
        # Each entry to hash again lost its stat data above (vouch.smudged): git cannot take it as clean.
        res = git(["update-index", "--add", "-z", "--stdin"], git_dir=git_dir, work_tree=agent_dir, cwd=agent_dir,
                  index_file=index, input_bytes=nul_terminated([*(p for p, _, _ in rehash), *added]))
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
    # settle keeps them without a look; it walks the rest of the scan.
    trusted = {p: st for p, st in compared.vouched.items() if st.st_mode in GIT_MODES and p not in excluded}
    rest = [(p, st) for p, st in seen.items() if p not in trusted]
    try:
        known = settle(agent_dir, git_dir, index, landed.tree, tree_modes, rest, broken, rewrite,
                       [p for p in found.unreadable if p not in seen], trusted=trusted)
    except OSError as exc:
        return Failure(f"cannot make {agent_dir} the job's tree: {exc}")
    if isinstance(known, Failure):
        return known
    return Landing(landed.commit, landed.tree, landed.base_sha, git_dir, index, landed.changed,
                   landed.left_out_ignored, known)


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
              index_file=index, input_bytes=nul_terminated([f"./{p}" for p in paths]))
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


def _ignored(git_dir: Path, work_tree: Path, index: Path, paths: list[str]) -> tuple[str, ...]:
    if not paths:
        return ()
    res = git(["check-ignore", "-z", "--", *paths], git_dir=git_dir, work_tree=work_tree, cwd=work_tree,
              index_file=index)
    return tuple(p.decode("utf-8", "surrogateescape") for p in res.out.split(b"\0") if p)


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
