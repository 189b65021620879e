"""The rules that turn one test step's exit code and evidence into pass, fail and risks.

With the base's own run of the step (proctor.mechanisms.evidence.baseline), the job's run is held to it
test by test (proctor.mechanisms.evidence.compare): a test that passed on the base and does not pass now
fails the step, whatever raised it; what failed on the base and still fails is pre-existing, not the
job's; the job's new tests and the held-out ones must pass. The step's exit code counts too: nonzero
passes only where the base's was nonzero and every failure is one the base had. Every runner whose
sessions ended on the base must have ended on the job's run (an `os._exit(0)` at import, an `atexit`
hook, a runner that never started). Without a base (a step proctor cannot hold to one), the rules are
the plain ones: exit 0, every session ended, no failure, and a step with no per-test evidence rests on
its exit code alone, which is a risk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proctor.mechanisms.evidence.baseline import StepBase
from proctor.mechanisms.evidence.compare import Comparison, Rules, compare
from proctor.mechanisms.evidence.readers import FAILING, PASSING, Evidence

SHOWN = 5


@dataclass(frozen=True)
class Judgement:
    failure: str | None = None  # why the step failed (beyond, or despite, its exit code)
    risks: tuple[str, ...] = ()
    compared: Comparison | None = None
    explained: bool = False  # a nonzero exit the base's own failures account for: the step passes


def _names(ids: list[str] | tuple[str, ...]) -> str:
    more = f" (+{len(ids) - SHOWN} more)" if len(ids) > SHOWN else ""
    return ", ".join(ids[:SHOWN]) + more


def _merged(found: Mapping[str, Evidence]) -> tuple[dict[str, str], dict[str, str]]:
    tests: dict[str, str] = {}
    files: dict[str, str] = {}
    for ev in found.values():
        tests.update(ev.tests)
        files.update(ev.files)
    return tests, files


def _session_failure(label: str, found: Mapping[str, Evidence], need: tuple[str, ...] | None) -> str | None:
    for kind in need if need is not None else tuple(found):
        ev = found.get(kind)
        if ev is None or not ev.sessions:
            return (f"{label}: its {kind} run never started (its evidence is missing: the run never reached "
                    "the runner, or ended before it began)")
        if ev.ended < ev.sessions:
            return (f"{label}: its {kind} run never reached its normal end ({ev.ended} of {ev.sessions} ended; "
                    f"{ev.count('passed')} passed, {ev.count('failed')} failed so far)")
        if ev.session_exit not in (None, 0, 1, 5):
            return f"{label}: its {kind} session ended with status {ev.session_exit}"
        if ev.problems:
            return f"{label}: {ev.problems[0]}"
    return None


def judge(label: str, exit_code: int | None, found: Mapping[str, Evidence], base: StepBase | None, *,
          expected: str | None = None, rules: Rules = Rules(),
          touched: Callable[[str, str | None], bool] = lambda tid, file: False) -> Judgement:
    """`found`: the step's evidence by kind (read for the base's kinds, when there is a base). `touched(id,
    file)`: the test's defining file is one the job changed (its edit to a test is judged on the run with
    the base's files, not here)."""
    if base is not None and base.kinds:
        return _against_base(label, exit_code, found, base, rules, touched)
    return _plain(label, exit_code, found, expected, base)


def _plain(label: str, exit_code: int | None, found: Mapping[str, Evidence], expected: str | None,
           base: StepBase | None) -> Judgement:
    if exit_code != 0:
        bad = _session_failure(label, found, None) if found else None
        return Judgement(bad if bad and "never reached its normal end" in bad else None)
    if not found:
        if expected is not None:
            return Judgement(f"{label} exited 0 but its runner reported no test session ({expected} evidence "
                             "missing: the run never reached the runner, or ended before it began)")
        runs = [r for r in (base.runners if base is not None else ()) if r != label]
        seen = f" from what it runs ({', '.join(runs)})" if runs else ""
        return Judgement(risks=(f"the verdict on `{label}` rests on its exit code alone: no per-test "
                                f"evidence{seen} (docs/concepts/verdict.md: What the verdict rests on)",))
    bad = _session_failure(f"{label} exited 0 but", found, None)
    if bad:
        return Judgement(bad)
    tests, _ = _merged(found)
    failing = sorted(t for t, o in tests.items() if o in FAILING)
    if failing:
        return Judgement(f"{label} exited 0 but {len(failing)} test(s) failed or errored: {_names(failing)}")
    if not any(o in PASSING or o == "failed" for o in tests.values()):
        return Judgement(risks=(f"validation ran no test: `{label}` reported no test that ran",))
    return Judgement()


def _against_base(label: str, exit_code: int | None, found: Mapping[str, Evidence], base: StepBase,
                  rules: Rules, touched: Callable[[str, str | None], bool]) -> Judgement:
    tests, files = _merged(found)
    cmp = compare(base.tests, tests, rules)
    risks: list[str] = []
    ended = _session_failure(label, found, base.kinds)
    if ended:
        return Judgement(ended, compared=cmp)
    # A broken test whose own file the job changed is judged again on the run with the base's test files
    # (the task may have been to change it); any other is the job's.
    broken = [t for t in cmp.broken if not touched(t, files.get(t) or base.files.get(t))]
    if broken:
        return Judgement(f"{label}: {len(broken)} test(s) that passed on the base do not pass now: {_names(broken)}",
                         compared=cmp)
    if cmp.must:
        return Judgement(f"{label}: {len(cmp.must)} test(s) that must pass did not: {_names(list(cmp.must))}",
                         compared=cmp)
    if cmp.new_failing:
        return Judgement(f"{label}: {len(cmp.new_failing)} new test(s) fail: {_names(cmp.new_failing)}", compared=cmp)
    if cmp.pre_existing:
        risks.append(f"{len(cmp.pre_existing)} test(s) of `{label}` already failed on the base and still fail "
                     f"(pre-existing, not this job's): {_names(list(cmp.pre_existing))}")
    explained = False
    if exit_code != 0:
        # Nonzero passes only when every failure the run shows is one the base had (or config knows).
        failing = sorted(t for t, o in tests.items() if o in FAILING)
        accounted = {*cmp.pre_existing, *cmp.known}
        if not failing and not tests and exit_code == base.exit_code:
            # Nothing ran, as on the base (pytest's 5: no test collected): nothing was checked.
            return Judgement(risks=(f"validation ran no test: `{label}` found none, as on the base",),
                             compared=cmp, explained=True)
        if not failing:
            return Judgement(f"{label} exited {exit_code} and no test it ran fails: a failure outside the tests "
                             "(a build, a crash, a hook)", compared=cmp)
        # A held-out file's tests (the visible file it replaces ran here) are the held-out run's to judge.
        unaccounted = [t for t in failing if t not in accounted and not rules.held(t)]
        if unaccounted:
            return Judgement(f"{label} exited {exit_code}: {len(unaccounted)} failing test(s) that did not fail on "
                             f"the base: {_names(unaccounted)}", compared=cmp)
        if base.exit_code == 0 and not all(t in cmp.known for t in failing):
            # Failures the base had account for a nonzero exit only where the base's run exited nonzero too:
            # else something else failed (a coverage threshold, a later command of the recipe). Tests config
            # knows to flake are the exception: their failure is the exit a person declared.
            return Judgement(f"{label} exited {exit_code} where the base exited 0", compared=cmp)
        explained = True
    if tests and not any(o in PASSING for o in tests.values()) and not cmp.pre_existing:
        risks.append(f"validation ran no test: `{label}` reported none that passed")
    return Judgement(risks=tuple(risks), compared=cmp, explained=explained)
