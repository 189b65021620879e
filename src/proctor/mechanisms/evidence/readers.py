"""Per-test evidence read back from one validation step: what each runner itself reported, test by test.

    read_pytest(report_bytes)      the JSON lines proctor's own pytest plugin wrote (a host-made file)
    read_go_json(stdout)           `go test -json` events (test2json)
    read_libtest(stdout, stderr)   cargo/libtest's `running N tests` ... `test result:` per test binary
    read_tap(stdout)               TAP (tape, node --test's reporter off a terminal, prove)
    read_summary(text)             jest / vitest / mocha summary lines: counts, no per-test detail
    read_any(...)                  the first of these that finds anything, for a command proctor did not choose

Each returns an `Evidence` or None when the format is absent. A reader never raises on odd bytes: the
output is the agent's code's as much as the runner's. Only the plugin's file is a channel of the host's
own; the stdout readers can be fooled by code that prints a runner's lines, which README "What the verdict
rests on" says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Skip:
    test: str
    origin: str  # the file the skip was raised from, as the runner gave it (absolute or rootdir-relative)
    line: int | None


@dataclass(frozen=True)
class Evidence:
    source: str  # "pytest" | "go-json" | "libtest" | "tap" | "summary"
    sessions: int = 0  # runs that started
    ended: int = 0  # runs that reached their own normal end
    collected: int | None = None
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0  # setup/teardown/collection errors
    xfailed: int = 0
    deselected: int = 0
    problems: tuple[str, ...] = ()  # facts the runner itself reported that fail the run
    skips: tuple[Skip, ...] = ()
    session_exit: int | None = None  # the exit status the runner's session gave itself (pytest)
    failed_tests: tuple[str, ...] = field(default=())
    ran_ids: frozenset[str] = frozenset()  # the tests that reported an outcome (pytest node ids)
    item_ids: frozenset[str] = frozenset()  # what a collect-only run collected

    @property
    def ran(self) -> int:
        return self.passed + self.failed

    def counts(self) -> dict[str, object]:
        return {"source": self.source, "collected": self.collected, "passed": self.passed, "failed": self.failed,
                "skipped": self.skipped, "errors": self.errors, "xfailed": self.xfailed,
                "deselected": self.deselected, "sessions": self.sessions, "ended": self.ended}


def _lines(data: bytes) -> Iterable[str]:
    return data.decode("utf-8", "replace").splitlines()


# -- pytest (proctor's plugin) ------------------------------------------------------------------------------

def read_pytest(report: bytes) -> Evidence | None:
    records = []
    for line in _lines(report):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run: the missing `finish` says it
        if isinstance(rec, dict):
            records.append(rec)
    if not records:
        return None
    started = {r.get("pid") for r in records if r.get("e") == "start"}
    finished = [r for r in records if r.get("e") == "finish"]
    tests: dict[str, dict[str, str]] = {}
    xfail: set[str] = set()
    skips: list[Skip] = []
    collect_errors, collected, deselected, problems = [], None, 0, []
    items: set[str] = set()
    for r in records:
        kind = r.get("e")
        if kind == "test":
            tid = str(r.get("id"))
            tests.setdefault(tid, {})[str(r.get("when"))] = str(r.get("outcome"))
            if r.get("xfail"):
                xfail.add(tid)
            origin = r.get("origin")
            if r.get("outcome") == "skipped" and isinstance(origin, list) and origin and not r.get("xfail"):
                skips.append(Skip(tid, str(origin[0]), origin[1] if isinstance(origin[1], int) else None))
        elif kind == "collect":
            if r.get("outcome") == "failed":
                collect_errors.append(str(r.get("id")))
            elif r.get("origin"):
                skips.append(Skip(str(r.get("id")), str(r.get("origin")), None))
        elif kind == "item":
            items.add(str(r.get("id")))
        elif kind == "collected" and isinstance(r.get("n"), int):
            collected = (collected or 0) + r["n"]
        elif kind == "deselected" and isinstance(r.get("n"), int):
            deselected += r["n"]
    passed = failed = skipped = errors = xfailed = 0
    failed_tests = []
    for tid, phases in tests.items():
        if tid in xfail:
            xfailed += 1
        elif phases.get("call") == "failed":
            failed += 1
            failed_tests.append(tid)
        elif "failed" in (phases.get("setup"), phases.get("teardown")):
            errors += 1
            failed_tests.append(tid)
        elif "skipped" in phases.values():
            skipped += 1
        elif phases.get("call") == "passed":
            passed += 1
    if collect_errors:
        problems.append(f"{len(collect_errors)} collection error(s): {', '.join(collect_errors[:3])}")
    if collected is not None and finished and len(tests) < collected and not items:
        problems.append(f"{collected - len(tests)} of the {collected} collected tests never reported an outcome")
    exits = [r.get("exit") for r in finished if isinstance(r.get("exit"), int)]
    return Evidence("pytest", sessions=len(started), ended=len({r.get("pid") for r in finished} & started),
                    collected=collected, passed=passed, failed=failed, skipped=skipped, errors=errors + len(collect_errors),
                    xfailed=xfailed, deselected=deselected, problems=tuple(problems), skips=tuple(skips),
                    session_exit=max(exits) if exits else None, failed_tests=tuple(failed_tests),
                    ran_ids=frozenset(tests), item_ids=frozenset(items))


# -- go test -json ------------------------------------------------------------------------------------------

def read_go_json(stdout: bytes) -> Evidence | None:
    events = []
    for line in _lines(stdout):
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and "Action" in ev:
                events.append(ev)
    if not events:
        return None
    final: dict[tuple[str, str], str] = {}
    pkg_end: dict[str, str] = {}
    pkg_out: dict[str, str] = {}
    pkgs: set[str] = set()
    for ev in events:
        pkg, test, action = str(ev.get("Package", "")), ev.get("Test"), ev.get("Action")
        if pkg:
            pkgs.add(pkg)
        if action == "output" and not test:
            pkg_out[pkg] = (pkg_out.get(pkg, "") + str(ev.get("Output", "")))[-2000:]
        if action in ("pass", "fail", "skip"):
            if test:
                if "/" not in str(test):  # subtests roll up into their parent
                    final[(pkg, str(test))] = action
            else:
                pkg_end[pkg] = action
    passed = sum(1 for a in final.values() if a == "pass")
    failed = sum(1 for a in final.values() if a == "fail")
    skipped = sum(1 for a in final.values() if a == "skip")
    problems = []
    for pkg in sorted(pkgs):
        if pkg_end.get(pkg) == "fail" and not any(p == pkg and a == "fail" for (p, _), a in final.items()):
            problems.append(f"package {pkg} failed outside any test")
        ran = any(p == pkg for p, _ in final)
        quiet = "[no test files]" in pkg_out.get(pkg, "") or "[no tests to run]" in pkg_out.get(pkg, "")
        if pkg_end.get(pkg) == "pass" and not ran and not quiet:
            # os.Exit(0) in an init(): go reports `ok` for a test binary that never reached its tests.
            problems.append(f"package {pkg} passed without reporting any test")
    return Evidence("go-json", sessions=len(pkgs), ended=len(pkg_end), passed=passed, failed=failed,
                    skipped=skipped, problems=tuple(problems),
                    failed_tests=tuple(f"{p} {t}" for (p, t), a in final.items() if a == "fail"))


# -- libtest (cargo test) -----------------------------------------------------------------------------------

RUNNING = re.compile(r"^running (\d+) tests?$")
RESULT = re.compile(r"^test result: (ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored")
BINARY = re.compile(r"^\s*(Running|Doc-tests) ")
TEST_LINE = re.compile(r"^test (\S+) \.\.\. (ok|FAILED|ignored)")


def read_libtest(stdout: bytes, stderr: bytes) -> Evidence | None:
    out = list(_lines(stdout))
    starts = [m for m in map(RUNNING.match, out) if m]
    if not starts:
        return None
    binaries = sum(1 for line in _lines(stderr) if BINARY.match(line))
    passed = failed = ignored = 0
    ends = 0
    for m in map(RESULT.match, out):
        if m:
            ends += 1
            passed, failed, ignored = passed + int(m[2]), failed + int(m[3]), ignored + int(m[4])
    problems = []
    sessions = max(len(starts), binaries)
    if ends < sessions:
        problems.append(f"{sessions - ends} of {sessions} test binaries ended before their `test result` line")
    failed_tests = tuple(m[1] for m in map(TEST_LINE.match, out) if m and m[2] == "FAILED")
    return Evidence("libtest", sessions=sessions, ended=ends, collected=sum(int(m[1]) for m in starts),
                    passed=passed, failed=failed, skipped=ignored, problems=tuple(problems), failed_tests=failed_tests)


# -- TAP ----------------------------------------------------------------------------------------------------

PLAN = re.compile(r"^1\.\.(\d+)")
POINT = re.compile(r"^(not )?ok\b(?:\s+\d+)?\s*-?\s*([^#]*)(#\s*(SKIP|TODO)\S*)?", re.I)


# node --test runs each file in a child and merges its TAP; a child that exits before reporting (a
# `process.exit(0)` in the code under test) shows as one passing point named by the file's path, with no
# test of its own under it (measured, node 20).
FILE_POINT = re.compile(r"\.(?:c|m)?[jt]sx?$")


def read_tap(stdout: bytes) -> Evidence | None:
    plans, passed, failed, skipped, problems, failed_tests = [], 0, 0, 0, [], []
    lines = list(_lines(stdout))
    for i, line in enumerate(lines):
        point = POINT.match(line)
        if point and not point[1] and FILE_POINT.search(point[2].strip()) and not _has_children(lines, i):
            problems.append(f"the test file {point[2].strip()[:200]} reported no test of its own (it ended early)")
    for line in lines:
        if line.startswith("Bail out!"):
            problems.append(f"the TAP stream bailed out: {line[:200]}")
        m = PLAN.match(line)
        if m:
            plans.append(int(m[1]))
            continue
        m = POINT.match(line)
        if not m:
            continue
        directive = (m[4] or "").upper()
        if directive == "SKIP" or (directive == "TODO" and m[1]):
            skipped += 1
        elif m[1]:
            failed += 1
            failed_tests.append(m[2].strip()[:200])
        else:
            passed += 1
    points = passed + failed + skipped
    if not plans and not points:
        return None
    if not plans:
        problems.append(f"the TAP stream has {points} test points and no plan: it ended before its end")
    elif points < sum(plans):
        problems.append(f"the TAP plan announced {sum(plans)} tests and {points} reported")
    return Evidence("tap", sessions=max(1, len(plans)), ended=len(plans), collected=sum(plans) if plans else None,
                    passed=passed, failed=failed, skipped=skipped, problems=tuple(problems),
                    failed_tests=tuple(failed_tests))


def _has_children(lines: list[str], i: int) -> bool:
    """Whether the TAP point at `i` had indented subtests above it (node prints a file's subtests, then the
    file's own point)."""
    j = i - 1
    while j >= 0 and not lines[j].startswith("# Subtest:"):
        if lines[j].startswith("    ") and POINT.match(lines[j].strip()):
            return True
        j -= 1
    return False


# -- summary lines ------------------------------------------------------------------------------------------

JEST = re.compile(r"^Tests:\s+(.*\d+ total)", re.M)
VITEST = re.compile(r"^\s*Tests\s+(.*)\(\d+\)\s*$", re.M)
MOCHA_PASS = re.compile(r"^\s+(\d+) passing\b", re.M)
MOCHA_FAIL = re.compile(r"^\s+(\d+) failing\b", re.M)
MOCHA_PEND = re.compile(r"^\s+(\d+) pending\b", re.M)


def _count(text: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", text)
    return int(m[1]) if m else 0


def read_summary(text: str) -> Evidence | None:
    m = JEST.search(text) or VITEST.search(text)
    if m:
        s = m[1]
        return Evidence("summary", sessions=1, ended=1, passed=_count(s, "passed"), failed=_count(s, "failed"),
                        skipped=_count(s, "skipped") + _count(s, "todo"))
    p = MOCHA_PASS.search(text)
    if p:
        f, n = MOCHA_FAIL.search(text), MOCHA_PEND.search(text)
        return Evidence("summary", sessions=1, ended=1, passed=int(p[1]), failed=int(f[1]) if f else 0,
                        skipped=int(n[1]) if n else 0)
    return None


def read_any(report: bytes, stdout: bytes, stderr: bytes) -> Evidence | None:
    """For a command proctor did not choose (a Makefile, a script): whatever a runner under it reported."""
    return (read_pytest(report) or read_go_json(stdout) or read_libtest(stdout, stderr) or read_tap(stdout)
            or read_summary(stdout.decode("utf-8", "replace") + "\n" + stderr.decode("utf-8", "replace")))
