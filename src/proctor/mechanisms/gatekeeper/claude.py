"""Claude Code's hook dialect for a job's gate service: its built-in tools and what each does, its PreToolUse
hook JSON as the gate's call, the gate's decision as its answer, the settings file that installs the hook
for one job (`--settings`, `--setting-sources ''`, `dontAsk`), and the tool calls its stream-json shows.

It never decides a call (the gate does) and never speaks to the socket (the hook client does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proctor.mechanisms.gatekeeper.dialect import Answer, reason, settings_path
from proctor.mechanisms.gatekeeper.hook import HOOK_TIMEOUT_S, shell_word
from proctor.mechanisms.gatekeeper.stream import json_events
from proctor.mechanisms.policy.gate import CallVerdict, Decision
from proctor.mechanisms.policy.task import Effect
from proctor.mechanisms.validation.capped import read_capped

# Claude Code's built-in tools (2.1.197 and 2.1.332) and what each does; a name missing here is UNKNOWN
# (gatekeeper.task: `shell`, online) and, when claude's init event announces it, a risk on the job; how each row was determined is in docs/concepts/gate.md's
# gate table (research/gating.md "Coverage", its -p tool list, the binary's strings, the docs). A tool that
# can run a command is `shell` whatever its name: `Skill` ran a skill's embedded `!`git ...`` itself with no
# Bash row (issue 22, item 4); LSP starts language-server programs; EnterWorktree/ExitWorktree run git
# itself.
CLAUDE_TOOLS: dict[str, tuple[Effect, bool]] = {
    "Bash": (Effect.shell, False), "BashOutput": (Effect.shell, False), "KillShell": (Effect.shell, False),
    "TaskOutput": (Effect.shell, False), "TaskStop": (Effect.shell, False), "Monitor": (Effect.shell, False),
    "PowerShell": (Effect.shell, False), "Skill": (Effect.shell, False), "LSP": (Effect.shell, False),
    "EnterWorktree": (Effect.shell, False), "ExitWorktree": (Effect.shell, False),
    "Write": (Effect.write, False), "Edit": (Effect.write, False), "MultiEdit": (Effect.write, False),
    "NotebookEdit": (Effect.write, False),
    "Read": (Effect.read, False), "Glob": (Effect.read, False), "Grep": (Effect.read, False),
    "LS": (Effect.read, False), "NotebookRead": (Effect.read, False),
    "WebFetch": (Effect.network, True), "WebSearch": (Effect.network, True),
    "RemoteTrigger": (Effect.network, True),
    # A workflow runs a script of sub-agents, each with the shell and file tools. Its sub-agents' own calls
    # pass the hook; their transcripts show them (`journal`, reconciled).
    "Workflow": (Effect.shell, False),
    # Messages to and a list of other sessions, a cloud one included (the binary's strings: "a cloud session
    # receives your message"); DesignSync syncs with claude.ai's design service.
    "SendMessage": (Effect.send, True), "ListAgents": (Effect.network, True), "DesignSync": (Effect.network, True),
    # A sub-agent's own calls pass the same hook (research/gating.md "Coverage"); the rest only plan,
    # ask, schedule a prompt or keep a list inside the session.
    "Task": (Effect.none, False), "Agent": (Effect.none, False), "TodoWrite": (Effect.none, False),
    "ExitPlanMode": (Effect.none, False), "EnterPlanMode": (Effect.none, False),
    "AskUserQuestion": (Effect.none, False), "ToolSearch": (Effect.none, False),
    **{n: (Effect.none, False) for n in ("TaskCreate", "TaskUpdate", "TaskList", "TaskGet", "CronCreate",
                                          "CronDelete", "CronList", "ScheduleWakeup", "ReportFindings")},
}

# A job's sub-agent transcripts read for reconciliation (`journal`): how many, and how large each.
JOURNAL_FILES = 1000
JOURNAL_CAP = 64 << 20

# Where each file tool names its path in tool_input; a read tool without one acts on the workspace.
CLAUDE_PATH_KEYS = ("file_path", "notebook_path", "path")


class ClaudeDialect:
    """Claude Code's PreToolUse/SessionStart hooks (`--settings`, `--setting-sources ''`, `dontAsk`)."""

    name = "claude"
    tools = CLAUDE_TOOLS

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]:
        tool = str(payload.get("tool_name", ""))
        args = payload.get("tool_input") if isinstance(payload.get("tool_input"), dict) else {}
        paths = [str(args[k]) for k in CLAUDE_PATH_KEYS if isinstance(args.get(k), str) and args.get(k)]
        effect = self.tools.get(tool, (None, False))[0]
        if not paths and effect in (Effect.read, Effect.write):
            paths = [str(worktree)]  # Glob/Grep/LS with no path act on the cwd: the worktree
        return {"tool": tool, "arguments": args, "paths": paths, "call_id": str(payload.get("tool_use_id", ""))}

    def answer(self, d: Decision) -> Answer:
        allow = d.verdict is CallVerdict.run
        out = {"hookSpecificOutput": {"hookEventName": "PreToolUse",
                                      "permissionDecision": "allow" if allow else "deny",
                                      "permissionDecisionReason": reason(d)}}
        return Answer(json.dumps(out))

    def files(self, hook: list[str], dir: Path) -> dict[str, str]:
        """The files that install the hook for one job, relative to the gate dir (`{gate_dir}` in gate_args)."""
        def entry(event: str) -> dict[str, Any]:
            command = " ".join(shell_word(a) for a in [*hook, event])
            return {"matcher": "*", "hooks": [{"type": "command", "command": command, "timeout": HOOK_TIMEOUT_S}]}

        settings = {"hooks": {"PreToolUse": [entry("PreToolUse")], "SessionStart": [entry("SessionStart")]}}
        return {settings_path(dir, self.name).name: json.dumps(settings, indent=1)}

    def env(self, dir: Path) -> dict[str, str]:
        """Variables the agent's CLI needs to find its hook (none for claude: its args name the file)."""
        return {}

    # The stream lines `tool_uses` and `announced` read (GateService._take).
    stream_marks = (b'"tool_use"', b'"init"')

    def announced(self, stdout: str) -> list[str]:
        """The tools claude says it has, deferred ones included: its `system/init` event's `tools`."""
        return [str(t) for ev in json_events(stdout, '"init"') if ev.get("type") == "system"
                and ev.get("subtype") == "init" for t in ev.get("tools") or [] if isinstance(t, str)]

    def journal(self, home: Path) -> tuple[list[tuple[str, str]], list[str]]:
        """The tool calls of the sub-agents a Workflow ran, from their transcripts in the job's copy of
        ~/.claude (`projects/<dir>/<session>/subagents/**/agent-*.jsonl`; `projects` is never copied in, so
        every one is this job's): 2.1.332's stream shows none of them, `--forward-subagent-text` or not
        (measured), while each passed the hook. (tool_use id, name) as `tool_uses` gives them, and the
        transcripts too large, too many or odd to read whole (their calls cannot be reconciled)."""
        found: list[tuple[str, str]] = []
        paths = sorted((home / ".claude" / "projects").glob("*/*/subagents/**/agent-*.jsonl"))
        unread = [f"{len(paths) - JOURNAL_FILES} past the first {JOURNAL_FILES}"] if len(paths) > JOURNAL_FILES else []
        for path in paths[:JOURNAL_FILES]:
            data = read_capped(path, JOURNAL_CAP)
            if data is None:
                unread.append(path.name)
                continue
            found += self.tool_uses(data.decode("utf-8", "replace"))
        return found, unread

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(tool_use id, tool name) of every tool call in claude's stream-json output (an Agent sub-agent's
        too, an assistant message with `parent_tool_use_id` set) or in a transcript of its (`journal`)."""
        found = []
        for ev in json_events(stdout, '"tool_use"'):
            msg = ev.get("message") if ev.get("type") == "assistant" else None
            for part in (msg or {}).get("content") or [] if isinstance(msg, dict) else []:
                if isinstance(part, dict) and part.get("type") == "tool_use":
                    found.append((str(part.get("id", "")), str(part.get("name", ""))))
        return found
