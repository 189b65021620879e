"""What the person who started `proctor mcp` lets its client do beyond reading and running jobs (`Grants`).

MCP gets no more than the queue: the client driving this server is often the model that asked for the work,
so a run_agent request is held to what a queue sender without `may_set_validate_command` may ask
(`validateCommand`, `holdout`, and a `confine` weaker than the config's are OVER_PRIVILEGED, the listener's
checks mirrored in `over_privileged`; measured before: `confine: "off"` ran unconfined under
`confine = "required"` and its validation read the host key) unless the server was started with
`--may-set-validate-command`. The review verbs are offered only when granted (`--allow-verb land|discard`).
It never refuses anything itself: the surface turns a reason from here into OVER_PRIVILEGED.
"""

from __future__ import annotations

from dataclasses import dataclass

from proctor.contract import RunAgentRequest
from proctor.mechanisms.confine import CONFINE_ORDER

VERBS = ("land", "discard")  # the review verbs a server may be started to offer (approve never is)


@dataclass(frozen=True)
class Grants:
    """What the person who started `proctor mcp` lets its client do beyond reading and running jobs."""

    verbs: frozenset[str] = frozenset()  # of VERBS
    may_set_validate_command: bool = False  # as a signer's grant in signers.toml: validateCommand, holdout, confine


def over_privileged(request: RunAgentRequest, floor: str, grants: Grants) -> str | None:
    """Why `request` asks for more than an ungranted queue sender may (proctor.services.listen.checks, in
    its order), or None. `floor`: the configured confinement."""
    if grants.may_set_validate_command:
        return None
    if request.validate_command is not None:
        return "this MCP server may not set validateCommand (shell on this host): start it with " \
               "--may-set-validate-command to allow it"
    if request.holdout:
        return "this MCP server may not name held-out test dirs (paths on this host): that needs " \
               "--may-set-validate-command"
    if request.confine is not None and CONFINE_ORDER.get(request.confine, 0) < CONFINE_ORDER.get(floor, 1):
        return f"this MCP server may not weaken confinement to {request.confine!r} (the config's is {floor!r}): " \
               "that needs --may-set-validate-command (RCE-equivalent)"
    return None
