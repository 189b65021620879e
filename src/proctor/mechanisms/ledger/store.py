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
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from proctor.home import ensure_home

LEDGER_FILE = "ledger.sqlite3"
GENESIS = "0" * 64
BUSY_TIMEOUT_S = 30.0
RESERVE_BYTES = 256 * 1024
# Below this much free space beside the ledger a job is refused before it starts (host.run_agent): its
# rows could not all be written.
MIN_FREE_BYTES = 1024 * 1024
# The newest rows walked before an open ledger's first write (`chain_problems`): 56 ms at 10k rows, about
# 0.2 s at a million (the row count is linear); `proctor ledger verify` walks them all (6-7 s at a million).
RECENT_ROWS = 10_000

T = TypeVar("T")

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


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def row_hash(prev_hash: str, row_id: int, ts: str, kind: str, job_id: str | None, payload: str) -> str:
    # Canonical JSON of a list, not a joined string: a separator inside a field cannot forge another row.
    material = canonical_json([prev_hash, row_id, ts, kind, job_id, payload])
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


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


def disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return False


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


@dataclass(frozen=True)
class Row:
    id: int
    ts: str
    kind: str
    job_id: str | None
    payload: dict[str, Any]
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class Entry:
    """A row to append, as returned by an `update` callback."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None


class Ledger:
    """`Ledger(path)` opens (creating and migrating) the ledger at `path`; `Ledger.default()` the one under
    `$PROCTOR_HOME`. Safe from several threads (one connection behind a lock) and several processes (WAL,
    busy timeout, every append in one BEGIN IMMEDIATE transaction). Close it with `close()` or `with`.
    """

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._head_path = self._path.with_suffix(".head")
        self._reserve_path = self._path.with_suffix(".reserve")
        self._reserve_checked = False
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
        return self._head_path

    @property
    def reserve_path(self) -> Path:
        return self._reserve_path

    def space_problem(self) -> str | None:
        """Why a job should not start on this ledger's filesystem (under MIN_FREE_BYTES free), or None."""
        free = free_bytes(self._path.parent)
        if free is None or free >= MIN_FREE_BYTES:
            return None
        return (f"the ledger's filesystem ({self._path.parent}) has {free} bytes free, under the "
                f"{MIN_FREE_BYTES} a job needs for its ledger rows")

    def _failure(self, exc: BaseException) -> LedgerError:
        return LedgerFull(self._space(exc)) if self._full(exc) else LedgerError(f"the ledger write failed: {exc}")

    def _full(self, exc: BaseException) -> bool:
        # SQLite reports a full disk as SQLITE_FULL only where it sees ENOSPC itself; growing the WAL index
        # (-shm) on a full filesystem is a bare "disk I/O error". Free space tells which it was.
        free = free_bytes(self._path.parent)
        return disk_full(exc) or (isinstance(exc, sqlite3.Error) and free is not None and free < MIN_FREE_BYTES)

    def _space(self, exc: BaseException) -> str:
        free = free_bytes(self._path.parent)
        where = f"{self._path.parent}, {free} bytes free" if free is not None else str(self._path.parent)
        return f"the ledger's disk is full ({where}): {exc}"

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
                db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
                applied = {name for (name,) in db.execute("SELECT name FROM _migrations")}
                for fn in MIGRATIONS:
                    if fn.__name__ not in applied:
                        fn(db)
                        db.execute("INSERT INTO _migrations VALUES (?, ?)", (fn.__name__, _now()))
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
            if not (reserve and self._release_reserve()):
                raise
            done = self._update_once(apply)
        self._keep_reserve()
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
                        ts = _now()
                        digest = row_hash(prev, last_id, ts, entry.kind, entry.job_id, payload)
                        rows.append((last_id, ts, entry.kind, entry.job_id, payload, prev, digest))
                        ids.append(last_id)
                        prev = digest
                    # Both heads are on disk before any row goes in: a disk too full for them changes nothing,
                    # and putting the old head back after a failed commit is a rename, which needs no space.
                    new_head = self._stage_head(last_id, prev, "new")
                    staged.append(new_head)
                    if head_before[0]:
                        old_head = self._stage_head(*head_before, "old")
                        staged.append(old_head)
                    db.executemany(
                        "INSERT INTO rows (id, ts, kind, job_id, payload, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
                    # Swapped while this process holds the write lock, so heads land in row order.
                    os.replace(new_head, self._head_path)
                    staged.remove(new_head)
                    swapped = True
                db.execute("COMMIT")
            except BaseException as exc:
                if swapped and head_before is not None:
                    self._undo_head(db, head_before, old_head)
                _rollback(db)
                for tmp in staged:
                    _unlink(tmp)
                if isinstance(exc, (sqlite3.Error, OSError)):
                    raise self._failure(exc) from exc
                raise
            for tmp in staged:
                _unlink(tmp)
            return result, ids

    def _recover_interrupted(self) -> None:
        """A writer killed between swapping its new head in and its commit (SIGKILL, power loss) leaves the
        head one append ahead of the rows and its staged old head behind (`.ledger.head.<pid>.<tid>.old.tmp`).
        Put that old head back when it names the last row, so a crash is not read as a cut tail (which
        every job and command request then refuses). Staged files of writers still alive are left alone;
        one of a dead writer that names anything else is only removed, and `verify` judges the head."""
        prefix = f".{self._head_path.name}."
        try:
            leftovers = [t for t in self._head_path.parent.iterdir()
                         if t.name.startswith(prefix) and t.name.endswith(".tmp")]
        except OSError:
            return
        for tmp in leftovers:
            parts = tmp.name[len(prefix):].split(".")
            try:
                pid, which = int(parts[0]), parts[2]
            except (ValueError, IndexError):
                continue
            if pid == os.getpid() or _pid_alive(pid):
                continue
            if which == "old":
                self._restore_head(tmp)
            _unlink(tmp)

    def _restore_head(self, staged: Path) -> None:
        with self._lock:
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
                last = db.execute("SELECT id, hash FROM rows ORDER BY id DESC LIMIT 1").fetchone()
                old = json.loads(staged.read_text(encoding="utf-8"))
                head = json.loads(self._head_path.read_text(encoding="utf-8"))
                if last is not None and (int(old["id"]), str(old["hash"])) == (last[0], last[1]) \
                        and int(head["id"]) > last[0]:
                    os.replace(staged, self._head_path)
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
                if old_head is not None:
                    os.replace(old_head, self._head_path)
                else:
                    self._head_path.unlink(missing_ok=True)
        except (sqlite3.Error, OSError):
            pass  # `verify` names a head that does not match the rows
        finally:
            if not own:
                _rollback(db)

    def _stage_head(self, row_id: int, digest: str, which: str) -> Path:
        tmp = self._head_path.with_name(
            f".{self._head_path.name}.{os.getpid()}.{threading.get_ident()}.{which}.tmp")
        try:
            tmp.write_text(canonical_json({"id": row_id, "hash": digest}) + "\n", encoding="utf-8")
        except BaseException:
            _unlink(tmp)
            raise
        return tmp

    def _release_reserve(self) -> bool:
        """Give the reserve's space back to the filesystem; False when there was none to give."""
        try:
            self._reserve_path.unlink()
        except OSError:
            return False
        self._reserve_checked = False
        return True

    def _keep_reserve(self) -> None:
        """Make `ledger.reserve` when it is missing and there is room for it (once per open, and again after
        it was given up)."""
        if self._reserve_checked:
            return
        self._reserve_checked = True
        if self._reserve_path.exists():
            return
        free = free_bytes(self._path.parent)
        if free is None or free < RESERVE_BYTES + MIN_FREE_BYTES:
            self._reserve_checked = False  # try again after a later write
            return
        tmp = self._reserve_path.with_name(f".{self._reserve_path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    os.write(fd, b"\0" * RESERVE_BYTES)  # a filesystem without fallocate
            finally:
                os.close(fd)
            os.replace(tmp, self._reserve_path)
        except OSError:
            _unlink(tmp)
            self._reserve_checked = False

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
        return [Row(r[0], r[1], r[2], r[3], _payload(r[4]), r[5], r[6]) for r in raw]

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
                found = self._head_against(last[0] if last else 0,
                                           lambda i: (r[0] if (r := db.execute(
                                               "SELECT hash FROM rows WHERE id = ?", (i,)).fetchone()) else None))
                if not locked and found and "the tail was cut" in found[0]:
                    return []  # without the lock a head ahead is an append in flight as likely: not evidence
                return found
            finally:
                _rollback(db)

    def _head_against(self, last_id: int, hash_of: Callable[[int], str | None]) -> list[str]:
        try:
            head = json.loads(self._head_path.read_text(encoding="utf-8"))
            head_id, head_hash = int(head["id"]), str(head["hash"])
        except FileNotFoundError:
            if not last_id:
                return []
            return [f"row {last_id}: {self._head_path.name} is missing, so a cut tail cannot be ruled out"]
        except (OSError, ValueError, KeyError, TypeError):
            return [f"row {last_id}: {self._head_path.name} is unreadable"]
        if head_id > last_id:
            return [f"row {last_id + 1}: missing ({self._head_path.name} names row {head_id}; the tail was cut)"]
        if hash_of(head_id) != head_hash:
            return [f"row {head_id}: does not match {self._head_path.name} (edited or replaced)"]
        if head_id < last_id:
            return [f"row {head_id + 1}: after {self._head_path.name}'s row {head_id} (appended outside proctor?)"]
        return []


def _rollback(db: sqlite3.Connection) -> None:
    # SQLite ends a transaction itself on some errors (a full disk: SQLITE_FULL); a ROLLBACK then would
    # raise "cannot rollback - no transaction is active" and hide the first error.
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _payload(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        # A tampered payload must not break listing; `verify` reports the row.
        return {"unparseable": text}
    return value if isinstance(value, dict) else {"value": value}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
