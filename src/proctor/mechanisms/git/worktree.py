"""The job's repositories: base-ref resolution and host-made git dirs that borrow the main repo's objects.

Layout, for the repo `/x/app` and job `J` (branch `wt/J/<ticket>`):

    /x/app-agents/J        the agent's worktree while it runs; after it, the job's review checkout
    /x/app-agents/J/.git   a repository of the job's own, made by the host: its own objects and refs,
                           `objects/info/alternates` naming the main repo's object store

The main repo gets nothing from a job: no branch, no object, no config (landing copies the job's objects
in). Its store is only ever read through alternates, which git never writes, and it is read-only under
every confinement, so an agent can neither rewrite master's blobs nor delete history (found in review:
with a linked worktree the shared store was the agent's to edit). A linked worktree also put the agent's
branch ref and `HEAD` into files the host later read; here the host never reads the agent's git dir.

Right after the checkout, before anything else runs in it, the host keeps what its git wrote: the index (each
file's stat right after git wrote it) and a stamp (proctor.mechanisms.git.vouch). Landing compares the agent's directory
with that record and hashes only what it cannot vouch for; the record never leaves the host's memory, so
nothing the agent runs can edit it.

It never touches the main checkout's files or its HEAD, and never removes a job's checkout (review, land,
discard and gc are separate verbs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.contract import check_ref
from proctor.mechanisms.git.command import git
from proctor.mechanisms.git.vouch import Recorded, stamp


@dataclass(frozen=True)
class Failure:
    reason: str
    code: str | None = None  # a contract Code's value where the failure has its own (UNSAFE_DIRECTORY)


@dataclass(frozen=True)
class Repo:
    path: Path  # top of the main checkout
    common_dir: Path  # the shared .git
    object_format: str = "sha1"

    @property
    def objects(self) -> Path:
        return self.common_dir / "objects"


@dataclass(frozen=True)
class Base:
    ref: str
    sha: str


@dataclass(frozen=True)
class Worktree:
    """The agent's worktree: a fresh checkout of the base in a repository of the job's own."""

    path: Path
    branch: str
    base_ref: str
    base_sha: str
    repo: Repo
    # The checkout as the host's git wrote it, read before anything else ran there; None: nothing is vouched
    # for (every file's content is read at landing).
    recorded: Recorded | None = field(default=None, repr=False, compare=False)


def agents_dir(repo: Repo) -> Path:
    return repo.path.parent / f"{repo.path.name}-agents"


def path_for(repo: Repo, job_id: str) -> Path:
    return agents_dir(repo) / job_id


def unsafe_dirs(repo: Repo, private: tuple[Path, ...] = ()) -> str | None:
    """Why a job may not use `{repo}-agents/` (made here, mode 0700, when missing) or its `private` dirs
    (the TMPDIRs, made by mkdtemp): each must be this user's and writable by nobody else, under parents no
    other user can swap it in. Measured (issue 21): in a world-writable sticky dir another user pre-created
    `repo-agents/`; proctor used it as found and she swapped the validation checkout mid-job."""
    # Checked, not made: a job refused later (a budget, the breaker) leaves nothing behind; `create` makes
    # it 0700 and checks it again when the worktree is cut.
    agents = agents_dir(repo)
    why = (beneath.unsafe_dir(agents) or beneath.unsafe_parent(agents.parent)) if os.path.lexists(agents) \
        else beneath.unsafe_parent(agents.parent)
    for d in private:
        why = why or beneath.unsafe_dir(d) or beneath.unsafe_parent(d.parent)
    return f"unsafe directory: {why}" if why else None


def open_repo(path: str | Path) -> Repo | Failure:
    p = Path(path)
    if not p.is_dir():
        return Failure(f"repo {str(path)!r} is not an existing directory")
    res = git(["rev-parse", "--show-toplevel", "--path-format=absolute", "--git-common-dir",
               "--show-object-format"], cwd=p)
    lines = res.text.splitlines()
    if not res.ok or len(lines) != 3:
        return Failure(f"repo {str(path)!r} is not a git repository ({res.err or 'no work tree'})")
    return Repo(Path(lines[0]), Path(lines[1]), lines[2])


def default_base(repo: Repo) -> Base | Failure:
    """`master` where it exists, else `main`, else the branch HEAD names, else HEAD itself."""
    heads = git(["for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads/master", "refs/heads/main"],
                cwd=repo.path)
    found = dict(line.split(" ", 1) for line in heads.text.splitlines() if " " in line) if heads.ok else {}
    for name in ("master", "main"):
        if name in found:
            return Base(name, found[name])
    head = git(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=repo.path)
    return resolve_base(repo, head.text if head.ok and head.text else "HEAD")


def resolve_branch(repo: Repo, name: str) -> Base | Failure:
    """The branch `name` (refs/heads/<name>) and nothing else: not a tag, a stash or a remote-tracking ref of
    that name (git's own order puts refs/tags first)."""
    res = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"refs/heads/{name}^{{commit}}"], cwd=repo.path)
    if not res.ok or not res.text:
        return Failure(f"branch {name!r} is not a branch of {repo.path} (refs/heads/{name}): a request names a "
                       "branch, nothing else")
    return Base(name, res.text)


def resolve_base(repo: Repo, ref: str) -> Base | Failure:
    res = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], cwd=repo.path)
    if not res.ok or not res.text:
        anything = git(["rev-parse", "--verify", "--quiet", "HEAD"], cwd=repo.path)
        if not (anything.ok and anything.text) and not git(["for-each-ref", "--count=1"], cwd=repo.path).text:
            return Failure(f"the repo {repo.path} has no commits yet: make a first commit, then run the job")
        return Failure(f"base ref {ref!r} does not name a commit in {repo.path}")
    return Base(ref, res.text)


def filter_drivers(repo: Repo) -> list[str]:
    """The filter drivers the main repo's config names: content git would run a program for (clean/smudge),
    which host-side git in the main checkout never does."""
    res = git(["config", "--name-only", "--get-regexp", r"^filter\..*\.(clean|smudge|process)$"], cwd=repo.path)
    if not res.ok:
        return []
    return sorted({k[len("filter."):k.rindex(".")] for k in res.text.splitlines() if k.count(".") >= 2})


def checkout_risks(repo: Repo, base: Base, most: int = 5) -> list[str]:
    """What a reviewer of a job on `base` needs to know of the main checkout, read before the agent runs:
    uncommitted changes (the job never sees them) and a base behind the branch the checkout is on."""
    risks: list[str] = []
    drivers = filter_drivers(repo)
    st = git(["status", "--porcelain=v1", "-z", "--untracked-files=normal", "--ignore-submodules=dirty"],
             cwd=repo.path) if not drivers else None
    if drivers:
        risks.append(f"the main checkout's uncommitted changes were not looked for: its config names filter "
                     f"drivers ({', '.join(drivers)}), which proctor never runs")
    elif st is not None and st.ok:
        names: list[str] = []
        entries = iter(st.out.decode("utf-8", "replace").split("\0"))
        for e in entries:
            if len(e) > 3:
                names.append(e[3:])
                if "R" in e[:2] or "C" in e[:2]:
                    next(entries, None)  # a rename's source path follows as an entry of its own
        if names:
            more = f" and {len(names) - most} more" if len(names) > most else ""
            risks.append(f"the main checkout has {len(names)} uncommitted change(s) the job did not include: "
                         f"{', '.join(names[:most])}{more}")
    head = git(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=repo.path)
    branch = head.text if head.ok else ""
    if branch and branch != base.ref:
        ahead = git(["rev-list", "--count", f"{base.sha}..HEAD"], cwd=repo.path)
        if ahead.ok and ahead.text.isdigit() and int(ahead.text) > 0:
            risks.append(f"the base {base.ref} is {ahead.text} commit(s) behind {branch}, the branch the main "
                         "checkout is on (pass --branch to work on it)")
    return risks


def init_git_dir(work_tree: Path, repo: Repo, branch: str, alternates: tuple[Path, ...] = ()) -> Failure | None:
    """`work_tree/.git`, written whole by the host (git's documented layout, no `git init`: one process
    less a job, and no template, so no hooks): git's default config only, HEAD on `branch`, objects
    borrowed from `alternates` and then the main repo, the main repo's info/exclude."""
    git_dir = work_tree / ".git"
    version = 0 if repo.object_format == "sha1" else 1
    config = (f"[core]\n\trepositoryformatversion = {version}\n\tfilemode = true\n\tbare = false\n"
              "\tlogallrefupdates = true\n")
    if version:
        config += f"[extensions]\n\tobjectformat = {repo.object_format}\n"
    try:
        for d in ("objects/info", "objects/pack", "refs/heads", "refs/tags", "info"):
            (git_dir / d).mkdir(parents=True, exist_ok=True)
        (git_dir / "config").write_text(config)
        (git_dir / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
        (git_dir / "objects" / "info" / "alternates").write_text("".join(f"{p}\n" for p in (*alternates, repo.objects)))
        exclude = repo.common_dir / "info" / "exclude"
        if exclude.is_file():
            (git_dir / "info" / "exclude").write_bytes(exclude.read_bytes()[:1_000_000])
    except OSError as exc:
        return Failure(f"cannot write the job's git dir {git_dir}: {exc}")
    return None


def checkout(git_dir: Path, work_tree: Path, rev: str) -> Failure | None:
    """Populate `work_tree` (and `git_dir`'s index) with `rev`: git's own checkout with no config of the
    repo's, so no filter runs; submodules stay empty directories. Written by one git worker per core: the
    checkout is most of a small job's cost and creating files is kernel time a second core halves
    (`checkout.workers`; git keeps one process below `checkout.thresholdForParallelism`, 100 files)."""
    res = git(["-c", "checkout.workers=0", "read-tree", "--reset", "-u", rev], git_dir=git_dir, work_tree=work_tree,
              cwd=work_tree, umask=0o022)
    return None if res.ok else Failure(f"git checkout of {rev[:12]} failed: {res.err}")


def record(git_dir: Path, repo: Repo) -> Recorded | None:
    """The index a checkout just wrote in `git_dir` and a stamp after it: called before anything but the host
    ran in the checkout. None when it cannot be read (nothing is vouched for then)."""
    try:
        data = (git_dir / "index").read_bytes()
        fd = os.open(git_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            since = stamp(fd)
        finally:
            os.close(fd)
    except OSError:
        return None
    return Recorded(data, since, 32 if repo.object_format == "sha256" else 20)


def set_ref(git_dir: Path, ref: str, sha: str) -> Failure | None:
    """A loose ref in a git dir the host made (written, then renamed into place)."""
    path = git_dir / ref
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".lock")
        tmp.write_text(f"{sha}\n")
        os.replace(tmp, path)
    except OSError as exc:
        return Failure(f"cannot write {ref} in {git_dir}: {exc}")
    return None


def create(repo: Repo, job_id: str, ticket: str, base: Base) -> Worktree | Failure:
    """The agent's worktree: the base checked out in a repository of the job's own, the job's branch at
    the base, and (for the agent's `git diff <base>`) a branch of the base's name where it is one."""
    path = path_for(repo, job_id)
    branch = f"wt/{job_id}/{ticket}"
    unsafe = beneath.private_dir(agents_dir(repo))  # made 0700 here, and checked once it is there
    if unsafe:
        return Failure(f"unsafe directory: {unsafe}", code="UNSAFE_DIRECTORY")
    try:
        path.mkdir(0o700)  # never one that is there: mkdir fails on any entry, a link included
    except FileExistsError:
        return Failure(f"worktree path {path} already exists")
    except OSError as exc:
        return Failure(f"cannot create the worktree {path}: {exc}")
    gd = path / ".git"
    failure = (init_git_dir(path, repo, branch) or set_ref(gd, f"refs/heads/{branch}", base.sha)
               or _base_name_ref(gd, base, branch) or checkout(gd, path, base.sha))
    return failure or Worktree(path, branch, base.ref, base.sha, repo, record(gd, repo))


def _base_name_ref(git_dir: Path, base: Base, branch: str) -> Failure | None:
    try:
        check_ref(base.ref)
    except ValueError:
        return None
    if base.ref in ("HEAD", branch) or base.ref.startswith(("refs/", "wt/")) or len(base.ref) >= 40:
        return None
    return set_ref(git_dir, f"refs/heads/{base.ref}", base.sha)


def remove_tree(path: Path) -> bool:
    """Remove a directory the agent wrote: no symlink is followed inside it, nor is `path` itself one
    (a link there is removed, not its target); unreadable modes are undone first. `path`'s parent is the
    host's (`{repo}-agents/`, or a scratch dir)."""
    try:
        parent = beneath.open_root(path.parent)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        beneath.rmtree(parent, path.name)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    finally:
        os.close(parent)
    return not os.path.lexists(path)
