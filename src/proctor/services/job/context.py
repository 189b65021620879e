"""One job's state, shared by its phases: what the request, config and admission fixed, and what each phase
found (risks, the gate, the confiner, the egress proxy, the spend). It decides nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proctor.contract import Requester, RunAgentRequest
from proctor.mechanisms import confine, gatekeeper
from proctor.mechanisms.adapters.output import Backend, Usage
from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.confine.limits import Limits
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.governor import Prebooked, UsageGovernor
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.process.local import ProcessRunner
from proctor.services.job import sandbox_home
from proctor.services.job.progress import Progress

if TYPE_CHECKING:  # the proxy (and asyncio, 8 MB a process) loads only for a job that has one
    from proctor.mechanisms.confine.egress import EgressProxy


@dataclass
class Job:
    request: RunAgentRequest
    config: Config
    runner: ProcessRunner
    progress: Progress
    cancel: Callable[[], str | None] | None
    job_id: str
    start: float
    ledger: Ledger
    stop: StopSwitch
    spec: AdapterSpec
    limits: Limits  # config's [limits], resolved once: the agent, its validation and its probe get them
    # Two private dirs: the agent's TMPDIR (writable by it) and the host's own (never granted to it).
    agent_tmp: Path
    host_tmp: Path
    risks: list[str] = field(default_factory=list)
    # What the person should know that puts no verdict in doubt (their own config's doing): the result's
    # `warnings`, and a line each on the CLI's stderr.
    warnings: list[str] = field(default_factory=list)
    mode: str = "auto"
    # Set once the agent's plan is made; validation runs under the same confiner, network off.
    confiner: confine.Confiner | None = None
    # The agent's directory once it exited, taken aside and made exactly a tree; validation runs there.
    work: Path = Path()
    state_dirs: tuple[Path, ...] = ()  # the job's copies of the adapter's, under its own HOME (sandbox_home)
    state: sandbox_home.StateCopy | None = None  # settled when the agent exited (boundary.settle_state)
    egress: EgressProxy | None = None  # the host-run proxy to the adapter's declared hosts, while the agent runs
    refused_egress: dict[str, str] = field(default_factory=dict)  # host:port -> why, every proxy of the job
    reached_egress: int = 0  # requests the agent's own proxy let through (`network.never_reached`)
    gate: gatekeeper.GateService | None = None  # the gate the agent's CLI asks before each tool call
    backend: Backend | None = None  # an HTTP status the CLI's protocol reported for the deciding run
    # The repo's keys (config over the base's .proctor.toml), read once: its setup, shares and validate.
    settings: RepoSettings | None = None
    governor: UsageGovernor | None = None  # books the job against the trusted policy's spend budgets
    booked: Prebooked | None = None  # booked for it before it was asked (a race books all its runs at once)
    usage: Usage | None = None  # what the CLI's protocol reported using, every attempt's
    # Did the agent's process start: False until the launch is tried, None while it is in flight (unknown
    # if it raised), then what the runner saw. Decides whether the job's booking is settled or released.
    launched: bool | None = False
    requester: Requester | None = None  # who asked, when not the person at this machine

    @property
    def trusted(self) -> bool:
        """May this job's request pick what proctor trusts (a base's settings, any commit as its base)? Only
        the person at this machine's (docs "Who is asking")."""
        return self.requester is None

    @property
    def may_read_untracked(self) -> bool:
        """May this job's validation see the person's untracked files and setup reach registries? The person's,
        and a requester granted what validateCommand needs (it could read them that way anyway)."""
        return self.requester is None or self.requester.privileged

    @property
    def home(self) -> Path:
        """The agent's HOME: in its private tmp, where its copy of the adapter's state dirs goes."""
        return self.agent_tmp / "home"

    def poll(self) -> str | None:
        """Why the job's processes must end now, if they must: the stop switch, a call held for a person,
        the caller's cancel. The runner's wait loop asks (every 0.1 s): pass `job.poll` as its `poll`."""
        reason = self.stop.reason()
        if reason:
            return f"stopped: {reason}"
        if self.gate is not None and self.gate.held:
            return f"approval: {self.gate.held[0]['tool']} is held for a person"
        reason = self.cancel() if self.cancel is not None else None
        return f"cancelled: {reason}" if reason else None


def names(paths: list[str], most: int = 5) -> str:
    more = f" (+{len(paths) - most} more)" if len(paths) > most else ""
    return ", ".join(paths[:most]) + more
