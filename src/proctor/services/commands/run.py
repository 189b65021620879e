"""`run_request`: one command request, checked in the documented order, run, and accounted for.

Owns the order (DESIGN.md 5): 1 shape and identity, 2 arguments, 3 allowlist, 4 declared writes,
5 confinement, 6 stdin; then the project must be a git worktree's top level (fail closed). Running: a
write-ahead `run-request-start` row, the control files' fingerprints and pinned bytes (pins.py), a snapshot,
the command (own process group and job cgroup via proctor.mechanisms.process.local, scrubbed env, no shell, capped timeout
and output; confined, or unconfined in a mount namespace that hides $PROCTOR_HOME and the home:
isolation.py), the fingerprints again, every pinned control file put back, a second snapshot, the diff. Rows: `run-request-end`, `run-request-refused` (every
ProposalError, not under dry_run), `run-request-undeclared-writes`; after tampering, none.
It never decides what a row means later (the ledger's `verify` and its readers do).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.services.commands import confined, controlplane, isolation, snapshot
from proctor.services.commands.allowlist import MAX_COMMAND_TIMEOUT_S, Allowlist, Entry
from proctor.services.commands.controlplane import ControlPlane, real
from proctor.services.commands.declared import DeclaredWrites, declare
from proctor.services.commands.environment import resolve_program, scrubbed_env
from proctor.services.commands.errors import LedgerTamperedError, ProposalError, RequestCode, UndeclaredWritesError
from proctor.services.commands.gates import first_failure
from proctor.services.commands.journal import Journal
from proctor.services.commands.pins import Pins
from proctor.services.commands.request import CommandRequest, StdinContent, read_request, read_stdin
from proctor.services.commands.result import CommandResult
from proctor.home import proctor_home
from proctor.mechanisms.git.command import git
from proctor.mechanisms.process.local import LocalRunner, ProcessRunner
from proctor.mechanisms.process.spawn import Exit, Spawn
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.trusted import check_workspace


@dataclass(frozen=True)
class _Plan:
    """Everything checks 1-6 and the worktree check established; nothing has run."""

    request: CommandRequest
    entry: Entry
    plane: ControlPlane
    declared: DeclaredWrites
    program: Path
    cwd: Path
    env: dict[str, str]
    stdin: StdinContent | None
    grant: confined.Grant | None
    watch: tuple[Path, ...]
    timeout_s: float
    git_dirs: tuple[Path, ...]
    hiding: isolation.Hiding
    pin_paths: tuple[Path, ...]

    def result(self, **fields: Any) -> CommandResult:
        return CommandResult(
            agent=self.request.agent,
            argv=list(self.request.argv),
            entry=self.entry.name,
            cwd=self.entry.cwd,
            timeout_s=self.timeout_s,
            **fields,
        )


def _project(project: str | os.PathLike[str]) -> Path:
    raw = os.fspath(project)
    why = check_workspace(raw)
    if why is not None:
        raise ProposalError(RequestCode.PROJECT_INVALID, why)
    return real(raw)


def _worktree(plane: ControlPlane) -> tuple[Path, ...]:
    """Fail closed: only a git worktree's top level is a project; returns its git dirs (to watch)."""
    found = git(["rev-parse", "--show-toplevel", "--absolute-git-dir", "--git-common-dir"], cwd=plane.project)
    lines = found.text.splitlines() if found.ok else []
    if len(lines) != 3:
        raise ProposalError(
            RequestCode.NOT_A_GIT_WORKTREE,
            f"{plane.project} is not a git worktree ({found.err or 'git said nothing'}); without one there is "
            "no baseline to account writes against",
        )
    top, git_dir, common = lines
    if real(top) != plane.project:
        raise ProposalError(
            RequestCode.NOT_A_GIT_WORKTREE, f"{plane.project} lies inside the worktree {top}, not at its top level"
        )
    return tuple(dict.fromkeys((real(git_dir), real(plane.project / common))))


def _stdin(raw: Any, entry: Entry, plane: ControlPlane) -> StdinContent | None:
    stdin = read_stdin(raw)
    if stdin is None:
        return None
    if not entry.stdin_gates:
        raise ProposalError(
            RequestCode.STDIN_NOT_GATED, f"entry {entry.name!r} registers no stdin gates, so it takes no content"
        )
    resolved = real(plane.project / stdin.path)
    rel = plane.relative(resolved)
    if rel is None or plane.is_protected(resolved):
        raise ProposalError(
            RequestCode.STDIN_SHAPE, f"stdin path {stdin.path!r} must name a project path outside the control plane"
        )
    why = first_failure(entry.stdin_gates, stdin, rel)
    if why is not None:
        raise ProposalError(RequestCode.STDIN_GATE_FAILED, why)
    return stdin


def _prepare(
    request: CommandRequest | Mapping[str, Any],
    *,
    project: str | os.PathLike[str],
    policy: Allowlist | str | os.PathLike[str] | None,
    confine: bool,
    timeout_cap: float | None,
    expect_agent: str | None,
    refuse_agents: Collection[str],
    journal: Journal,
) -> _Plan:
    allow = policy if isinstance(policy, Allowlist) else Allowlist.load(policy)
    proj = _project(project)
    admitted = read_request(request, expect_agent=expect_agent, refuse_agents=refuse_agents)  # 1, 2
    req = admitted.request
    plane = controlplane.build(
        proj, home=proctor_home(), ledger_files=journal.files(), policy_source=allow.source,
        briefs=allow.file.protected,
    )
    entry = allow.select(req.agent, req.argv, req.cwd, plane)  # 3
    cwd = real(plane.project / entry.cwd)
    if plane.relative(cwd) is None or plane.is_protected(cwd):  # a symlink planted where the pinned cwd was
        raise ProposalError(
            RequestCode.CWD_MISMATCH,
            f"pinned cwd {entry.cwd!r} resolves to {cwd}, outside the project or in its control plane",
        )
    env = scrubbed_env(entry, plane)
    program = resolve_program(entry.program, env["PATH"], plane, cwd)
    writes_ok = [*entry.writes, *allow.agent(req.agent).write_scopes]
    declared = declare(req.expected_writes, allowed=writes_ok, plane=plane)  # 4
    grant = confined.check(entry, program, plane, confine=confine)  # 5
    stdin = _stdin(admitted.stdin, entry, plane)  # 6
    git_dirs = _worktree(plane)
    timeout = min(entry.timeout_s, MAX_COMMAND_TIMEOUT_S, timeout_cap if timeout_cap is not None else float("inf"))
    try:
        hiding = isolation.hidden_paths(entry, plane, proctor_home(), program, git_dirs)
    except isolation.TooManyToHide as exc:
        raise ProposalError(RequestCode.CONFINEMENT_UNAVAILABLE, f"cannot hide the home: {exc}") from None
    plane = plane.with_git_dirs(git_dirs)
    return _Plan(
        req, entry, plane, declared, program, cwd, env, stdin, grant,
        tuple(snapshot.git_watch_paths(git_dirs)), timeout, git_dirs, hiding,
        tuple(_pin_paths(plane, proctor_home(), allow, git_dirs)),
    )


def _pin_paths(plane: ControlPlane, home: Path, allow: Allowlist, git_dirs: tuple[Path, ...]) -> list[Path]:
    """What is put back after the run (pins.py): proctor's trust and config, the allowlist, the briefs, and
    the git files that would run code at the next `git`."""
    paths = [real(home) / n for n in controlplane.HOME_CONTROL_FILES]
    if allow.source is not None:
        paths.append(allow.source)
    for brief in allow.file.protected:
        paths.append(real(brief if os.path.isabs(brief) else plane.project / brief))
    for d in git_dirs:
        paths += [d / n for n in ("config", "config.worktree", "hooks", "commondir", "gitdir")]
    paths.append(plane.project / ".git")  # a linked worktree's pointer file (a folder is pinned by its parts)
    return [p for p in dict.fromkeys(paths) if not (p == plane.project / ".git" and p.is_dir())]


def _agent_and_argv(request: CommandRequest | Mapping[str, Any]) -> tuple[Any, Any]:
    if isinstance(request, CommandRequest):
        return request.agent, list(request.argv)
    if isinstance(request, Mapping):
        agent, argv = request.get("agent"), request.get("argv")
        ok = isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        return (agent if isinstance(agent, str) else None), (argv if ok else None)
    return None, None


def _result(
    plan: _Plan, done: Exit, changes: snapshot.Changes, run: confined.ConfinedRun | isolation.UnconfinedRun,
    request_id: str, outside: list[str], rolled_back: list[str], unpinned: list[str],
) -> CommandResult:
    undeclared = plan.declared.undeclared(changes.paths, changes.folders) + outside
    pidns = run.details.get("cleanup") == "pidns"
    is_confined = isinstance(run, confined.ConfinedRun)
    hidden_by_os = is_confined or run.isolation != "none"
    return plan.result(
        exit=done.exit_code,
        duration_ms=int(done.duration_s * 1000),
        stdout=done.stdout.decode("utf-8", "replace"),
        stderr=done.stderr.decode("utf-8", "replace"),
        truncated=bool(done.stdout_dropped or done.stderr_dropped),
        undeclared_writes=undeclared,
        ran=True,
        code=RequestCode.UNDECLARED_WRITES if undeclared else _code(done, pidns=pidns),
        request_id=request_id,
        timed_out=done.timed_out,
        changed=changes.paths,
        stdout_dropped=done.stdout_dropped,
        stderr_dropped=done.stderr_dropped,
        leftovers_killed=done.leftovers_killed,
        confinement=run.confinement if is_confined else "none",
        confinement_details=run.details,
        confinement_gaps=[*run.gaps, *(f"not pinned, so not put back if changed: {u}" for u in unpinned)],
        confined=is_confined,
        hidden=[str(p) for p in plan.hiding.roots] if hidden_by_os else [],
        exposed=[] if hidden_by_os else [str(p) for p in plan.hiding.roots],
        outside_writes=outside,
        rolled_back=rolled_back,
    )


def _tampered(
    plan: _Plan, done: Exit, before: snapshot.Snapshot, run: confined.ConfinedRun | isolation.UnconfinedRun,
    request_id: str, outside: list[str], rolled_back: list[str], unpinned: list[str], *, tampered: list[str],
    problems: list[str], ran: bool = True,
) -> CommandResult | None:
    """The full result of a run that changed the control plane: it ran (its exit, output and writes stand),
    and the tamper is its code and its own field, so a caller never reads "did not run" into it. None when
    even that cannot be built (the project cannot be read back): the tamper is still LEDGER_TAMPERED."""
    try:
        changes = snapshot.diff(before, snapshot.take(plan.plane.project, plan.watch, reference=before))
        result = _result(plan, done, changes, run, request_id, outside, rolled_back, unpinned)
    except Exception:  # noqa: BLE001 - the tamper must reach the caller as itself, never as HOST_ERROR
        return None
    return result.model_copy(update={"code": RequestCode.LEDGER_TAMPERED, "ran": ran, "tampered": tampered,
                                     "ledger_problems": problems[:20]})


def _refusal_row(agent: Any, argv: Any, exc: ProposalError, **extra: Any) -> dict[str, Any]:
    return {"agent": agent, "argv": argv, "code": exc.code.value, "message": exc.message, **extra}


def _code(done: Exit, *, pidns: bool) -> RequestCode:
    if done.timed_out:
        return RequestCode.TIMED_OUT
    # In a bwrap pid namespace nothing the command started outlives bwrap's pid 1 (the kernel kills the
    # namespace with it), but the runner can catch bwrap's own pid 1 mid-exit, re-parented and unnamed:
    # measured 1-2 runs in 40 here under load. So only outside a pid namespace is a leftover the command's.
    if done.leftovers_killed and not pidns:
        return RequestCode.LEFTOVER_PROCESSES
    return RequestCode.OK if done.exit_code == 0 else RequestCode.EXIT_NONZERO


def _execute(plan: _Plan, journal: Journal, runner: ProcessRunner) -> CommandResult:
    req = plan.request
    request_id = f"rr-{uuid.uuid4().hex[:16]}"
    stdin_bytes = plan.stdin.content.encode("utf-8") if plan.stdin is not None else None
    run: confined.ConfinedRun | isolation.UnconfinedRun
    tmpdir: Path | None = None
    try:
        if plan.grant is not None:
            run = confined.wrap(plan.grant, plan.program, req.argv, plan.cwd, plan.plane, plan.hiding.paths,
                                plan.hiding.readable_homes)
            tmpdir = run.tmpdir
        else:
            # Unconfined, as the allowlist allows: still in a mount namespace that hides proctor's state.
            tmpdir = Path(tempfile.mkdtemp(prefix="proctor-cmd-"))
            run = isolation.unconfined([str(plan.program), *req.argv[1:]], plan.cwd, plan.plane, plan.hiding,
                                       plan.git_dirs, tmpdir)
    except ProposalError as exc:
        journal.append("run-request-refused", _refusal_row(req.agent, list(req.argv), exc), request_id)
        raise
    try:
        return _run(plan, journal, runner, run, request_id, stdin_bytes)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _wrapped_spawn_error(plan: _Plan, run: confined.ConfinedRun | isolation.UnconfinedRun, done: Exit) -> str | None:
    """Inside bwrap the program is started by `env -C`: its exec failure is env's exit 126/127 and one line."""
    if run.argv[:1] == [str(plan.program)] or done.exit_code not in (126, 127):
        return None
    err = done.stderr.decode("utf-8", "replace").strip()
    head, _, why = err.partition(": ")
    if "\n" in err or not (head == "env" or head.endswith("/env")) or str(plan.program) not in why:
        return None
    return why


def _run(
    plan: _Plan, journal: Journal, runner: ProcessRunner, run: confined.ConfinedRun | isolation.UnconfinedRun,
    request_id: str, stdin_bytes: bytes | None,
) -> CommandResult:
    req, entry = plan.request, plan.entry
    start_row = journal.append(
        "run-request-start",
        {
            "agent": req.agent, "argv": list(req.argv), "cwd": entry.cwd, "entry": entry.name,
            "purpose": req.purpose, "expected_writes": list(req.expected_writes), "project": str(plan.plane.project),
            "timeout_s": plan.timeout_s, "confine": plan.grant is not None,
            "hidden_by": run.confinement if isinstance(run, confined.ConfinedRun) else run.isolation,
            "stdin": None if plan.stdin is None else {"path": plan.stdin.path, "bytes": len(stdin_bytes or b"")},
        },
        request_id,
    )
    argv, env = run.argv, {**plan.env, **run.env}
    # Fingerprinted after the start row, so only a change during the run counts. The ledger is shared by
    # every job on this host: one appending to it while a command runs reads as tampering too (fail closed).
    tamper_before = controlplane.fingerprints(plan.plane.tamper_files)
    pins = Pins.take(plan.pin_paths)
    restore: tuple[list[str], list[str]] | None = None
    try:
        homes = None
        if not isinstance(run, confined.ConfinedRun) and run.isolation == "none":
            skip = (plan.plane.project, *plan.git_dirs, real(proctor_home()))
            homes = isolation.HomeWatch.take(isolation.user_homes(), skip)
        before = snapshot.take(plan.plane.project, plan.watch)
        done = runner.run(
            Spawn(argv=argv, cwd=plan.cwd, env=env, deadline_s=plan.timeout_s, stdin=stdin_bytes,
                  tail_bytes=entry.max_output_bytes, name=request_id)
        )
        outside = homes.changed() if homes is not None else []
        # Fingerprints first (a restore moves them too), then every control file is put back.
        moved = controlplane.changed(tamper_before, controlplane.fingerprints(plan.plane.tamper_files))
        restore = pins.restore()
    finally:
        if restore is None:  # the run itself raised: still put every control file back
            pins.restore()
        pins.close()
    rolled_back, unrestored = restore
    spawn_error = done.spawn_error if done.spawn_error is not None else _wrapped_spawn_error(plan, run, done)
    if unrestored:
        raise LedgerTamperedError(
            f"{entry.name!r} changed control files that could not be put back: {unrestored[:5]}; "
            f"put back: {rolled_back[:5]}; nothing more is recorded for request {request_id}",
            _tampered(plan, done, before, run, request_id, outside, rolled_back, pins.unpinned,
                      tampered=sorted({*moved, *unrestored}), problems=journal.problems(), ran=spawn_error is None),
        )
    if spawn_error is not None:
        exc = ProposalError(RequestCode.SPAWN_FAILED, f"{entry.program!r} could not start: {spawn_error}")
        journal.append(
            "run-request-refused", {**_refusal_row(req.agent, list(req.argv), exc), "start_row": start_row},
            request_id,
        )
        raise exc
    if moved:
        problems = journal.problems()
        raise LedgerTamperedError(
            f"{moved} changed while {entry.name!r} ran; nothing more is recorded for request {request_id}"
            + (f"; put back: {rolled_back}" if rolled_back else "")
            + (f"; ledger verify: {problems[:3]}" if problems else ""),
            _tampered(plan, done, before, run, request_id, outside, rolled_back, pins.unpinned,
                      tampered=moved, problems=problems),
        )
    after = snapshot.take(plan.plane.project, plan.watch, reference=before)
    changes = snapshot.diff(before, after)
    result = _result(plan, done, changes, run, request_id, outside, rolled_back, pins.unpinned)
    undeclared = result.undeclared_writes
    row = {
        "start_row": start_row, "agent": req.agent, "entry": entry.name, "exit": result.exit,
        "code": result.code.value, "timed_out": result.timed_out, "duration_ms": result.duration_ms,
        "truncated": result.truncated, "changed": result.changed[:200], "undeclared_writes": undeclared[:200],
        "rolled_back": rolled_back[:50], "exposed": result.exposed,
    }
    if undeclared:
        journal.append("run-request-undeclared-writes", row, request_id)
        raise UndeclaredWritesError(
            f"{entry.name!r} changed {len(undeclared)} undeclared path(s): {undeclared[:10]}", result
        )
    journal.append("run-request-end", row, request_id)
    return result


def run_request(
    request: CommandRequest | Mapping[str, Any],
    *,
    project: str | os.PathLike[str],
    policy: Allowlist | str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    confine: bool = False,
    timeout_cap: float | None = None,
    expect_agent: str | None = None,
    refuse_agents: Collection[str] = frozenset(),
    ledger: Ledger | None = None,
    runner: ProcessRunner | None = None,
) -> CommandResult:
    """Check, run and account for one command request.

    `policy`: a loaded Allowlist, or its file (default `$PROCTOR_HOME/commands.toml`). `ledger`: default
    `Ledger.default()`, opened only when a row is written. Raises ProposalError (refused; recorded unless
    dry_run), UndeclaredWritesError (ran; recorded; `.result` attached) or LedgerTamperedError (nothing more
    recorded; `.result` attached, `ran` true, when the command ran and changed the control plane; none when
    the ledger's chain was already broken, and then nothing ran). A dry run runs every check, then returns
    `ran=False, code=DRY_RUN` without running or recording.
    """
    if timeout_cap is not None and not timeout_cap > 0:
        raise ValueError(f"timeout_cap must be positive seconds, not {timeout_cap!r}")
    journal = Journal(ledger, record=not dry_run)
    try:
        try:
            plan = _prepare(
                request, project=project, policy=policy, confine=confine, timeout_cap=timeout_cap,
                expect_agent=expect_agent, refuse_agents=refuse_agents, journal=journal,
            )
        except ProposalError as exc:
            agent, argv = _agent_and_argv(request)
            journal.append("run-request-refused", _refusal_row(agent, argv, exc, project=os.fspath(project)))
            raise
        if dry_run:
            return plan.result(code=RequestCode.DRY_RUN, dry_run=True)
        return _execute(plan, journal, runner or LocalRunner())
    finally:
        journal.close()
