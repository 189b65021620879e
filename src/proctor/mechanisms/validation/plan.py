"""The host's own validation of a worktree: what to run (autodetected or given) and its real exit codes.

Owns detection at the worktree root and running the commands through the same process runner as agents
(deadline, whole-tree kill, bounded tails). It never reads the agent's claims about tests: only exit codes
that this module observed go into `tests_attempted`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.evidence import instrument as evidence
from proctor.mechanisms.evidence import readers, runners
from proctor.mechanisms.evidence.baseline import Baseline
from proctor.mechanisms.evidence.compare import Comparison, Rules
from proctor.mechanisms.evidence.verdict import judge
from proctor.mechanisms.process.local import ProcessRunner
from proctor.mechanisms.process.spawn import Poll, Spawn, Watch

VALIDATE_TIMEOUT_S = 900
OUTPUT_TAIL_BYTES = 64 * 1024
OUTPUT_BYTES = 1_000_000  # a step's output the runner keeps (a stream)
READ_BYTES = 16 * 1024 * 1024  # a test step's: its runner's per-test lines are read from it
NPM_PLACEHOLDER = 'echo "Error: no test specified" && exit 1'


SETUP_LABEL = "setup: "  # a repo's `setup` step in a validation plan (proctor.mechanisms.validation.environment)


@dataclass(frozen=True)
class Step:
    label: str  # what tests_attempted shows
    argv: tuple[str, ...]
    source: tuple[str, ...] = ()  # the argv before confinement wrapped it, when it was


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    skipped_reason: str | None = None  # set when nothing will run


@dataclass(frozen=True)
class Attempt:
    label: str
    exit_code: int | None
    timed_out: bool
    duration_s: float = 0.0
    output: str = ""  # the last OUTPUT_TAIL_BYTES of stdout, then of stderr: a failure readable from the result
    dropped: int = 0  # bytes of its output not in the log (past the runner's per-stream tail)
    counts: dict[str, object] | None = None  # what the runner reported, test by test (proctor.mechanisms.evidence)
    failure: str | None = None  # why it failed beyond (or despite) its exit code: the evidence says so
    risks: tuple[str, ...] = ()  # what the evidence leaves unproven (the exit code alone, no test ran)
    compared: Comparison | None = None  # the job's tests held to the base's run of this step
    explained: bool = False  # a nonzero exit the base's own failures account for: the step passed
    found: Mapping[str, readers.Evidence] = field(default_factory=dict, compare=False)  # by kind, not recorded
    argv: tuple[str, ...] = ()  # the step's command before confinement wrapped it, not recorded

    def record(self) -> dict[str, object]:
        return {"label": self.label, "exit_code": self.exit_code, "timed_out": self.timed_out,
                "duration_s": round(self.duration_s, 3), "output_tail": self.output, "output_dropped": self.dropped,
                "tests": self.counts, "evidence_failure": self.failure, "passed": self.passed,
                "compared": self.compared.record() if self.compared is not None else None}

    @property
    def passed(self) -> bool:
        return (self.exit_code == 0 or self.explained) and not self.timed_out and self.failure is None

    def line(self, timeout_s: float) -> str:
        if self.timed_out:
            return f"{self.label} => timed out after {timeout_s:.0f}s"
        if self.exit_code is None:
            return f"{self.label} => did not start"
        if self.exit_code < 0:  # the runner's -N: killed by signal N (a cancel, the stop switch, a limit)
            return f"{self.label} => killed by signal {-self.exit_code}"
        if self.failure is not None and self.exit_code == 0:
            return f"{self.label} => exit {self.exit_code}, but the evidence says failed"
        if self.explained:
            return f"{self.label} => exit {self.exit_code}, as on the base"
        return f"{self.label} => exit {self.exit_code}"


@dataclass(frozen=True)
class Checks:
    """How a run's test steps are checked beyond their exit code (proctor.mechanisms.evidence): the instrument
    laid out for this run, the checkout it runs in, and the base's own run of the same plan to hold each
    step to (None: the base's run itself, read for every kind it leaves; or a run with no base to hold to).
    `rules`: ids that must pass, known flaky ones, held-out files; `touched(id, file)`: the test's own file
    is one the job changed (judged on the run with the base's test files instead)."""

    instrument: evidence.Instrument
    root: Path
    base: Baseline | None = None
    rules: Rules = field(default_factory=Rules)
    touched: Callable[[str, str | None], bool] = field(default=lambda tid, file: False)
    observe: bool = False  # the base's own run: every kind read, none judged against anything


def _python() -> str:
    return "python" if shutil.which("python") else "python3"


def _has_make_test(makefile: Path) -> bool:
    try:
        text = makefile.read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^test\s*:(?!=)", text, re.M) is not None


NODE_MANAGERS = (("pnpm-lock.yaml", ("pnpm", "test")), ("yarn.lock", ("yarn", "test")),
                 ("bun.lockb", ("bun", "run", "test")), ("bun.lock", ("bun", "run", "test")))
PYTEST_DJANGO = re.compile(rb"DJANGO_SETTINGS_MODULE|--ds[= ]")


def _pytest_django(root: Path) -> bool:
    """pytest-django configured: the project runs its Django tests through pytest."""
    for name in ("pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "conftest.py"):
        try:
            with open(root / name, "rb") as fh:
                if PYTEST_DJANGO.search(fh.read(1024 * 1024)):
                    return True
        except OSError:
            continue
    return False


def _npm_test(package_json: Path) -> bool:
    try:
        data = json.loads(package_json.read_text(errors="replace"))
    except (OSError, ValueError):
        return False
    script = data.get("scripts", {}).get("test") if isinstance(data, dict) else None
    return isinstance(script, str) and bool(script.strip()) and script.strip() != NPM_PLACEHOLDER


def detect(root: Path) -> Plan:
    """Autodetect at the worktree root. More than one ecosystem is ambiguous unless a Makefile `test`
    target is among them: that is the repo's own declared entry point and wins."""
    found: dict[str, tuple[Step, ...]] = {}
    py = _python()
    if (root / "manage.py").is_file() and not _pytest_django(root):
        # A Django project's tests are Django's TestCases, run by its own runner (`tests.py` modules pytest
        # never collects, and a test database pytest would not make): what its docs say to run.
        found["python"] = (Step(f"{py} manage.py test", (py, "manage.py", "test")),)
    elif any((root / f).is_file() for f in ("pyproject.toml", "setup.cfg", "pytest.ini", "tox.ini")):
        found["python"] = (Step(f"{py} -m pytest", (py, "-m", "pytest")),)
    if (root / "package.json").is_file() and _npm_test(root / "package.json"):
        # The package manager the lockfile names runs the script, as its developer does (a pnpm workspace's
        # `test` script runs `pnpm -r test`, which npm cannot).
        manager = next((m for lock, m in NODE_MANAGERS if (root / lock).is_file()), ("npm", "test"))
        found["node"] = (Step(" ".join(manager), manager),)
    if (root / "Cargo.toml").is_file():
        found["rust"] = (Step("cargo test", ("cargo", "test")),)
    if (root / "go.mod").is_file():
        # A vendored module tests offline only with -mod=vendor (GOPROXY is off in validation); go turns it on
        # by itself only for go >= 1.14 modules whose go.mod says so, so say it whenever vendor/ is there.
        vendored = ("-mod=vendor",) if (root / "vendor" / "modules.txt").is_file() else ()
        found["go"] = (Step(f"go test {' '.join(vendored + ('./...',))}", ("go", "test", "-json", *vendored, "./...")),)
    slns = sorted(p.name for p in root.glob("*.sln"))
    projs = sorted(p.name for p in root.glob("*.csproj"))
    dotnet_target = slns[0] if len(slns) == 1 else (projs[0] if not slns and len(projs) == 1 else None)
    if dotnet_target:
        found["dotnet"] = (
            Step(f"dotnet build {dotnet_target}", ("dotnet", "build", dotnet_target)),
            Step(f"dotnet test {dotnet_target}", ("dotnet", "test", dotnet_target)),
        )
    elif slns or projs:
        return Plan((), f"validation skipped: ambiguous .NET root ({', '.join(slns + projs)})")
    if (root / "Makefile").is_file() and _has_make_test(root / "Makefile"):
        found["make"] = (Step("make test", ("make", "test")),)

    if not found:
        return Plan((), "validation skipped: no test command detected at the worktree root")
    if len(found) == 1:
        return Plan(next(iter(found.values())))
    if "make" in found:
        return Plan(found["make"])
    return Plan((), f"validation skipped: ambiguous root ({', '.join(sorted(found))}); pass --validate-cmd")


def given(command: str) -> Plan:
    return Plan((Step(command, ("/bin/sh", "-c", command)),))


@dataclass(frozen=True)
class Run:
    attempts: list[Attempt]
    killed_reason: str | None = None  # the stop switch or a cancel ended validation


def run(
    plan: Plan,
    runner: ProcessRunner,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float = VALIDATE_TIMEOUT_S,
    name: str = "validate",
    poll: Poll | None = None,
    log: Path | None = None,
    watch: Watch | None = None,
    checks: Checks | None = None,
) -> Run:
    """Run each step in order under one shared deadline; stop at the first failure (the base's own run
    goes on past a test step that failed: its later steps' outcomes are the base's too). Each step's output
    is appended to `log` (what the runner kept of it: its per-stream tail) and its tail kept in the attempt.
    With `checks`, every step but the repo's setup is judged on its runners' evidence too."""
    attempts: list[Attempt] = []
    budget = timeout_s
    for i, step in enumerate(plan.steps):
        if budget <= 0:
            attempts.append(Attempt(step.label, None, True))
            break
        ex = runner.run(Spawn(argv=step.argv, cwd=cwd, env=env, deadline_s=budget, name=f"{name}-{i}", poll=poll,
                              watch=watch, tail_bytes=READ_BYTES if checks is not None else OUTPUT_BYTES))
        budget -= ex.duration_s
        attempt = Attempt(step.label, ex.exit_code, ex.timed_out, ex.duration_s, _tail(ex.stdout, ex.stderr),
                          ex.stdout_dropped + ex.stderr_dropped, argv=step.source or step.argv)
        setup = step.label.startswith(SETUP_LABEL)
        if checks is not None and not setup and not ex.killed_reason:
            attempt = _with_evidence(attempt, step, checks, ex.stdout, ex.stderr, ex.stdout_dropped)
        attempts.append(attempt)
        if log is not None:
            _append_log(log, name, attempts[-1], ex.stdout, ex.stderr)
        if ex.killed_reason:
            return Run(attempts, ex.killed_reason)
        if not attempts[-1].passed and (setup or checks is None or not checks.observe or ex.timed_out):
            break
    return Run(attempts)


def _with_evidence(attempt: Attempt, step: Step, checks: Checks, stdout: bytes, stderr: bytes,
                   dropped: int = 0) -> Attempt:
    """The step judged on what its runners reported. The step's own argv is the wrapped one (bwrap, the
    Landlock helper), so the runner is told from the plan's argv: the unwrapped command."""
    argv = step.source or step.argv
    base = checks.base.step(step.label) if checks.base is not None else None
    if checks.observe:
        found = evidence.collect(checks.instrument, None, stdout, stderr, checks.root)
        for kind in runners.stdout_kinds(argv, checks.root):
            ev = evidence.stdout_evidence(kind, stdout, stderr)
            if ev is not None:
                found[kind] = ev
        if "tap" not in found and readers.valid_tap(stdout):
            found["tap"] = readers.read_tap(stdout)  # type: ignore[assignment]
        return dataclasses.replace(attempt, found=found, counts=_counts(found))
    expected = evidence.expects(argv)
    kinds = base.kinds if base is not None and base.kinds else ((expected,) if expected else None)
    found = evidence.collect(checks.instrument, kinds, stdout, stderr, checks.root)
    verdict = judge(step.label, attempt.exit_code, found, base, expected=expected, rules=checks.rules,
                    touched=checks.touched)
    failure = verdict.failure
    if dropped and failure is None and set(found) & set(evidence.STDOUT_KINDS):
        # Fail closed: the lines of the tests before the kept tail are gone (a flood hides a broken test).
        failure = (f"{step.label}: its output passed the {READ_BYTES >> 20} MB the host reads ({dropped} bytes "
                   "before them lost): its per-test lines are incomplete")
    return dataclasses.replace(attempt, counts=_counts(found), failure=failure, risks=verdict.risks,
                               compared=verdict.compared, explained=verdict.explained, found=found)


def _counts(found: Mapping[str, readers.Evidence]) -> dict[str, object] | None:
    """One step's counts: its one runner's, or every runner's summed (a `make test` that runs two)."""
    if not found:
        return None
    evs = list(found.values())
    if len(evs) == 1:
        return evs[0].counts()
    total: dict[str, object] = {"source": "+".join(sorted(found))}
    for key in ("collected", "passed", "failed", "skipped", "errors", "xfailed", "deselected", "sessions", "ended"):
        total[key] = sum(int(ev.counts()[key] or 0) for ev in evs)  # type: ignore[call-overload]
    return total


def _tail(stdout: bytes, stderr: bytes) -> str:
    """At most OUTPUT_TAIL_BYTES of UTF-8: stdout's end, then stderr's (up to half when there is stdout)."""
    err = stderr[-(OUTPUT_TAIL_BYTES // 2 if stdout else OUTPUT_TAIL_BYTES):]
    text = stdout.decode("utf-8", "replace")[-OUTPUT_TAIL_BYTES:] if stdout else ""
    if err:
        text += ("\n" if text and not text.endswith("\n") else "") + "[stderr]\n" + err.decode("utf-8", "replace")
    data = text.encode("utf-8")
    return data[-OUTPUT_TAIL_BYTES:].decode("utf-8", "ignore") if len(data) > OUTPUT_TAIL_BYTES else text


def _append_log(log: Path, name: str, attempt: Attempt, stdout: bytes, stderr: bytes) -> None:
    """One section a step; a log that cannot be written costs the log, never the verdict (the tail is kept)."""
    head = (f"=== {name}: {attempt.label} => exit {attempt.exit_code}"
            f"{' (timed out)' if attempt.timed_out else ''}, {attempt.duration_s:.2f} s"
            f"{f', {attempt.dropped} bytes before the kept tail not logged' if attempt.dropped else ''} ===\n")
    try:
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(log, "ab") as f:
            f.write(head.encode() + b"--- stdout ---\n" + stdout + b"\n--- stderr ---\n" + stderr + b"\n")
    except OSError:
        pass
