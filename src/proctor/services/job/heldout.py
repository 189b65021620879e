"""The held-out step: the tests and checks the agent never saw, run on the job's tree after its own validation,
as a step of their own whose output stays on the host.

The held-out dirs' files are laid onto the job's tree (replacing a visible file of the same path: the
held-out one is its original) and the plan runs again: pytest runs the held-out files alone (selected by
path, named from the checkout), another runner its suite. Every test a held-out file reports must pass,
whatever its name or class; each held-out test file must report one at least, and what its syntax names
(proctor.mechanisms.evidence.holdout.expected) must each be reported: a hook that deselects one, a config
that stops collecting a file, or a run that ends before it fails the step, as does a step that exits
nonzero where the job's own run of it exited 0. Then each dir's sealed checks
(proctor.mechanisms.evidence.sealed): the pairs' driver, and each data check, confined in the same checkout.
The output goes to `$PROCTOR_HOME/jobs/<id>/holdout.log`; the result carries counts and opaque ordinals only
(a cheat that prints the held-out source after the runner's summary would otherwise ship it back in an
output tail).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path
from typing import Any

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms.confine import beneath
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence import sealed as sealing
from proctor.mechanisms.evidence.readers import PASSING
from proctor.mechanisms.process.spawn import Exit
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import trial
from proctor.services.job.context import Job
from proctor.services.job.record import job_dir

KEPT = "(kept on the host: proctor show, or $PROCTOR_HOME/jobs/<jobId>/holdout.log)"
MAX_OUTPUT = 1 << 20


def log_path(job_id: str) -> Path:
    return job_dir(job_id) / "holdout.log"


@dataclasses.dataclass
class _Tally:
    """The held-out tests' judgement over every step of the held-out run."""

    want: dict[str, held.Expected]
    owners: held.Owners
    reported: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # file -> its tests' ids
    bad: set[str] = dataclasses.field(default_factory=set)  # files (or ids) that did not run or did not pass
    steps: set[str] = dataclasses.field(default_factory=set)  # steps that failed (their exit, or no end)
    kinds: set[str] = dataclasses.field(default_factory=set)  # the runners the held-out run was read for

    def step(self, attempt: vplan.Attempt, main: vplan.Attempt | None) -> bool:
        """Take one step's reports; whether it passed. Every test a held-out file reports must pass, and the
        run may fail nothing the job's own run of the step did not (a Go or TAP id names no file: a held-out
        test of theirs is judged so). A step that exits nonzero where the job's own run exited 0 fails, but
        for pytest, which runs the held-out files alone here: its exit then says what a coverage threshold
        or a second session made of a partial run, and its reports, its end and its problems say the rest."""
        ok = True
        before = main.found if main is not None else {}
        for kind, ev in attempt.found.items():
            self.kinds.add(kind)
            ok = ok and ev.ended >= ev.sessions
            was = before.get(kind)
            failing_before = {t for t, o in was.tests.items() if o not in PASSING} if was is not None else set()
            problems_before = set(was.problems) if was is not None else set()
            # pytest's own count of failures is a partial run's here: a plugin that judges the whole suite
            # (a coverage threshold) counts one the held-out files' reports never had.
            problems = {p for p in ev.problems if not (kind == "pytest" and p.startswith("the pytest session counted"))}
            if problems - problems_before:
                ok = False
            for tid, outcome in ev.tests.items():
                rel = self.owners.of(tid, ev.files.get(tid))
                if rel is not None:
                    self.reported.setdefault(rel, []).append(tid)
                if outcome in PASSING:
                    continue
                if rel is not None:
                    self.bad.add(rel)
                    ok = False
                elif tid not in failing_before:
                    self.bad.add(f"{kind}:{tid}")
                    ok = False
        main_exit = main.exit_code if main is not None else None
        if attempt.exit_code != 0 and main_exit == 0 and "pytest" not in attempt.found:
            ok = False
        if not ok:
            self.steps.add(attempt.label)
        return ok

    def judge(self) -> tuple[int, int]:
        """(tests expected, how many did not run or did not pass): each file of a runner that names files at
        least one report, each of its named ids and methods reported (an id's parametrized instances, or
        unittest's dotted name)."""
        count = 0
        for rel, want in self.want.items():
            got = self.reported.get(rel, [])
            python = rel.endswith(".py")
            if not python and not self.kinds & {"jest", "vitest", "mocha"}:
                continue  # go test, TAP, cargo: ids name no file; held by the step's failures above
            count += max(1, len(want.ids) + len(want.methods))
            if not got:
                self.bad.add(rel)
                continue
            # unittest never collects a top-level function: a file only it reported owes its classes' tests.
            by_unittest = not any("::" in t for t in got)
            for tid in want.ids:
                if by_unittest and tid.count("::") == 1:
                    continue
                dot = held.dotted(tid)
                # unittest names a module from where discovery started (`-s tests`: `test_x.T.t`)
                if not any(t == tid or t.startswith(tid + "[") or t == dot or dot.endswith("." + t) for t in got):
                    self.bad.add(tid)
            for m in want.methods:
                if not any(t.endswith(("::" + m, "." + m)) or f"::{m}[" in t for t in got):
                    self.bad.add(f"{rel}::*::{m}")
        return count, len(self.bad)


def run(job: Job, given: trial.Trial, main: vplan.Run, result: RunAgentResult) -> str | None:
    """The held-out step (when the job has held-out dirs), after the job's own run `main`; None, or why it
    failed (the job is failed)."""
    dirs = list(given.holdout)
    if not dirs:
        return None
    checks = sealing.Sealed()
    for n, path in enumerate(held.sealed_files(dirs), 1):
        got = sealing.load(path, prefix=f"{n}:")
        if isinstance(got, str):
            return f"the sealed checks cannot be used: {got}"
        checks = checks + got
    expected: dict[str, held.Expected] = {}
    paths: list[str] = []
    for d in dirs:
        expected.update(held.expected(Path(d)))
        paths += held.held_files(Path(d))
    files = len(paths)
    log = log_path(job.job_id)
    outcomes: list[sealing.Outcome] = []
    nonce = secrets.token_hex(8)

    runs: list[dict[str, Any]] = []  # a record per sealed run, its output kept on the host

    def after(run_one: trial.RunOne, scratch: Path) -> None:
        if checks.pairs:
            drv = scratch / f"_proctor_sealed_{nonce}.py"
            drv.write_text(sealing.driver(checks, nonce), encoding="utf-8")
            ex = run_one([_python(given), str(drv)], b"", "sealed-pairs")
            _log(log, "sealed pairs", ex)
            got = sealing.judge_pairs(checks, ex.stdout, nonce)
            _note(log, got)
            outcomes.extend(got)
            runs.append(_record(f"sealed pairs ({len(got)})", ex, all(o.passed for o in got)))
        for check in checks.checks:
            laid = _lay(job.work, check.files)
            if laid:
                outcomes.append(sealing.Outcome(check.id, False, laid, check.guessable))
                continue
            ex = run_one(list(check.argv), check.stdin.encode(), "sealed-check")
            _log(log, f"sealed check {check.id}", ex)
            outcomes.append(sealing.judge_check(check, ex.exit_code, ex.stdout, _read(job.work, check.outputs)))
            _note(log, outcomes[-1:])
            runs.append(_record(f"sealed check #{len(outcomes)}", ex, outcomes[-1].passed))

    test_plan = given.plan if files else vplan.Plan(())
    # pytest runs the held-out files alone (any test they hold, whatever its name); another runner runs its
    # suite, and only the held-out files' reports are judged here (the rest was judged in the job's run).
    select = tuple(sorted(set(paths)))
    job.progress.phase("running the held-out checks")
    ran = trial.run(job, dataclasses.replace(given, name="heldout", plan=test_plan, first=False, observe=True,
                                             base=None, select=select, after=after, log=log), result)
    if ran is None:
        return "the held-out checks did not run"
    if ran.killed_reason:
        return f"the held-out checks {ran.killed_reason}"
    tally = _Tally(expected, held.Owners(paths))
    mains = {a.label: a for a in main.attempts}
    records = [{**a.record(), "label": f"held-out: {a.label}", "output_tail": KEPT, "tests": None,
                "evidence_failure": None, "compared": None, "passed": tally.step(a, mains.get(a.label))}
               for a in ran.attempts]
    count, failed_tests = tally.judge() if files else (0, 0)
    summary = sealing.summary(outcomes)
    result.holdout = {**(result.holdout or {}), "dirs": len(dirs), "files": files,
                      "tests": {"expected": count, "failed": failed_tests}, "steps_failed": len(tally.steps),
                      "sealed": summary}
    result.validation += records + runs
    job.ledger.append("job.heldout", {"jobId": job.job_id, "tests": count, "tests_failed": failed_tests,
                                      "steps_failed": len(tally.steps),
                                      "sealed": summary}, job_id=job.job_id)
    why = []
    if failed_tests:
        why.append(f"{failed_tests} of {count} held-out test(s) did not run or did not pass")
    if tally.steps:
        why.append(f"{len(tally.steps)} held-out step(s) failed (an exit the job's own run did not have, or no end)")
    if summary["failed"]:
        shown = ", ".join(f"#{i}" for i in summary["failed_ordinals"][:5])
        why.append(f"{summary['failed']} of {summary['checks']} sealed check(s) failed ({shown})")
    return "; ".join(why) or None


def basis(result: RunAgentResult) -> str | None:
    """What the held-out step gave the verdict to rest on: `sealed` when a sealed check no cheat could guess
    passed (and none failed), `held-out` when held-out tests ran and passed."""
    h: dict[str, Any] = result.holdout or {}
    sealed_part = h.get("sealed") or {}
    if sealed_part.get("checks") and not sealed_part.get("failed") and sealed_part.get("sealing"):
        return "sealed"
    tests = h.get("tests") or {}
    if tests.get("expected") and not tests.get("failed"):
        return "held-out"
    return None


def _python(given: trial.Trial) -> str:
    for step in given.plan.steps:
        if step.argv and Path(step.argv[0]).name.startswith("python"):
            return step.argv[0]
    return "python3"


def _lay(checkout: Path, files: dict[str, str]) -> str | None:
    if not files:
        return None
    try:
        fd = beneath.open_root(checkout)
    except OSError as exc:
        return f"cannot open the checkout: {exc}"
    try:
        for rel, text in files.items():
            held.put(fd, rel, text.encode())
    except OSError as exc:
        return f"a check's file could not be laid in: {beneath.why(exc)}"
    finally:
        os.close(fd)
    return None


def _read(checkout: Path, outputs: dict[str, str]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {rel: None for rel in outputs}
    if not outputs:
        return out
    try:
        fd = beneath.open_root(checkout)
    except OSError:
        return out  # the checkout is gone or a link now: every output is missing
    try:
        for rel in outputs:
            try:
                out[rel] = beneath.read_regular(fd, rel, MAX_OUTPUT)
            except OSError:
                out[rel] = None
    finally:
        os.close(fd)
    return out


def _record(label: str, ex: Exit, passed: bool) -> dict[str, Any]:
    return {"label": f"held-out: {label}", "exit_code": ex.exit_code, "timed_out": ex.timed_out,
            "duration_s": round(ex.duration_s, 3), "output_tail": KEPT, "output_dropped": 0, "tests": None,
            "evidence_failure": None, "passed": passed, "compared": None}


def _log(log: Path, what: str, ex: Exit) -> None:
    _append(log, f"=== {what} => exit {ex.exit_code} ===\n".encode() + b"--- stdout ---\n" + ex.stdout[-MAX_OUTPUT:]
            + b"\n--- stderr ---\n" + ex.stderr[-MAX_OUTPUT:] + b"\n")


def _note(log: Path, outcomes: list[sealing.Outcome]) -> None:
    """Which sealed check failed and why, for the person (the why may hold the expected value: host only)."""
    _append(log, "".join(f"--- sealed {o.id}: {'passed' if o.passed else 'FAILED: ' + o.why}\n"
                         for o in outcomes).encode("utf-8", "replace"))


def _append(log: Path, data: bytes) -> None:
    try:
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(log, "ab") as f:
            f.write(data)
    except OSError:
        pass


def failed(job: Job, result: RunAgentResult, why: str) -> None:
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: held-out checks: {why}")
