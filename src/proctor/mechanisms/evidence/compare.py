"""The job's tests held to the base's own run, by test id, as SWE-bench's harness holds a patch to its
PASS_TO_PASS and FAIL_TO_PASS lists.

    compare(base, job, rules) -> Comparison

    broken        passed on the base, and did not pass now: failed, errored, skipped, xfailed, not collected,
                  not run — whatever raised it; no reasoning about where a skip came from
    fixed         failed or errored on the base, and passes now
    pre_existing  failed or errored on the base, and still does not pass: not the job's doing, reported as such
    new           ids the base never ran (the job's own tests), with their outcomes
    must          ids that had to pass (a request's or config's `must_pass`) and did not

Pure data: no I/O, nothing decided here but the lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from proctor.mechanisms.evidence.readers import FAILED, FAILING, PASSED, PASSING, SKIPPED, XFAILED

SHOWN = 20  # ids listed per class in the result; the counts are whole


@dataclass(frozen=True)
class Rules:
    must_pass: frozenset[str] = frozenset()  # ids that must pass whatever the base did
    known: frozenset[str] = frozenset()  # ids config knows as flaky or failing: never the job's failure, no risk
    held: Callable[[str], bool] = field(default=lambda tid: False)  # a held-out file's id: judged in its own run


@dataclass(frozen=True)
class Comparison:
    broken: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()
    pre_existing: tuple[str, ...] = ()
    new: Mapping[str, str] = field(default_factory=dict)  # id -> outcome
    must: tuple[str, ...] = ()  # must-pass ids that did not pass (held-out included)
    known: tuple[str, ...] = ()  # known ids that did not pass (not the job's, not a risk)

    @property
    def new_failing(self) -> list[str]:
        return sorted(t for t, o in self.new.items() if o in FAILING)

    def record(self) -> dict[str, object]:
        new = sorted(self.new)
        return {"basis": "base-tests", "broken": list(self.broken[:SHOWN]), "fixed": list(self.fixed[:SHOWN]),
                "pre_existing": list(self.pre_existing[:SHOWN]), "new": new[:SHOWN],
                "new_failing": self.new_failing[:SHOWN], "must_pass_failing": list(self.must[:SHOWN]),
                "counts": {"broken": len(self.broken), "fixed": len(self.fixed),
                           "pre_existing": len(self.pre_existing), "new": len(new),
                           "new_failing": len(self.new_failing), "must_pass_failing": len(self.must)}}


def compare(base: Mapping[str, str], job: Mapping[str, str], rules: Rules = Rules()) -> Comparison:
    broken, fixed, pre, must, known = [], [], [], [], []
    for tid, was in base.items():
        if rules.held(tid):
            continue  # replaced by a held-out file: the held-out file defines that test now
        now = job.get(tid)
        if now is None and was in FAILING:
            # A file that errored as a whole on the base (a module that did not import yet) is its tests now.
            under = [o for t, o in job.items() if t.startswith((tid + "::", tid + " > "))]
            now = (PASSED if all(o in PASSING for o in under) else FAILED) if under else None
        passes = now in PASSING
        if tid in rules.known:
            if not passes:
                known.append(tid)
        elif was in PASSING and not passes:
            broken.append(tid)
        elif was in FAILING:
            (fixed if passes else pre).append(tid)
        elif was in (SKIPPED, XFAILED) and now in FAILING:
            broken.append(tid)  # skipped on the base, runs and fails now: the job's (or its environment's)
    errored = tuple(t + sep for t, o in base.items() if o in FAILING for sep in ("::", " > "))
    # A held-out file's tests are judged in the held-out run (proctor.services.job.heldout): not here, where
    # the visible file it replaces ran in its place.
    new = {tid: o for tid, o in job.items()
           if tid not in base and not tid.startswith(errored) and not rules.held(tid)}
    for tid in sorted(rules.must_pass):
        if job.get(tid) not in PASSING and tid not in rules.known and not rules.held(tid):
            must.append(tid)
    return Comparison(tuple(sorted(broken)), tuple(sorted(fixed)), tuple(sorted(pre)), new, tuple(must),
                      tuple(sorted(known)))
