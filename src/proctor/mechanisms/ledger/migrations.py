"""The ledger file's schema: an ordered list of small migrations, each applied once and recorded.

Owns `MIGRATIONS` (append a new function at the end; never edit or reorder one that shipped) and `migrate`,
which applies the ones a file lacks and records each in `_migrations`. It never begins or ends a transaction:
proctor.mechanisms.ledger.store runs it inside one, so a file is migrated wholly or not at all.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from proctor.mechanisms.ledger.rows import now

MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = []
migration = MIGRATIONS.append


@migration
def m001_rows(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE rows (
            id INTEGER PRIMARY KEY,
            ts TEXT NOT NULL,
            kind TEXT NOT NULL,
            job_id TEXT,
            payload TEXT NOT NULL,
            prev_hash TEXT NOT NULL,
            hash TEXT NOT NULL
        )"""
    )
    db.execute("CREATE INDEX rows_kind ON rows (kind)")
    db.execute("CREATE INDEX rows_job ON rows (job_id)")
    for verb in ("update", "delete"):
        db.execute(
            f"CREATE TRIGGER rows_no_{verb} BEFORE {verb.upper()} ON rows"
            " BEGIN SELECT RAISE(ABORT, 'ledger is append-only'); END"
        )


@migration
def m002_breaker(db: sqlite3.Connection) -> None:
    # The circuit breaker's current state (mutable, one row per adapter); its transitions go in `rows`.
    db.execute(
        """CREATE TABLE breaker (
            adapter TEXT PRIMARY KEY,
            state TEXT NOT NULL,
            failures INTEGER NOT NULL,
            opened_at REAL,
            trial_at REAL,
            backoff_until REAL
        )"""
    )


def migrate(db: sqlite3.Connection) -> None:
    """Apply, in order, every migration `db` has not recorded yet (inside the caller's transaction)."""
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    applied = {name for (name,) in db.execute("SELECT name FROM _migrations")}
    for fn in MIGRATIONS:
        if fn.__name__ not in applied:
            fn(db)
            db.execute("INSERT INTO _migrations VALUES (?, ?)", (fn.__name__, now()))
