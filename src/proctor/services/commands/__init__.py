"""Command requests (DESIGN.md 5): an agent asks for one command; it runs only if allowlisted, confined when
asked, and accounted for against a before/after snapshot of the whole tree.

The public API is re-exported here; each module's first lines say what it owns and what it never does.
"""

from proctor.services.commands.allowlist import ALLOWLIST_FILE, MAX_COMMAND_TIMEOUT_S, Allowlist, Entry
from proctor.services.commands.errors import (
    CommandRequestError,
    LedgerTamperedError,
    ProposalError,
    RequestCode,
    UndeclaredWritesError,
)
from proctor.services.commands.request import CommandRequest, StdinContent
from proctor.services.commands.result import CommandResult
from proctor.services.commands.run import run_request

__all__ = [
    "ALLOWLIST_FILE", "MAX_COMMAND_TIMEOUT_S", "Allowlist", "CommandRequest", "CommandRequestError",
    "CommandResult", "Entry", "LedgerTamperedError", "ProposalError", "RequestCode", "StdinContent",
    "UndeclaredWritesError", "run_request",
]
