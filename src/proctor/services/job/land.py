"""Landing: the agent's directory taken aside and made exactly a tree the host hashed and committed (what
would land), the risks a person must read in that diff whatever the tests say, and the review checkout
put in place at the end. Nothing of the agent's directory is read but through lstat and git's hashing."""

from __future__ import annotations

import os
from pathlib import Path

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms.evidence import preempt, recipe, signals
from proctor.mechanisms.git import frozen, landing, scan, trees, trustline, worktree
from proctor.mechanisms.git.materialise import materialise
from proctor.mechanisms.policy import diffcheck
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.services.job.context import Job, names


def land(job: Job, wt: worktree.Worktree, result: RunAgentResult) -> landing.Landing | None:
    """Take the agent's directory aside, commit its content on the job's branch in a git dir the host makes
    (at the review path, which holds nothing else yet), and make the directory exactly that commit's tree.
    Nothing of the agent's directory is read but through lstat and git's hashing of regular files."""
    try:
        os.rename(wt.path, job.work)
        wt.path.mkdir()
    except OSError as exc:
        result.status, result.code = Status.failed, Code.HOST_ERROR
        job.risks.append(f"could not take the agent's worktree for review: {exc}")
        return None
    found = scan.scan(job.work)
    if isinstance(found, worktree.Failure):
        result.status, result.code = Status.failed, Code.TAMPERED
        job.risks.append(f"the job's tree was not built: {found.reason}")
        return None
    _report_scan(job, found, result)
    built = landing.build(job.work, wt.path / ".git", wt, job.host_tmp, found,
                          f"proctor job {job.job_id} ({job.request.agent}): {job.request.ticket}\n")
    if isinstance(built, worktree.Failure):  # build also made the work directory exactly its tree
        result.status, result.code = Status.failed, Code.HOST_ERROR
        job.risks.append(f"the job's tree was not built: {built.reason}")
        return None
    big = [(p, n) for p, n in found.oversized if p not in built.left_out_ignored]
    if big:
        job.risks.append("files over the size cap were left out of the job's tree: "
                         + names([f"{p} ({n} bytes)" for p, n in big]))
    result.commit = built.commit
    result.agent_changed_files = list(built.changed)
    result.changed_files = list(built.changed)
    if not built.changed:
        job.risks.append("the agent changed no files")
    job.ledger.append("job.tree", {"jobId": job.job_id, "commit": built.commit, "tree": built.tree,
                                   "changed": len(built.changed), "left_out": list(found.left_out)[:50]},
                      job_id=job.job_id)
    return built


def _report_scan(job: Job, found: scan.Scan, result: RunAgentResult) -> None:
    if found.special:
        # A FIFO where the host reads hung it for ever in review; nothing honest leaves one.
        result.status, result.code = Status.failed, Code.TAMPERED
        job.risks.append("the agent left special files (FIFO, socket or device) in its worktree: "
                         f"{names(list(found.special))}; left out of the job's tree")
    if found.nested:
        job.risks.append(f"the agent left nested git repositories: {names(list(found.nested))}; "
                         "their files are not part of the job's tree")
    if found.unreadable:
        job.risks.append(f"unreadable entries in the agent's worktree were left out: {names(list(found.unreadable))}")


def diff_risks(job: Job, landed: landing.Landing) -> list[str]:
    """What a person must look at in the diff whatever the tests said: test-defining files changed (which
    it returns: validation runs once more with the base's), files that run before or instead of the code
    under test (a stdlib-named module, a `.pth`, a dist-info, bytecode, a runner's config), cheat signals in
    the code (reading its caller, ending the process, state across calls, answers copied from the tests),
    and paths the declared task did not allow. Each a risk naming the file (and line)."""
    touched = frozen.test_defining(landed.changed)
    if touched:
        job.risks.append(f"the agent changed files that define the tests: {names(touched)}")
    crossed = crossing_of(job, landed)
    if crossed:
        job.risks.append(f"the agent changed what runs or is obeyed outside the tests (the trust line): "
                         f"{trustline.say(crossed)}; `proctor land` asks for --allow-trust-line")
    if landed.changed:  # the base's own modules matter only to a changed path that could shadow one
        listed = trees.top_levels(landed.git_dir, landed.base_sha, preempt.top_level_modules(landed.changed))
        # Unread, the base has no modules of its own here: its every module a changed path could shadow is
        # named, more risks and never fewer.
        ours = preempt.top_level_modules([] if isinstance(listed, worktree.Failure) else listed)
        job.risks.extend(preempt.preempting(landed.changed, base_modules=ours))
    job.risks.extend(signals.diff_signals(landed.git_dir, landed.base_sha, landed.commit, landed.changed,
                                          frozen.is_test_defining))
    # The gate decides calls, not effects: the diff is checked against the declaration too (issue 22).
    try:
        policy = job.gate.gate.policy if job.gate is not None else Policy.load()
    except PolicyError as exc:
        job.risks.append(f"the job's diff was not checked against the trusted policy: {exc}")
        return touched
    job.risks.extend(diffcheck.undeclared(job.gate.gate.task if job.gate is not None else None,
                                          policy.forbidden_paths, landed.changed))
    return touched


def crossing_of(job: Job, landed: landing.Landing) -> list[tuple[str, str]]:
    cfg = job.settings
    commands = [c for c in (job.request.validate_command or (cfg.validate if cfg else None), *(cfg.setup if cfg else ()))
                if c]
    return trustline.crossing(landed.changed, trustline.hooks_path(Path(job.request.repo)),
                              sorted(recipe.named_paths(commands)),
                              trustline.versions_in(landed.git_dir, landed.base_sha, landed.commit))


def review_checkout(job: Job, wt: worktree.Worktree, landed: landing.Landing | None, dirty: bool) -> None:
    """The review surface at the job's path: the work directory made exactly the job's commit once more
    (validation ran agent code in it), with the job's git dir moved in. Until this rename the path holds
    only that git dir, so a crash never leaves agent-written files where a person reviews."""
    if landed is None:
        if not worktree.remove_tree(job.work):
            job.risks.append(f"the agent's scratch directory {job.work} could not be removed")
        return
    made = materialise(job.work, landed.git_dir, landed.tree, landed.index,
                               known=landed.known) if dirty else None
    failure = made or landing.fresh_index_copy(landed.index, landed.git_dir)
    if failure is None:
        try:
            os.rename(landed.git_dir, job.work / ".git")
            os.rmdir(wt.path)
            os.rename(job.work, wt.path)
        except OSError as exc:
            failure = worktree.Failure(f"cannot move the review checkout in place: {exc}")
    if failure is not None:
        job.risks.append(f"the review checkout was not made: {failure.reason}")
        worktree.remove_tree(job.work)
