"""A task as proctor would run it (what `proctor check-task` and the MCP `check_task` tool show): its verdict,
its limits as the trusted ceilings cap them, and each tool with what the gate would say of it. Nothing is
run or decided to make it: every call is still the gate's to decide.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from proctor.mechanisms.policy.gate import GateCode, tool_rules
from proctor.mechanisms.policy.task import AgentTask, Effect
from proctor.mechanisms.policy.trusted import Policy, check_workspace


class ToolPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    effect: Effect
    online: bool
    permitted: bool
    denial: str | None
    outward: bool
    needs_network: bool
    paths_required: bool
    policy_blocked: bool


class TaskPlan(BaseModel):
    """The task as proctor would run it (what `proctor check-task` prints). Nothing is run to make it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verdict: str
    """`ready`, or `blocked-escalated` when the workspace rule refuses the task."""
    code: str
    reason: str
    goal: str
    workspace: str
    limits: dict[str, int | float]
    limits_lowered: list[str]
    policy_source: str | None
    tools: list[ToolPlan]


def plan(task: AgentTask, policy: Policy) -> TaskPlan:
    problem = check_workspace(task.permissions.workspace)
    limits = policy.ceilings.cap(task)
    return TaskPlan(
        verdict="ready" if problem is None else "blocked-escalated",
        code=GateCode.OK.value if problem is None else GateCode.WORKSPACE.value,
        reason=problem or "the task can run; every call is still decided by the gate",
        goal=task.goal,
        workspace=task.permissions.workspace,
        limits={
            "max_steps": limits.max_steps, "max_tool_calls": limits.max_tool_calls, "wall_clock_s": limits.wall_clock_s,
        },
        limits_lowered=policy.ceilings.lowered(task),
        policy_source=str(policy.source) if policy.source else None,
        tools=[
            ToolPlan(
                name=r.name, effect=r.effect, online=r.online, permitted=r.denial is None, denial=r.denial,
                outward=r.outward, needs_network=r.needs_network, paths_required=r.file_tool,
                policy_blocked=r.effect_forbidden,
            )
            for r in tool_rules(task, policy).values()
        ],
    )
