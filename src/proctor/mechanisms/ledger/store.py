"""The ledger: one append-only, hash-chained SQLite file (WAL) under `$PROCTOR_HOME`.

Owns the file `ledger.sqlite3`, its schema migrations, the chain of rows and the head file `ledger.head`.
Every job start and end, every gate decision and refusal, every breaker transition is a row. It never
decides anything and never rewrites or deletes a row: edits, deletions, re-orderings and a cut tail are
what `verify` finds.

Each row's `hash` is sha256 over canonical JSON of [prev_hash, id, ts, kind, job_id, payload], where
`prev_hash` is the previous row's hash (`GENESIS` for the first). Row ids are in the hash, so moving a row
breaks it. The chain alone cannot show that rows were cut from the end, so `ledger.head` beside the file
holds the last row's id and hash; it is rewritten inside the same write transaction as the row.

A full disk never leaves half a write: the new head and the old one are written to temporary files before
any row is inserted (so a write that cannot even stage them changes nothing), the head is swapped in by a
rename, and a failed commit puts the old one back by a rename, which needs no free space. Such a failure is a
`LedgerFull`. `ledger.reserve` (RESERVE_BYTES of allocated space beside the file) is given up to let a
write that must not be lost (`reserve=True`: a job's end, the breaker hearing of a run) through once; it is
made again after the next write that finds room.

Without a secret key anyone who can write the file can recompute the whole chain: the chain makes an edit
detectable, not impossible. SQLite triggers refuse UPDATE and DELETE on rows as a guard against accidents.

Beside it: a row's shape and hash (rows.py), the schema (migrations.py), the head file (head.py), free space
and the reserve (space.py). This module owns the Ledger: its connection, its lock and every transaction.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from proctor.home import ensure_home
from proctor.mechanisms.ledger import space
from proctor.mechanisms.ledger.head import Head, discard
from proctor.mechanisms.ledger.migrations import migrate
from proctor.mechanisms.ledger.rows import GENESIS, Entry, Row, canonical_json, now, payload_of, row_hash
from proctor.mechanisms.ledger.space import Reserve

LEDGER_FILE = "ledger.sqlite3"
BUSY_TIMEOUT_S = 30.0
# The newest rows walked before an open ledger's first write (`chain_problems`): 56 ms at 10k rows, about
# 0.2 s at a million (the row count is linear); `proctor ledger verify` walks them all (6-7 s at a million).
RECENT_ROWS = 10_000

T = TypeVar("T")


class LedgerError(sqlite3.OperationalError):
    """A write the ledger could not make; nothing of it was kept (rows, head and state are as before)."""


class LedgerFull(LedgerError):
    """A write failed because the ledger's filesystem is full."""


class LedgerTampered(LedgerError):
    """The chain was already broken when this ledger was opened: no row is chained onto an edited one."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"the ledger {path} was changed outside proctor: {problems[0]}"
                         + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


class Ledger:
    """`Ledger(path)` opens (creating and migrating) the ledger at `path`; `Ledger.default()` the one under
    `$PROCTOR_HOME`. Safe from several threads (one connection behind a lock) and several processes (WAL,
    busy timeout, every append in one BEGIN IMMEDIATE transaction). Close it with `close()` or `with`.
    """

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._head = Head(self._path.with_suffix(".head"))
        self._reserve = Reserve(self._path.with_suffix(".reserve"))
        self._chain: list[str] | None = None
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = sqlite3.connect(
            self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self._recover_interrupted()
        except BaseException as exc:
            self.close()
            if isinstance(exc, (sqlite3.Error, OSError)) and self._full(exc):
                raise LedgerFull(self._space(exc)) from exc
            raise

    @classmethod
    def default(cls) -> Ledger:
        return cls(ensure_home() / LEDGER_FILE)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def head_path(self) -> Path:
        return self._head.path

    @property
    def reserve_path(self) -> Path:
        return self._reserve.path

    def space_problem(self) -> str | None:
        """Why a job should not start on this ledger's filesystem (under MIN_FREE_BYTES free), or None."""
        return space.space_problem(self._path.parent)

    def _failure(self, exc: BaseException) -> LedgerError:
        return LedgerFull(self._space(exc)) if self._full(exc) else LedgerError(f"the ledger write failed: {exc}")

    def _full(self, exc: BaseException) -> bool:
        return space.full(exc, self._path.parent)

    def _space(self, exc: BaseException) -> str:
        return space.full_reason(exc, self._path.parent)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ValueError(f"ledger {self._path} is closed")
        return self._db

    def _migrate(self) -> None:
        db = self._conn()
        with self._lock:
            db.execute("BEGIN IMMEDIATE")
            try:
                migrate(db)
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)
                raise

    def migrations(self) -> list[str]:
        """Names of the applied migrations, in the order they were applied."""
        with self._lock:
            return [name for (name,) in self._conn().execute("SELECT name FROM _migrations ORDER BY rowid")]

    def append(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None, reserve: bool = False) -> int:
        """Append one row and return its id. `payload` must be JSON (no NaN); anything else is a TypeError."""
        return self.update(lambda _db: (None, [Entry(kind, payload, job_id)]), reserve=reserve)[1][0]

    def update(self, apply: Callable[[sqlite3.Connection], tuple[T, Sequence[Entry]]], *,
               reserve: bool = False) -> tuple[T, list[int]]:
        """Run `apply(db)` -> (result, entries) and append the entries, all in one write transaction.
        Returns the result and the new row ids.

        For state kept beside the chain in this file (the breaker's table): its change and the row that
        records it commit together or not at all. `apply` must not open or end transactions, and may be run
        twice: with `reserve`, a write that finds the disk full gives up `ledger.reserve` and is tried once
        more. A write that fails leaves rows, head and state as they were; on a full disk it is `LedgerFull`.
        """
        try:
            done = self._update_once(apply)
        except LedgerFull:
            if not (reserve and self._reserve.release()):
                raise
            done = self._update_once(apply)
        self._reserve.keep()
        return done

    def claim_once(self, kind: str, key: str, payload: dict[str, Any], *, job_id: str | None = None) -> int | None:
        """Append a `kind` row claiming `key` (its payload's `claim`) unless a `kind` row already claimed it:
        a compare-and-set, the check and the append in one write transaction (BEGIN IMMEDIATE), so of
        several threads or processes claiming one key exactly one gets a row id; the others get None.

        Why not `rows()` then `append()`: between the two another process can append the same claim. Two
        jobs of one ticket released at once both used one grant that way, 4 of 5 tries with a long ledger
        (issue 22, item 5)."""
        def apply(db: sqlite3.Connection) -> tuple[bool, list[Entry]]:
            # json_valid first: one unparseable payload (an edit `verify` reports) must not fail every claim.
            taken = db.execute("SELECT 1 FROM rows WHERE kind = ? AND CASE WHEN json_valid(payload)"
                               " THEN json_extract(payload, '$.claim') END = ? LIMIT 1", (kind, key)).fetchone()
            return (False, []) if taken else (True, [Entry(kind, {**payload, "claim": key}, job_id)])

        won, ids = self.update(apply)
        return ids[0] if won else None

    def chain_problems(self) -> list[str]:
        """What is wrong with the chain as this open found it (the newest RECENT_ROWS walked, the head, the
        triggers, the row count), worked out once per open. Every writer of this instance is refused while
        it is not empty (`LedgerTampered`), so no writer, the listener's or the gate's, can bury an edited
        row under new ones until it falls out of the window."""
        if self._chain is None:
            try:
                self._chain = self.verify(last=RECENT_ROWS)
            except Exception as exc:  # noqa: BLE001 - a file that cannot be read back is no audit trail either
                self._chain = [f"it cannot be read: {exc}"]
        return self._chain

    def _update_once(self, apply: Callable[[sqlite3.Connection], tuple[T, Sequence[Entry]]]) -> tuple[T, list[int]]:
        db = self._conn()  # a closed ledger says so before anything else
        broken = self.chain_problems()
        if broken:
            raise LedgerTampered(self._path, broken)
        with self._lock:
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._failure(exc) from exc
            staged: list[Path] = []
            head_before: tuple[int, str] | None = None
            old_head: Path | None = None
            swapped = False
            try:
                result, entries = apply(db)
                ids: list[int] = []
                if entries:
                    last = db.execute("SELECT id, hash FROM rows ORDER BY id DESC LIMIT 1").fetchone()
                    head_before = (last[0], last[1]) if last else (0, GENESIS)
                    last_id, prev = head_before
                    rows = []
                    for entry in entries:
                        payload = canonical_json(entry.payload)
                        last_id += 1
                        ts = now()
                        digest = row_hash(prev, last_id, ts, entry.kind, entry.job_id, payload)
                        rows.append((last_id, ts, entry.kind, entry.job_id, payload, prev, digest))
                        ids.append(last_id)
                        prev = digest
                    # Both heads are on disk before any row goes in: a disk too full for them changes nothing,
                    # and putting the old head back after a failed commit is a rename, which needs no space.
                    new_head = self._head.stage(last_id, prev, "new")
                    staged.append(new_head)
                    if head_before[0]:
                        old_head = self._head.stage(*head_before, "old")
                        staged.append(old_head)
                    db.executemany(
                        "INSERT INTO rows (id, ts, kind, job_id, payload, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
                    # Swapped while this process holds the write lock, so heads land in row order.
                    os.replace(new_head, self._head.path)
                    staged.remove(new_head)
                    swapped = True
                db.execute("COMMIT")
            except BaseException as exc:
                if swapped and head_before is not None:
                    self._undo_head(db, head_before, old_head)
                _rollback(db)
                for tmp in staged:
                    discard(tmp)
                if isinstance(exc, (sqlite3.Error, OSError)):
                    raise self._failure(exc) from exc
                raise
            for tmp in staged:
                discard(tmp)
            return result, ids

    def _recover_interrupted(self) -> None:
        """A writer killed between swapping its new head in and its commit (SIGKILL, power loss) leaves the
        head one append ahead of the rows and its staged old head behind (`.ledger.head.<pid>.<tid>.old.tmp`).
        Put that old head back when it names the last row, so a crash is not read as a cut tail (which
        every job and command request then refuses). Staged files of writers still alive are left alone;
        one of a dead writer that names anything else is only removed, and `verify` judges the head."""
        for tmp, which in self._head.dead_writers():
            if which == "old":
                self._restore_head(tmp)
            discard(tmp)

    def _restore_head(self, staged: Path) -> None:
        with self._lock:
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
                last = db.execute("SELECT id, hash FROM rows ORDER BY id DESC LIMIT 1").fetchone()
                self._head.restore(staged, last)
            except (sqlite3.Error, OSError, ValueError, KeyError, TypeError):
                pass  # nothing repaired: `verify` says what it finds
            finally:
                _rollback(db)

    def _undo_head(self, db: sqlite3.Connection, head_before: tuple[int, str], old_head: Path | None) -> None:
        """Put the head back after a failed write. Still inside its transaction nobody else can have
        written; after SQLite rolled it back itself (a full disk does), another process may have appended
        since, and then its head stands."""
        own = db.in_transaction
        try:
            if not own:
                db.execute("BEGIN IMMEDIATE")
            last = db.execute("SELECT id, hash FROM rows ORDER BY id DESC LIMIT 1").fetchone()
            if own or (tuple(last) if last else (0, GENESIS)) == head_before:
                self._head.put_back(old_head)
        except (sqlite3.Error, OSError):
            pass  # `verify` names a head that does not match the rows
        finally:
            if not own:
                _rollback(db)

    def read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read-only `query(db)` on this file (for state kept beside the chain, as the breaker's)."""
        with self._lock:
            return query(self._conn())

    def rows(self, kind: str | None = None, job_id: str | None = None) -> list[Row]:
        """Rows in id order, optionally only one kind and/or one job."""
        sql = "SELECT id, ts, kind, job_id, payload, prev_hash, hash FROM rows"
        where, args = [], []
        if kind is not None:
            where.append("kind = ?")
            args.append(kind)
        if job_id is not None:
            where.append("job_id = ?")
            args.append(job_id)
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._lock:
            raw = self._conn().execute(sql + " ORDER BY id", args).fetchall()
        return [Row(r[0], r[1], r[2], r[3], payload_of(r[4]), r[5], r[6]) for r in raw]

    def verify(self, *, last: int | None = None) -> list[str]:
        """Problems found, in row order (empty when intact); the first one names the first bad row id.

        `last=None` walks every row (`proctor ledger verify`). `last=N` walks only the newest N rows, anchored
        on the stored hash of the row before them, and still checks the head, the triggers and that no id is
        missing anywhere (a count): the check made each time a job or command request opens the ledger
        (RECENT_ROWS), bounded whatever the ledger's size. An edit of an older row, hash recomputed or not,
        is found only by the full walk."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN")  # one read snapshot: the count and the rows walked agree
            try:
                count, low, high = db.execute("SELECT count(*), min(id), max(id) FROM rows").fetchone()
                first = 1 if last is None else max(1, (high or 0) - max(1, last) + 1)
                raw = db.execute("SELECT id, ts, kind, job_id, payload, prev_hash, hash FROM rows WHERE id >= ?"
                                 " ORDER BY id", (first,)).fetchall()
                anchor = db.execute("SELECT id, hash FROM rows WHERE id < ? ORDER BY id DESC LIMIT 1",
                                    (first,)).fetchone()
                triggers = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
                # Rows before the anchor are not walked, but a count shows one deleted there; only then is the
                # first gap looked for (one after the anchor is the walk's to name).
                gap = None
                if anchor is not None and (low != 1 or count != high - low + 1):
                    found = (1,) if low != 1 else db.execute(
                        "SELECT r.id + 1 FROM rows r WHERE r.id < ? AND NOT EXISTS"
                        " (SELECT 1 FROM rows n WHERE n.id = r.id + 1) ORDER BY r.id LIMIT 1", (anchor[0],)).fetchone()
                    gap = found[0] if found else None
            finally:
                _rollback(db)
        problems: list[str] = []
        if gap is not None:
            problems.append(f"row {gap}: missing ({count} rows, ids {low}..{high})")
        prev_id, prev_hash = (anchor[0], anchor[1]) if anchor is not None else (0, GENESIS)
        for row_id, ts, kind, job_id, payload, stored_prev, stored_hash in raw:
            if row_id != prev_id + 1:
                problems.append(f"row {prev_id + 1}: missing (row {row_id} follows row {prev_id})")
            elif stored_prev != prev_hash:
                problems.append(f"row {row_id}: chain broken (its prev_hash is not row {prev_id}'s hash)")
            if row_hash(stored_prev, row_id, ts, kind, job_id, payload) != stored_hash:
                problems.append(f"row {row_id}: content does not match its hash (edited)")
            prev_id, prev_hash = row_id, stored_hash
        problems.extend(self._check_head())
        missing = {"rows_no_update", "rows_no_delete"} - triggers
        if missing:
            problems.append(f"ledger: append-only triggers removed: {', '.join(sorted(missing))}")
        return problems

    def _check_head(self) -> list[str]:
        """The head file against the rows as they are now. Read under the write lock when it can be taken: a
        writer swaps the head in before its commit, so outside the lock a head one row ahead of the rows
        is an append in flight, not a cut tail."""
        with self._lock:
            db = self._conn()
            locked = True
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:
                locked = False  # a read-only file or a writer that holds on: read without the lock
            try:
                last = db.execute("SELECT id, hash FROM rows ORDER BY id DESC LIMIT 1").fetchone()
                found = self._head.against(last[0] if last else 0,
                                           lambda i: (r[0] if (r := db.execute(
                                               "SELECT hash FROM rows WHERE id = ?", (i,)).fetchone()) else None))
                if not locked and found and "the tail was cut" in found[0]:
                    return []  # without the lock a head ahead is an append in flight as likely: not evidence
                return found
            finally:
                _rollback(db)

def _rollback(db: sqlite3.Connection) -> None:
    # SQLite ends a transaction itself on some errors (a full disk: SQLITE_FULL); a ROLLBACK then would
    # raise "cannot rollback - no transaction is active" and hide the first error.
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass
