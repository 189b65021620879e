"""`proctor discard JOB` and `proctor gc`: removing what a job left on disk.

Owns a job's footprint and its removal: the checkout at `{repo}-agents/<jobId>` (with the job's own git dir,
which holds its `wt/<jobId>/<ticket>` branch and every object the job wrote), the scratch dirs a crash can
leave beside it (`.<jobId>.work`, `.<jobId>.land`), the job's two private TMPDIRs (`$TMPDIR/proctor-<jobId>-*`,
`$TMPDIR/proctor-host-<jobId>-*`: the host removes them as the job ends, so only a killed host leaves them),
and — from before jobs had repositories of their own —
a `wt/<jobId>/...` branch and a linked-worktree registration in the main repo. The main repo's objects are
never touched: a job borrows them through alternates and never the other way round, so removing a job
cannot break the main repo (`git fsck` stays clean; `land` copied in whatever it needed).

A running job is never removed: its host is alive (proctor.services.job.record). An interrupted job whose host
died is abandoned; one with no host record (from before it) counts as abandoned once older than any job
can run. Each removal is a `review.discard` row (`by`: discard or gc), written ahead as
`review.discard.start`; gc adds one `review.gc` row. It never follows a symlink out of a job's dir.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proctor.mechanisms.confine import beneath
from proctor.services.job import record
from proctor.mechanisms.git import worktree
from proctor.mechanisms.git.command import git
from proctor.mechanisms.ledger.store import Ledger, LedgerError
from proctor.services.review.jobs import Job, load_jobs, parse_ts
from proctor.services.review.outcome import Code, Outcome, refuse

# Longer than any job can run (two attempts at the 14,400 s cap, two validations at theirs): an interrupted
# job with no host record older than this has no host left.
MAX_JOB_S = 24 * 3600
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_AGE = "7d"  # `proctor gc` with no --older-than; said in its output, not only in --help
# tempfile.mkdtemp's name: the prefix the host gives (proctor.services.job.run_agent) and 8 characters of its alphabet.
_MKDTEMP_TAIL = r"-[a-z0-9_]{8}"


def parse_age(text: str) -> float | None:
    """`7d`, `12h`, `30m`, `90s`, `2w`, or plain seconds; None when it is none of those."""
    t = text.strip().lower()
    unit = UNITS.get(t[-1:]) if t else None
    number = t[:-1] if unit else t
    try:
        value = float(number)
    except ValueError:
        return None
    return value * (unit or 1) if value >= 0 else None


@dataclass
class Footprint:
    job_id: str
    paths: list[Path] = field(default_factory=list)  # directories to remove
    bytes: int = 0  # allocated on disk (du), before removal
    branches: list[tuple[str, str]] = field(default_factory=list)  # legacy refs in the main repo: (ref, sha)
    registrations: list[Path] = field(default_factory=list)  # legacy `.git/worktrees/<name>` dirs
    repo: worktree.Repo | None = None

    @property
    def empty(self) -> bool:
        return not (self.paths or self.branches or self.registrations)

    def to_dict(self) -> dict[str, Any]:
        return {"jobId": self.job_id, "paths": [str(p) for p in self.paths], "bytes": self.bytes,
                "branches": [r.removeprefix("refs/heads/") for r, _ in self.branches],
                "registrations": [str(p) for p in self.registrations]}


def _du(path: Path) -> int:
    """Bytes allocated under `path`, each directory opened beneath it with no symlink on the way (an
    agent's link never makes gc count, or later remove, another tree)."""
    try:
        root = beneath.open_root(path)
    except OSError:
        return 0
    total = 0
    stack = [""]
    try:
        while stack:
            rel = stack.pop()
            try:
                fd = beneath.open_beneath(root, rel, beneath.DIR_FLAGS) if rel else os.dup(root)
            except OSError:
                continue
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        total += st.st_blocks * 512
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(f"{rel}/{e.name}" if rel else e.name)
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return total


def _real_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False


def age_text(seconds: float) -> str:
    """`--older-than` as a person reads it: 7d, 12h, 90s."""
    for unit, size in (("d", UNITS["d"]), ("h", UNITS["h"]), ("m", UNITS["m"])):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def job_tmpdirs(job_id: str, tmp: Path | None = None) -> list[Path]:
    """The job's private TMPDIRs a killed host left: this user's own real dirs, named exactly as the host
    makes them (a name only like them, or another user's, is never taken)."""
    if not record.safe_job_id(job_id):
        return []
    root = tmp or Path(tempfile.gettempdir())
    shape = re.compile(rf"proctor-(?:host-)?{re.escape(job_id)}{_MKDTEMP_TAIL}")
    try:
        names = [e.name for e in os.scandir(root) if shape.fullmatch(e.name)]
    except OSError:
        return []
    out = []
    for name in sorted(names):
        try:
            st = os.lstat(root / name)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            out.append(root / name)
    return out


def footprint(job: Job, tmp: Path | None = None) -> Footprint:
    fp = Footprint(job.job_id)
    wt = job.checkout
    dirs = [wt, wt.with_name(f".{wt.name}.work"), wt.with_name(f".{wt.name}.land")] if wt is not None else []
    for p in [*dirs, *job_tmpdirs(job.job_id, tmp)]:
        if _real_dir(p):
            fp.paths.append(p)
            fp.bytes += _du(p) + os.lstat(p).st_blocks * 512
    repo = worktree.open_repo(job.repo) if job.repo else None
    if isinstance(repo, worktree.Repo) and record.safe_job_id(job.job_id):  # the id goes into a ref pattern
        fp.repo = repo
        refs = git(["for-each-ref", "--format=%(refname) %(objectname)", f"refs/heads/wt/{job.job_id}/"],
                   cwd=repo.path)
        fp.branches = [tuple(line.split(" ", 1)) for line in refs.text.splitlines() if " " in line] if refs.ok else []
        if wt is not None:
            fp.registrations = _registrations(repo, wt)
    return fp


def _registrations(repo: worktree.Repo, wt: Path) -> list[Path]:
    """Linked-worktree entries (legacy jobs) whose `gitdir` points at the job's checkout."""
    base = repo.common_dir / "worktrees"
    if not _real_dir(base):
        return []
    out = []
    try:
        fd = beneath.open_root(base)
    except OSError:
        return []
    try:
        with os.scandir(fd) as it:
            for e in it:
                if not e.is_dir(follow_symlinks=False):
                    continue
                try:
                    raw = beneath.read_regular(fd, f"{e.name}/gitdir", 64 * 1024)
                except OSError:
                    continue
                if Path(raw.decode("utf-8", "replace").strip()).parent == wt:
                    out.append(base / e.name)
    finally:
        os.close(fd)
    return out


def _remove(fp: Footprint) -> list[str]:
    problems = []
    for p in [*fp.paths, *fp.registrations]:
        if not worktree.remove_tree(p):
            problems.append(f"{p} could not be removed")
    for ref, sha in fp.branches:
        # Compare-and-delete: a branch someone moved since it was listed is theirs now. No hook runs
        # (proctor.mechanisms.git.command: core.hooksPath=/dev/null, no system or global config).
        res = git(["update-ref", "-d", ref, sha], cwd=fp.repo.path if fp.repo else None)
        if not res.ok:
            problems.append(f"branch {ref} not deleted: {res.err}")
    for p in fp.paths[:1]:
        if not p.parent.name.endswith("-agents"):
            continue  # a TMPDIR's parent is /tmp: never removed
        try:
            p.parent.rmdir()  # `{repo}-agents`, once it holds no job
        except OSError:
            pass
    return problems


def _write(ledger: Ledger, kind: str, payload: dict[str, Any], job_id: str | None = None) -> str | None:
    try:
        ledger.append(kind, payload, job_id=job_id)
    except (LedgerError, OSError, ValueError) as exc:
        return f"the {kind} row could not be written: {exc}"
    return None


def _discard_one(ledger: Ledger, job: Job, fp: Footprint, by: str, via: str = "cli") -> Outcome:
    failed = _write(ledger, "review.discard.start", {"jobId": job.job_id, "by": by, "via": via, **fp.to_dict()},
                    job.job_id)
    if failed:
        return refuse(Code.LEDGER_FAILED, f"{failed}; nothing was removed")
    problems = _remove(fp)
    row = {"jobId": job.job_id, "by": by, "via": via, "ok": not problems, "problems": problems, **fp.to_dict()}
    late = _write(ledger, "review.discard", row, job.job_id)
    details = {"freed": fp.to_dict(), "problems": problems, **({"ledger_warning": late} if late else {})}
    if problems:
        return refuse(Code.REMOVE_FAILED, problems[0], **details)
    return Outcome(Code.OK, f"discarded job {job.job_id}", details)


def _running(job: Job) -> bool:
    return job.ended is None and job.host_alive is True


def discard(ledger: Ledger, job: Job, via: str = "cli") -> Outcome:
    """Remove one job's checkout, branch and objects, whatever its state, unless it is still running;
    `via` names the surface that asked (cli, web, mcp) in its rows."""
    if _running(job):
        return refuse(Code.JOB_RUNNING, f"job {job.job_id} is still running (its host, pid "
                      f"{(job.record.host or {}).get('pid')}, is alive): nothing was removed")
    fp = footprint(job)
    if job.state == "discarded" and fp.empty:
        # A second discard did nothing: it says so and fails, rather than "freed 0.0 KiB" and exit 0.
        return refuse(Code.DISCARDED, f"job {job.job_id} was already discarded: nothing is left to remove")
    return _discard_one(ledger, job, fp, "discard", via)


def collectable(job: Job, older_than_s: float, now: datetime) -> str | None:
    """Why gc takes `job` (None: it does not): ended, or abandoned by a host that died, and old enough."""
    if _running(job):
        return None
    when = parse_ts(job.ended or job.started)
    age = (now - when).total_seconds() if when else None
    if age is None or age < older_than_s:
        return None
    if job.ended is not None:
        return "ended"
    if job.host_alive is False:
        return "abandoned (its host died)"
    return "abandoned (no host record, older than any job runs)" if age >= MAX_JOB_S else None


def gc(ledger: Ledger, *, older_than_s: float, dry_run: bool = False, now: datetime | None = None) -> Outcome:
    """Remove every collectable job's footprint; with `dry_run`, only say what that would free."""
    now = now or datetime.now(UTC)
    picked: list[tuple[Job, Footprint, str]] = []
    younger = 0  # ended jobs kept only for their age: the output says so (a default of 7d surprised users)
    for job in load_jobs(ledger):
        why = collectable(job, older_than_s, now)
        if why is None:
            younger += job.worktree_exists and collectable(job, 0, now) is not None
            continue
        fp = footprint(job)
        if not fp.empty:
            picked.append((job, fp, why))
    listed = [{**fp.to_dict(), "status": job.status, "state": job.state, "why": why} for job, fp, why in picked]
    total = sum(fp.bytes for _, fp, _ in picked)
    details: dict[str, Any] = {"dry_run": dry_run, "older_than_s": older_than_s, "older_than": age_text(older_than_s),
                               "kept_younger": younger, "jobs": listed,
                               "freed_bytes": 0 if dry_run else total, "would_free_bytes": total}
    if dry_run:
        late = _write(ledger, "review.gc", {"ok": True, "dry_run": True, "jobs": [j["jobId"] for j in listed],
                                            "bytes": total})
        return Outcome(Code.OK, f"would free {total} bytes of {len(listed)} job(s)",
                       {**details, **({"ledger_warning": late} if late else {})})
    problems: list[str] = []
    freed = 0
    code = Code.OK
    for job, fp, _ in picked:
        out = _discard_one(ledger, job, fp, "gc")
        if out.code is Code.LEDGER_FAILED:
            code = out.code
            problems.append(out.reason)
            break
        if out.ok:
            freed += fp.bytes
        else:
            code = out.code
            problems.extend(out.details.get("problems") or [out.reason])
    details["freed_bytes"] = freed
    details["problems"] = problems
    late = _write(ledger, "review.gc", {"ok": not problems, "dry_run": False, "jobs": [j["jobId"] for j in listed],
                                        "bytes": freed, "problems": problems[:20]})
    if late:
        details["ledger_warning"] = late
    if problems:
        return refuse(code, problems[0], **details)
    return Outcome(Code.OK, f"freed {freed} bytes of {len(picked)} job(s)", details)
