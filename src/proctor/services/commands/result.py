"""The result of one command request, as `run_request` returns it and `proctor run-request` prints it.

Owns the result shape: the nine fields every caller reads first (`agent, argv, exit, duration_ms, stdout,
stderr, truncated, undeclared_writes, ran`), then additive ones. It never computes anything.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from proctor.services.commands.codes import RequestCode


class CommandResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: str
    argv: list[str]
    exit: int | None = None
    """The exit status; negative for a signal (a timed-out command is killed); None when nothing ran."""
    duration_ms: int = 0
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    """A stream went over the entry's `max_output_bytes`: its tail is kept, the front dropped."""
    undeclared_writes: list[str] = Field(default_factory=list)
    ran: bool = False
    # additive
    code: RequestCode = RequestCode.OK
    entry: str = ""
    cwd: str = "."
    request_id: str | None = None
    dry_run: bool = False
    timed_out: bool = False
    timeout_s: float | None = None
    changed: list[str] = Field(default_factory=list)
    """Every path the command changed, declared or not."""
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    leftovers_killed: int = 0
    confinement: str = "none"
    confinement_details: dict[str, Any] | None = None
    confinement_gaps: list[str] = Field(default_factory=list)
    confined: bool = False
    """Ran under the entry's confined profile; false: unconfined, as the allowlist allowed (see the gaps)."""
    hidden: list[str] = Field(default_factory=list)
    """What the command could not read: $PROCTOR_HOME always, the user's home unless `read_home`."""
    exposed: list[str] = Field(default_factory=list)
    """What should have been hidden and was readable (no mount namespace on this host): said, not hidden."""
    outside_writes: list[str] = Field(default_factory=list)
    """Writes seen outside the project (absolute paths); also in `undeclared_writes`."""
    rolled_back: list[str] = Field(default_factory=list)
    """Control files (proctor's trust and config, the allowlist, briefs, git config and hooks) the command
    changed and the host put back."""
    tampered: list[str] = Field(default_factory=list)
    """Control-plane files (the ledger, its WAL and head, the allowlist, briefs, proctor's trust and config)
    that changed while the command ran: code LEDGER_TAMPERED, nothing more recorded. The command did run."""
    ledger_problems: list[str] = Field(default_factory=list)
    """What the ledger's full verify found after such a run (the first names the first bad row)."""

    @property
    def ok(self) -> bool:
        return self.ran and self.code == RequestCode.OK

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)
