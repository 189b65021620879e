"""Per-test evidence read back from one validation step: each runner's own report, test by test, by id.

    read_pytest(report)                 proctor's pytest plugin's JSON lines (a host-made file)
    read_unittest(report)               proctor's unittest hook's JSON lines (unittest, Django's runner, nose2)
    read_go_json(stdout)                `go test -json` events (test2json)
    read_go_verbose(stdout)             `go test -v` lines (GOFLAGS=-v reaches a `go test` a script runs)
    read_libtest(stdout, stderr)        cargo/libtest's `running N tests` ... `test result:` per test binary
    read_tap(stdout)                    TAP (tape, node --test off a terminal, prove, a C harness)
    read_jest_json(kind, starts, files) jest's and vitest's JSON reports, written where the host said
    read_mocha_json(starts, files)      mocha's JSON reporter's file
    read_ctest(stdout)                  CTest's per-test lines

Each returns an `Evidence` or None when the runner left nothing. Which reader reads a step is decided by
the runner the step runs and by what the base's own run left (proctor.mechanisms.evidence.baseline), never
by what the judged run printed. A reader never raises on odd bytes: the output is the agent's code's as
much as the runner's. A test id is the runner's own name for the test, stable between the base's run and
the job's (a doctest's line number, which any edit above it moves, is left out).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PASSED, FAILED, ERROR, SKIPPED, XFAILED, XPASSED = "passed", "failed", "error", "skipped", "xfailed", "xpassed"
# A test's outcome when it ran more than once in one step: the worst of them (a failure is never hidden by
# a later pass of the same id in the same run).
RANK = {FAILED: 5, ERROR: 4, XPASSED: 1, PASSED: 0, SKIPPED: 2, XFAILED: 3}
PASSING = frozenset({PASSED, XPASSED})
FAILING = frozenset({FAILED, ERROR})
MAX_IDS = 200_000  # ids kept per step: far past any suite here; more is a problem the evidence names


@dataclass(frozen=True)
class Evidence:
    source: str  # the runner kind: pytest, unittest, go, libtest, tap, jest, vitest, mocha, ctest
    sessions: int = 0  # runs that started
    ended: int = 0  # runs that reached their own normal end
    tests: Mapping[str, str] = field(default_factory=dict)  # id -> outcome
    files: Mapping[str, str] = field(default_factory=dict)  # id -> the file that defines it, when known
    problems: tuple[str, ...] = ()  # facts the runner itself reported that fail the run
    session_exit: int | None = None  # the exit status the runner's session gave itself (pytest)
    collected: int | None = None
    deselected: int = 0

    def count(self, *outcomes: str) -> int:
        return sum(1 for o in self.tests.values() if o in outcomes)

    @property
    def ran(self) -> int:
        return self.count(PASSED, FAILED, ERROR, XPASSED)

    @property
    def passed(self) -> int:
        return self.count(PASSED, XPASSED)

    @property
    def failed(self) -> int:
        return self.count(FAILED)

    @property
    def skipped(self) -> int:
        return self.count(SKIPPED)

    def counts(self) -> dict[str, object]:
        return {"source": self.source, "collected": self.collected, "passed": self.count(PASSED, XPASSED),
                "failed": self.count(FAILED), "skipped": self.count(SKIPPED), "errors": self.count(ERROR),
                "xfailed": self.count(XFAILED), "deselected": self.deselected, "sessions": self.sessions,
                "ended": self.ended}


class _Tests:
    """Outcomes by id as a reader meets them: repeats keep the worst; past MAX_IDS, a problem."""

    def __init__(self) -> None:
        self.out: dict[str, str] = {}
        self.files: dict[str, str] = {}
        self.dropped = 0

    def add(self, tid: str, outcome: str, file: str | None = None) -> None:
        old = self.out.get(tid)
        if old is None and len(self.out) >= MAX_IDS:
            self.dropped += 1
            return
        if old is None or RANK[outcome] > RANK[old]:
            self.out[tid] = outcome
        if file:
            self.files.setdefault(tid, file)

    def problems(self) -> tuple[str, ...]:
        return (f"{self.dropped} test outcome(s) past the {MAX_IDS} the host keeps",) if self.dropped else ()


def _lines(data: bytes) -> Iterable[str]:
    return data.decode("utf-8", "replace").splitlines()


def _records(report: bytes) -> list[dict]:
    out = []
    for line in _lines(report):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run: the missing `finish` says it
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _sessions(records: list[dict]) -> tuple[int, int]:
    started = {r.get("pid") for r in records if r.get("e") == "start"}
    finished = {r.get("pid") for r in records if r.get("e") == "finish"}
    return len(started), len(finished & started)


# -- pytest (proctor's plugin) ------------------------------------------------------------------------------

PHASE_RANK = {"failed": 2, "skipped": 1, "passed": 0}


def _session_prefix(records: list[dict], root: str) -> dict[object, str]:
    """Per pytest process: its rootdir relative to the checkout, when it is below it (a monorepo's
    `cd a && pytest; cd ../b && pytest` names `tests/test_x.py::t` in both: prefixed, they stay two tests)."""
    out: dict[object, str] = {}
    base = root.rstrip("/") + "/"
    for r in records:
        if r.get("e") == "start":
            rd = str(r.get("rootdir") or "")
            out[r.get("pid")] = rd[len(base):].strip("/") + "/" if root and rd.startswith(base) else ""
    return out


def read_pytest(report: bytes, root: str = "") -> Evidence | None:
    records = [r for r in _records(report) if r.get("r", "pytest") == "pytest"]
    if not records:
        return None
    prefix = _session_prefix(records, root)
    tests, phases = _Tests(), {}
    collect_outcomes, collected, deselected, counted_failed = [], None, 0, 0
    for r in records:
        kind = r.get("e")
        pre = prefix.get(r.get("pid"), "")
        if kind == "test":
            tid = pre + str(r.get("id"))
            ph = phases.setdefault(tid, {"file": r.get("file")})
            when, new = str(r.get("when")), (str(r.get("outcome")), bool(r.get("xfail")))
            old = ph.get(when)
            # The worst report of a phase stands (a unittest subTest's failure, then its test's own pass).
            if old is None or PHASE_RANK.get(new[0], 2) > PHASE_RANK.get(old[0], 2):
                ph[when] = new
        elif kind == "collect" and r.get("outcome") in ("failed", "skipped"):
            collect_outcomes.append((pre + str(r.get("id")), ERROR if r.get("outcome") == "failed" else SKIPPED))
        elif kind == "collected" and isinstance(r.get("n"), int):
            collected = (collected or 0) + r["n"]
        elif kind == "deselected" and isinstance(r.get("n"), int):
            deselected += r["n"]
        elif kind == "finish" and isinstance(r.get("failed"), int):
            counted_failed += r["failed"]
    for tid, ph in phases.items():
        setup, call, teardown = ph.get("setup"), ph.get("call"), ph.get("teardown")
        xfail = any(p[1] for p in (setup, call) if p)
        if call and call[0] == "failed":
            outcome = FAILED
        elif any(p and p[0] == "failed" for p in (setup, teardown)):
            outcome = ERROR
        elif xfail:
            outcome = XPASSED if call and call[0] == "passed" else XFAILED
        elif any(p and p[0] == "skipped" for p in (setup, call)):
            outcome = SKIPPED
        elif call and call[0] == "passed":
            outcome = PASSED
        else:
            outcome = ERROR  # a test that began and never reported its call: the run ended under it
        tests.add(tid, outcome, ph.get("file") if isinstance(ph.get("file"), str) else tid.split("::", 1)[0])
    for cid, outcome in collect_outcomes:  # a module that failed to import, or was skipped whole
        tests.add(cid, outcome, cid.split("::", 1)[0])
    sessions, ended = _sessions(records)
    problems = list(tests.problems())
    failing = sum(1 for o in tests.out.values() if o in FAILING)
    if counted_failed and not failing:  # (subtests count each failure: only "some" against "none" is told)
        problems.append(f"the pytest session counted {counted_failed} failed test(s) and its reports none")
    finished = [r for r in records if r.get("e") == "finish"]
    exits = [r.get("exit") for r in finished if isinstance(r.get("exit"), int)]
    return Evidence("pytest", sessions=sessions, ended=ended, tests=tests.out, files=tests.files,
                    problems=tuple(problems), session_exit=max(exits) if exits else None, collected=collected,
                    deselected=deselected)


# -- unittest (proctor's hook: unittest, Django's runner, anything on unittest's TestResult) -----------------

def _unittest_file(tid: str) -> str:
    """`pkg.tests.test_x.Case.test_y` -> `pkg/tests/test_x.py`, the module's likely file (a guess the
    held-out and touched-file rules may use, never the verdict): the id's parts before the class."""
    parts = tid.split(".")
    mod = [p for p in parts[:-2]] if len(parts) > 2 else parts[:1]
    return "/".join(mod) + ".py"


def read_unittest(report: bytes) -> Evidence | None:
    records = [r for r in _records(report) if r.get("r") == "unittest"]
    if not records:
        return None
    tests = _Tests()
    for r in records:
        if r.get("e") == "test" and r.get("outcome") in RANK:
            tid = str(r.get("id"))
            tests.add(tid, r["outcome"], _unittest_file(tid))
    sessions, ended = _sessions(records)
    return Evidence("unittest", sessions=sessions, ended=ended, tests=tests.out, files=tests.files,
                    problems=tests.problems())


# -- go test -json / -v -------------------------------------------------------------------------------------

GO_OUTCOME = {"pass": PASSED, "fail": FAILED, "skip": SKIPPED}


def _go_problems(pkgs: Sequence[str], ended: Mapping[str, str], ran: set[str], quiet: set[str],
                 failed_tests: set[str]) -> list[str]:
    problems = []
    for pkg in pkgs:
        if ended.get(pkg) == "fail" and pkg not in failed_tests:
            problems.append(f"package {pkg} failed outside any test (a build or setup failure, or an exit)")
        if ended.get(pkg) == "pass" and pkg not in ran and pkg not in quiet:
            # os.Exit(0) in an init(): go reports `ok` for a test binary that never reached its tests.
            problems.append(f"package {pkg} passed without reporting any test")
    return problems


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
    tests, ended, out = _Tests(), {}, {}
    pkgs: dict[str, None] = {}
    for ev in events:
        pkg, test, action = str(ev.get("Package", "")), ev.get("Test"), ev.get("Action")
        if pkg:
            pkgs[pkg] = None
        if action == "output" and not test:
            out[pkg] = (out.get(pkg, "") + str(ev.get("Output", "")))[-2000:]
        if action in GO_OUTCOME:
            if test:
                if "/" not in str(test):  # subtests roll up into their parent
                    tests.add(f"{pkg} {test}", GO_OUTCOME[str(action)])
            else:
                ended[pkg] = action
    ran = {t.split(" ", 1)[0] for t in tests.out}
    failed = {t.split(" ", 1)[0] for t, o in tests.out.items() if o == FAILED}
    quiet = {p for p in pkgs if "[no test files]" in out.get(p, "") or "[no tests to run]" in out.get(p, "")}
    problems = _go_problems(list(pkgs), ended, ran, quiet, failed) + list(tests.problems())
    return Evidence("go", sessions=len(pkgs), ended=len(ended), tests=tests.out, problems=tuple(problems))


GO_RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): (\S+)")
GO_PKG = re.compile(r"^(ok|FAIL|\?)\s+(\S+)(?:\s+(.*))?$")
GO_OUT = {"PASS": PASSED, "FAIL": FAILED, "SKIP": SKIPPED}


def read_go_verbose(stdout: bytes) -> Evidence | None:
    """`go test -v`: a package's lines come as one block ending with its `ok`/`FAIL`/`?` line (go buffers
    each package's output when it tests more than one), so a result line belongs to the next package line."""
    tests, ended = _Tests(), {}
    pending: list[tuple[str, str]] = []
    pkgs: dict[str, None] = {}
    quiet: set[str] = set()
    for line in _lines(stdout):
        m = GO_RESULT.match(line)
        if m:
            if line.startswith("---") and "/" not in m[2]:  # a subtest's line is indented, and rolls up
                pending.append((m[2], GO_OUT[m[1]]))
            continue
        m = GO_PKG.match(line)
        if m and (m[1] != "FAIL" or m[3] is not None or "/" in m[2] or "." in m[2]):
            pkg, rest = m[2], m[3] or ""
            pkgs[pkg] = None
            ended[pkg] = "pass" if m[1] == "ok" else "fail" if m[1] == "FAIL" else "none"
            if m[1] == "?" or "[no tests to run]" in rest:
                quiet.add(pkg)
            for name, outcome in pending:
                tests.add(f"{pkg} {name}", outcome)
            pending = []
    if not pkgs:
        return None
    ran = {t.split(" ", 1)[0] for t in tests.out}
    failed = {t.split(" ", 1)[0] for t, o in tests.out.items() if o == FAILED}
    problems = _go_problems(list(pkgs), {p: e for p, e in ended.items() if e != "none"}, ran, quiet, failed)
    if pending:
        problems.append(f"{len(pending)} test result(s) after the last package line: the run ended early")
    return Evidence("go", sessions=len(pkgs), ended=len(ended), tests=tests.out,
                    problems=tuple(problems + list(tests.problems())))


# -- libtest (cargo test) -----------------------------------------------------------------------------------

RUNNING = re.compile(r"^running (\d+) tests?$")
RESULT = re.compile(r"^test result: (ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored")
BINARY = re.compile(r"^\s*(Running|Doc-tests) (.*)$")
TEST_LINE = re.compile(r"^test (.+?) \.\.\. (ok|FAILED|ignored)(?:,|$| )")
DOCTEST_LINE = re.compile(r" \(line \d+\)$")
LIBTEST = {"ok": PASSED, "FAILED": FAILED, "ignored": SKIPPED}


def _binary_name(raw: str) -> str:
    """`unittests src/lib.rs (target/debug/deps/itoa-1a2b)` -> `unittests src/lib.rs`: the hash changes."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", raw.strip())


def read_libtest(stdout: bytes, stderr: bytes) -> Evidence | None:
    out = list(_lines(stdout))
    if not any(RUNNING.match(line) for line in out):
        return None
    names = [f"{m[1] == 'Doc-tests' and 'doc ' or ''}{_binary_name(m[2])}"
             for m in map(BINARY.match, _lines(stderr)) if m]
    tests, block, sessions, ends = _Tests(), -1, 0, 0
    for line in out:
        if RUNNING.match(line):
            block, sessions = block + 1, sessions + 1
            continue
        if RESULT.match(line):
            ends += 1
            continue
        m = TEST_LINE.match(line)
        if m and block >= 0:
            name = DOCTEST_LINE.sub("", m[1])
            where = names[block] if block < len(names) else f"binary {block + 1}"
            tid, k = f"{where} {name}", 2
            while tid in tests.out:  # two doctests of one item: their line numbers were their only names
                tid, k = f"{where} {name} #{k}", k + 1
            tests.add(tid, LIBTEST[m[2]])
    sessions = max(sessions, len(names))
    problems = list(tests.problems())
    if ends < sessions:
        problems.append(f"{sessions - ends} of {sessions} test binaries ended before their `test result` line")
    return Evidence("libtest", sessions=sessions, ended=ends, tests=tests.out, problems=tuple(problems))


# -- TAP ----------------------------------------------------------------------------------------------------

PLAN = re.compile(r"^1\.\.(\d+)")
POINT = re.compile(r"^(not )?ok\b(?:\s+(\d+))?\s*-?\s*([^#]*)(#\s*(SKIP|TODO)\S*)?", re.I)
# node --test runs each file in a child and merges its TAP; a child that exits before reporting (a
# `process.exit(0)` in the code under test) shows as one passing point named by the file's path, with no
# test of its own under it (measured, node 20).
FILE_POINT = re.compile(r"\.(?:c|m)?[jt]sx?$")


def read_tap(stdout: bytes) -> Evidence | None:
    """Top-level points only (a subtest's indented point rolls up into its parent's, as go's do)."""
    lines = list(_lines(stdout))
    plans, problems, tests = [], [], _Tests()
    for i, line in enumerate(lines):
        if line.startswith("Bail out!"):
            problems.append(f"the TAP stream bailed out: {line[:200]}")
        m = PLAN.match(line)
        if m:
            plans.append(int(m[1]))
            continue
        m = POINT.match(line)
        if not m:
            continue
        name = m[3].strip()[:300] or f"test {m[2] or len(tests.out) + 1}"
        if not m[1] and FILE_POINT.search(name) and not _has_children(lines, i):
            problems.append(f"the test file {name[:200]} reported no test of its own (it ended early)")
        directive = (m[5] or "").upper()
        outcome = (SKIPPED if directive == "SKIP" else XFAILED if directive == "TODO" and m[1]
                   else FAILED if m[1] else PASSED)
        tid, k = name, 2
        while tid in tests.out:
            tid, k = f"{name} #{k}", k + 1
        tests.add(tid, outcome)
    if not plans and not tests.out:
        return None
    points = len(tests.out)
    if not plans:
        problems.append(f"the TAP stream has {points} test points and no plan: it ended before its end")
    elif points < sum(plans):
        problems.append(f"the TAP plan announced {sum(plans)} tests and {points} reported")
    return Evidence("tap", sessions=max(1, len(plans)), ended=len(plans), collected=sum(plans) if plans else None,
                    tests=tests.out, problems=tuple(problems + list(tests.problems())))


def valid_tap(stdout: bytes) -> bool:
    """A whole TAP stream: a plan, as many points as it announced, no bail out. Asked of the base's own
    run only, to learn that a step's runner speaks TAP (a C harness a Makefile starts)."""
    ev = read_tap(stdout)
    return ev is not None and not ev.problems and ev.ended == ev.sessions and bool(ev.tests)


def _has_children(lines: list[str], i: int) -> bool:
    j = i - 1
    while j >= 0 and not lines[j].startswith("# Subtest:"):
        if lines[j].startswith("    ") and POINT.match(lines[j].strip()):
            return True
        j -= 1
    return False


# -- jest / vitest / mocha JSON (the host's preload told the runner where to write) -------------------------

JEST_OUTCOME = {"passed": PASSED, "failed": FAILED, "pending": SKIPPED, "skipped": SKIPPED, "todo": SKIPPED,
                "disabled": SKIPPED, "focused": PASSED}


def _rel(path: object, root: str) -> str:
    p = str(path or "")
    return p[len(root):].lstrip("/") if root and p.startswith(root.rstrip("/") + "/") else p


def _json_reports(kind: str, reports: Sequence[bytes]) -> tuple[list[dict], list[str]]:
    """Each report that is a JSON object (one per runner process that reached its end), and a problem for
    each that is not (a runner that ended while writing it)."""
    docs, problems = [], []
    for raw in reports:
        try:
            data = json.loads(raw)
        except ValueError:
            problems.append(f"a {kind} report is not JSON: the runner ended while writing it")
            continue
        if isinstance(data, dict):
            docs.append(data)
    return docs, problems


def read_jest_json(kind: str, starts: int, reports: Sequence[bytes], root: str = "") -> Evidence | None:
    """jest's `--json --outputFile` and vitest's json reporter (the same shape). `starts`: runner processes
    the preload saw begin; each wrote one report when it reached its end."""
    if not starts and not reports:
        return None
    tests = _Tests()
    docs, problems = _json_reports(kind, reports)
    ended = len(docs)
    for data in docs:
        for suite in data.get("testResults") or []:
            if not isinstance(suite, dict):
                continue
            file = _rel(suite.get("name"), root)
            results = [a for a in suite.get("assertionResults") or [] if isinstance(a, dict)]
            if not results and suite.get("status") == "failed":
                tests.add(f"{file}", ERROR, file)  # the file failed before any test: an import, a syntax error
            for a in results:
                name = a.get("fullName") or " ".join([*(a.get("ancestorTitles") or []), str(a.get("title") or "")])
                tests.add(f"{file} > {name}", JEST_OUTCOME.get(str(a.get("status")), ERROR), file)
    return Evidence(kind, sessions=max(starts, ended), ended=min(ended, max(starts, ended)), tests=tests.out,
                    files=tests.files, problems=tuple(problems + list(tests.problems())))


def read_mocha_json(starts: int, reports: Sequence[bytes], root: str = "") -> Evidence | None:
    if not starts and not reports:
        return None
    tests = _Tests()
    docs, problems = _json_reports("mocha", reports)
    ended = len(docs)
    for data in docs:
        for key, outcome in (("passes", PASSED), ("pending", SKIPPED), ("failures", FAILED)):
            for t in data.get(key) or []:
                if isinstance(t, dict):
                    file = _rel(t.get("file"), root)
                    name = str(t.get("fullTitle") or t.get("title") or "")
                    # mocha reports a failing hook as a failure named `"before all" hook ...`: an error of its file.
                    tests.add(f"{file} > {name}", ERROR if outcome == FAILED and '" hook' in name else outcome, file)
    return Evidence("mocha", sessions=max(starts, ended), ended=min(ended, max(starts, ended)), tests=tests.out,
                    files=tests.files, problems=tuple(problems + list(tests.problems())))


# -- ctest ---------------------------------------------------------------------------------------------------

CTEST_PROJECT = re.compile(r"^Test project ")
CTEST_LINE = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) \.*\s*(\*{0,3})([A-Za-z][A-Za-z ()]*?)\s+[\d.]+ sec")
CTEST_END = re.compile(r"^\d+% tests passed, \d+ tests? failed out of \d+|^No tests were found!!!")
CTEST_OUTCOME = {"Passed": PASSED, "Skipped": SKIPPED, "Not Run (Disabled)": SKIPPED}


def read_ctest(stdout: bytes) -> Evidence | None:
    """CTest's own lines: `1/3 Test #1: name ....   Passed    0.00 sec` per test, a summary per project."""
    tests, sessions, ended = _Tests(), 0, 0
    for line in _lines(stdout):
        if CTEST_PROJECT.match(line):
            sessions += 1
        elif CTEST_END.match(line):
            ended += 1
        else:
            m = CTEST_LINE.match(line)
            if m:
                tests.add(m[1], CTEST_OUTCOME.get(m[3].strip(), FAILED))
    if not sessions:
        return None
    return Evidence("ctest", sessions=sessions, ended=ended, tests=tests.out, problems=tests.problems())

