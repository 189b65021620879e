"""`proctor land JOB`: move a branch of the main repo to a validated job's work.

Owns the decision and the move, in this order, every refusal a code (proctor.services.review.outcome):

1. Only a job whose validation passed: the ledger says `completed`, and every validation command the
   host ran (result.json, checked against the ledger's status and commit) exited 0. `--force --reason`
   lands anything else, and the row says so.
2. The new commit, built in a git dir the host makes (proctor.services.review.objects): a fast-forward to the job's
   commit when the target has not moved past the base (mode `auto`, `--ff-only`), else a merge commit
   (`auto`, `--merge`: parents target and job) or one squashed commit (`--squash`: parent target), the
   tree from `git merge-tree` (a conflict refuses). No merge driver exists in any config that git reads.
3. When that tree is not the one the job validated (the target moved), the job's validation runs again
   on it (proctor.services.review.revalidate) before the ref moves; a failure refuses.
4. The new objects are copied into the main repo (one pack, verified there), then the ref moves by
   compare-and-swap against the tip read in step 2: a target that moved meanwhile refuses, nothing moved.
5. The main checkout's files change only when it is on the target branch and clean: then exactly as a
   checkout would (`read-tree -m -u`), checked by a dry run before the ref moves. It is refused when a
   linked worktree has the target out, when the repo's config names filter drivers (proctor never
   runs them; a checkout without them would write their input, not their output), and when it would
   overwrite or remove an untracked or ignored file of the person's (`would_lose`: git's checkout treats
   ignored files as expendable). A change the target already holds lands nothing (no empty merge).

No hook runs (core.hooksPath=/dev/null), no fsmonitor, no gc (gc.auto=0), no system or global config
(proctor.mechanisms.git.command). A `review.land.start` row is written before the first write to the main repo, and a
`review.land` row ends every land, refused ones included.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.confine import CONFINE_ORDER, beneath
from proctor.contract import check_ref
from proctor.mechanisms.evidence import recipe
from proctor.mechanisms.git import trustline, worktree
from proctor.mechanisms.git.command import git
from proctor.mechanisms.git.landing import COMMIT_ENV
from proctor.mechanisms.git.trees import changed_paths, tree_entries
from proctor.mechanisms.ledger.store import Ledger, LedgerError
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.validation import environment
from proctor.services.review import revalidate
from proctor.services.review.jobs import Job
from proctor.services.review.objects import JobObjects, open_objects
from proctor.services.review.outcome import Code, Outcome, refuse

Mode = Literal["auto", "merge", "squash", "ff-only"]
# Beside proctor.mechanisms.git.command's SAFE_CONFIG, for the commands that write the main repo: no auto-gc or
# maintenance (each could run a hook or a repack at the user's cost).
MAIN_REPO = ("-c", "gc.auto=0", "-c", "maintenance.auto=false")


def landable(job: Job) -> str | None:
    """Why `job` may not land without --force (None: it may): not completed, or its validation did not
    run and pass in full (a second run with the base's test files included)."""
    result = job.record.result
    if job.status != "completed":
        return f"job {job.job_id} is {job.status} ({job.code or 'no code'})"
    if result is None:
        return f"job {job.job_id} has no result.json: its validation cannot be checked"
    if result.get("status") != job.status:
        return f"result.json says {result.get('status')!r}, the ledger {job.status!r}"
    runs = result.get("validation") or []
    if not runs:
        return f"job {job.job_id}'s validation did not run ({'; '.join(result.get('known_risks') or [])[:200]})"
    for run in runs:
        # `passed`: the host's own word on the step (an exit of 1 the base's failures account for passes);
        # a record from before it has only the exit code.
        passed = run.get("passed") if "passed" in run else run.get("exit_code") == 0
        if not passed or run.get("timed_out"):
            return f"job {job.job_id}'s validation did not pass: {run.get('label')} => exit {run.get('exit_code')}"
    return None


def stronger(job_mode: object, config_mode: str) -> str:
    """Re-validation runs agent code anew: under the job's confine mode or today's config, whichever is
    stronger (a job run with --confine off does not make its landing unconfined once config says auto)."""
    modes = [m for m in (job_mode, config_mode) if m in CONFINE_ORDER]
    return max(modes, key=CONFINE_ORDER.__getitem__) if modes else "auto"


def _commit_env() -> dict[str, str]:
    # The person landing is the committer when their environment names one; else proctor.
    return {k: os.environ.get(k) or v for k, v in COMMIT_ENV.items()}


def _main(repo: worktree.Repo, args: list[str], **kw: Any):
    return git([*MAIN_REPO, *args], cwd=repo.path, **kw)


@dataclass(frozen=True)
class Checkout:
    on_target: bool  # the main checkout has the target out (and is clean: else refused)


def checkout_state(repo: worktree.Repo, target: str) -> Checkout | Outcome:
    """Whether the main checkout's files follow the ref, refusing what would leave files stale."""
    res = _main(repo, ["worktree", "list", "--porcelain", "-z"])
    if not res.ok:
        return refuse(Code.GIT_FAILED, f"git worktree list failed: {res.err}")
    entries: list[dict[str, str]] = []
    for field_ in res.out.decode("utf-8", "surrogateescape").split("\0"):
        if field_.startswith("worktree "):
            entries.append({"path": field_[9:]})
        elif entries and " " in field_:
            key, value = field_.split(" ", 1)
            entries[-1][key] = value
    ref = f"refs/heads/{target}"
    linked = [e["path"] for e in entries[1:] if e.get("branch") == ref]
    if linked:
        return refuse(Code.TARGET_CHECKED_OUT, f"{target} is checked out in the linked worktree {linked[0]}, "
                      "whose files would go stale: check out another branch there first")
    if not entries or entries[0].get("branch") != ref:
        return Checkout(False)
    drivers = worktree.filter_drivers(repo)
    if drivers:
        return refuse(Code.TARGET_CHECKED_OUT, f"the main checkout is on {target} and the repo's config names "
                      f"filter drivers ({', '.join(drivers)}), which proctor never runs: check out another "
                      "branch, land, and check it out again")
    st = _main(repo, ["status", "--porcelain=v1", "-z", "--untracked-files=no", "--ignore-submodules=all"])
    if not st.ok:
        return refuse(Code.GIT_FAILED, f"git status of the main checkout failed: {st.err}")
    if st.out.strip(b"\0"):
        names = [e[3:] for e in st.out.decode("utf-8", "replace").split("\0") if len(e) > 3]
        return refuse(Code.CHECKOUT_DIRTY, f"the main checkout is on {target} with uncommitted changes "
                      f"({', '.join(names[:5])}): commit or stash them, or land into another branch")
    return Checkout(True)


MAX_LOST_NAMES = 50


def would_lose(repo: worktree.Repo, git_dir: Path, old: str, new: str) -> list[str] | Outcome:
    """The untracked or ignored entries of the main checkout (clean, on the target at `old`) that moving its
    files to `new` would overwrite or remove. `git read-tree -m -u` treats ignored files as expendable
    (measured, git 2.39: an agent that emptied `.gitignore` and committed its own `.env` replaced the
    developer's ignored `.env`), so the host looks first: for each path `new` adds, an untracked entry at
    it, or at a directory on its way, or under it where a directory must become a file, is lost.

    Only lstat, each entry reached beneath the checkout with no symlink on the way; tracked files are not
    counted (the checkout is clean: their content is in `old`)."""
    tracked = _entries(git_dir, old)
    if isinstance(tracked, Outcome):
        return tracked
    res = git(["diff-tree", "-r", "-z", "--no-renames", "--name-only", "--diff-filter=ACMRT", old, new],
              git_dir=git_dir)
    if not res.ok:
        return refuse(Code.GIT_FAILED, f"git diff-tree failed: {res.err}")
    try:
        root = beneath.open_root(repo.path)
    except OSError as exc:
        return refuse(Code.GIT_FAILED, f"cannot open the main checkout {repo.path}: {exc.strerror}")
    lost: list[str] = []
    try:
        for raw in res.out.split(b"\0"):
            if raw and len(lost) < MAX_LOST_NAMES:
                lost += _lost_on_the_way(root, raw.decode("utf-8", "surrogateescape"), tracked)
    finally:
        os.close(root)
    return sorted(set(lost))[:MAX_LOST_NAMES]


def _entries(git_dir: Path, rev: str) -> dict[str, str] | Outcome:
    got = tree_entries(git_dir, rev)
    return refuse(Code.GIT_FAILED, got.reason) if isinstance(got, worktree.Failure) else got


def _lost_on_the_way(root: int, path: str, tracked: dict[str, str]) -> list[str]:
    """What of the checkout's untracked entries writing `path` (a file, link or submodule dir) destroys."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        here = "/".join(parts[:i])
        mode = tracked.get(here)
        if mode is not None and mode != "040000":
            return []  # a tracked file or link: git replaces it, and its content is in the target's tip
        try:
            st = beneath.lstat(root, here)
        except FileNotFoundError:
            return []
        except OSError:
            return [here]  # cannot be told safe: named, not guessed
        if not stat.S_ISDIR(st.st_mode):
            return [] if mode is not None else [here]
        if i == len(parts):  # a directory where a file goes: git empties it, ignored files and all
            return _untracked_under(root, here, tracked)
    return []


def _untracked_under(root: int, top: str, tracked: dict[str, str]) -> list[str]:
    out: list[str] = []
    stack = [top]
    while stack and len(out) < MAX_LOST_NAMES:
        rel = stack.pop()
        try:
            fd = beneath.open_beneath(root, rel, beneath.DIR_FLAGS)
        except OSError:
            out.append(rel)
            continue
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        for name in sorted(names):
            child = f"{rel}/{name}"
            if tracked.get(child) == "040000":
                stack.append(child)
            elif child not in tracked:
                out.append(child)
    return out


def _clobbers(objs: JobObjects, p: Plan, **details: Any) -> Outcome | None:
    """A refusal naming the person's files the landing would destroy in the main checkout, or None."""
    lost = would_lose(objs.repo, objs.git_dir, p.old, p.new)
    if isinstance(lost, Outcome):
        return refuse(lost.code, lost.reason, **details)
    if not lost:
        return None
    return refuse(Code.CHECKOUT_WOULD_LOSE, f"landing into {p.target} would overwrite or remove untracked or "
                  f"ignored files of the main checkout: {', '.join(lost[:10])}"
                  f"{f' (+{len(lost) - 10} more)' if len(lost) > 10 else ''}; move them aside, or check out "
                  "another branch and land", would_lose=lost, **details)


@dataclass(frozen=True)
class Plan:
    target: str
    old: str  # the target's tip, read once: the compare-and-swap's expected value
    new: str
    tree: str
    how: str  # ff | merge | squash


def _tip(repo: worktree.Repo, target: str) -> str | None:
    res = _main(repo, ["rev-parse", "--verify", "--quiet", "--end-of-options", f"refs/heads/{target}^{{commit}}"])
    return res.text if res.ok and res.text else None


def plan(objs: JobObjects, job: Job, target: str, old: str, mode: Mode) -> Plan | Outcome:
    gd = objs.git_dir
    anc = git(["merge-base", "--is-ancestor", old, objs.commit], git_dir=gd)
    if anc.code not in (0, 1):
        return refuse(Code.GIT_FAILED, f"git merge-base failed: {anc.err}")
    ff = anc.code == 0
    if mode == "ff-only" and not ff:
        return refuse(Code.NOT_FAST_FORWARD, f"{target} moved since the job's base ({objs.base[:12]} -> "
                      f"{old[:12]}): --ff-only cannot land it")
    if ff and mode in ("auto", "ff-only"):
        if old == objs.commit:
            return refuse(Code.NOTHING_TO_LAND, f"{target} is already at job {job.job_id}'s commit")
        return Plan(target, old, objs.commit, objs.tree, "ff")
    tree = objs.tree
    if not ff:
        merged = git(["merge-tree", "--write-tree", "--name-only", "--no-messages", "-z", old, objs.commit],
                     git_dir=gd)
        parts = [p for p in merged.out.decode("utf-8", "surrogateescape").split("\0") if p]
        if merged.code == 1:
            return refuse(Code.CONFLICT, f"job {job.job_id} conflicts with {target} in "
                          f"{', '.join(parts[1:6]) or 'some paths'}", conflicts=parts[1:])
        if not merged.ok or not parts:
            return refuse(Code.GIT_FAILED, f"git merge-tree failed: {merged.err}")
        tree = parts[0]
    if tree == _tree_at(gd, old):
        # The target already holds the change (it landed another way, or the same edit was made there):
        # a merge would be an empty commit that says something landed.
        return refuse(Code.NOTHING_TO_LAND, f"{target} already holds job {job.job_id}'s change: nothing to land")
    message = f"Land proctor job {job.job_id} ({job.agent}): {job.ticket}\n"
    parents = ["-p", old] if mode == "squash" else ["-p", old, "-p", objs.commit]
    if mode == "squash":
        body = git(["log", "-1", "--format=%B", objs.commit], git_dir=gd)
        message = f"{body.text or message}\n\nSquashed proctor job {job.job_id}.\n"
    made = git(["commit-tree", "--no-gpg-sign", tree, *parents, "-m", message], git_dir=gd, env=_commit_env())
    if not made.ok:
        return refuse(Code.GIT_FAILED, f"git commit-tree failed: {made.err}")
    return Plan(target, old, made.text, tree, "squash" if mode == "squash" else "merge")


def copy_in(objs: JobObjects, p: Plan) -> int | Outcome:
    """The objects the new commit needs that the target lacks, as one pack written into the main repo."""
    pack = git(["pack-objects", "--revs", "--stdout", "-q"], git_dir=objs.git_dir,
               input_bytes=f"{p.new}\n^{p.old}\n".encode())
    if not pack.ok:
        return refuse(Code.GIT_FAILED, f"git pack-objects failed: {pack.err}")
    idx = _main(objs.repo, ["index-pack", "--stdin"], input_bytes=pack.out)
    if not idx.ok:
        return refuse(Code.GIT_FAILED, f"git index-pack in the main repo failed: {idx.err}")
    # Every object of the new commit is in the main repo now (index-pack checked each one's hash).
    whole = _main(objs.repo, ["rev-list", "--objects", "--quiet", p.new, "--not", p.old])
    if not whole.ok:
        return refuse(Code.OBJECTS_MISSING, f"the main repo lacks objects of {p.new[:12]} after the copy: {whole.err}")
    return len(pack.out)


def _target_for(job: Job, into: str | None, repo: worktree.Repo) -> str | Outcome:
    raw = into or (job.record.result or {}).get("baseRef") or job.base
    if not raw:
        base = worktree.default_base(repo)
        raw = base.ref if isinstance(base, worktree.Base) else None
    target = str(raw or "").removeprefix("refs/heads/")
    try:
        check_ref(target)
    except ValueError as exc:
        return refuse(Code.TARGET_INVALID, f"--into: {exc}")
    if target == "HEAD" or target.startswith(("refs/", "wt/")):
        return refuse(Code.TARGET_INVALID, f"{target!r} is not a branch proctor lands into; pass --into BRANCH")
    return target


def land(ledger: Ledger, job: Job, *, into: str | None = None, mode: Mode = "auto", force: bool = False,
         reason: str = "", config: Config | None = None, stop: StopSwitch | None = None,
         via: str = "cli", allow_trust_line: bool = False) -> Outcome:
    """Land `job` into `into` (default: the job's base branch); every outcome is also a `review.land` row,
    naming the surface it came through (`via`: cli, web, mcp). A job that changes what runs or is obeyed
    outside the tests (proctor.mechanisms.git.trustline) lands only with `allow_trust_line`: a person read it."""
    start = time.monotonic()
    out = _land(ledger, job, into, mode, force, reason, config, stop or StopSwitch(), allow_trust_line)
    out.details.setdefault("jobId", job.job_id)
    out.details["seconds"] = round(time.monotonic() - start, 3)
    if out.code is not Code.LEDGER_FAILED:
        row = {"ok": out.ok, "code": out.code.value, "reason": out.reason, "jobId": job.job_id, "forced": force,
               "force_reason": reason if force else None, "via": via,
               **{k: v for k, v in out.details.items() if k not in ("revalidation_output", "jobId")}}
        try:
            ledger.append("review.land", row, job_id=job.job_id, reserve=out.ok)
        except (LedgerError, OSError, ValueError) as exc:
            out.details["ledger_warning"] = f"the review.land row could not be written: {exc}"
    return out


def _land(ledger: Ledger, job: Job, into: str | None, mode: Mode, force: bool, reason: str,
          config: Config | None, stop: StopSwitch, allow_trust_line: bool) -> Outcome:
    if force and not reason.strip():
        return refuse(Code.FORCE_NEEDS_REASON, "--force needs --reason TEXT: it is recorded in the ledger")
    stopped = stop.reason()
    if stopped:
        return refuse(Code.STOPPED, f"proctor is stopped ({stopped}): nothing lands until `proctor resume`")
    if job.ended is None and job.host_alive:
        return refuse(Code.JOB_RUNNING, f"job {job.job_id} is still running")
    if job.state == "landed":
        return refuse(Code.ALREADY_LANDED, f"job {job.job_id} already landed into {(job.landed or {}).get('into')}")
    why = landable(job)
    if why and not force:
        return refuse(Code.NOT_LANDABLE, f"{why}; --force --reason TEXT lands it anyway")
    if job.checkout is None:
        return refuse(Code.OBJECTS_MISSING, f"job {job.job_id} has no worktree to land from")
    scratch = job.checkout.with_name(f".{job.checkout.name}.land")
    # The job's objects are read from beside it: a `{repo}-agents/` another user can write could swap them.
    unsafe = beneath.private_dir(scratch.parent)
    if unsafe:
        return refuse(Code.UNSAFE_DIRECTORY, f"unsafe directory: {unsafe}; nothing was landed")
    if os.path.lexists(scratch) and not worktree.remove_tree(scratch):
        return refuse(Code.REMOVE_FAILED, f"a stale {scratch} could not be removed")
    try:
        os.mkdir(scratch, 0o700)
        os.mkdir(scratch / "host", 0o700)
    except OSError as exc:
        return refuse(Code.GIT_FAILED, f"cannot make {scratch}: {exc}")
    try:
        return _in_scratch(ledger, job, scratch, into, mode, force, why, config, stop, allow_trust_line)
    finally:
        worktree.remove_tree(scratch)


def _in_scratch(ledger: Ledger, job: Job, scratch: Path, into: str | None, mode: Mode, force: bool,
                why: str | None, config: Config | None, stop: StopSwitch, allow_trust_line: bool) -> Outcome:
    objs = open_objects(job, scratch / "host")
    if isinstance(objs, Outcome):
        return objs
    if objs.tree == _tree_of(objs, objs.base):
        return refuse(Code.NOTHING_TO_LAND, f"job {job.job_id} changed no file")
    crossed = _crossed(objs, job, config)
    if crossed and not allow_trust_line:
        return refuse(Code.TRUST_LINE, f"job {job.job_id} changes what runs or is obeyed outside the tests: "
                      f"{trustline.say(crossed)}; read it (`proctor diff {job.job_id}`), then land with "
                      "--allow-trust-line", trust_line=[p for p, _ in crossed])
    target = _target_for(job, into, objs.repo)
    if isinstance(target, Outcome):
        return target
    old = _tip(objs.repo, target)
    if old is None:
        return refuse(Code.TARGET_MISSING, f"{target} is not a branch of {objs.repo.path}")
    state = checkout_state(objs.repo, target)
    if isinstance(state, Outcome):
        return state
    p = plan(objs, job, target, old, mode)
    if isinstance(p, Outcome):
        return p
    details: dict[str, Any] = {"into": target, "old": p.old, "new": p.new, "tree": p.tree, "how": p.how,
                               "moved": p.old != objs.base, "not_landable": why}
    lose = _clobbers(objs, p, **details) if state.on_target else None
    if lose is not None:
        return lose
    if p.tree != objs.tree:
        # The tree that would land is not the one the job validated: validate it before the ref moves.
        try:
            config = config or load_config()
        except ConfigError as exc:
            return refuse(Code.CONFIG_INVALID, str(exc), **details)
        request = job.record.request or {}
        subject = revalidate.Subject(
            job_id=job.job_id, branch=str((job.record.result or {}).get("branch") or f"wt/{job.job_id}"),
            repo=objs.repo, git_dir=objs.git_dir, commit=p.new, target=p.old, checkout=scratch / "tree",
            job_checkout=job.checkout, validate_command=request.get("validateCommand"),
            confine_mode=stronger(request.get("confine"), config.confine))
        rv = revalidate.revalidate(subject, config, poll=_poll(stop))
        details["revalidation"] = rv.summary()
        details["revalidation_output"] = rv.attempts
        details["validation_log"] = rv.log
        if not rv.passed and not force:
            return refuse(Code.REVALIDATION_FAILED, f"the merged tree did not pass: {rv.reason}", **details)
        if not rv.passed:
            details["forced_past_revalidation"] = rv.reason
    try:
        ledger.append("review.land.start", {"jobId": job.job_id, "forced": force, **details}, job_id=job.job_id)
    except (LedgerError, OSError, ValueError) as exc:
        return refuse(Code.LEDGER_FAILED, f"the review.land.start row could not be written ({exc}): nothing moved",
                      **details)
    copied = copy_in(objs, p)
    if isinstance(copied, Outcome):
        return refuse(copied.code, copied.reason, **details)
    details["pack_bytes"] = copied
    # Checked again: the person may have switched branches or edited files while validation ran.
    state = checkout_state(objs.repo, target)
    if isinstance(state, Outcome):
        return refuse(state.code, state.reason, **details)
    lose = _clobbers(objs, p, **details) if state.on_target else None  # the person may have made one since
    if lose is not None:
        return lose
    if state.on_target:
        dry = _main(objs.repo, ["read-tree", "-m", "-u", "-n", p.old, p.new])
        if not dry.ok:
            return refuse(Code.CHECKOUT_DIRTY, f"the main checkout cannot follow the land: {dry.err}", **details)
    moved = _main(objs.repo, ["update-ref", "-m", f"proctor land {job.job_id}", f"refs/heads/{target}", p.new, p.old])
    if not moved.ok:
        return refuse(Code.TARGET_MOVED, f"{target} moved while land ran ({moved.err}): nothing moved; run it again",
                      **details)
    details["checkout_updated"] = False
    if state.on_target:
        follow = _main(objs.repo, ["read-tree", "-m", "-u", p.old, p.new])
        details["checkout_updated"] = follow.ok
        if not follow.ok:
            details["checkout_warning"] = (f"{target} moved but the main checkout did not follow ({follow.err}): "
                                           f"`git read-tree -m -u {p.old[:12]} {p.new[:12]}` finishes it")
    return Outcome(Code.OK, f"landed job {job.job_id} into {target} ({p.how}) at {p.new[:12]}", details)


def _crossed(objs: JobObjects, job: Job, config: Config | None) -> list[tuple[str, str]]:
    changed = changed_paths(objs.git_dir, objs.base, objs.commit)
    if isinstance(changed, worktree.Failure):
        return [("(the job's diff could not be read)", changed.reason)]
    # The scripts the job's validation and setup run, as the job named them: the request's command, else
    # the repo's settings at the base (found in review: a script the config's `validate` names landed
    # without the flag).
    command = (job.record.request or {}).get("validateCommand")
    if config is None:
        try:
            config = load_config()
        except ConfigError:
            config = None  # the base's `.proctor.toml` still names its scripts
    used = str((job.record.result or {}).get("settingsCommit") or objs.base)  # the job's own settings' commit
    cfg = environment.settings(config.repos if config is not None else None, objs.repo.path, objs.git_dir, used)
    cfg = cfg if isinstance(cfg, RepoSettings) else None
    commands = [c for c in (command or (cfg.validate if cfg else None), *(cfg.setup if cfg else ())) if c]
    return trustline.crossing(changed, trustline.hooks_path(objs.repo.path), sorted(recipe.named_paths(commands)),
                              trustline.versions_in(objs.git_dir, objs.base, objs.commit))


def _tree_of(objs: JobObjects, rev: str) -> str | None:
    return _tree_at(objs.git_dir, rev)


def _tree_at(git_dir: Path, rev: str) -> str | None:
    res = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{tree}}"], git_dir=git_dir)
    return res.text if res.ok else None


def _poll(stop: StopSwitch):
    def poll() -> str | None:
        reason = stop.reason()
        return f"stopped: {reason}" if reason else None

    return poll
