"""A job's gate service and each CLI's hook dialect: every tool call the agent's CLI makes is decided first.

Owns the socket, the hook client and the dialects; the decision itself is policy.gate's, never this folder's.
"""

from proctor.mechanisms.gatekeeper.dialect import settings_path
from proctor.mechanisms.gatekeeper.hook import HOOK_CLIENT
from proctor.mechanisms.gatekeeper.service import DIALECTS, GateService
from proctor.mechanisms.gatekeeper.task import default_task, with_workspace

__all__ = ["DIALECTS", "HOOK_CLIENT", "GateService", "default_task", "settings_path", "with_workspace"]
