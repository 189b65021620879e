"""The three errors `run_request` raises (the codes are in `codes.py`, re-exported here).

Owns the error tree:

    CommandRequestError (.code, .message)
    ├── ProposalError            refused before or instead of running; recorded as a refusal row
    ├── UndeclaredWritesError    ran, and wrote outside its declared set; `.result` is the full result
    └── LedgerTamperedError      the ledger or a dispatch file changed during the run (`.result` attached),
                                 or the ledger's chain was broken before it; nothing more recorded

It never decides anything: the checks that raise these live in request, allowlist, gates and run.
"""

from __future__ import annotations

from proctor.services.commands.codes import RequestCode
from proctor.services.commands.result import CommandResult

__all__ = ["CommandRequestError", "LedgerTamperedError", "ProposalError", "RequestCode", "UndeclaredWritesError"]


class CommandRequestError(Exception):
    """Root of the tree: a stable code and a message that says why and, where it can, what to do."""

    def __init__(self, code: RequestCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ProposalError(CommandRequestError):
    """The request was refused; nothing ran (SPAWN_FAILED: it was meant to, and could not start)."""


class UndeclaredWritesError(CommandRequestError):
    """The command ran and changed paths it had not declared; the full result rides along."""

    def __init__(self, message: str, result: CommandResult) -> None:
        super().__init__(RequestCode.UNDECLARED_WRITES, message)
        self.result = result


class LedgerTamperedError(CommandRequestError):
    """The ledger, its head or a dispatch file changed while the command ran, or the ledger's chain was
    already broken when the request opened it: the audit trail is suspect. `.result` is the full result
    (`ran` true, `tampered` naming what changed) when the command had started; None when nothing ran."""

    def __init__(self, message: str, result: CommandResult | None = None) -> None:
        super().__init__(RequestCode.LEDGER_TAMPERED, message)
        self.result = result
