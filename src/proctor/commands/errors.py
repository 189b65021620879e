"""The stable codes of a command request and the three errors `run_request` raises.

Owns the code vocabulary (additive only, never renamed) and the error tree:

    CommandRequestError (.code, .message)
    ├── ProposalError            refused before or instead of running; recorded as a refusal row
    ├── UndeclaredWritesError    ran, and wrote outside its declared set; `.result` is the full result
    └── LedgerTamperedError      the ledger or a dispatch file changed during the run (`.result` attached),
                                 or the ledger's chain was broken before it; nothing more recorded

It never decides anything: the checks that raise these live in request, allowlist, gates and run.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proctor.commands.result import CommandResult


class RequestCode(StrEnum):
    """Why a command request was refused, or how a run ended. Additive only."""

    # outcomes of a request that got past every check
    OK = "OK"
    DRY_RUN = "DRY_RUN"
    EXIT_NONZERO = "EXIT_NONZERO"
    TIMED_OUT = "TIMED_OUT"
    LEFTOVER_PROCESSES = "LEFTOVER_PROCESSES"
    UNDECLARED_WRITES = "UNDECLARED_WRITES"
    LEDGER_TAMPERED = "LEDGER_TAMPERED"
    # the call itself is unusable
    REQUEST_UNREADABLE = "REQUEST_UNREADABLE"
    POLICY_INVALID = "POLICY_INVALID"
    PROJECT_INVALID = "PROJECT_INVALID"
    # 1. shape and identity
    REQUEST_SHAPE = "REQUEST_SHAPE"
    NOT_A_COMMAND_REQUEST = "NOT_A_COMMAND_REQUEST"
    AGENT_MISMATCH = "AGENT_MISMATCH"
    AGENT_REFUSED = "AGENT_REFUSED"
    # 2. arguments
    ARGV_SHELL_STRING = "ARGV_SHELL_STRING"
    ARGV_INVALID = "ARGV_INVALID"
    PURPOSE_EMPTY = "PURPOSE_EMPTY"
    # 3. allowlist
    NO_ALLOWLIST = "NO_ALLOWLIST"
    NOT_ALLOWLISTED = "NOT_ALLOWLISTED"
    ARG_PATH_OUTSIDE_PROJECT = "ARG_PATH_OUTSIDE_PROJECT"
    ARG_PATH_PROTECTED = "ARG_PATH_PROTECTED"
    CWD_MISMATCH = "CWD_MISMATCH"
    PROGRAM_NOT_FOUND = "PROGRAM_NOT_FOUND"
    PROGRAM_IN_PROJECT = "PROGRAM_IN_PROJECT"
    # 4. declared writes
    WRITE_OUTSIDE_PROJECT = "WRITE_OUTSIDE_PROJECT"
    WRITE_IN_CONTROL_PLANE = "WRITE_IN_CONTROL_PLANE"
    WRITE_NOT_ALLOWED = "WRITE_NOT_ALLOWED"
    # 5. confinement
    CONFINEMENT_REQUIRED = "CONFINEMENT_REQUIRED"
    CONFINEMENT_NOT_CONFIGURED = "CONFINEMENT_NOT_CONFIGURED"
    PROGRAM_OUTSIDE_EXEC_PATHS = "PROGRAM_OUTSIDE_EXEC_PATHS"
    WRITE_ROOT_PROTECTED = "WRITE_ROOT_PROTECTED"
    CONFINEMENT_UNAVAILABLE = "CONFINEMENT_UNAVAILABLE"
    # 6. stdin
    STDIN_SHAPE = "STDIN_SHAPE"
    STDIN_NOT_GATED = "STDIN_NOT_GATED"
    STDIN_GATE_FAILED = "STDIN_GATE_FAILED"
    # running
    NOT_A_GIT_WORKTREE = "NOT_A_GIT_WORKTREE"
    SPAWN_FAILED = "SPAWN_FAILED"
    # a bug or an unexpected OS error, mapped at the CLI edge
    HOST_ERROR = "HOST_ERROR"


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
