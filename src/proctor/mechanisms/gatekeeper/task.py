"""The task a job's gate decides against: a declared task bound to the job's worktree (`with_workspace`), the
default task of a job that declared none (`default_task`), and each declared tool's effect raised to what the
CLI's tool measurably does (`measured`). It never decides a call; the gate (policy.gate) does.
"""

from __future__ import annotations

from pathlib import Path

from proctor.mechanisms.policy.task import AgentTask, Effect, Permissions, ToolSpec

# Tool names no table lists that run a program of the user's (an MCP server, a gemini discovered tool or
# extension): `shell`, whatever effect a declaration gives them (`measured`).
COMMAND_PREFIXES = ("mcp__", "mcp_", "discovered_tool_")
# The CLIs' MCP resource tools reach those same programs: `shell` when declared, and (no table row) never in
# a default task, as before.
COMMAND_TOOLS = frozenset({"ListMcpResourcesTool", "ReadMcpResourceTool", "read_mcp_resource"})
# A tool the CLI's table does not list, nor COMMAND_PREFIXES name: a new or unlisted built-in, whose effect
# nobody measured. The most dangerous there is, whatever a declaration says: it may run commands, and (like
# WebSearch or RemoteTrigger) it may run on the provider's side, outside the sandbox's network.
UNKNOWN = (Effect.shell, True)
# How strong an effect is, for `measured`: a declaration may not make a tool weaker than what it does.
_STRENGTH = {Effect.none: 0, Effect.read: 1, Effect.write: 2, Effect.delete: 3, Effect.network: 4,
             Effect.send: 4, Effect.pay: 5, Effect.shell: 6}


def row(name: str, tools: dict[str, tuple[Effect, bool]]) -> tuple[Effect, bool] | None:
    """What the tool `name` measurably does: its table row; `shell` for a user's program (COMMAND_TOOLS,
    COMMAND_PREFIXES); None for a name nothing knows, which `measured` takes as UNKNOWN."""
    if name in tools:
        return tools[name]
    if name in COMMAND_TOOLS or name.startswith(COMMAND_PREFIXES):
        return Effect.shell, False
    return None


def measured(task: AgentTask, tools: dict[str, tuple[Effect, bool]]) -> AgentTask:
    """The task with each declared tool's effect at least what the CLI's tool measurably does (its table
    row; `shell` for a user's program behind COMMAND_PREFIXES; UNKNOWN for a name the table lacks): declaring
    `Skill` as effect `none` does not let it run commands without the `shell` permission, nor a tool newer
    than the table reach anything at all without `shell` and `network`."""
    specs = []
    for t in task.tools:
        effect, online = row(t.name, tools) or UNKNOWN
        if _STRENGTH[effect] > _STRENGTH[t.effect] or (online and not t.online):
            t = t.model_copy(update={"effect": max(effect, t.effect, key=_STRENGTH.__getitem__),
                                     "online": t.online or online})
        specs.append(t)
    return task.model_copy(update={"tools": tuple(specs)})


def default_task(goal: str, worktree: Path, network: bool, tools: dict[str, tuple[Effect, bool]]) -> AgentTask:
    """The declaration of a job that brought none: the CLI's own tools, files and shell inside the worktree,
    the network only when the adapter has egress. Ceilings from the trusted policy apply as for any task."""
    specs = tuple(ToolSpec(name=n, effect=e, online=o) for n, (e, o) in tools.items() if network or not o)
    return AgentTask(goal=goal[:2000] or "run-agent job", tools=specs,
                     permissions=Permissions(workspace=str(worktree), read_files=True, write_files=True,
                                             shell=True, network=network))


def with_workspace(task: AgentTask, worktree: Path) -> AgentTask:
    """A declared task bound to this job: its workspace is the job's worktree, whatever it named (a person
    writes the declaration before the worktree exists)."""
    perms = task.permissions.model_copy(update={"workspace": str(worktree)})
    return task.model_copy(update={"permissions": perms})
