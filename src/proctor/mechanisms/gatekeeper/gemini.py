"""Gemini CLI 0.61's hook dialect for the job's gate service (proctor.mechanisms.gatekeeper.service).

Every tool call gemini makes runs its BeforeTool hooks first, then its policy engine (measured: the hook
cannot grant, only deny; research/gating.md). For one job only, never the user's ~/.gemini:

- the hooks (BeforeTool -> the gate; SessionStart -> "armed") are in a **system settings** file in the
  job's gate dir, named by `GEMINI_CLI_SYSTEM_SETTINGS_PATH`. The user's own settings and credentials
  (~/.gemini) still load below it, so auth survives. Gemini reads that file only when it and every ancestor
  directory are owned by uid 0 and not group/other-writable. The gate dir (under the host's /tmp) passes
  only inside bubblewrap's private /tmp, so when it does not pass as the host sees it, gemini is pointed at
  a root-owned copy under /var/cache, which loads in every confinement mode (`env`). Not root: no copy
  can be made, no hook runs, and the first tool call ends the run BYPASS.
- a **policy** file (`--policy {gate_dir}/gemini-policy.toml`, user tier; it replaces ~/.gemini/policies
  for the run) compiled from the declaration: the declared, permitted tools allowed; the declared tools
  the task or the trusted policy does not permit denied with the gate's code; every other tool denied,
  `[proctor TOOL_UNDECLARED]`. Its denials carry an `argsPattern`, so the tools stay registered and every
  call still reaches the hook (one ledger row per call, the model hears the gate's reason); the policy is
  the static backstop when a hook does not run. It beats `--approval-mode yolo`'s allow-all.
- gemini runs a hook that crashes, is killed or prints garbage as an **allow** (exit 1 and any non-JSON
  text with exit 0 allow). So the BeforeTool command is wrapped: the client under `timeout -s KILL`, and
  any exit but 0 becomes exit 2 with `[proctor GATE_UNAVAILABLE]` on stderr, which gemini blocks on.
  What stays open: gemini's own hook timeout (an allow) if the wrapper itself cannot finish in
  HOOK_TIMEOUT_MS; the reconciliation below catches such a call.

Reconciliation: gemini's hook input carries no call id, so a call is named `<tool>#<n>` (the n-th hooked
call of that tool); its `--output-format stream-json` output names each call's `tool_result` the same way,
counting only calls that reached the hook stage (not `tool_not_registered` / `invalid_tool_params`, which
gemini rejects before any hook). A tool that ran with no gate row shows up as an unmatched name.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proctor.mechanisms.gatekeeper.dialect import Answer
from proctor.mechanisms.gatekeeper.gemini_glob import GlobError, glob_roots
from proctor.mechanisms.policy.gate import CallVerdict, Decision, ToolRule, tool_rules
from proctor.mechanisms.policy.task import Effect

if TYPE_CHECKING:
    from proctor.mechanisms.policy.task import AgentTask
    from proctor.mechanisms.policy.trusted import Policy

# Gemini CLI 0.61's built-in tools (its *_TOOL_NAME constants and the declarations `-p --approval-mode yolo`
# sends its model API, measured) and what each does.
GEMINI_TOOLS: dict[str, tuple[Effect, bool]] = {
    "run_shell_command": (Effect.shell, False),
    # Background shells the shell tool started: reading or listing them is part of the shell capability.
    "list_background_processes": (Effect.shell, False), "read_background_output": (Effect.shell, False),
    "write_file": (Effect.write, False), "replace": (Effect.write, False),
    "read_file": (Effect.read, False), "read_many_files": (Effect.read, False),
    "list_directory": (Effect.read, False), "glob": (Effect.read, False), "grep_search": (Effect.read, False),
    "search_file_content": (Effect.read, False),  # grep_search's legacy name
    "web_fetch": (Effect.network, True), "google_web_search": (Effect.network, True),
    # activate_skill reads the skill's folder (outside the worktree: ~/.gemini/skills) and adds it to
    # gemini's own workspace (measured in the 0.61 bundle, ActivateSkillToolInvocation.execute): a read
    # with no path the gate could confine, so PATHS_REQUIRED refuses it. It runs nothing itself; a skill's
    # scripts run through run_shell_command, which is gated.
    "activate_skill": (Effect.read, False),
    # A subagent's own tool calls pass the same hook (research/gating.md "Coverage").
    "invoke_agent": (Effect.none, False),
    "update_topic": (Effect.none, False), "write_todos": (Effect.none, False),
    "enter_plan_mode": (Effect.none, False), "exit_plan_mode": (Effect.none, False),
    "complete_task": (Effect.none, False), "get_internal_docs": (Effect.none, False),
    "ask_user": (Effect.none, False),
    **{f"tracker_{n}": (Effect.none, False) for n in ("create_task", "update_task", "get_task", "list_tasks",
                                                       "add_dependency", "visualize")},
}
# Where each tool names its paths in tool_input (0.61's parameter schemas): a file, a directory (the shell's
# cwd included); the glob tools' patterns are walked by gemini_glob.glob_roots.
PATH_KEYS = ("file_path", "dir_path", "absolute_path", "path")
PATH_LIST_KEYS = ("paths",)
GLOB_LIST_KEY = "include"  # read_many_files: glob patterns, not paths (GeminiDialect._glob_paths)
# Tools that act on the workspace when they name no path.
CWD_TOOLS = frozenset({"list_directory", "glob", "grep_search", "search_file_content", "read_many_files"})
# tool_result error types gemini gives a call it rejected before running any hook (scheduler: the tool is
# not registered, or its arguments do not build): such a call never ran and was never asked of the gate.
# (`invalid_tool_params` also follows a user's hook that rewrote a call into arguments that do not build:
# hooked but not counted, so it can hide one later unhooked call of that tool from the count.)
BEFORE_HOOKS = frozenset({"tool_not_registered", "invalid_tool_params"})

HOOK_TIMEOUT_MS = 60_000  # gemini's own hook timeout (its default); a timeout there is an allow
KILL_AFTER_S = 30  # the wrapper kills the client after this (the client itself gives up at 20 s)
POLICY_FILE = "gemini-policy.toml"
# A policy toolName gemini reads literally: no wildcard (`*`), nothing TOML or a regex could misread.
_LITERAL = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class GeminiDialect:
    """Gemini CLI 0.61's BeforeTool/SessionStart hooks (system settings file + `--policy`, stream-json)."""

    name = "gemini"
    tools = GEMINI_TOOLS
    # The lines of its output stream `tool_uses` reads (GateService.watch): calls and their results.
    stream_marks = (b'"tool_use"', b'"tool_result"')
    kill_after_s = KILL_AFTER_S

    def __init__(self) -> None:
        self._rules: dict[str, ToolRule] | None = None
        self._lock = threading.Lock()
        self._hooked: dict[str, int] = {}  # tool -> hooked calls so far (the gate's call ids)
        self._streamed: dict[str, int] = {}  # tool -> calls the stream showed reaching the hook stage
        self._names: dict[str, str] = {}  # stream tool_id -> tool name

    def bind(self, task: AgentTask, policy: Policy) -> None:
        """The job's declaration, before `files()`: the policy file is compiled from it."""
        self._rules = tool_rules(task, policy)

    # --- one call ------------------------------------------------------------------------------------

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]:
        tool = str(payload.get("tool_name", ""))
        raw = payload.get("tool_input")
        args: dict[str, Any] = raw if isinstance(raw, dict) else {}
        paths = [str(args[k]) for k in PATH_KEYS if isinstance(args.get(k), str) and args[k]]
        for k in PATH_LIST_KEYS:
            if isinstance(args.get(k), list):
                paths += [str(p) for p in args[k] if isinstance(p, str) and p]
        try:
            paths += self._glob_paths(tool, args, worktree)
            unparsed = ""
        except GlobError as exc:
            unparsed = f"gemini's glob: {exc}"
        if not paths and tool in CWD_TOOLS:
            paths = [str(worktree)]
        with self._lock:
            n = self._hooked[tool] = self._hooked.get(tool, 0) + 1
        call = {"tool": tool, "arguments": args, "paths": paths, "call_id": f"{tool}#{n}"}
        return {**call, "unparsed": unparsed} if unparsed else call

    @staticmethod
    def _glob_paths(tool: str, args: dict[str, Any], worktree: Path) -> list[str]:
        """Where a glob tool's patterns walk from (glob_roots), each a path the gate checks: `glob`'s
        pattern below its dir_path (the worktree without one), read_many_files' `include` patterns below
        the worktree, with backslashes made slashes first as that tool does."""
        if tool == "glob":
            pattern = args.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                return []
            patterns, base = [pattern], posixpath.join(str(worktree), str(args.get("dir_path") or ""))
        elif tool == "read_many_files" and isinstance(args.get(GLOB_LIST_KEY), list):
            patterns = [p.replace("\\", "/") for p in args[GLOB_LIST_KEY] if isinstance(p, str) and p]
            base = str(worktree)
        else:
            return []
        found: list[str] = []
        for p in patterns:
            # A pattern naming an existing path is taken literally (escaped) by both tools: that path too.
            found += [*glob_roots(p, base), posixpath.normpath(posixpath.join(base, p))]
        return list(dict.fromkeys(found))

    def answer(self, d: Decision) -> Answer:
        if d.verdict is CallVerdict.run:
            return Answer(json.dumps({"decision": "allow"}))
        # The model sees "Tool execution blocked: <reason>" (measured).
        return Answer(json.dumps({"decision": "deny", "reason": f"[proctor {d.code.value}] {d.reason}"}))

    # --- installing the hook for one job -------------------------------------------------------------

    def files(self, hook: list[str], dir: Path) -> dict[str, str]:
        """The system settings file (the hooks) and the policy file, relative to the gate dir."""
        return {f"{self.name}-settings.json": json.dumps(self.settings(hook, dir), indent=1),
                POLICY_FILE: self.policy_toml()}

    def settings(self, hook: list[str], dir: Path) -> dict[str, Any]:
        # No `name`: a hook is known by its command, which holds the job's random gate dir, so a repo's own
        # `hooksConfig.disabled` (a union over every settings layer) cannot name it in advance.
        def entry(event: str, command: str, **extra: Any) -> dict[str, Any]:
            return {"matcher": "*", **extra, "hooks": [{"type": "command", "command": command,
                                                        "timeout": HOOK_TIMEOUT_MS}]}

        session = self._killed_after(" ".join(shlex.quote(a) for a in [*hook, "SessionStart"]))
        # Sequential: BeforeTool lists concatenate with system settings last, so a user's own hook in
        # ~/.gemini runs before ours, and one that rewrites tool_input has the gate decide the rewritten
        # arguments (measured). A repo's `.gemini/settings.json` is not merged at all under --skip-trust
        # (measured on 0.61: its hooks, hooksConfig and tools.core took no effect).
        # `privacy.usageStatisticsEnabled` off (gemini's documented switch; no flag or variable has it): 0.61
        # otherwise posts its usage statistics to play.googleapis.com twice a run, measured as refused egress
        # rows. This file outranks ~/.gemini's, which is never written.
        return {"hooksConfig": {"enabled": True},
                "hooks": {"BeforeTool": [entry("BeforeTool", self.guarded(hook), sequential=True)],
                          "SessionStart": [entry("SessionStart", session)]},
                "privacy": {"usageStatisticsEnabled": False}}

    def guarded(self, hook: list[str]) -> str:
        """The BeforeTool command: the client (told the gate's event name), killed after kill_after_s, and
        any failure of it an exit 2 with the reason on stderr (gemini's blocking form)."""
        client = self._killed_after(" ".join(shlex.quote(a) for a in [*hook, "PreToolUse"]))
        unavailable = shlex.quote("[proctor GATE_UNAVAILABLE] the gate's hook failed (exit ")
        return f"{client} || {{ rc=$?; [ $rc -eq 2 ] || echo {unavailable}\"$rc)\" >&2; exit 2; }}"

    def _killed_after(self, command: str) -> str:
        # A hung SessionStart hook holds gemini's start for its whole hook timeout (measured: 60 s).
        timeout = shutil.which("timeout")
        return f"{shlex.quote(timeout)} -s KILL {int(self.kill_after_s)} {command}" if timeout else command

    def policy_toml(self) -> str:
        lines = ["# proctor: this job's declared task as gemini policy rules (user tier). A deny has an",
                 "# argsPattern, so the tool stays registered and each call still reaches proctor's hook (a",
                 "# global deny would unregister it). An allow has none: with one, gemini denies a shell command",
                 "# its parser cannot read in yolo mode; the gate decides those.", ""]

        def rule(tool: str, decision: str, priority: int, message: str = "") -> None:
            lines.extend(["[[rule]]", f"toolName = {_toml(tool)}", f'decision = "{decision}"',
                          f"priority = {priority}"])
            lines.extend([f"denyMessage = {_toml(message)}", 'argsPattern = ".*"'] if message else
                         ["allowRedirection = true"])
            lines.append("")

        rule("*", "deny", 990, "[proctor TOOL_UNDECLARED] the job's declared task does not name this tool")
        for r in (self._rules or {}).values():
            if not _LITERAL.match(r.name):
                continue  # the catch-all denies it; the gate still decides it first
            if r.denial is not None:
                rule(r.name, "deny", 999, f"[proctor PERMISSION] {r.denial}")
            elif r.effect_forbidden:
                rule(r.name, "deny", 999, f"[proctor POLICY_BLOCKED] the trusted policy forbids effect "
                                          f"{r.effect.value!r}")
            else:
                rule(r.name, "allow", 995)
        return "\n".join(lines)

    def env(self, dir: Path) -> dict[str, str]:
        """GEMINI_CLI_SYSTEM_SETTINGS_PATH: the settings file in the gate dir when gemini will load it there,
        else a root-owned copy (system_copy). Gemini skips a system settings file unless it and every
        ancestor are uid 0 and not group/other-writable (checkPosixStatsSecurity, 0.61 bundle): the gate
        dir sits under the host's /tmp (mode 1777), which only bubblewrap's private /tmp hides, so with
        `--confine off` (or Landlock alone) the hooks never loaded and the first call ended BYPASS (issue 22).
        The copy is under the host's /var/cache, which bubblewrap shows read-only at the same path: one
        path that loads in every confinement mode."""
        settings = dir / f"{self.name}-settings.json"
        if system_file_loads(settings):
            return {"GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(settings)}
        copy = system_copy(settings)
        return {"GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(copy or settings)}

    # --- its own output stream -----------------------------------------------------------------------

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(`<tool>#<n>`, tool) of every call gemini's stream-json shows past its pre-hook checks, named as
        `call()` names the hooked calls of that tool."""
        found = []
        # Split on newlines only: str.splitlines also splits on U+2028, which a CLI's JSON carries raw
        # (Node's JSON.stringify), so a tool call holding one was never read (issue 22).
        for line in stdout.split("\n"):
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if not isinstance(ev, dict):
                continue
            tool_id = str(ev.get("tool_id", ""))
            if ev.get("type") == "tool_use":
                self._names[tool_id] = str(ev.get("tool_name", ""))
            elif ev.get("type") == "tool_result":
                err = ev.get("error")
                if isinstance(err, dict) and err.get("type") in BEFORE_HOOKS:
                    continue
                name = self._names.get(tool_id, "?")
                with self._lock:
                    n = self._streamed[name] = self._streamed.get(name, 0) + 1
                found.append((f"{name}#{n}", name))
        return found


# Where the root-owned copies of job settings go (one dir per gate dir); removed once their gate dir is.
SYSTEM_COPIES = Path("/var/cache/proctor-gate")
_COPY_MARK = "gate-dir"


def system_file_loads(path: Path) -> bool:
    """Whether gemini 0.61 loads `path` as a system settings file as this process sees it: the file and
    every ancestor (as named and as resolved) owned by uid 0 and not group/other-writable."""
    try:
        real = Path(os.path.realpath(path))
        for p in dict.fromkeys([path, *path.parents, real, *real.parents]):
            st = os.stat(p)
            if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
        return not path.is_symlink() or os.lstat(path).st_uid == 0
    except OSError:
        return False


def system_copy(settings: Path, root: Path = SYSTEM_COPIES) -> Path | None:
    """A root-owned, read-only copy of `settings` under `root` that gemini loads, or None when this process
    cannot make one (not root: then nothing can, and a gemini job it runs unconfined ends BYPASS). Copies
    whose gate dir is gone are removed first (the host removes a job's gate dir when the job ends)."""
    if os.geteuid() != 0:
        return None
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        for old in root.iterdir():
            mark = old / _COPY_MARK
            if mark.is_file() and not Path(mark.read_text()).exists():
                shutil.rmtree(old, ignore_errors=True)
        gate_dir = settings.parent
        slot = root / hashlib.sha256(str(gate_dir).encode()).hexdigest()[:24]
        slot.mkdir(mode=0o755, exist_ok=True)
        os.chmod(slot, 0o755)
        (slot / _COPY_MARK).write_text(str(gate_dir))
        target = slot / settings.name
        tmp = slot / f".{settings.name}.tmp"
        tmp.write_text(settings.read_text())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError:
        return None
    return target if system_file_loads(target) else None


def _toml(s: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's; non-ASCII kept as is, never a surrogate escape)."""
    return json.dumps(s, ensure_ascii=False)
