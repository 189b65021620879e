"""The spend tally: one versioned value per budget, changed only by compare-and-set.

Owns where the counters live and the one primitive the governor builds on: read a key's value and revision,
then write a new value only if the revision is still the one read (`create` only if there is none). Two
places, the same contract:

- `SqliteTally`: `$PROCTOR_HOME/usage.sqlite3` (WAL), for jobs that did not come through the queue. The
  revision is a column; an update is `... WHERE revision = ?` inside BEGIN IMMEDIATE, so two processes on
  one machine cannot both move the same revision.
- `KvTally`: the JetStream KV bucket `proctor_usage` of the fleet's NATS servers, for queued jobs: every
  listener of the fleet counts in the same keys. The revision is the key's stream sequence; `update(last=)`
  and `create` are the server's own compare-and-set (`Nats-Expected-Last-Subject-Sequence`).

A lost race is `None` from `create`/`update`, never an exception: the caller reads again and retries. It
never decides what a value means (proctor.mechanisms.policy.governor does) and writes no ledger rows (the host does). A tally
that cannot be reached raises `TallyError`, which the governor turns into a refusal: spend that cannot be
counted is not spent. nats is imported where the KV tally uses it: a local job never loads it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from proctor.home import ensure_home

USAGE_FILE = "usage.sqlite3"
BUCKET = "proctor_usage"
# A key holds its budget's current hour and day windows; one untouched for two days holds only expired
# windows, so the server may drop it.
BUCKET_TTL_S = 2 * 86400.0
BUSY_TIMEOUT_S = 30.0
KV_TIMEOUT_S = 30.0  # one operation, failovers included (jetstream.FAILOVER_S)

T = TypeVar("T")


class TallyError(Exception):
    """The tally could not be read or written (unreachable, refused, unreadable); nothing was changed."""


@dataclass(frozen=True)
class Versioned:
    value: bytes
    revision: int


class Tally(Protocol):
    store: str  # "sqlite" | "jetstream": said in results and ledger rows

    def get(self, key: str) -> Versioned | None: ...

    def create(self, key: str, value: bytes) -> int | None:
        """The new revision, or None when the key exists already (someone created it first)."""
        ...

    def update(self, key: str, value: bytes, last: int) -> int | None:
        """The new revision, or None when the key's revision is no longer `last`."""
        ...

    def close(self) -> None: ...


class SqliteTally:
    """`SqliteTally(path)`; `SqliteTally.default()` is `$PROCTOR_HOME/usage.sqlite3`. One connection behind a
    lock (threads), BEGIN IMMEDIATE around each write (processes)."""

    store = "sqlite"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS tally (key TEXT PRIMARY KEY, value BLOB NOT NULL,"
                             " revision INTEGER NOT NULL)")
        except sqlite3.Error as exc:
            raise TallyError(f"the usage tally {self.path} cannot be opened: {exc}") from None

    @classmethod
    def default(cls) -> SqliteTally:
        return cls(ensure_home() / USAGE_FILE)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise TallyError(f"the usage tally {self.path} is closed")
        return self._db

    def get(self, key: str) -> Versioned | None:
        with self._lock:
            try:
                row = self._conn().execute("SELECT value, revision FROM tally WHERE key = ?", (key,)).fetchone()
            except sqlite3.Error as exc:
                raise TallyError(f"the usage tally {self.path} cannot be read: {exc}") from None
        return Versioned(bytes(row[0]), int(row[1])) if row else None

    def _write(self, sql: str, args: tuple[Any, ...]) -> bool:
        db = self._conn()
        with self._lock:
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    changed = db.execute(sql, args).rowcount == 1
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.IntegrityError:
                return False
            except sqlite3.Error as exc:
                raise TallyError(f"the usage tally {self.path} cannot be written: {exc}") from None
        return changed

    def create(self, key: str, value: bytes) -> int | None:
        return 1 if self._write("INSERT INTO tally (key, value, revision) VALUES (?, ?, 1)", (key, value)) else None

    def update(self, key: str, value: bytes, last: int) -> int | None:
        done = self._write("UPDATE tally SET value = ?, revision = revision + 1 WHERE key = ? AND revision = ?",
                           (value, key, last))
        return last + 1 if done else None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class KvTally:
    """`KvTally(url, options=...)`: its own NATS connection, on an event loop of its own in a daemon thread,
    so the synchronous host can book and settle (a run_agent job runs in a child process with no loop).
    It connects on first use and opens the bucket, creating it when it is missing and this user may.

    `options` are nats-py connect options (proctor.mechanisms.queue.connection.options: TLS, NKEY seed, the bundled
    server's token); `replicas` the bucket's copies when it has to be made (None: up to 3, as the cluster)."""

    store = "jetstream"

    def __init__(self, url: str, *, options: dict[str, Any] | None = None, replicas: int | None = None,
                 connect_timeout_s: float = 5.0, request_timeout_s: float = 5.0) -> None:
        self.url = url
        self._options = dict(options or {})
        self._replicas = replicas
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        # The server's "permissions violation" for one of the tally's subjects: a request it refuses is never
        # answered, which looks like a failover's timeout; this tells the two apart, so it is not retried.
        self._violation: str | None = None
        self._loop = _asyncio().new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proctor-tally", daemon=True)
        self._thread.start()
        self._nc: Any = None
        self._kv: Any = None
        self._closed = False

    def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        if self._closed:
            raise TallyError("the fleet's usage tally is closed")

        async def run() -> T:
            await self._open()
            return await make()

        future = _asyncio().run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result(self._connect_timeout_s + KV_TIMEOUT_S + 2 * self._request_timeout_s)
        except TallyError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to reach the server is one clear refusal
            future.cancel()
            raise TallyError(f"the fleet's usage tally ({BUCKET} at {self.url}) cannot be reached: "
                             f"{type(exc).__name__}: {exc}") from None

    async def _open(self) -> None:
        if self._kv is not None:
            return
        import nats.js.errors
        from nats.js.api import KeyValueConfig

        from proctor.mechanisms.queue.jetstream import JetStreamBackend

        if self._nc is None:
            # Not JetStreamBackend.connect: that opens (or makes) the job stream's buckets too; a tally needs
            # only its own.
            self._nc = await _connect(self.url, {"error_cb": self._on_error, **self._options},
                                      self._connect_timeout_s)
        js = self._nc.jetstream(timeout=self._request_timeout_s)
        try:
            self._kv = await self._retrying(lambda: js.key_value(BUCKET))
        except nats.js.errors.BucketNotFoundError:
            replicas = self._replicas or min(3, JetStreamBackend(self._nc).cluster_size())
            try:
                # Once, not through a failover's retries: a user that may not create streams is refused by
                # silence, and the job should hear so in seconds.
                self._kv = await js.create_key_value(
                    KeyValueConfig(bucket=BUCKET, history=1, ttl=BUCKET_TTL_S, replicas=replicas))
            except (nats.js.errors.APIError, *_transient()) as exc:
                why = self._violation or f"{type(exc).__name__}: {exc}"
                raise TallyError(f"the bucket {BUCKET} does not exist at {self.url} and could not be made ({why}):"
                                 " the fleet's admin creates it (`proctor usage --fleet` as a user that may)") from None

    async def _on_error(self, exc: Exception) -> None:
        text = str(exc)
        if "permissions violation" in text.lower() and BUCKET in text.lower():
            self._violation = text
        from proctor.mechanisms.queue.jetstream import _log_error

        await _log_error(exc)  # noqa: SLF001 - one line per error, as the queue's own connections log them

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        """Through a cluster's failover, as the queue's own KV operations are; a permissions violation is
        final."""
        from proctor.mechanisms.queue.jetstream import through_failover

        def final() -> TallyError | None:
            return TallyError(f"the server refused this user the tally: {self._violation}") if self._violation else None

        return await through_failover(op, final)

    def get(self, key: str) -> Versioned | None:
        import nats.js.errors

        async def op() -> Versioned | None:
            try:
                entry = await self._retrying(lambda: self._kv.get(key))
            except nats.js.errors.KeyNotFoundError:
                return None
            return Versioned(entry.value or b"", int(entry.revision))

        return self._call(op)

    def create(self, key: str, value: bytes) -> int | None:
        import nats.js.errors

        async def op() -> int | None:
            try:
                return int(await self._retrying(lambda: self._kv.create(key, value)))
            except nats.js.errors.KeyWrongLastSequenceError:
                return None

        return self._call(op)

    def update(self, key: str, value: bytes, last: int) -> int | None:
        import nats.js.errors

        async def op() -> int | None:
            try:
                return int(await self._retrying(lambda: self._kv.update(key, value, last=last)))
            except nats.js.errors.KeyWrongLastSequenceError:
                return None

        return self._call(op)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shut() -> None:
            if self._nc is not None:
                try:
                    await self._nc.close()
                except Exception:  # noqa: BLE001 - closing a connection that already failed
                    pass

        try:
            _asyncio().run_coroutine_threadsafe(shut(), self._loop).result(10)
        except Exception:  # noqa: BLE001 - the thread dies with the process anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _asyncio() -> Any:
    # Imported where the KV tally uses it, as nats is: a local job's host never loads it (8 MB a process).
    import asyncio

    return asyncio


async def _connect(url: str, options: dict[str, Any], timeout_s: float) -> Any:
    from proctor.mechanisms.queue.jetstream import open_client

    try:
        return await open_client(url, timeout_s, **options)
    except ConnectionError as exc:
        raise TallyError(str(exc)) from None


def _transient() -> tuple[type[BaseException], ...]:
    from proctor.mechanisms.queue.jetstream import TRANSIENT

    return TRANSIENT


def fleet_tally(url: str, settings: Any, home: Path, *, nkey_seed: str | None = None,
                inbox_prefix: str | None = None) -> KvTally:
    """The fleet's tally reached as this machine reaches its queue (`settings`: config's QueueSettings): the
    same TLS files, NKEY seed and local token; a listener's own seed and inbox (`proctor listen --nkey-seed`)
    over them, so a job's child process connects as its listener does."""
    from proctor.mechanisms.queue import connection

    try:
        options = connection.options(url, settings, home)
    except connection.QueueConnectionError as exc:
        raise TallyError(str(exc)) from None
    if nkey_seed:
        options["nkeys_seed"] = str(Path(nkey_seed).expanduser())
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix.encode()
    elif getattr(settings, "name", None) and "nkeys_seed" in options:
        options["inbox_prefix"] = f"_INBOX_{settings.name}".encode()
    return KvTally(url, options=options, replicas=settings.replicas)
