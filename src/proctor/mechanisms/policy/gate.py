"""The gate: decides every tool call of a declared task before it runs, with a stable code and a reason.

Owns the order of checks and their codes (`GateCode`), and the per-run count of granted calls. It never runs
a tool, never writes the ledger (a caller may pass `on_decision` to record each decision before it takes
effect) and never raises for a bad task or call: those are refusals too.

Order of checks, first failure wins (stable, documented, part of the contract):

    STOPPED            the stop switch is engaged
    TASK_INVALID       the task is not a valid AgentTask (unknown fields included)
    CALL_INVALID       the call is not a valid ToolCall, reuses a call id of this run, or its CLI's input
                       cannot be parsed completely the way that CLI parses it (`UNPARSED`)
    WORKSPACE          the task's workspace breaks the trusted workspace rule
    TOOL_UNDECLARED    the task declares no tool of that name
    PERMISSION         the tool's effect is not granted, or it is online without `network`
    PATHS_REQUIRED     a file tool (read/write/delete) names no path
    OUTSIDE_WORKSPACE  a path resolves (`..` and symlinks followed) outside the workspace
    TOOL_LIMIT         the run already had its effective max_tool_calls granted
    POLICY_BLOCKED     the trusted policy forbids the effect or a path
    APPROVAL_REQUIRED  the trusted policy holds the effect for a person, and no one-time grant covers the call

A call that passes is `dry_run` when its tool is outward (an outward effect, or online) and the run is not
explicitly live, else `run`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import (
    FILE_EFFECTS,
    NETWORK_EFFECTS,
    OUTWARD,
    PERMISSION_FOR,
    AgentTask,
    Effect,
    ToolCall,
)
from proctor.mechanisms.policy.trusted import Ceilings, Policy, PolicyError, check_workspace


# The key under which a CLI dialect hands the gate a call whose input it could not parse completely
# (Gate.decide refuses it CALL_INVALID, with the reason given there).
UNPARSED = "unparsed"


class GateCode(StrEnum):
    """Stable codes of a gate decision; additive only, never renamed."""

    OK = "OK"
    STOPPED = "STOPPED"
    TASK_INVALID = "TASK_INVALID"
    CALL_INVALID = "CALL_INVALID"
    WORKSPACE = "WORKSPACE"
    TOOL_UNDECLARED = "TOOL_UNDECLARED"
    PERMISSION = "PERMISSION"
    PATHS_REQUIRED = "PATHS_REQUIRED"
    OUTSIDE_WORKSPACE = "OUTSIDE_WORKSPACE"
    TOOL_LIMIT = "TOOL_LIMIT"
    POLICY_BLOCKED = "POLICY_BLOCKED"
    APPROVAL_REQUIRED = "APPROVAL_REQUIRED"


class CallVerdict(StrEnum):
    run = "run"
    dry_run = "dry_run"
    refused = "refused"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the gate decided for one call. `code` is OK exactly when the verdict is not `refused`.

    A plain frozen dataclass, not a pydantic model: it is made on the hot path and never parsed from input.
    """

    verdict: CallVerdict
    code: GateCode
    reason: str
    tool: str = ""
    call_id: str = ""
    effect: Effect | None = None
    outward: bool = False
    paths: tuple[str, ...] = ()
    """For a granted call, its paths as resolved when decided: a tool should act on these, not the asked
    ones, so a symlink swapped in after the decision cannot redirect it."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value, "code": self.code.value, "reason": self.reason, "tool": self.tool,
            "call_id": self.call_id, "effect": self.effect.value if self.effect else None, "outward": self.outward,
            "paths": list(self.paths),
        }


def _invalid_message(exc: ValidationError, what: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or what
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{what} invalid: {loc}: {err['msg']}{more}"


@dataclass(frozen=True, slots=True)
class ToolRule:
    """A declared tool as the gate sees it, computed once per task."""

    name: str
    effect: Effect
    online: bool
    denial: str | None
    """Why the task's permissions do not grant this tool, or None when they do."""
    outward: bool
    needs_network: bool
    file_tool: bool
    effect_forbidden: bool
    """The trusted policy forbids this tool's effect."""
    needs_approval: bool = False
    """The trusted policy holds this tool's effect for a person."""


def tool_rules(task: AgentTask, policy: Policy) -> dict[str, ToolRule]:
    rules = {}
    perms = task.permissions
    for t in task.tools:
        flag = PERMISSION_FOR[t.effect]
        needs_network = t.online or t.effect in NETWORK_EFFECTS
        denial = None
        if flag is not None and not getattr(perms, flag):
            denial = f"tool {t.name!r} has effect {t.effect.value!r}, which needs permission {flag!r}"
        elif t.online and not perms.network:
            denial = f"tool {t.name!r} is online, which needs permission 'network'"
        rules[t.name] = ToolRule(
            name=t.name,
            effect=t.effect,
            online=t.online,
            denial=denial,
            outward=t.effect in OUTWARD or t.online,
            needs_network=needs_network,
            file_tool=t.effect in FILE_EFFECTS,
            effect_forbidden=t.effect in policy.forbidden_effects,
            needs_approval=t.effect in policy.approval_effects,
        )
    return rules


def path_matcher(patterns: tuple[str, ...]) -> Callable[[str, str], str | None]:
    """A function (relative, absolute) -> the first forbidden pattern the path matches, or None (the gate
    checks each call's paths with it, policy.diffcheck the job's changed files)."""
    component = [(p, re.compile(fnmatch.translate(p))) for p in patterns if "/" not in p]
    absolute = [(p, re.compile(fnmatch.translate(p.rstrip("/")))) for p in patterns if p.startswith("/")]
    relative = [
        (p, re.compile(fnmatch.translate(p.strip("/")))) for p in patterns if "/" in p and not p.startswith("/")
    ]

    def match(rel: str, absolute_path: str) -> str | None:
        if component:
            for part in rel.split("/"):
                for pat, rx in component:
                    if rx.match(part):
                        return pat
        for pat, rx in relative:
            if rx.match(rel):
                return pat
        for pat, rx in absolute:
            if rx.match(absolute_path) or absolute_path.startswith(pat.rstrip("/") + "/"):
                return pat
        return None

    return match


class Gate:
    """Decides the calls of one run of `task`. Counts granted calls against the effective max_tool_calls.

    `Gate(task, *, policy, dry_run=True, stop=None, on_decision=None)`:
    - `policy`: the trusted policy (ceilings, forbidden effects and paths).
    - `dry_run`: False only for an explicitly live run; outward calls are `dry_run` otherwise.
    - `stop`: returns a reason while stopped; None means the `StopSwitch` of `$PROCTOR_HOME`.
    - `on_decision`: called with every decision before it takes effect (the runtime records it in the
      ledger there). If it raises, the exception propagates and the call is not granted.
    - `approved`: for a call whose effect the policy holds for a person, the one-time grant that covers it
      (a description), or None; None as the callable: nothing is ever approved.
    """

    def __init__(
        self,
        task: AgentTask,
        *,
        policy: Policy,
        dry_run: bool = True,
        stop: Callable[[], str | None] | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        approved: Callable[[ToolCall], str | None] | None = None,
    ) -> None:
        self.task = task
        self._approved = approved
        self.policy = policy
        self.dry_run = dry_run
        self.limits: Ceilings = policy.ceilings.cap(task)
        self._stop = stop if stop is not None else StopSwitch().reason
        self._on_decision = on_decision
        self._rules = tool_rules(task, policy)
        self._workspace_problem = check_workspace(task.permissions.workspace)
        self._ws = os.path.realpath(task.permissions.workspace) if self._workspace_problem is None else ""
        self._ws_prefix = self._ws.rstrip("/") + "/"
        self._forbidden_path = path_matcher(policy.forbidden_paths) if policy.forbidden_paths else None
        # Verdicts only, not decisions: a long run keeps one small entry per call id (cheaper for the GC).
        self._decided: dict[str, CallVerdict] = {}
        self._granted = 0

    @property
    def granted_calls(self) -> int:
        """How many calls this gate let run or dry-run so far."""
        return self._granted

    def verdict_for(self, call_id: str) -> CallVerdict | None:
        """The verdict this gate gave `call_id`, or None when it never saw that id."""
        return self._decided.get(call_id)

    def decide(self, call: ToolCall | Mapping[str, Any]) -> Decision:
        decision = self._decide(call)
        if self._on_decision is not None:
            self._on_decision(decision)
        # A refused reuse of an id must not overwrite the decision that id first got.
        if decision.call_id and decision.call_id not in self._decided:
            self._decided[decision.call_id] = decision.verdict
            if decision.verdict is not CallVerdict.refused:
                self._granted += 1
        return decision

    def _decide(self, call: ToolCall | Mapping[str, Any]) -> Decision:
        stopped = self._stop()
        if stopped is not None:
            return _refuse(GateCode.STOPPED, f"stopped: {stopped}", call)
        unparsed = ""
        if not isinstance(call, ToolCall):
            # A CLI dialect that cannot read a tool's input the way its CLI will (a patch, a glob) says why
            # under `unparsed`: the call is refused, never decided on a guess of what it would touch.
            if isinstance(call, Mapping) and UNPARSED in call:
                unparsed = str(call[UNPARSED])[:300] or "unreadable"
                call = {k: v for k, v in call.items() if k != UNPARSED}
            try:
                call = ToolCall.model_validate(call)
            except ValidationError as exc:
                return _refuse(GateCode.CALL_INVALID, _invalid_message(exc, "call"), None)
        call_id = call.call_id or self._fresh_id()
        if call_id in self._decided:
            return _refuse(GateCode.CALL_INVALID, f"call id {call_id!r} was already decided in this run", call)
        if unparsed:
            return _refuse(GateCode.CALL_INVALID, f"the tool's input cannot be read the way the CLI reads it "
                                                  f"({unparsed}): refused rather than guessed at", call, call_id)
        if self._workspace_problem is not None:
            return _refuse(GateCode.WORKSPACE, self._workspace_problem, call, call_id)
        rule = self._rules.get(call.tool)
        if rule is None:
            return _refuse(GateCode.TOOL_UNDECLARED, f"tool {call.tool!r} is not declared by the task", call, call_id)

        def refuse(code: GateCode, reason: str) -> Decision:
            return _refuse(code, reason, call, call_id, rule)

        if rule.denial is not None:
            return refuse(GateCode.PERMISSION, rule.denial)
        if rule.file_tool and not call.paths:
            return refuse(GateCode.PATHS_REQUIRED, f"tool {rule.name!r} acts on files but the call names no path")
        resolved = []
        for p in call.paths:
            rel = self._inside(p)
            if rel is None:
                return refuse(GateCode.OUTSIDE_WORKSPACE, f"path {p!r} resolves outside the workspace {self._ws!r}")
            resolved.append(rel)
        if self._granted >= self.limits.max_tool_calls:
            return refuse(GateCode.TOOL_LIMIT, self.limits.check_tool_calls(self._granted + 1) or "")
        if rule.effect_forbidden:
            return refuse(GateCode.POLICY_BLOCKED, f"the trusted policy forbids effect {rule.effect.value!r}")
        absolute = tuple(self._ws_prefix + rel if rel else self._ws for rel in resolved)
        if self._forbidden_path is not None:
            for p, rel, full in zip(call.paths, resolved, absolute):
                pat = self._forbidden_path(rel, full)
                if pat is not None:
                    return refuse(GateCode.POLICY_BLOCKED, f"the trusted policy forbids path {p!r} (pattern {pat!r})")
        grant = None
        if rule.needs_approval:
            grant = self._approved(call) if self._approved is not None else None
            if grant is None:
                return refuse(GateCode.APPROVAL_REQUIRED, f"the trusted policy holds effect {rule.effect.value!r} "
                                                          f"for a person: `proctor approve JOB {call_id}`")
        if grant is not None:
            verdict, reason = CallVerdict.run, f"approved by a person ({grant})"
        elif rule.outward and self.dry_run:
            verdict, reason = CallVerdict.dry_run, f"outward tool {rule.name!r}: dry run (the run is not live)"
        else:
            verdict, reason = CallVerdict.run, "granted"
        return Decision(
            verdict=verdict, code=GateCode.OK, reason=reason, tool=rule.name, call_id=call_id, effect=rule.effect,
            outward=rule.outward, paths=absolute,
        )

    def _fresh_id(self) -> str:
        n = len(self._decided) + 1
        while f"call-{n}" in self._decided:
            n += 1
        return f"call-{n}"

    def _inside(self, path: str) -> str | None:
        """The workspace-relative form of `path` after resolving `..` and symlinks, or None when outside."""
        if path.startswith("/"):
            if not path.startswith(self._ws_prefix):
                return self._relative(_resolve(path))
            path = path[len(self._ws_prefix):]
        # Fast path, same answer as realpath: the workspace is already resolved, so only the components below
        # it can be symlinks, and `..` after components that are not symlinks is their lexical parent.
        # realpath would lstat every component from `/` (measured ~2x slower). Missing components are not
        # symlinks; like realpath, they are taken lexically.
        cur = self._ws
        marks: list[int] = []
        for part in path.split("/"):
            if not part or part == ".":
                continue
            if part == "..":
                if not marks:
                    # Leaves the workspace (and may come back in by another name): let realpath judge.
                    return self._relative(_resolve(self._ws_prefix + path))
                cur = cur[:marks.pop()]
                continue
            marks.append(len(cur))
            cur = cur + "/" + part
            try:
                mode = os.lstat(cur).st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                return self._relative(_resolve(self._ws_prefix + path))
        return cur[len(self._ws_prefix):] if marks else ""

    def _relative(self, real: str | None) -> str | None:
        if real is None:
            return None
        if real == self._ws:
            return ""
        if real.startswith(self._ws_prefix):
            return real[len(self._ws_prefix):]
        return None


def _resolve(path: str) -> str | None:
    """realpath, except that a path through a symlink loop is None (cannot be shown to be anywhere).

    Non-strict realpath alone mis-resolves loops: on 3.11 `realpath("loop//")` for `loop -> loop` is `/`.
    """
    try:
        return os.path.realpath(path, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        # A missing tail (a file about to be written) is resolved lexically, as the kernel would create it.
        return os.path.realpath(path)
    except OSError:
        return None


def _refuse(
    code: GateCode,
    reason: str,
    call: ToolCall | Mapping[str, Any] | None,
    call_id: str = "",
    rule: ToolRule | None = None,
) -> Decision:
    tool = call.tool if isinstance(call, ToolCall) else ""
    if not call_id and isinstance(call, ToolCall):
        call_id = call.call_id
    return Decision(
        verdict=CallVerdict.refused, code=code, reason=reason, tool=tool, call_id=call_id,
        effect=rule.effect if rule else None, outward=rule.outward if rule else False,
    )


def _coerce_task(task: AgentTask | Mapping[str, Any]) -> AgentTask | str:
    if isinstance(task, AgentTask):
        return task
    try:
        return AgentTask.model_validate(task)
    except ValidationError as exc:
        return _invalid_message(exc, "task")


def decide(
    task: AgentTask | Mapping[str, Any],
    call: ToolCall | Mapping[str, Any],
    *,
    policy: Policy | None = None,
    dry_run: bool = True,
    stop: Callable[[], str | None] | None = None,
) -> Decision:
    """Decide one call with a fresh gate (so nothing counts against the run's tool-call limit). Never raises.

    `policy` defaults to the trusted policy of `$PROCTOR_HOME`; an unusable policy file refuses the call.
    """
    stopped = (stop if stop is not None else StopSwitch().reason)()
    if stopped is not None:
        return _refuse(GateCode.STOPPED, f"stopped: {stopped}", call if isinstance(call, ToolCall) else None)
    checked = _coerce_task(task)
    if isinstance(checked, str):
        return _refuse(GateCode.TASK_INVALID, checked, call if isinstance(call, ToolCall) else None)
    if policy is None:
        try:
            policy = Policy.load()
        except PolicyError as exc:
            return _refuse(GateCode.POLICY_BLOCKED, f"trusted policy unusable: {exc}", None)
    return Gate(checked, policy=policy, dry_run=dry_run, stop=lambda: stopped).decide(call)
