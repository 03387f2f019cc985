"""SqliteStore: the queue's source of truth in one SQLite file, for every process on the host.

Everything here is synchronous and runs on a worker thread the service owns,
one batch per wake-up of its loop, each batch one transaction: the script of
_sql.run_batch, over SQLite's dialect, SqliteSession.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .._codec import Codec
from .._exceptions import StoreError
from ._seam import Batch, BatchResult, Claimed, Row
from ._sql import (
    COUNTED_STATE,
    INSERT_COLUMNS,
    ROW_COLUMNS,
    SETS,
    QueueReport,
    Statements,
    cancel,
    counts,
    insert_keyed,
    lookup,
    prepare_enqueue,
    report,
    run_batch,
    seconds,
)

SCHEMA_VERSION = 2

# Which states a partial index holds, written out as ORs: SQLite builds a
# temporary table for an IN list of three or more values each time it checks
# a row against an index's WHERE clause, which every UPDATE of state does.
# A query uses a partial index when it holds the index's WHERE term as is.
_READY = "(state = 'queued' OR state = 'scheduled' OR state = 'retrying')"
_LIVE_STATE = "(state = 'queued' OR state = 'scheduled' OR state = 'running' OR state = 'retrying')"
_FINAL_STATE = "state IN ('succeeded', 'failed', 'cancelled')"

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
{INSERT_COLUMNS}
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (queue, key)
    WHERE key IS NOT NULL AND {_LIVE_STATE}
    DO NOTHING
RETURNING id
"""

_LIVE_ID_OF_KEY = f"""
SELECT id FROM tickler_requests
WHERE queue = ? AND key = ? AND key IS NOT NULL AND {_LIVE_STATE}
"""  # noqa: S608 (constants only)

_LIVE_WHERE = f"SELECT id, state FROM tickler_requests WHERE queue = ? AND {_LIVE_STATE} AND"  # noqa: S608 (constants only)
_ROW = f"SELECT {ROW_COLUMNS} FROM tickler_requests"  # noqa: S608 (constants only)

_STATEMENTS = Statements(
    insert=_INSERT,
    live_id_of_key=_LIVE_ID_OF_KEY,
    renew="UPDATE tickler_requests SET lease_until = ?"
    " WHERE queue = ? AND state = 'running' AND owner = ?",
    mine="SELECT id, cancel_requested FROM tickler_requests"
    " WHERE queue = ? AND state = 'running' AND owner = ?",
    end_cancelled_orphans="UPDATE tickler_requests"
    " SET state = 'cancelled', finished_at = ?, owner = NULL, lease_until = NULL"
    " WHERE queue = ? AND state = 'running' AND lease_until < ? AND owner <> ?"
    " AND cancel_requested",
    recent=f"SELECT id FROM tickler_requests WHERE queue = ? AND {_FINAL_STATE}"  # noqa: S608 (constants only)
    " AND finished_at >= ?",
    # (The scan is on tickler_finished, by finished_at; the queue is a filter on top of it.)
    prune="DELETE FROM tickler_requests WHERE id IN ("  # noqa: S608 (constants only)
    f" SELECT id FROM tickler_requests WHERE queue = ? AND {_FINAL_STATE} AND finished_at < ?"
    " LIMIT ?)",
    has="SELECT 1 FROM tickler_requests WHERE id = ?",
    row_by_id=f"{_ROW} WHERE queue = ? AND id = ?",
    row_by_key=f"{_ROW} WHERE queue = ? AND key = ?"
    " ORDER BY state NOT IN ('queued', 'scheduled', 'running', 'retrying'), id DESC LIMIT 1",
    live_by_id=f"{_LIVE_WHERE} id = ?",
    live_by_key=f"{_LIVE_WHERE} key = ?",
    ask_cancel="UPDATE tickler_requests SET cancel_requested = TRUE WHERE id = ?",
    cancel_now="UPDATE tickler_requests SET state = 'cancelled', finished_at = ? WHERE id = ?",
    counts=f"SELECT {COUNTED_STATE} AS s, count(*) FROM tickler_requests"  # noqa: S608 (constants only)
    " WHERE queue = ? GROUP BY s",
)

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

_DUE_AND_LIVE = f"""
SELECT
    (SELECT min(run_at) FROM tickler_requests WHERE queue = :queue AND {_READY}),
    EXISTS (SELECT 1 FROM tickler_requests WHERE queue = :queue AND {_READY})
    OR EXISTS (SELECT 1 FROM tickler_requests WHERE queue = :queue AND state = 'running')
"""  # noqa: S608 (constants only)

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
        self.lease = seconds("lease", lease)
        self.poll_interval = seconds("poll_interval", poll_interval)
        self.retention = seconds("retention", retention, allow_zero=True)
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

    def connect(self) -> SqliteSession:
        """Open the file, creating or checking its schema. Blocking: call it on a thread."""
        return SqliteSession(self)

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
        SqliteSession(self).close()

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
        key_text, state, data, run_at, now = prepare_enqueue(
            self._codecs, queue, request, key, delay
        )
        params = (queue, key_text, state, data, run_at, now)
        try:
            return int(
                insert_keyed(connection.execute, _INSERT, _LIVE_ID_OF_KEY, key_text, params)[0]
            )
        except sqlite3.OperationalError as exc:
            if "no such table: tickler_requests" not in str(exc):
                raise
            raise StoreError(
                f"{self.path} has no tickler schema yet: create it with store.create_schema()"
                " (blocking: in a Trio program, through trio.to_thread.run_sync), or start a"
                " service on the store first"
            ) from None


class SqliteSession:
    """One service's connection to the file, and SQLite's dialect of _sql.run_batch.

    Used by one thread at a time.
    """

    statements = _STATEMENTS
    # Not in SQLite, which cannot commit while a statement has rows to give.
    reads_after_commit = False
    # How far each look at what became final reaches back before the last:
    # SQLite's writers commit one at a time, in the order of their times.
    finals_overlap = 1.0

    def __init__(self, store: SqliteStore) -> None:
        path = store.path
        if path.is_dir():
            raise StoreError(f"{path} is a directory, not a SQLite database")
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=60)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path}: {exc}") from None
        try:
            _check_schema(db, path)
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {store.synchronous}")
        except BaseException:
            db.close()
            raise
        self.db = db

    # -- the Session

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """Write and ask everything in ``batch`` in one transaction (see _sql.run_batch)."""
        return run_batch(self, queue, owner, lease, retention, batch)

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        return lookup(self, queue, id_or_key)

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        return cancel(self, queue, id_or_key)

    def statistics(self, queue: str) -> dict[str, int]:
        return counts(self, queue)

    def close(self) -> None:
        self.db.close()

    # -- the Dialect

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.db.execute(sql, params)

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def now(self) -> tuple[float, float]:
        """This process's clock: the file has none of its own."""
        return time.time(), 0.0

    def insert_rows(
        self, queue: str, entries: Sequence[tuple[Any, ...]], now: float
    ) -> Iterable[int]:
        """One INSERT of many rows; their ids counted back from the last.

        SQLite gives the rows of one statement consecutive ids: each is one
        more than the largest the table ever held (AUTOINCREMENT), and the
        write lock keeps every other writer out. Reading them from the last
        id costs less than RETURNING.
        """
        # Only placeholders are formatted into the statement.
        marks = ",".join(["(?, NULL, ?, ?, ?, ?)"] * len(entries))
        params = [p for e in entries for p in (queue, e[1], e[2], e[3], now)]
        cursor = self.db.execute(f"{INSERT_COLUMNS} VALUES {marks}", params)
        count, last = cursor.rowcount, cursor.lastrowid or 0
        if count != len(entries):
            raise StoreError(f"an insert wrote {count} rows of {len(entries)}")
        return range(last - count + 1, last + 1)

    def write_outcomes(
        self, owner: str, outcomes: Sequence[tuple[str, int, tuple[Any, ...]]], now: float
    ) -> list[str | None]:
        """One UPDATE per kind of outcome (and per chunk), joined with its rows as VALUES."""
        x = self.db.execute
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
            sets = SETS[kind].format(now=f"v.column{width}")
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

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        self.db.execute(_STARTED, (now, json.dumps(list(ids)), owner))

    def claim(
        self, queue: str, owner: str, now: float, lease_until: float, limit: int
    ) -> Callable[[], list[Claimed]]:
        params = {
            "owner": owner,
            "lease_until": lease_until,
            "now": now,
            "queue": queue,
            "limit": limit,
        }
        return self.db.execute(_CLAIM, params).fetchall

    def due_and_live(self, queue: str) -> Callable[[], tuple[float | None, int]]:
        return self.db.execute(_DUE_AND_LIVE, {"queue": queue}).fetchone

    def finals(self, ids: Sequence[int]) -> list[Row]:
        found: list[Row] = []
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            marks = ",".join("?" * len(chunk))
            sql = f"{_ROW} WHERE id IN ({marks}) AND {_FINAL_STATE}"
            found.extend(Row(*row) for row in self.db.execute(sql, chunk))
        return found

    def notify(self, queue: str) -> None:
        """Nothing tells a file's readers about new rows: they poll."""

    def after_error_in_transaction(self) -> None:
        """Nothing to do: SQLite takes the next statement after one failed."""


def _check_schema(db: sqlite3.Connection, path: Path) -> None:
    """Create tickler's tables in the file, or check (and migrate) the ones it holds."""
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
        try:
            # Another process may have created it meanwhile.
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tickler_schema'").fetchone():
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
        row = _migrate(db)
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has tickler schema version {row and row[0]}; this tickler reads"
            f" version {SCHEMA_VERSION}"
        )


def _migrate(db: sqlite3.Connection) -> tuple[int]:
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


_FAILURES = (
    "SELECT id, attempts, error_type, error_message FROM tickler_requests"
    " WHERE queue = ? AND state = 'failed' ORDER BY finished_at DESC LIMIT ?"
)


def inspect(path: Path, latest: int) -> dict[str, QueueReport]:
    """Each queue of the file: its counts and ``latest`` failures, read without writing.

    Raises:
        ValueError: the file is missing, or not a tickler store of a version this reads.
    """
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise ValueError(f"{path}: cannot open it ({exc})") from None
    try:
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except sqlite3.DatabaseError:
            raise ValueError(f"{path}: not a tickler store") from None
        # An older version reads the same (a migration changes only indexes).
        if version is None or (version[0] != SCHEMA_VERSION and version[0] not in _MIGRATIONS):
            raise ValueError(f"{path}: tickler schema version {version and version[0]} unknown")
        return report(db.execute, _FAILURES, latest)
    finally:
        db.close()
