"""PostgresStore: one queue shared by many replicas, in a PostgreSQL schema.

The batch is the script of _sql.run_batch, over PostgreSQL's dialect,
PostgresSession: psycopg 3's synchronous connections on the service's
worker thread, in pipeline mode; claims with FOR UPDATE SKIP LOCKED; a
NOTIFY per batch that enqueues; and a reconnect when the server went away.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._codec import Codec
from .._exceptions import StoreError
from ._pg_listen import Listener
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

if TYPE_CHECKING:
    import psycopg

logger = logging.getLogger("tickler")

# The version of the tables below.
SCHEMA_VERSION = 1

# A schema's name also names its NOTIFY channel, "tickler_" + schema, which
# PostgreSQL caps at 63 bytes.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,54}$")

_SCHEMA = """
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id BIGSERIAL PRIMARY KEY,
    queue TEXT NOT NULL,
    key TEXT,
    state TEXT NOT NULL,
    request BYTEA NOT NULL,
    result BYTEA,
    error_type TEXT,
    error_message TEXT,
    error_traceback TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    run_at DOUBLE PRECISION NOT NULL,
    enqueued_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    owner TEXT,
    lease_until DOUBLE PRECISION,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE
) WITH (
    -- A queue's rows are updated a few times and deleted: vacuum it early.
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    fillfactor = 70
);
CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)
    WHERE key IS NOT NULL AND state IN ('queued', 'scheduled', 'running', 'retrying');
-- lookup(key) of a finished request, which the index of live keys does not hold.
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)
    WHERE state IN ('queued', 'scheduled', 'retrying');
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until)
    WHERE state = 'running';
CREATE INDEX tickler_finished ON tickler_requests (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled')
"""

# The states of the partial indexes above, in their very words, so that a
# query holding them is planned on the index.
_READY = "state IN ('queued', 'scheduled', 'retrying')"
_LIVE_STATE = "state IN ('queued', 'scheduled', 'running', 'retrying')"
_FINAL_STATE = "state IN ('succeeded', 'failed', 'cancelled')"

_LIVE_WHERE = f"SELECT id, state FROM tickler_requests WHERE queue = %s AND {_LIVE_STATE} AND"  # noqa: S608 (constants only)
_ROW = f"SELECT {ROW_COLUMNS} FROM tickler_requests"  # noqa: S608 (constants only)
# Locks the row until the transaction ends: a cancel commits before or after a batch
# that writes the row, never in between.
_FOR_UPDATE = " FOR UPDATE"

_STATEMENTS = Statements(
    insert=f"{INSERT_COLUMNS} VALUES (%s, %s, %s, %s, %s, %s)"
    f" ON CONFLICT (queue, key) WHERE key IS NOT NULL AND {_LIVE_STATE} DO NOTHING RETURNING id",
    live_id_of_key="SELECT id FROM tickler_requests"  # noqa: S608 (constants only)
    f" WHERE queue = %s AND key = %s AND key IS NOT NULL AND {_LIVE_STATE}",
    renew="UPDATE tickler_requests SET lease_until = %s"
    " WHERE queue = %s AND state = 'running' AND owner = %s",
    mine="SELECT id, cancel_requested FROM tickler_requests"
    " WHERE queue = %s AND state = 'running' AND owner = %s",
    end_cancelled_orphans="UPDATE tickler_requests"
    " SET state = 'cancelled', finished_at = %s, owner = NULL, lease_until = NULL"
    " WHERE queue = %s AND state = 'running' AND lease_until < %s AND owner <> %s"
    " AND cancel_requested",
    recent=f"SELECT id FROM tickler_requests WHERE queue = %s AND {_FINAL_STATE}"  # noqa: S608 (constants only)
    " AND finished_at >= %s",
    prune="DELETE FROM tickler_requests WHERE id IN ("  # noqa: S608 (constants only)
    f" SELECT id FROM tickler_requests WHERE queue = %s AND {_FINAL_STATE} AND finished_at < %s"
    " LIMIT %s)",
    has="SELECT 1 FROM tickler_requests WHERE id = %s",
    row_by_id=f"{_ROW} WHERE queue = %s AND id = %s",
    row_by_key=f"{_ROW} WHERE queue = %s AND key = %s"
    " ORDER BY state NOT IN ('queued', 'scheduled', 'running', 'retrying'), id DESC LIMIT 1",
    live_by_id=f"{_LIVE_WHERE} id = %s{_FOR_UPDATE}",
    live_by_key=f"{_LIVE_WHERE} key = %s{_FOR_UPDATE}",
    ask_cancel="UPDATE tickler_requests SET cancel_requested = TRUE WHERE id = %s",
    cancel_now="UPDATE tickler_requests SET state = 'cancelled', finished_at = %s WHERE id = %s",
    counts=f"SELECT {COUNTED_STATE} AS s, count(*) FROM tickler_requests"  # noqa: S608 (constants only)
    " WHERE queue = %s GROUP BY s",
)

# One statement per wake-up: the oldest ready rows and the expired leases,
# skipping rows another replica is claiming at this instant. Each kind is
# ordered and limited on its own partial index (tickler_ready,
# tickler_running), so a claim reads about as many index entries as it
# claims: one WHERE with an OR of the two would scan and sort every ready
# row. A lease of this replica's own that lapsed (the server was away longer
# than the lease) is never claimed by it again: its attempt still runs here,
# and the next look renews the lease (or hands back a row this replica never
# learned it held). A request whose cancel was asked for is never claimed
# again: the batch ends it CANCELLED instead (rechecked here, since a cancel
# can commit in between). The ids are picked first, as an array, so that the
# rows are then found by primary key: a join with the picked ids may be
# planned as a hash join over a scan of the whole table.
_CLAIM = f"""
UPDATE tickler_requests AS t
SET state = 'running', owner = %(owner)s, lease_until = %(lease_until)s,
    attempts = t.attempts + 1, started_at = NULL
WHERE t.id = ANY(ARRAY(
    SELECT id FROM (
        SELECT id, run_at AS due FROM (
            SELECT id, run_at FROM tickler_requests
            WHERE queue = %(queue)s AND {_READY} AND run_at <= %(now)s
            ORDER BY run_at, id LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS ready
        UNION ALL
        SELECT id, run_at FROM (
            SELECT id, run_at FROM tickler_requests
            WHERE queue = %(queue)s AND state = 'running' AND lease_until < %(now)s
                AND owner <> %(owner)s AND NOT cancel_requested
            ORDER BY lease_until LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS expired
    ) AS both_kinds
    ORDER BY due, id LIMIT %(limit)s
))
RETURNING t.id, t.request, t.attempts, t.key, t.enqueued_at, t.run_at
"""  # noqa: S608 (constants only)

# When the next ready row falls due, and whether anything is live, in one
# statement, each part an ordered LIMIT 1 on its partial index: an EXISTS
# over the ready states may be planned as a sequential scan, which reads
# every finished row ahead of the first ready one.
_DUE_AND_LIVE = f"""
SELECT (
    SELECT run_at FROM tickler_requests
    WHERE queue = %(queue)s AND {_READY}
    ORDER BY run_at LIMIT 1
), (
    SELECT 1 FROM tickler_requests
    WHERE queue = %(queue)s AND state = 'running'
    ORDER BY lease_until LIMIT 1
) IS NOT NULL
"""  # noqa: S608 (constants only)

_STARTED = (
    "UPDATE tickler_requests SET started_at = %s WHERE id = ANY(%s::int8[])"
    " AND owner = %s AND state = 'running' AND started_at IS NULL"
)

_FINALS = f"{_ROW} WHERE id = ANY(%s::int8[]) AND {_FINAL_STATE}"

# The SQL type of each value an outcome writes (see _sql.run_batch), after
# the id and before the batch's time: the arrays unnest() reads them from.
_OUTCOME_TYPES = {
    "succeeded": ("bytea", "float8"),
    "retrying": ("float8", "text", "text", "text"),
    "failed": ("float8", "text", "text", "text"),
    "cancelled": ("float8",),
    "handed_back": ("float8",),
    "returned": ("float8",),
}


@functools.cache
def _outcome_sql(kind: str) -> str:
    """One UPDATE for every outcome of a kind: one text, prepared once, whatever their number."""
    types = ("int8", *_OUTCOME_TYPES[kind], "float8")
    columns = ", ".join(f"column{i}" for i in range(1, len(types) + 1))
    arrays = ", ".join(f"%s::{t}[]" for t in types)
    sets = SETS[kind].format(now=f"v.column{len(types)}")
    return (
        f"UPDATE tickler_requests SET {sets}, owner = NULL, lease_until = NULL"  # noqa: S608
        f" FROM unnest({arrays}) AS v({columns})"
        " WHERE tickler_requests.id = v.column1 AND owner = %s AND state = 'running'"
        " RETURNING tickler_requests.id, state"
    )


# A server host that vanishes without closing its connections (no FIN, no
# RST) would leave a read waiting for ever: TCP keepalives find it within
# about 25 seconds, and the batch is retried. A DSN's own settings win.
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def _open_connection(dsn: str) -> psycopg.Connection[Any]:
    """A connection in autocommit, with TCP keepalives unless the DSN sets its own."""
    import psycopg
    import psycopg.conninfo

    given = psycopg.conninfo.conninfo_to_dict(dsn)
    keepalives: dict[str, Any] = {
        key: value for key, value in _KEEPALIVES.items() if key not in given
    }
    return psycopg.connect(dsn, autocommit=True, connect_timeout=10, **keepalives)


class PostgresStore:
    """A durable queue in a PostgreSQL schema, shared by every replica that uses it.

    Each request is a row of the table ``<schema>.tickler_requests``. Its
    ``key`` column holds the request's key as canonical JSON, ASCII only:
    ``json.dumps(key, separators=(",", ":"))``, so the str key ``k`` is the
    text ``"k"`` (quotes included) and the tuple ``("order", 7)`` is
    ``["order",7]``; NULL for a request without a key. A row inserted by
    another driver de-duplicates against ``enqueue_in`` and the services
    only if its key is encoded so. An encoded key is at most MAX_KEY_BYTES
    (1,000) bytes and a queue name at most MAX_QUEUE_BYTES (1,000) bytes in
    UTF-8, so that both fit one entry of PostgreSQL's index of live keys;
    longer ones are refused with ValueError.

    The schema and its tables are created when a service first connects,
    or by ``create_schema()``.

    Args:
        dsn: a libpq connection string or URL.
        lease: seconds a claimed request stays leased; renewed every
            ``lease / 3`` while it runs.
        poll_interval: seconds between looks for work, cancels and outcomes
            from other replicas (NOTIFY wakes the loop sooner).
        notify: send NOTIFY after a batch that enqueues; False for a pooler
            in transaction mode, which then relies on polling.
        schema: the schema holding tickler's tables, created on first use.
        retention: seconds a final request is kept before it is deleted.
    """

    def __init__(
        self,
        dsn: str,
        *,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        notify: bool = True,
        schema: str = "tickler",
        retention: float = 86400.0,
    ) -> None:
        if not isinstance(dsn, str):
            raise TypeError("dsn must be a str")
        if not isinstance(notify, bool):
            raise TypeError("notify must be a bool")
        if not isinstance(schema, str) or not _IDENTIFIER.match(schema):
            raise ValueError(
                "schema must be a lower-case SQL identifier: letters, digits and _, at most 55"
            )
        self.dsn = dsn
        self.lease = seconds("lease", lease)
        self.poll_interval = seconds("poll_interval", poll_interval)
        self.notify = notify
        self.schema = schema
        self.retention = seconds("retention", retention, allow_zero=True)
        self._codecs: dict[str, Codec] = {}
        self._enqueue_sql: tuple[str, str] | None = None

    def __repr__(self) -> str:
        return f"tickler.PostgresStore(schema={self.schema!r})"

    def connect(self) -> PostgresSession:
        """Connect, creating or checking the schema. Blocking: call it on a thread."""
        return PostgresSession(self)

    def create_schema(self) -> None:
        """Create the schema and tickler's tables in it, unless they exist.

        A service creates them when it starts; call this first to enqueue
        with ``enqueue_in`` before any service has run on the schema.
        Calling it again does nothing; replicas calling it at once create
        the tables once. It opens a connection of its own and closes it.
        Blocking: in a Trio program, call it through
        ``trio.to_thread.run_sync(store.create_schema)``.

        Raises:
            StoreError: the server cannot be reached, the schema holds
                tables that are not tickler's, or another schema version.
        """
        PostgresSession(self).close()

    def enqueue_in(
        self,
        connection: psycopg.Connection[Any],
        queue: str,
        request: object,
        *,
        key: object = None,
        delay: float | None = None,
    ) -> int:
        """Write a request through the caller's psycopg connection, in its open transaction.

        The request exists if and only if the caller commits; on a
        connection in autocommit mode, it is committed at once. Returns its
        id, or the live request's id if ``key`` is live.

        Raises:
            StoreError: the schema has no tickler tables yet: call
                ``create_schema()`` first, or start a service on the store.
                The failed statement has aborted the caller's transaction,
                which must be rolled back.
            ValueError: ``queue`` is over MAX_QUEUE_BYTES, or the encoded
                ``key`` over MAX_KEY_BYTES (see the class's note on keys).
        """
        import psycopg
        import psycopg.errors
        import psycopg.rows

        if not isinstance(connection, psycopg.Connection):
            raise TypeError("connection must be a psycopg.Connection")
        key_text, state, data, run_at, now = prepare_enqueue(
            self._codecs, queue, request, key, delay
        )
        # The server's clock, not this process's: only the delay goes as a
        # value (see _enqueue_statements).
        params: tuple[Any, ...] = (queue, key_text, state, data, run_at - now)
        if self.notify:
            params = (*params, self.channel, queue)  # pg_notify's
        insert, live = self._enqueue_statements()
        # A cursor of its own reads rows as tuples, whatever the connection's
        # row factory.
        with connection.cursor(row_factory=psycopg.rows.tuple_row) as cursor:
            try:
                return int(insert_keyed(cursor.execute, insert, live, key_text, params)[0])
            except psycopg.errors.UndefinedTable:
                raise StoreError(
                    f"schema {self.schema!r} has no tickler tables yet: create them with"
                    " store.create_schema() (blocking: in a Trio program, through"
                    " trio.to_thread.run_sync), or start a service on the store first. The"
                    " failed statement aborted the connection's transaction: roll it back"
                ) from None

    def _enqueue_statements(self) -> tuple[str, str]:
        """enqueue_in's statements, in this store's schema whatever the caller's search_path.

        The insert sends the NOTIFY itself when it inserts a row: one round
        trip a request, and the notification goes out at the caller's commit.
        Its times are the server's, as the claim's are, so that a caller's
        clock cannot hold a request back or start it early: the row is
        enqueued at the statement's time, and due ``delay`` later.
        """
        if self._enqueue_sql is None:
            table = f'"{self.schema}".tickler_requests'
            at = "extract(epoch FROM statement_timestamp())::float8"
            insert = (
                f"INSERT INTO {table} (queue, key, state, request, run_at, enqueued_at)"  # noqa: S608
                f" VALUES (%s, %s, %s, %s, {at} + %s, {at})"
                f" ON CONFLICT (queue, key) WHERE key IS NOT NULL AND {_LIVE_STATE}"
                " DO NOTHING RETURNING id"
            )
            if self.notify:
                # The channel and queue are parameters' values, never SQL:
                # only the placeholders for them are added here.
                insert = f"WITH inserted AS ({insert}) SELECT id, pg_notify(%s, %s) FROM inserted"  # noqa: S608
            live = (
                f"SELECT id FROM {table}"  # noqa: S608
                f" WHERE queue = %s AND key = %s AND key IS NOT NULL AND {_LIVE_STATE}"
            )
            self._enqueue_sql = (insert, live)
        return self._enqueue_sql

    def use_codec(self, queue: str, codec: Codec) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with ``codec`` (its service's)."""
        self._codecs[queue] = codec

    def listener(self, queue: str) -> Listener | None:
        """A LISTEN on this schema's channel for ``queue``, or None with notify=False."""
        if not self.notify:
            return None
        return Listener(
            functools.partial(_open_connection, self.dsn), self.channel, queue, self.poll_interval
        )

    @property
    def channel(self) -> str:
        """The NOTIFY channel of this schema."""
        return f"tickler_{self.schema}"


class PostgresSession:
    """One service's connection to the server, and PostgreSQL's dialect of _sql.run_batch.

    Used by one thread at a time.
    """

    statements = _STATEMENTS
    reads_after_commit = True  # a pipeline's answers stay with their cursors
    # Replicas commit concurrently, so a row can become final with a time
    # earlier than a look that did not see it yet: reach back further (the
    # sweep every 30 looks catches a commit slower than this).
    finals_overlap = 10.0

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.db = self._open()
        self._pipeline: psycopg.Pipeline | None = None

    def _open(self) -> psycopg.Connection[Any]:
        import psycopg

        store = self.store
        try:
            db = _open_connection(store.dsn)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from None
        try:
            _check_schema(db, store.schema)
        except BaseException:
            db.close()
            raise
        return db

    # -- the Session

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """_sql.run_batch in psycopg's pipeline mode.

        A statement whose answer the batch does not read (BEGIN, the lease
        renewal, the end of cancelled orphans, the NOTIFY) waits to go out
        with the next one whose answer it reads: fewer round trips, each of
        which costs a wait for the GIL as well as the network.
        """
        self._reconnect_if_broken()
        try:
            with self.db.pipeline() as pipeline:
                self._pipeline = pipeline
                try:
                    return run_batch(self, queue, owner, lease, retention, batch)
                finally:
                    self._pipeline = None
        except BaseException:
            # The session's state after an error in pipeline mode is not
            # certain (the transaction, the prepared statements psycopg
            # believes the server holds): close it, which rolls the batch
            # back, and the next batch connects again.
            self._reset("a failed batch")
            raise

    # psycopg learns that the server ended a session only when a statement
    # fails: these calls then connect again and try once more. (A batch
    # needs no such care: the loop retries it, and begin() reconnects.)
    # Any other error is rolled back (see rollback()), so that it cannot
    # fail the calls and batches after it.

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        return self._twice(lookup, queue, id_or_key)  # type: ignore[no-any-return]

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        return self._twice(cancel, queue, id_or_key)  # type: ignore[no-any-return]

    def statistics(self, queue: str) -> dict[str, int]:
        return self._twice(counts, queue)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.db.close()

    # -- the Dialect

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.db.execute(sql, params)

    def begin(self) -> None:
        self._reconnect_if_broken()  # the server went away, and the loop retries
        self.db.execute("BEGIN")

    def commit(self) -> None:
        self.db.execute("COMMIT")
        if self._pipeline is not None:
            self._pipeline.sync()  # the COMMIT's answer, and its error, before run returns

    def rollback(self) -> None:
        """Roll back after an error; out of a batch, close the session if that fails.

        In a batch (in pipeline mode), run() closes the session instead.
        psycopg's rollback() also forgets the statements it prepared, on
        both sides, which an error may have left out of step.
        """
        import psycopg

        if self._pipeline is not None:
            return
        db = self.db
        if db.closed or db.broken:
            return
        try:
            db.rollback()
            if db.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                return
        except Exception:  # noqa: S110 (the session is closed below)
            pass
        self._reset("a failed rollback")

    def now(self) -> tuple[float, float]:
        """The server's clock: one clock for every replica's leases and times.

        The shift from this process's clock to the server's is measured from
        this process's time before the question, so it is never less than the
        true one: a request enqueued here before the batch is due in the
        batch's claim, and a delay never ends early.
        """
        asked_at = time.time()
        row = self.db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        now = float(row[0])
        return now, now - asked_at

    def insert_rows(
        self, queue: str, entries: Sequence[tuple[Any, ...]], now: float
    ) -> Iterable[int]:
        """One INSERT of many rows; their ids read back, since other sessions draw from the
        same sequence."""
        # Only placeholders are formatted into the statement.
        marks = ",".join(["(%s, NULL, %s, %s, %s, %s)"] * len(entries))
        params = [p for e in entries for p in (queue, e[1], e[2], e[3], now)]
        rows = self.db.execute(f"{INSERT_COLUMNS} VALUES {marks} RETURNING id", params).fetchall()
        # One statement allocates ids in the order of its rows.
        return sorted(request_id for (request_id,) in rows)

    def write_outcomes(
        self, owner: str, outcomes: Sequence[tuple[str, int, tuple[Any, ...]]], now: float
    ) -> list[str | None]:
        """One UPDATE per kind: its values as arrays, one per column, joined by unnest()."""
        by_kind: dict[str, list[tuple[Any, ...]]] = {}
        for kind, request_id, values in outcomes:
            by_kind.setdefault(kind, []).append((request_id, *values, now))
        applied: dict[int, str] = {}
        for kind, rows in by_kind.items():
            arrays = [list(column) for column in zip(*rows, strict=True)]
            applied.update(self.db.execute(_outcome_sql(kind), [*arrays, owner]).fetchall())
        return [applied.get(request_id) for _, request_id, _ in outcomes]

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        self.db.execute(_STARTED, (now, list(ids), owner))

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
        cursor = self.db.execute(_DUE_AND_LIVE, {"queue": queue})

        def read() -> tuple[float | None, int]:
            due, running = cursor.fetchone()  # type: ignore[misc]
            return due, int(due is not None or bool(running))

        return read

    def finals(self, ids: Sequence[int]) -> list[Row]:
        return [Row(*row) for row in self.db.execute(_FINALS, (list(ids),))]

    def notify(self, queue: str) -> None:
        """Other replicas wake and claim."""
        if self.store.notify:
            self.db.execute("SELECT pg_notify(%s, %s)", (self.store.channel, queue))

    def after_error_in_transaction(self) -> None:
        """Take the pipeline out of its aborted state: the savepoint's rollback goes next.

        The transaction stays open (failed, until rolled back to a
        savepoint); what the pipeline skipped was only what followed the
        error, whose errors are reported here and passed over.
        """
        import psycopg

        if self._pipeline is not None:
            try:
                self._pipeline.sync()
            except psycopg.Error:
                if self.db.closed or self.db.broken:
                    raise

    # -- connection handling

    def _twice(self, call: Callable[..., Any], *args: Any) -> Any:
        import psycopg

        self._reconnect_if_broken()
        try:
            return call(self, *args)
        except psycopg.OperationalError:
            lost = self.db.closed or self.db.broken
            self.rollback()
            if not lost:
                raise
        except BaseException:
            self.rollback()
            raise
        self._reconnect_if_broken()
        return call(self, *args)

    def _reset(self, after: str) -> None:
        """Close the session an error left in doubt; the next call connects again."""
        db = self.db
        if db.closed:
            return
        if not db.broken:  # (else the session was lost, not closed here)
            self._reset_after = after
        with contextlib.suppress(Exception):  # closed or not, it is not used again
            db.close()

    # Why this connection closed its last session itself, until it connects again.
    _reset_after: str | None = None

    def _reconnect_if_broken(self) -> None:
        if self.db.closed or self.db.broken:
            self.db = self._open()
            if self._reset_after is not None:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been closed"
                    " after %s",
                    self.store,
                    self._reset_after,
                )
                self._reset_after = None
            else:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been lost",
                    self.store,
                )


def _check_schema(db: psycopg.Connection[Any], schema: str) -> None:
    """Create the schema and tickler's tables in it, or check the ones it holds."""
    with db.transaction():
        # One replica creates the schema; the others wait for it here.
        db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tickler:{schema}",))
        db.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        tables = {
            row[0]
            for row in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            )
        }
        if "tickler_schema" not in tables:
            if tables:
                raise StoreError(
                    f"schema {schema!r} holds tables that are not tickler's;"
                    " give tickler a schema of its own"
                )
            db.execute(f'SET LOCAL search_path TO "{schema}"')
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT INTO tickler_schema VALUES (%s)", (SCHEMA_VERSION,))
    db.execute(f'SET search_path TO "{schema}"')
    row = db.execute("SELECT version FROM tickler_schema").fetchone()
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"schema {schema!r} has tickler schema version {row and row[0]}; this tickler"
            f" reads version {SCHEMA_VERSION}"
        )


_FAILURES = (
    "SELECT id, attempts, error_type, error_message FROM tickler_requests"
    " WHERE queue = %s AND state = 'failed' ORDER BY finished_at DESC LIMIT %s"
)


def inspect(dsn: str, schema: str, latest: int) -> dict[str, QueueReport]:
    """Each queue of the schema: its counts and ``latest`` failures, in a read-only session.

    Raises:
        ValueError: the server cannot be reached (the message may quote the DSN,
            password and all), or the schema is not a tickler store of this version.
    """
    import psycopg
    import psycopg.sql

    try:
        db = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except (psycopg.Error, ValueError) as exc:
        raise ValueError(f"cannot connect: {exc}".strip()) from None
    try:
        db.execute("SET default_transaction_read_only = on")
        db.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(schema)))
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except psycopg.Error:
            raise ValueError(f"schema {schema!r}: not a tickler store") from None
        if version is None or version[0] != SCHEMA_VERSION:
            raise ValueError(f"schema {schema!r}: tickler schema version unknown")
        return report(lambda sql, params: db.execute(sql, params).fetchall(), _FAILURES, latest)
    finally:
        db.close()
