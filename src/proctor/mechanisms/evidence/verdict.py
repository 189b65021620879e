"""The rules that turn one test step's exit code and evidence into pass, fail and risks.

A step passes only when its exit code is 0, its runner's sessions all reached their normal end, it
reported no failure, and no test was skipped from code the agent wrote. An exit code of 0 that the
evidence contradicts is a failure that says so (an `os._exit(0)` or an `atexit` hook made pytest's `1
failed` exit 0 in review). A step with no per-test evidence at all is judged by its exit code alone, and
that is a risk; for a runner proctor chose itself, no evidence at all means the runner never ran as asked,
which fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from proctor.mechanisms.evidence.readers import Evidence


@dataclass(frozen=True)
class Judgement:
    failure: str | None = None  # why the step failed though its exit code was 0
    risks: tuple[str, ...] = ()


def _relative(origin: str, root: Path) -> str:
    p = Path(origin)
    if p.is_absolute():
        try:
            return PurePosixPath(p.relative_to(root)).as_posix()
        except ValueError:
            return origin
    return PurePosixPath(origin).as_posix()


def judge(label: str, exit_code: int | None, evidence: Evidence | None, expected: str | None, *,
          root: Path, agent_code: Callable[[str], bool]) -> Judgement:
    """`expected`: the evidence source the step must leave (instrument.expects). `agent_code(path)`: the
    path (relative to `root`, the checkout) is code the agent changed and not a test-defining file."""
    if exit_code != 0:
        # The exit code already fails it; a run cut short says so too (a crash is not a test failure).
        ev = evidence
        if ev is not None and ev.sessions > ev.ended:
            return Judgement(f"its test session never reached its normal end ({ev.ended} of {ev.sessions} ended)")
        return Judgement()
    if evidence is None:
        if expected is not None:
            return Judgement(f"{label} exited 0 but its runner reported no test session ({expected} evidence "
                             "missing: the run never reached the runner, or ended before it started)")
        return Judgement(risks=(f"the verdict on `{label}` rests on its exit code alone: no per-test evidence "
                                "(README: What the verdict rests on)",))
    ev = evidence
    if ev.sessions > ev.ended or (ev.source == "pytest" and ev.sessions == 0):
        return Judgement(f"{label} exited 0 but its test session never reached its normal end "
                         f"({ev.ended} of {max(ev.sessions, 1)} ended; {ev.passed} passed, {ev.failed} failed so far)")
    if ev.session_exit not in (None, 0, 5):
        return Judgement(f"{label} exited 0 but its test session ended with status {ev.session_exit}")
    if ev.failed or ev.errors:
        named = f": {', '.join(ev.failed_tests[:3])}" if ev.failed_tests else ""
        return Judgement(f"{label} exited 0 but {ev.failed} test(s) failed and {ev.errors} errored{named}")
    if ev.problems:
        return Judgement(f"{label} exited 0 but {ev.problems[0]}")
    planted = [s for s in ev.skips if agent_code(_relative(s.origin, root))]
    if planted:
        where = ", ".join(f"{s.test} (from {_relative(s.origin, root)}{f':{s.line}' if s.line else ''})"
                          for s in planted[:3])
        return Judgement(f"{label}: {len(planted)} test(s) were skipped by code the agent changed: {where}")
    risks = []
    if ev.ran == 0:
        risks.append(f"validation ran no test: `{label}` reported {ev.skipped} skipped, 0 passed, 0 failed")
    if ev.source == "summary":
        risks.append(f"the verdict on `{label}` rests on a summary line in its output (counts, no per-test "
                     "outcomes)")
    return Judgement(risks=tuple(risks))
