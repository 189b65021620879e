"""The held-out step: the tests and checks the agent never saw, run on the job's tree after its own validation,
as a step of their own whose output stays on the host.

The held-out dirs' test files are laid onto the job's tree (replacing a visible file of the same path: the
held-out one is its original) and the plan's test steps run again with only their tests selected where the
runner can select (pytest); then each dir's sealed checks (proctor.mechanisms.evidence.sealed): the pairs'
driver, and each data check, confined in the same checkout. The host knows every held-out id before the
run (a Python test file's syntax; each sealed check's own) and requires each to have run and passed: a hook
that deselects one, or a run that ends before it, fails the step. The output goes to
`$PROCTOR_HOME/jobs/<id>/holdout.log`; the result carries counts and opaque ordinals only (a cheat that
prints the held-out source after the runner's summary would otherwise ship it back in an output tail).
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
from proctor.mechanisms.git import landing
from proctor.mechanisms.process.spawn import Exit
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import trial
from proctor.services.job.context import Job
from proctor.services.job.record import job_dir

KEPT = "(kept on the host: proctor show, or $PROCTOR_HOME/jobs/<jobId>/holdout.log)"
MAX_OUTPUT = 1 << 20


def log_path(job_id: str) -> Path:
    return job_dir(job_id) / "holdout.log"


def _dotted(pytest_id: str) -> str:
    """`tests/test_x.py::T::test_y` as unittest names it: `tests.test_x.T.test_y`."""
    path, _, rest = pytest_id.partition("::")
    return path.removesuffix(".py").replace("/", ".") + "." + rest.replace("::", ".")


def _judge_tests(expected: dict[str, list[str]], outcomes: dict[str, str], files: dict[str, str]) -> tuple[int, list[str]]:
    """(ids expected, the held-out test files' ids that did not run or pass). A Python file's ids are known
    from its syntax: each must be reported (a parametrized one as `id[...]`), every instance passing. Another
    runner's file must report at least one test, all passing."""
    bad, count = [], 0
    for rel, ids in expected.items():
        if ids:
            for tid in ids:
                count += 1
                dotted = _dotted(tid)
                got = [o for t, o in outcomes.items() if t == tid or t.startswith(tid + "[") or t == dotted]
                if not got or any(o not in PASSING for o in got):
                    bad.append(tid)
        else:
            count += 1
            got = [o for t, o in outcomes.items() if files.get(t) == rel or t.startswith((rel + "::", rel + " > "))]
            if not got or any(o not in PASSING for o in got):
                bad.append(rel)
    return count, bad


def run(job: Job, given: trial.Trial, landed: landing.Landing, result: RunAgentResult) -> str | None:
    """The held-out step (when the job has held-out dirs); None, or why it failed (the job is failed)."""
    dirs = list(given.holdout)
    if not dirs:
        return None
    checks = sealing.Sealed()
    for n, path in enumerate(held.sealed_files(dirs), 1):
        got = sealing.load(path, prefix=f"{n}:")
        if isinstance(got, str):
            return f"the sealed checks cannot be used: {got}"
        checks = checks + got
    expected: dict[str, list[str]] = {}
    files = 0
    for d in dirs:
        expected.update(held.held_ids(Path(d)))
        files += len(held.held_files(Path(d)))
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
            runs.append(_record(f"sealed check #{len(outcomes)}", ex, outcomes[-1].passed))

    test_plan = given.plan if files else vplan.Plan(())
    python_only = all(ids for ids in expected.values()) and bool(expected)
    select = tuple(i for ids in expected.values() for i in ids) if python_only else None
    job.progress.phase("running the held-out checks")
    ran = trial.run(job, dataclasses.replace(given, name="heldout", plan=test_plan, first=False, observe=True,
                                             base=None, select=select, after=after, log=log), result)
    if ran is None:
        return "the held-out checks did not run"
    if ran.killed_reason:
        return f"the held-out checks {ran.killed_reason}"
    tests: dict[str, str] = {}
    test_files: dict[str, str] = {}
    ended = True
    for a in ran.attempts:
        for ev in a.found.values():
            tests.update(ev.tests)
            test_files.update(ev.files)
            ended = ended and ev.ended >= ev.sessions
    count, bad_tests = _judge_tests(expected, tests, test_files) if files else (0, [])
    summary = sealing.summary(outcomes)
    result.holdout = {**(result.holdout or {}), "dirs": len(dirs), "files": files,
                      "tests": {"expected": count, "failed": len(bad_tests)}, "sealed": summary}
    tests_ok = not bad_tests and ended
    result.validation += [{**a.record(), "label": f"held-out: {a.label}", "output_tail": KEPT, "compared": None,
                           "passed": tests_ok} for a in ran.attempts] + runs
    job.ledger.append("job.heldout", {"jobId": job.job_id, "tests": count, "tests_failed": len(bad_tests),
                                      "sealed": summary}, job_id=job.job_id)
    why = []
    if files and not ended:
        why.append("the held-out run never reached its end")
    if bad_tests:
        why.append(f"{len(bad_tests)} of {count} held-out test(s) did not run or did not pass")
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
            try:
                beneath.rmtree(fd, rel)
            except FileNotFoundError:
                pass
            beneath.create_excl(fd, rel, text.encode(), 0o644)
    except OSError as exc:
        return f"a check's file could not be laid in: {beneath.why(exc)}"
    finally:
        os.close(fd)
    return None


def _read(checkout: Path, outputs: dict[str, str]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    if not outputs:
        return out
    fd = beneath.open_root(checkout)
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
    try:
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(log, "ab") as f:
            f.write(f"=== {what} => exit {ex.exit_code} ===\n".encode() + b"--- stdout ---\n" + ex.stdout[-MAX_OUTPUT:]
                    + b"\n--- stderr ---\n" + ex.stderr[-MAX_OUTPUT:] + b"\n")
    except OSError:
        pass


def failed(job: Job, result: RunAgentResult, why: str) -> None:
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: held-out checks: {why}")
