"""SqliteStore: the queue's source of truth in one SQLite file, for every process on the host.

Everything here is synchronous and runs on a worker thread the service owns,
one batch per wake-up of its loop, each batch one transaction.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

from ._codec import Codec, JsonCodec, check_queue_name, encode_key
from ._core import _one_line
from ._exceptions import StoreError
from ._stores._seam import Batch, BatchResult, Row

SCHEMA_VERSION = 2

# Live states hold their key; ready states may be claimed once run_at has come.
LIVE = ("queued", "scheduled", "running", "retrying")
FINAL = ("succeeded", "failed", "cancelled")
# What statistics() counts: the states, with the running rows claimed ahead
# of a free slot (started_at still NULL) on their own.
COUNTED = ("queued", "scheduled", "claimed", "running", "retrying", *FINAL)
_COUNTS = """
SELECT CASE WHEN state = 'running' AND started_at IS NULL THEN 'claimed' ELSE state END AS s,
    count(*)
FROM tickler_requests WHERE queue = ? GROUP BY s
"""

# Which states a partial index holds, written out as ORs: SQLite builds a
# temporary table for an IN list of three or more values each time it checks
# a row against an index's WHERE clause, which every UPDATE of state does.
# A query uses a partial index when it holds the index's WHERE term as is.
_READY = "(state = 'queued' OR state = 'scheduled' OR state = 'retrying')"
_LIVE_STATE = "(state = 'queued' OR state = 'scheduled' OR state = 'running' OR state = 'retrying')"

# The indexes version 2 changed, by name: the schema creates them, and the
# migration from version 1 drops and creates them again.
_INDEXES_OF_V2 = {
    "tickler_live_keys": "CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)"
    f" WHERE key IS NOT NULL AND {_LIVE_STATE}",
    "tickler_ready": "CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)"
    f" WHERE {_READY}",
    # A row has finished_at exactly when it is final. Said of finished_at,
    # the index is left alone by a claim, which sets no finished_at.
    "tickler_finished": "CREATE INDEX tickler_finished ON tickler_requests (finished_at)"
    " WHERE finished_at IS NOT NULL",
}

_V2_INDEXES = ";\n".join(_INDEXES_OF_V2.values())

_SCHEMA = f"""
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    key TEXT,
    state TEXT NOT NULL,
    request BLOB NOT NULL,
    result BLOB,
    error_type TEXT,
    error_message TEXT,
    error_traceback TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    run_at REAL NOT NULL,
    enqueued_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    owner TEXT,
    lease_until REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until)
    WHERE state = 'running';
{_V2_INDEXES};
"""

# From each older version, the statements that bring a file to the next one.
_MIGRATIONS = {
    1: tuple(
        statement
        for name, create in _INDEXES_OF_V2.items()
        for statement in (f"DROP INDEX {name}", create)
    ),
}

_INSERT = f"""
INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (queue, key)
    WHERE key IS NOT NULL AND {_LIVE_STATE}
    DO NOTHING
RETURNING id
"""  # noqa: S608 (constants only)

_INSERT_MANY = (
    "INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at) VALUES"
)

_LIVE_ID_OF_KEY = f"""
SELECT id FROM tickler_requests
WHERE queue = ? AND key = ? AND key IS NOT NULL AND {_LIVE_STATE}
"""  # noqa: S608 (constants only)

# Ready rows, and rows whose lease expired (their process died), in the
# order they fell due (run_at): a rescue goes before the backlog queued after
# it, not behind it.
_CLAIM = f"""
UPDATE tickler_requests
SET state = 'running', owner = :owner, lease_until = :lease_until,
    attempts = attempts + 1, started_at = NULL
WHERE id IN (
    SELECT id FROM (
        SELECT * FROM (
            SELECT id, run_at AS due FROM tickler_requests
            WHERE queue = :queue AND {_READY} AND run_at <= :now
            ORDER BY run_at, id LIMIT :limit
        )
        UNION ALL
        SELECT * FROM (
            SELECT id, run_at AS due FROM tickler_requests
            WHERE queue = :queue AND state = 'running' AND lease_until < :now
                AND owner <> :owner AND NOT cancel_requested
            ORDER BY lease_until LIMIT :limit
        )
    )
    ORDER BY due, id LIMIT :limit
)
RETURNING id, request, attempts, key, enqueued_at, run_at
"""  # noqa: S608 (constants only)

# A request whose cancel was asked for, and whose owner's lease lapsed (the
# owner died): it ends CANCELLED, and nobody claims it again. The owner's own
# rows are left to its next look, which withdraws the attempt.
_END_CANCELLED_ORPHANS = """
UPDATE tickler_requests
SET state = 'cancelled', finished_at = ?, owner = NULL, lease_until = NULL
WHERE queue = ? AND state = 'running' AND lease_until < ? AND owner <> ? AND cancel_requested
"""

_NEXT_DUE = f"""
SELECT min(run_at) FROM tickler_requests
WHERE queue = ? AND {_READY}
"""  # noqa: S608 (constants only)

_ANY_LIVE = f"""
SELECT EXISTS (
    SELECT 1 FROM tickler_requests
    WHERE queue = ? AND {_READY}
) OR EXISTS (
    SELECT 1 FROM tickler_requests WHERE queue = ? AND state = 'running'
)
"""  # noqa: S608 (constants only)

_MINE = """
SELECT id, cancel_requested FROM tickler_requests
WHERE queue = ? AND state = 'running' AND owner = ?
"""

_RENEW = """
UPDATE tickler_requests SET lease_until = ?
WHERE queue = ? AND state = 'running' AND owner = ?
"""

# What each outcome sets, from the columns of its VALUES row: column1 is the
# id, then the outcome's values, then {now}, the transaction's time. Every
# finished_at is that time, taken once the write lock is held, so that rows
# become final in the order of finished_at (see Batch.finished_since).
_SETS = {
    # Once its cancel was asked for, a request ends CANCELLED, even if its
    # handler returned (or failed) before the cancel reached it.
    "succeeded": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'succeeded' END,"
        " result = CASE WHEN cancel_requested THEN NULL ELSE v.column2 END,"
        " finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    # A request whose cancel was asked for is never retried nor handed back.
    "retrying": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'retrying' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END,"
        " run_at = v.column2, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    "failed": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'failed' END,"
        " finished_at = {now}, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    "cancelled": (
        "state = 'cancelled', finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    "handed_back": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END, run_at = v.column2,"
        " started_at = coalesce(started_at, {now})"
    ),
    # Claimed but never started: handed back, and the claim's attempt undone.
    "returned": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END, run_at = v.column2,"
        " attempts = attempts - 1"
    ),
}
_ROWS_PER_STATEMENT = 150

# The order of claimed rows: as they fell due, then as they were enqueued.
_DUE_THEN_ID = itemgetter(5, 0)

# "succeeded" for requests whose result is None (kept as NULL), given as a
# JSON list of ids.
_SUCCEEDED_BARE = """
UPDATE tickler_requests
SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'succeeded' END,
    result = NULL, finished_at = ?, owner = NULL, lease_until = NULL,
    started_at = coalesce(started_at, ?)
WHERE id IN (SELECT value FROM json_each(?)) AND owner = ? AND state = 'running'
RETURNING id, state
"""

# Attempts that started since the last batch and still run: a claimed row's
# started_at is NULL until its attempt starts (claimed ahead, not started),
# then the time of the first batch after the start. An attempt that ended
# before that batch gets it from its outcome's write.
_STARTED = """
UPDATE tickler_requests SET started_at = ?
WHERE id IN (SELECT value FROM json_each(?)) AND owner = ? AND state = 'running'
    AND started_at IS NULL
"""

_ROW = """
SELECT id, key, state, request, result, error_type, error_message, error_traceback,
    attempts, enqueued_at, started_at, finished_at
FROM tickler_requests
"""

_RECENT = """
SELECT id FROM tickler_requests
WHERE queue = ? AND state IN ('succeeded', 'failed', 'cancelled') AND finished_at >= ?
"""

# Each queue's retention deletes its own rows only: queues of one store may
# keep their final rows for different times. (The scan is on tickler_finished,
# by finished_at; the queue is a filter on top of it.)
_PRUNE = """
DELETE FROM tickler_requests WHERE id IN (
    SELECT id FROM tickler_requests
    WHERE queue = ? AND state IN ('succeeded', 'failed', 'cancelled') AND finished_at < ?
    LIMIT ?
)
"""

PRUNE_BATCH = 1000


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds")
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}")
    if value == math.inf:
        raise ValueError(f"{name} must be finite")
    return float(value)


def _shifted(
    outcome: tuple[str, int, tuple[Any, ...]], shift: float
) -> tuple[str, int, tuple[Any, ...]]:
    """An outcome whose time (finished_at, or run_at) is moved by ``shift``."""
    kind, request_id, values = outcome
    at = 1 if kind == "succeeded" else 0  # (result, finished_at); the others start with it
    return kind, request_id, (*values[:at], values[at] + shift, *values[at + 1 :])


class SqliteStore:
    """A durable queue in one SQLite file; one file can hold many queues.

    Each request is a row of the table ``tickler_requests``. Its ``key``
    column holds the request's key as canonical JSON, ASCII only:
    ``json.dumps(key, separators=(",", ":"))``, so the str key ``k`` is the
    text ``"k"`` (quotes included) and the tuple ``("order", 7)`` is
    ``["order",7]``; NULL for a request without a key. A row inserted by
    another driver de-duplicates against ``enqueue_in`` and the services
    only if its key is encoded so. An encoded key is at most MAX_KEY_BYTES
    (1,000) bytes and a queue name at most MAX_QUEUE_BYTES (1,000) bytes in
    UTF-8; longer ones are refused with ValueError.

    The tables are created when a service first opens the file, or by
    ``create_schema()``.

    Args:
        path: the database file, created if missing.
        synchronous: ``"FULL"`` (a commit survives power loss) or
            ``"NORMAL"`` (it survives a crash of the process, not of the
            machine).
        lease: seconds a claimed request stays leased; renewed every
            ``lease / 3`` while it runs.
        poll_interval: seconds between looks at the file for work enqueued
            by other processes, cancels and outcomes waited for.
        retention: seconds a final request is kept before it is deleted.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        lease: float = 30.0,
        poll_interval: float = 1.0,
        retention: float = 86400.0,
    ) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError("path must be a str or a path")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError('synchronous must be "FULL" or "NORMAL"')
        self.path = Path(path)
        self.synchronous = synchronous
        self.lease = _positive("lease", lease)
        self.poll_interval = _positive("poll_interval", poll_interval)
        self.retention = _positive("retention", retention, allow_zero=True)
        # The codec of each queue's service in this process, for enqueue_in.
        self._codecs: dict[str, Codec] = {}

    def __repr__(self) -> str:
        return f"tickler.SqliteStore({str(self.path)!r}, synchronous={self.synchronous!r})"

    def use_codec(self, queue: str, codec: Codec) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with ``codec`` (its service's)."""
        self._codecs[queue] = codec

    def listener(self, queue: str) -> None:
        """Nothing tells a SQLite file's readers about new rows: they poll."""
        return

    def connect(self) -> Connection:
        """Open the file, creating or checking its schema. Blocking: call it on a thread."""
        return Connection(self)

    def create_schema(self) -> None:
        """Create tickler's tables in the file, or bring an older schema up to date.

        A service creates them when it starts; call this first to enqueue
        with ``enqueue_in`` before any service has run on the file. Calling
        it again does nothing. Blocking: in a Trio program, call it through
        ``trio.to_thread.run_sync(store.create_schema)``.

        Raises:
            StoreError: the file cannot be opened, is not a SQLite database,
                or holds a foreign schema under tickler's names.
        """
        Connection(self).close()

    def enqueue_in(
        self,
        connection: sqlite3.Connection,
        queue: str,
        request: object,
        *,
        key: object = None,
        delay: float | None = None,
    ) -> int:
        """Write a request through the caller's connection, inside its open transaction.

        The request exists if and only if the caller commits. A service
        running ``queue`` sees it within ``poll_interval``. The request is
        encoded with the codec of the service that runs ``queue`` in this
        process, else as JSON.

        Returns:
            The new request's id, or the live request's id if ``key`` is live.

        Raises:
            StoreError: the file has no tickler schema yet: call
                ``create_schema()`` first, or start a service on the store.
            ValueError: ``queue`` is over MAX_QUEUE_BYTES, or the encoded
                ``key`` over MAX_KEY_BYTES (see the class's note on keys).
        """
        if not isinstance(connection, sqlite3.Connection):
            raise TypeError("connection must be a sqlite3.Connection")
        try:
            return enqueue_through(connection.execute, self._codecs, queue, request, key, delay)
        except sqlite3.OperationalError as exc:
            if "no such table: tickler_requests" not in str(exc):
                raise
            raise StoreError(
                f"{self.path} has no tickler schema yet: create it with store.create_schema()"
                " (blocking: in a Trio program, through trio.to_thread.run_sync), or start a"
                " service on the store first"
            ) from None


_JSON = JsonCodec()


def enqueue_through(
    execute: Any,
    codecs: dict[str, Codec],
    queue: str,
    request: object,
    key: object,
    delay: float | None,
) -> int:
    """enqueue_in for every store: ``execute`` runs a statement on the caller's connection."""
    if not isinstance(queue, str):
        raise TypeError("queue must be a str")
    check_queue_name(queue, "queue")
    key_text = encode_key(key) if key is not None else None
    now = time.time()
    run_at, state = now, "queued"
    if delay is not None:
        run_at += _positive("delay", delay, allow_zero=True)
        state = "scheduled"
    data = codecs.get(queue, _JSON).encode(request)
    if key_text is None:
        return int(execute(_INSERT, (queue, None, state, data, run_at, now)).fetchone()[0])
    return int(insert_keyed(execute, queue, key_text, state, data, run_at, now)[0])


def insert_keyed(
    x: Any, queue: str, key: str, state: str, data: bytes, run_at: float, now: float
) -> tuple[int, bool]:
    """Insert a keyed request: (its id, True), or (the live one's id, False).

    Under PostgreSQL's READ COMMITTED the live row can end between the insert
    that met it and the select that looks for it: then insert again.
    """
    for _ in range(10):
        found = x(_INSERT, (queue, key, state, data, run_at, now)).fetchone()
        if found is not None:
            return found[0], True
        live = x(_LIVE_ID_OF_KEY, (queue, key)).fetchone()
        if live is not None:
            return live[0], False
    raise StoreError(f"the key {key} of queue {queue!r} kept changing hands; try again")


class Connection:
    """One service's connection to the file. Used by one thread at a time."""

    db: Any  # a sqlite3.Connection; PostgresConnection keeps a psycopg one

    def __init__(self, store: SqliteStore) -> None:
        path = store.path
        if path.is_dir():
            raise StoreError(f"{path} is a directory, not a SQLite database")
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=60)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path}: {exc}") from None
        try:
            self._check_schema(db, path)
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {store.synchronous}")
        except BaseException:
            db.close()
            raise
        self.db = db

    @staticmethod
    def _check_schema(db: sqlite3.Connection, path: Path) -> None:
        try:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path} is not a SQLite database ({exc})") from None
        if "tickler_schema" not in tables:
            # The application's own tables may share the file (enqueue_in
            # writes in its transactions), but not tables named as tickler's.
            clashing = sorted(name for name in tables if name.startswith("tickler_"))
            if clashing:
                raise StoreError(
                    f"{path} holds {', '.join(clashing)} but no tickler_schema: a foreign schema"
                    " under tickler's names"
                )
            db.execute("BEGIN IMMEDIATE")
            try:  # (schema creation is SQLite's own; PostgresConnection has its own)
                # Another process may have created it meanwhile.
                if db.execute(
                    "SELECT 1 FROM sqlite_master WHERE name = 'tickler_schema'"
                ).fetchone():
                    db.execute("COMMIT")
                else:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    db.execute("INSERT INTO tickler_schema VALUES (?)", (SCHEMA_VERSION,))
                    db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        row = db.execute("SELECT version FROM tickler_schema").fetchone()
        if row is not None and row[0] in _MIGRATIONS:
            row = Connection._migrate(db)
        if row is None or row[0] != SCHEMA_VERSION:
            raise StoreError(
                f"{path} has tickler schema version {row and row[0]}; this tickler reads"
                f" version {SCHEMA_VERSION}"
            )

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> Any:
        """Bring an older schema to SCHEMA_VERSION, one version at a time, in one transaction."""
        db.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the write lock: another process may have migrated.
            (version,) = db.execute("SELECT version FROM tickler_schema").fetchone()
            while version in _MIGRATIONS:
                for statement in _MIGRATIONS[version]:
                    db.execute(statement)
                version += 1
            db.execute("UPDATE tickler_schema SET version = ?", (version,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return (version,)

    # -- what a dialect provides (PostgresConnection has its own)

    claim_sql = _CLAIM
    lock_rows = ""  # SQLite locks the whole file for a writer: no row locks to ask for
    # Whether the claim's answers may be read once the batch has committed:
    # not in SQLite, which cannot commit while a statement has rows to give.
    reads_after_commit = False

    def _x(self, sql: str, params: Any = ()) -> Any:
        """Execute one statement, written with ? and :name placeholders."""
        return self.db.execute(sql, params)

    # How far each look at what became final reaches back before the last:
    # SQLite's writers commit one at a time, in the order of their times.
    finals_overlap = 1.0

    # The store's clock minus this process's, as _now last found it. The
    # loop's times (an enqueue's run_at, an outcome's) are this process's
    # time.time(): a batch moves them onto the store's clock by adding this.
    _shift = 0.0

    def _now(self) -> float:
        """The batch's time, taken once the write lock is held: this process's clock."""
        return time.time()

    def _begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        self.db.execute("COMMIT")

    def _rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def _notify_if(self, batch: Batch, queue: str) -> None:
        """Tell other processes there is new work: nothing to do for a file."""

    def close(self) -> None:
        self.db.close()

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """Write and ask everything in ``batch`` in one transaction.

        Outcomes are ``("succeeded", id, (result, finished_at))``,
        ``("retrying", id, (run_at, type, message, traceback))``,
        ``("failed", id, (finished_at, type, message, traceback))``,
        ``("cancelled", id, (finished_at,))``, ``("handed_back", id, (run_at,))`` and
        ``("returned", id, (run_at,))`` (claimed, never started);
        each applies only while ``owner`` still holds the request's lease.

        With ``batch.isolate``, each insert runs in a savepoint of its own: a
        row whose insert raises is rolled back alone, reported in
        ``BatchResult.refused`` and entered as (0, False) in ``inserted``,
        and the rest of the batch commits. Without it, any error fails the
        whole batch, and nothing of it is written.
        """
        x = self._x
        result = BatchResult()
        self._begin()
        try:
            now = result.now = self._now()
            inserts, outcomes = batch.inserts, batch.outcomes
            shift = result.shift = self._shift
            if shift:
                inserts = [(e[0], e[1], e[2], e[3] + shift, *e[4:]) for e in inserts]
                outcomes = [_shifted(outcome, shift) for outcome in outcomes]
            if batch.isolate:
                result.inserted = self._insert_isolated(queue, inserts, now, result.refused)
            else:
                result.inserted = self._insert(queue, inserts, now)
            if batch.started:
                self._mark_started(owner, batch.started, now)
            result.applied = self._write_outcomes(owner, outcomes, now)
            if batch.renew:
                x(_RENEW, (now + lease, queue, owner))
                result.mine = {row[0]: bool(row[1]) for row in x(_MINE, (queue, owner))}
            if batch.claim or batch.renew:
                x(_END_CANCELLED_ORPHANS, (now, queue, now, owner))
            claim = None
            if batch.claim:
                claim = x(
                    self.claim_sql,
                    {
                        "owner": owner,
                        "lease_until": now + lease,
                        "now": now,
                        "queue": queue,
                        "limit": batch.claim,
                    },
                )
            # Asked before the claim's rows are read: a server answers the
            # three, and with reads_after_commit the COMMIT, in one round trip.
            next_due = x(_NEXT_DUE, (queue,))
            live = x(_ANY_LIVE, (queue, queue))

            def read() -> None:
                if claim is not None:
                    rows = claim.fetchall()
                    rows.sort(key=_DUE_THEN_ID)
                    result.claimed = rows
                result.next_due = next_due.fetchone()[0]
                result.live = int(live.fetchone()[0])

            if not self.reads_after_commit:
                read()
            if batch.watched:
                result.finals = list(self._finals(batch.watched))
                found = {row.id for row in result.finals}
                result.missing = [i for i in batch.watched if i not in found and not self._has(i)]
            cutoff = now - retention
            if batch.finished_since is not None:
                result.recent = [row[0] for row in x(_RECENT, (queue, batch.finished_since))]
                # What this look reports as recent is read at the next look:
                # keep it until then, whatever the retention.
                cutoff = min(cutoff, batch.finished_since)
            if batch.prune:
                result.pruned = x(_PRUNE, (queue, cutoff, PRUNE_BATCH)).rowcount
            self._notify_if(batch, queue)
            self._commit()
            if self.reads_after_commit:
                read()
        except BaseException:
            self._rollback()
            raise
        return result

    def _insert(
        self, queue: str, inserts: Sequence[tuple[Any, ...]], now: float
    ) -> list[tuple[int, bool]]:
        """Insert in order; requests without a key many to a statement.

        Each entry starts with (key, state, request, run_at).
        """
        x = self._x
        inserted: list[tuple[int, bool]] = []
        plain: list[tuple[Any, ...]] = []

        def flush() -> None:
            for start in range(0, len(plain), _ROWS_PER_STATEMENT):
                chunk = plain[start : start + _ROWS_PER_STATEMENT]
                # Only placeholders are formatted into the statement.
                marks = ",".join(["(?, NULL, ?, ?, ?, ?)"] * len(chunk))
                params = [p for e in chunk for p in (queue, e[1], e[2], e[3], now)]
                ids = self._insert_rows(marks, params, len(chunk))
                inserted.extend((request_id, True) for request_id in ids)
            plain.clear()

        for entry in inserts:
            key = entry[0]
            if key is None:
                plain.append(entry)
                continue
            flush()
            inserted.append(insert_keyed(x, queue, key, entry[1], entry[2], entry[3], now))
        flush()
        return inserted

    def _insert_isolated(
        self, queue: str, inserts: Sequence[tuple[Any, ...]], now: float, refused: dict[int, str]
    ) -> list[tuple[int, bool]]:
        """As _insert, one row at a time, each in a savepoint of its own.

        A row whose insert raises is rolled back to its savepoint alone: it
        is entered in ``refused`` (its position, the error in one line) and
        as (0, False) in what this returns, and the batch goes on. If the
        rollback to the savepoint fails too (the connection is lost, or the
        store ended the transaction), the whole batch fails.
        """
        x = self._x
        inserted: list[tuple[int, bool]] = []
        for position, entry in enumerate(inserts):
            x("SAVEPOINT tickler_row")
            try:
                (row,) = self._insert(queue, (entry,), now)
            except Exception as exc:
                self._after_error_in_transaction()
                x("ROLLBACK TO SAVEPOINT tickler_row")
                refused[position] = _one_line(exc)
                row = (0, False)
            x("RELEASE SAVEPOINT tickler_row")
            inserted.append(row)
        return inserted

    def _after_error_in_transaction(self) -> None:
        """Make the connection take statements again after one failed: nothing to do in SQLite."""

    def _insert_rows(self, marks: str, params: list[Any], expected: int) -> Iterable[int]:
        """Insert the rows of ``marks`` in one statement; their ids, in their order.

        SQLite gives the rows of one statement consecutive ids: each is one
        more than the largest the table ever held (AUTOINCREMENT), and the
        write lock keeps every other writer out. Reading them from the last
        id costs less than RETURNING.
        """
        cursor = self._x(f"{_INSERT_MANY} {marks}", params)
        count, last = cursor.rowcount, cursor.lastrowid
        if count != expected:
            raise StoreError(f"an insert wrote {count} rows of {expected}")
        return range(last - count + 1, last + 1)

    def _write_outcomes(
        self, owner: str, outcomes: list[tuple[str, int, tuple[Any, ...]]], now: float
    ) -> list[str | None]:
        """One UPDATE per kind of outcome (and per chunk), each only under owner's lease.

        Returns the state each outcome wrote, or None where the lease was gone.
        """
        x = self._x
        by_kind: dict[str, list[tuple[int, tuple[Any, ...]]]] = {}
        # Successes without a result (None is kept as NULL) share every value
        # but the id: one statement over a list of ids, which costs SQLite
        # less per row than a join with VALUES.
        bare: list[int] = []
        for kind, request_id, values in outcomes:
            if kind == "succeeded" and values[0] is None:
                bare.append(request_id)
            else:
                by_kind.setdefault(kind, []).append((request_id, values))
        applied: dict[int, str] = {}
        if bare:
            applied.update(x(_SUCCEEDED_BARE, (now, now, json.dumps(bare), owner)).fetchall())
        for kind, entries in by_kind.items():
            width = 2 + len(entries[0][1])
            sets = _SETS[kind].format(now=f"v.column{width}")
            per_statement = max(1, 900 // width)
            for start in range(0, len(entries), per_statement):
                chunk = entries[start : start + per_statement]
                row = "(" + ",".join("?" * width) + ")"
                params = [p for request_id, values in chunk for p in (request_id, *values, now)]
                applied.update(
                    x(
                        f"UPDATE tickler_requests SET {sets}, owner = NULL,"  # noqa: S608
                        f" lease_until = NULL FROM (VALUES {','.join([row] * len(chunk))}) AS v"
                        " WHERE tickler_requests.id = v.column1 AND owner = ?"
                        " AND state = 'running' RETURNING tickler_requests.id, state",
                        [*params, owner],
                    ).fetchall()
                )
        return [applied.get(request_id) for _, request_id, _ in outcomes]

    def _mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        """Write the start of the attempts ``ids``, which run under ``owner``'s lease."""
        self._x(_STARTED, (now, json.dumps(list(ids)), owner))

    def _has(self, request_id: int) -> bool:
        found = self._x("SELECT 1 FROM tickler_requests WHERE id = ?", (request_id,))
        return found.fetchone() is not None

    def _finals(self, ids: Sequence[int]) -> Iterable[Row]:
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            marks = ",".join("?" * len(chunk))
            sql = f"{_ROW} WHERE id IN ({marks}) AND state IN ('succeeded', 'failed', 'cancelled')"
            for row in self._x(sql, chunk):
                yield Row(*row)

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
            if not 0 < id_or_key < 2**63:
                return None
            found = self._x(f"{_ROW} WHERE queue = ? AND id = ?", (queue, id_or_key))
        else:
            key = encode_key(id_or_key)
            found = self._x(
                f"{_ROW} WHERE queue = ? AND key = ? ORDER BY state NOT IN"
                " ('queued', 'scheduled', 'running', 'retrying'), id DESC LIMIT 1",
                (queue, key),
            )
        row = found.fetchone()
        return Row(*row) if row is not None else None

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        """Cancel a live request: at once unless it runs, else ask its owner.

        Returns whether a live request was found, and its id.
        """
        x = self._x
        self._begin()
        try:
            args: tuple[object, ...]
            if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
                if not 0 < id_or_key < 2**63:
                    self._commit()
                    return False, None
                where, args = "id = ?", (id_or_key,)
            else:
                where, args = "key = ?", (encode_key(id_or_key),)
            row = x(
                f"SELECT id, state FROM tickler_requests WHERE queue = ? AND {where}"  # noqa: S608
                f" AND {_LIVE_STATE}{self.lock_rows}",
                (queue, *args),
            ).fetchone()
            if row is None:
                self._commit()
                return False, None
            request_id, state = row
            if state == "running":
                x("UPDATE tickler_requests SET cancel_requested = TRUE WHERE id = ?", (request_id,))
            else:
                x(
                    "UPDATE tickler_requests SET state = 'cancelled', finished_at = ? WHERE id = ?",
                    (self._now(), request_id),
                )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return True, request_id

    def statistics(self, queue: str) -> dict[str, int]:
        """The queue's rows by state; "claimed" are running rows whose attempt has not started."""
        counts = dict.fromkeys(COUNTED, 0)
        for state, count in self._x(_COUNTS, (queue,)):
            counts[state] = count
        return counts
