"""A job's gate service and each CLI's hook dialect: every tool call the agent's CLI makes is decided first.

Owns the socket, the hook client and the dialects; the decision itself is policy.gate's.
"""

from proctor.mechanisms.gatekeeper.service import (
    DIALECTS,
    HOOK_CLIENT,
    GateService,
    default_task,
    settings_path,
    with_workspace,
)

__all__ = ["DIALECTS", "HOOK_CLIENT", "GateService", "default_task", "settings_path", "with_workspace"]
