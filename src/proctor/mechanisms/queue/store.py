"""The listener's job store (`$PROCTOR_HOME/queue.sqlite3`, WAL): the authority for "never twice at once".

Owns, per job id: the digest of the one envelope that job id belongs to, state, owner (pid, process start
time, boot id), delivery number, stored result, and the attempts that were abandoned; per nonce: the message
it first arrived in. It never talks to the queue engine
and never runs a job: the listener asks it `claim`, `still_owner`, `finish`.

Why a local store and not the broker: JetStream may accept an ack or progress from a stale delivery after a
redelivery (nats-server #4786), so the broker alone cannot fence. Each job names one target host, so that
host's store sees every delivery and decides; a delivery number lower than the recorded one is stale.

Work is keyed by envelope: a job id belongs to one envelope (by digest). A different envelope carrying a
known job id (another signer's, another kind, another lane) is a `CONFLICT` if it came later in the stream
(a higher stream sequence): it is refused, and never claims, finishes or is answered with the owner's row
or result. Job ids are random and first visible once their job is in the stream, so a squatter's message
always comes after the real one; when the squatter reached this store first (the real job was still queued
behind a busy lane), the real one displaces it on arrival (the squatter's answer moves to its own key) and
runs. Rows written before the digest column existed (digest NULL) match any envelope until they expire.
Several listener processes on one host share the file; each decision is made in a `BEGIN IMMEDIATE`
transaction. `transact` makes several decisions in one transaction (the listener's group commit: one commit
for a fetched batch of deliveries, or for the jobs that finished in one turn of its loop), each exactly as it
would be made alone, in order; nothing of the batch is acted on before the commit, so a crash loses only
decisions nobody acted on. `wait=False` never waits for a lock (this process's or another's SQLite write
lock): it raises `StoreBusy`, and the listener's event loop then hands the work to a worker thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from proctor.home import proctor_home
from proctor.mechanisms.queue.owner import Owner


class StoreBusy(Exception):
    """`wait=False` and the store is in use (by a thread of this process, or another process's write
    transaction): nothing was done; do it again where waiting is fine."""


BUSY_TIMEOUT_S = 30.0


class ClaimOutcome(StrEnum):
    NEW = "new"  # first delivery: recorded running, run it
    TAKEOVER = "takeover"  # the recorded owner died or released its lease: run it again, name what it left
    BUSY = "busy"  # the recorded owner is alive: do not start
    DONE = "done"  # finished already: answer with the stored result
    STALE = "stale"  # an older delivery than the one recorded: ignore
    REPLAYED = "replayed"  # the nonce arrived before in another message: refuse
    DRAINING = "draining"  # the owner died but its job runner is still stopping the agent: retry shortly
    CONFLICT = "conflict"  # the job id belongs to another envelope (another digest): refuse, touch nothing


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    result: bytes | None = None
    abandoned: tuple[str, ...] = ()  # human lines naming earlier attempts and the worktrees they left
    owner_digest: str | None = None  # CONFLICT: the id's owner; NEW with `displaced`: the envelope displaced
    displaced: bytes | None = None  # the displaced envelope's stored answer, to re-publish at its own key


@dataclass(frozen=True)
class RefusedAnswer:
    """What `finish_refused` says to publish: `result` (None: nothing, the job's own run answers) and whether
    it is the answer of the envelope that owns the job id (`owner`) or of another one reusing it."""

    result: bytes | None
    owner: bool


def _m1(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE jobs (
            job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, lane TEXT NOT NULL, kind TEXT NOT NULL,
            state TEXT NOT NULL, delivery INTEGER NOT NULL,
            owner_pid INTEGER, owner_start REAL, owner_boot TEXT,
            expires_at REAL NOT NULL, started_at REAL NOT NULL, updated_at REAL NOT NULL, result BLOB)"""
    )
    db.execute(
        "CREATE TABLE nonces (nonce TEXT PRIMARY KEY, job_id TEXT NOT NULL, seq INTEGER NOT NULL,"
        " expires_at REAL NOT NULL)"
    )
    db.execute(
        "CREATE TABLE attempts (job_id TEXT NOT NULL, delivery INTEGER NOT NULL, owner_pid INTEGER,"
        " worktree TEXT, ended TEXT, PRIMARY KEY (job_id, delivery))"
    )


def _m2(db: sqlite3.Connection) -> None:
    db.execute("CREATE INDEX nonces_expiry ON nonces (expires_at)")
    db.execute("CREATE INDEX jobs_expiry ON jobs (expires_at)")


def _m3(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE attempts ADD COLUMN runner_pid INTEGER")
    db.execute("ALTER TABLE attempts ADD COLUMN runner_start REAL")
    db.execute("ALTER TABLE attempts ADD COLUMN runner_boot TEXT")


def _m4(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE jobs ADD COLUMN digest TEXT")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_m1, _m2, _m3, _m4)
JOB_COLUMNS = ("job_id, seq, lane, kind, state, delivery, owner_pid, owner_start, owner_boot, expires_at,"
               " started_at, updated_at, result, digest")


class JobStore:
    def __init__(self, path: Path | None = None, owner: Owner | None = None) -> None:
        self.path = path or proctor_home() / "queue.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.owner = owner or Owner.me()
        # One user at a time: the listener's event loop (only with wait=False: never waiting for it) and worker
        # threads (which may wait).
        self.lock = threading.RLock()
        self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode loses at most the last transactions on power loss, never consistency; the
        # broker redelivers an unacked job, so a lost "running" row is re-claimed, not double-run.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        with self._tx():
            self.db.execute("CREATE TABLE IF NOT EXISTS migrations (id INTEGER PRIMARY KEY, name TEXT, at REAL)")
            done = {r[0] for r in self.db.execute("SELECT id FROM migrations")}
            for i, step in enumerate(MIGRATIONS, start=1):
                if i not in done:
                    step(self.db)
                    self.db.execute("INSERT INTO migrations VALUES (?, ?, ?)", (i, step.__name__, time.time()))

    def checkpoint_in_background(self) -> None:
        """This connection no longer checkpoints the WAL itself at a commit (SQLite's automatic checkpoint
        copies pages into the database file and syncs both, measured at up to 13 ms, on whichever commit
        crosses 1000 pages): the listener's event loop commits here and calls `checkpoint` from a worker
        thread instead. Other connections to the file keep their automatic checkpoints."""
        with self.lock:
            self.db.execute("PRAGMA wal_autocheckpoint = 0")

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database file, as far as no reader needs it (PASSIVE: never waits
        for a lock, never blocks a writer)."""
        with self.lock:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def _tx(self, wait: bool = True) -> _Tx:
        return _Tx(self.db, self.lock, wait)

    def transact(self, ops: Sequence[Callable[[], object]], *, wait: bool = True) -> list[object]:
        """Run `ops` (this store's `op_*` methods, bound with their arguments) in order in one transaction and
        return their results. One that raises rolls them all back and is raised. `wait=False`: `StoreBusy`
        instead of waiting for a lock."""
        with self._tx(wait):
            return [op() for op in ops]

    def read(self, op: Callable[[], object], *, wait: bool = True) -> object:
        """Run a read-only `op` on this store's connection (WAL: a reader never waits for a writer's lock).
        `wait=False`: `StoreBusy` when another thread of this process is using the connection."""
        if not self.lock.acquire(blocking=wait):
            raise StoreBusy("the job store is in use by another thread")
        try:
            return op()
        finally:
            self.lock.release()

    def admit(
        self, job_id: str, *, nonce: str, seq: int, delivery: int, lane: str, kind: str, expires_at: float,
        keep_until: float, digest: str | None = None,
    ) -> Claim:
        """Record the nonce and claim the job in one transaction (one commit per delivery).

        A nonce seen before in a different message is a replay: a JetStream redelivery carries the same
        stream sequence, the same envelope published again is a new message with a new sequence. `digest`
        is the envelope's (the listener always passes it); a job id already bound to another digest is a
        CONFLICT."""
        with self._tx():
            return self.op_admit(job_id, nonce=nonce, seq=seq, delivery=delivery, lane=lane, kind=kind,
                                 expires_at=expires_at, keep_until=keep_until, digest=digest)

    def op_admit(
        self, job_id: str, *, nonce: str, seq: int, delivery: int, lane: str, kind: str, expires_at: float,
        keep_until: float, digest: str | None = None,
    ) -> Claim:
        """`admit` inside a transaction the caller holds (`transact`)."""
        row = self.db.execute("SELECT seq FROM nonces WHERE nonce = ?", (nonce,)).fetchone()
        if row is None:
            self.db.execute("INSERT INTO nonces VALUES (?, ?, ?, ?)", (nonce, job_id, seq, keep_until))
        elif int(row[0]) != seq:
            return Claim(ClaimOutcome.REPLAYED)
        return self._claim(job_id, seq=seq, delivery=delivery, lane=lane, kind=kind, expires_at=expires_at,
                           digest=digest)

    def _claim(
        self, job_id: str, *, seq: int, delivery: int, lane: str, kind: str, expires_at: float, digest: str | None
    ) -> Claim:
        now, me = time.time(), self.owner
        row = self.db.execute(
            "SELECT state, delivery, owner_pid, owner_start, owner_boot, result, digest, seq FROM jobs"
            " WHERE job_id = ?",
            (job_id,),
        ).fetchone()
        if row is None:
            self.db.execute(
                f"INSERT INTO jobs ({JOB_COLUMNS}) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                (job_id, seq, lane, kind, delivery, me.pid, me.start, me.boot, expires_at, now, now, digest),
            )
            self._attempt(job_id, delivery)
            return Claim(ClaimOutcome.NEW)
        state, rec_delivery, pid, start, boot, result, owner_digest, rec_seq = row
        displace = digest is not None and owner_digest is not None and owner_digest != digest
        if displace and seq >= int(rec_seq):
            return Claim(ClaimOutcome.CONFLICT, owner_digest=owner_digest)
        if not displace and state == "done":
            return Claim(ClaimOutcome.DONE, result=result)
        if not displace and delivery < rec_delivery:
            return Claim(ClaimOutcome.STALE)
        if state == "running" and Owner(pid, start, boot).alive():
            return Claim(ClaimOutcome.BUSY)
        # A dead listener's job runner outlives it by the time it takes to kill the agent's tree; starting
        # again before it is gone would be two runs at once.
        for r_pid, r_start, r_boot in self.db.execute(
            "SELECT runner_pid, runner_start, runner_boot FROM attempts WHERE job_id = ? AND runner_pid IS NOT NULL",
            (job_id,),
        ).fetchall():
            if Owner(r_pid, r_start, r_boot).alive():
                return Claim(ClaimOutcome.DRAINING)
        if displace:
            # This envelope was in the stream before the one that owns the id here (a lower stream sequence):
            # the owner is the squatter, published after it learned the id. The id passes to this envelope;
            # the squatter's stored answer is handed back to be re-published at its own envelope's key.
            self.db.execute("DELETE FROM attempts WHERE job_id = ?", (job_id,))
            self.db.execute(
                "UPDATE jobs SET seq = ?, lane = ?, kind = ?, state = 'running', delivery = ?, owner_pid = ?,"
                " owner_start = ?, owner_boot = ?, expires_at = ?, started_at = ?, updated_at = ?, result = NULL,"
                " digest = ? WHERE job_id = ?",
                (seq, lane, kind, delivery, me.pid, me.start, me.boot, expires_at, now, now, digest, job_id),
            )
            self._attempt(job_id, delivery)
            return Claim(ClaimOutcome.NEW, owner_digest=owner_digest, displaced=result)
        abandoned = tuple(self._abandoned_lines(job_id))
        self.db.execute(
            "UPDATE jobs SET state = 'running', delivery = ?, owner_pid = ?, owner_start = ?, owner_boot = ?,"
            " updated_at = ? WHERE job_id = ?",
            (delivery, me.pid, me.start, me.boot, now, job_id),
        )
        self._attempt(job_id, delivery)
        return Claim(ClaimOutcome.TAKEOVER, abandoned=abandoned)

    def _attempt(self, job_id: str, delivery: int) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO attempts (job_id, delivery, owner_pid) VALUES (?, ?, ?)",
            (job_id, delivery, self.owner.pid),
        )

    def _abandoned_lines(self, job_id: str) -> list[str]:
        rows = self.db.execute(
            "SELECT delivery, owner_pid, worktree, ended FROM attempts WHERE job_id = ? ORDER BY delivery",
            (job_id,),
        ).fetchall()
        lines = []
        for delivery, pid, wt, ended in rows:
            where = f"its worktree {wt} was left for review" if wt else "it recorded no worktree"
            how = ended or "its listener died"
            lines.append(f"attempt {delivery} (listener pid {pid}) was abandoned ({how}); {where}")
        return lines

    def record_runner(self, job_id: str, delivery: int, runner: Owner) -> None:
        """Called by the job runner child first thing: a successor waits for it to be gone (DRAINING)."""
        with self._tx():
            self.db.execute(
                "UPDATE attempts SET runner_pid = ?, runner_start = ?, runner_boot = ? WHERE job_id = ?"
                " AND delivery = ?",
                (runner.pid, runner.start, runner.boot, job_id, delivery),
            )

    def record_attempt(self, job_id: str, delivery: int, *, worktree: str | None, ended: str) -> None:
        """Called by the job runner as soon as it knows how an attempt ended, even when its listener is gone."""
        with self._tx():
            self.db.execute(
                "UPDATE attempts SET worktree = COALESCE(?, worktree), ended = ? WHERE job_id = ? AND delivery = ?",
                (worktree, ended, job_id, delivery),
            )

    def still_owner(self, job_id: str, delivery: int) -> bool:
        with self.lock:
            return self.op_still_owner(job_id, delivery)

    def op_still_owner(self, job_id: str, delivery: int) -> bool:
        row = self.db.execute(
            "SELECT state, delivery, owner_pid, owner_start FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()
        return row is not None and row[0] == "running" and row[1] == delivery and row[2] == self.owner.pid \
            and row[3] == self.owner.start

    def finish(self, job_id: str, delivery: int, result: bytes) -> bool:
        """Store the result iff this process still owns this delivery (fencing); False means drop it."""
        with self._tx():
            return self.op_finish(job_id, delivery, result)

    def op_finish(self, job_id: str, delivery: int, result: bytes) -> bool:
        cur = self.db.execute(
            "UPDATE jobs SET state = 'done', result = ?, updated_at = ? WHERE job_id = ? AND delivery = ?"
            " AND state = 'running' AND owner_pid = ? AND owner_start = ?",
            (result, time.time(), job_id, delivery, self.owner.pid, self.owner.start),
        )
        if cur.rowcount == 1:
            self.db.execute("DELETE FROM attempts WHERE job_id = ? AND delivery = ?", (job_id, delivery))
        return cur.rowcount == 1

    def release(self, job_id: str, delivery: int, reason: str) -> None:
        """Give up a lease we could not hold: the next delivery takes over instead of waiting on a live pid."""
        with self._tx():
            self.op_release(job_id, delivery, reason)

    def op_release(self, job_id: str, delivery: int, reason: str) -> None:
        self.db.execute(
            "UPDATE jobs SET state = 'released', updated_at = ? WHERE job_id = ? AND delivery = ?"
            " AND owner_pid = ? AND state = 'running'",
            (time.time(), job_id, delivery, self.owner.pid),
        )
        self.db.execute(
            "UPDATE attempts SET ended = COALESCE(ended, ?) WHERE job_id = ? AND delivery = ?",
            (reason, job_id, delivery),
        )

    def finish_refused(
        self, job_id: str, *, seq: int, lane: str, kind: str, expires_at: float, result: bytes,
        digest: str | None = None,
    ) -> RefusedAnswer:
        """A refused job is done: its redelivery is answered from here, not verified and refused again.

        The answer to publish: `result` if the job id was unknown (this envelope now owns it); for the same
        envelope, the stored result of a job that already has one (never the refusal over it), or None (it is
        running: its own run answers); for another envelope reusing the job id, `result` as a non-owner
        answer: the known job's row and result are left alone."""
        with self._tx():
            return self.op_finish_refused(job_id, seq=seq, lane=lane, kind=kind, expires_at=expires_at,
                                          result=result, digest=digest)

    def op_finish_refused(
        self, job_id: str, *, seq: int, lane: str, kind: str, expires_at: float, result: bytes,
        digest: str | None = None,
    ) -> RefusedAnswer:
        now = time.time()
        cur = self.db.execute(
            f"INSERT OR IGNORE INTO jobs ({JOB_COLUMNS}) VALUES (?, ?, ?, ?, 'done', 0, NULL, NULL, NULL, ?, ?, ?,"
            " ?, ?)",
            (job_id, seq, lane, kind, expires_at, now, now, result, digest),
        )
        if cur.rowcount == 1:
            return RefusedAnswer(result, owner=True)
        row = self.db.execute("SELECT state, result, digest FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is not None and digest is not None and row[2] is not None and row[2] != digest:
            return RefusedAnswer(result, owner=False)
        stored = row[1] if row is not None and row[0] == "done" and row[1] is not None else None
        return RefusedAnswer(stored, owner=True)

    def digest_of(self, job_id: str) -> str | None:
        """The digest of the envelope `job_id` belongs to here (None: unknown, or a row from before digests)."""
        with self.lock:
            return self.op_digest_of(job_id)

    def op_admitted(self, job_id: str, digest: str) -> bool:
        """Whether this envelope's row for `job_id` is here (or a row from before digests, which matches any)."""
        row = self.db.execute("SELECT digest FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return row is not None and (row[0] is None or row[0] == digest)

    def op_digest_of(self, job_id: str) -> str | None:
        row = self.db.execute("SELECT digest FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return row[0] if row else None

    def job(self, job_id: str) -> dict[str, object] | None:
        with self.lock:
            return self.op_job(job_id)

    def op_job(self, job_id: str) -> dict[str, object] | None:
        cur = self.db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        row = cur.fetchone()
        if row is None:
            return None
        out = dict(zip([d[0] for d in cur.description], row, strict=True))
        if isinstance(out.get("result"), bytes):
            out["result"] = json.loads(out["result"])
        return out

    def prune(self, now: float, skew_s: float) -> int:
        """Drop rows past expiry + skew: an older replay then fails the expiry check instead of the lookup."""
        with self._tx():
            n = self.db.execute("DELETE FROM nonces WHERE expires_at < ?", (now - skew_s,)).rowcount
            n += self.db.execute(
                "DELETE FROM jobs WHERE expires_at < ? AND state != 'running'", (now - skew_s,)
            ).rowcount
        return n

    def close(self) -> None:
        self.db.close()


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT: takes the write lock up front so two listeners' decisions serialize.
    `wait=False`: StoreBusy at once rather than wait for this process's lock or SQLite's write lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock, wait: bool = True) -> None:
        self.db, self.lock, self.wait = db, lock, wait

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=self.wait):
            raise StoreBusy("the job store is in use by another thread")
        try:
            if self.wait:
                self.db.execute("BEGIN IMMEDIATE")
            else:
                self._begin_now()
        except BaseException:
            self.lock.release()
            raise

    def _begin_now(self) -> None:
        self.db.execute("PRAGMA busy_timeout = 0")
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if self.db.in_transaction:
                raise
            raise StoreBusy(f"the job store's write lock is held elsewhere: {exc}") from None
        finally:
            self.db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()
