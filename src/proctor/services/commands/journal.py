"""The ledger as one command request uses it: opened only when something is recorded (a dry run records
nothing), its chain checked before the first row, its files named for the fingerprints. It never decides
what a row means."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proctor.mechanisms.ledger.store import Ledger
from proctor.services.commands.errors import LedgerTamperedError


class Journal:
    """The ledger as this run uses it: opened only when something is recorded (a dry run records nothing),
    and checked when first opened: on a chain already broken nothing runs and nothing is appended (a row
    chained onto an edited one would vouch for it)."""

    def __init__(self, ledger: Ledger | None, *, record: bool) -> None:
        self._ledger = ledger
        self._owned = False
        self._checked = False
        self.record = record

    def _open(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger.default()
            self._owned = True
        if not self._checked:
            broken = self._ledger.chain_problems()
            if broken:
                raise LedgerTamperedError(
                    f"the ledger {self._ledger.path} was changed outside proctor: {broken[0]}"
                    + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else "")
                    + "; nothing ran and nothing was recorded. `proctor ledger verify` lists every problem; "
                    "move the ledger aside (it is evidence) to start a new one"
                )
            self._checked = True
        return self._ledger

    def files(self) -> list[Path]:
        """The ledger, its WAL and its head; none for a dry run without a ledger (nothing is fingerprinted)."""
        if self._ledger is None and not self.record:
            return []
        led = self._open()
        return [led.path, led.path.with_name(led.path.name + "-wal"), led.head_path]

    def append(self, kind: str, payload: dict[str, Any], job_id: str | None = None) -> int | None:
        return self._open().append(kind, payload, job_id=job_id) if self.record else None

    def problems(self) -> list[str]:
        try:
            return self._open().verify()
        except Exception as exc:  # a tampered file may not even open; the tamper error says so
            return [f"ledger unreadable: {exc}"]

    def close(self) -> None:
        if self._owned and self._ledger is not None:
            self._ledger.close()
