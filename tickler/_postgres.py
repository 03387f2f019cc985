"""PostgresStore: one queue shared by many replicas, in a PostgreSQL schema.

The batch logic is SqliteStore's (see _sqlite.Connection); this module gives
it PostgreSQL's dialect: psycopg 3's synchronous connections on the service's
worker thread, claims with FOR UPDATE SKIP LOCKED, a NOTIFY per batch that
enqueues, and a reconnect when the server went away.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ._codec import Codec
from ._exceptions import StoreError
from ._sqlite import (
    _ANY_LIVE,
    _INSERT,
    _INSERT_MANY,
    _LIVE_ID_OF_KEY,
    _NEXT_DUE,
    _SETS,
    Connection,
    _positive,
    enqueue_through,
)
from ._stores._seam import Batch, BatchResult

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
_CLAIM = """
UPDATE tickler_requests AS t
SET state = 'running', owner = :owner, lease_until = :lease_until,
    attempts = t.attempts + 1, started_at = NULL
WHERE t.id = ANY(ARRAY(
    SELECT id FROM (
        SELECT id, run_at AS due FROM (
            SELECT id, run_at FROM tickler_requests
            WHERE queue = :queue AND state IN ('queued', 'scheduled', 'retrying')
                AND run_at <= :now
            ORDER BY run_at, id LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ) AS ready
        UNION ALL
        SELECT id, run_at FROM (
            SELECT id, run_at FROM tickler_requests
            WHERE queue = :queue AND state = 'running' AND lease_until < :now
                AND owner <> :owner AND NOT cancel_requested
            ORDER BY lease_until LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ) AS expired
    ) AS both_kinds
    ORDER BY due, id LIMIT :limit
))
RETURNING t.id, t.request, t.attempts, t.key, t.enqueued_at, t.run_at
"""

# After the claim, the batch asks when the next ready row falls due and
# whether anything is live. Both are answered here by one statement, each
# part an ordered LIMIT 1 on its partial index: an EXISTS over the ready
# states may be planned as a sequential scan, which reads every finished
# row ahead of the first ready one.
_DUE_AND_LIVE = """
SELECT (
    SELECT run_at FROM tickler_requests
    WHERE queue = %(queue)s AND state IN ('queued', 'scheduled', 'retrying')
    ORDER BY run_at LIMIT 1
), (
    SELECT 1 FROM tickler_requests
    WHERE queue = %(queue)s AND state = 'running'
    ORDER BY lease_until LIMIT 1
) IS NOT NULL
"""

_PLACEHOLDER = re.compile(r"\?|(?<!:):([a-z_]+)")


@functools.lru_cache(maxsize=1024)
def _psycopg_style(sql: str) -> str:
    """SQLite's ? and :name placeholders as psycopg's %s and %(name)s."""
    return _PLACEHOLDER.sub(lambda m: f"%({m.group(1)})s" if m.group(1) else "%s", sql)


# The SQL type of each value an outcome writes (see Connection.run), after
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
    sets = _SETS[kind].format(now=f"v.column{len(types)}")
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


class _DueAndLive:
    """_DUE_AND_LIVE's one row, read once, when _NEXT_DUE's or _ANY_LIVE's answer is."""

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor
        self.row: tuple[Any, bool] | None = None

    def get(self, which: int) -> Any:
        if self.row is None:
            due, running = self.cursor.fetchone()
            self.row = (due, due is not None or bool(running))
        return self.row[which]


class _Answer:
    """_NEXT_DUE's answer (which=0) or _ANY_LIVE's (which=1), from _DueAndLive."""

    def __init__(self, both: _DueAndLive, which: int) -> None:
        self.both = both
        self.which = which

    def fetchone(self) -> tuple[Any]:
        return (self.both.get(self.which),)


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
        self.lease = _positive("lease", lease)
        self.poll_interval = _positive("poll_interval", poll_interval)
        self.notify = notify
        self.schema = schema
        self.retention = _positive("retention", retention, allow_zero=True)
        self._codecs: dict[str, Codec] = {}
        self._enqueue_sql: dict[str, str] | None = None

    def __repr__(self) -> str:
        return f"tickler.PostgresStore(schema={self.schema!r})"

    def connect(self) -> PostgresConnection:
        """Connect, creating or checking the schema. Blocking: call it on a thread."""
        return PostgresConnection(self)

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
        PostgresConnection(self).close()

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
        # A cursor of its own reads rows as tuples, whatever the connection's
        # row factory.
        statements = self._enqueue_statements()
        with connection.cursor(row_factory=psycopg.rows.tuple_row) as cursor:

            def x(sql: str, params: Any) -> Any:
                if sql == _INSERT:
                    # The server's clock, not this process's: only the delay
                    # goes as a value (see _enqueue_statements).
                    *values, run_at, now = params
                    params = (*values, run_at - now)
                    if self.notify:
                        params = (*params, self.channel, queue)  # pg_notify's
                return cursor.execute(statements[sql], params)

            try:
                return enqueue_through(x, self._codecs, queue, request, key, delay)
            except psycopg.errors.UndefinedTable:
                raise StoreError(
                    f"schema {self.schema!r} has no tickler tables yet: create them with"
                    " store.create_schema() (blocking: in a Trio program, through"
                    " trio.to_thread.run_sync), or start a service on the store first. The"
                    " failed statement aborted the connection's transaction: roll it back"
                ) from None

    def _enqueue_statements(self) -> dict[str, str]:
        """enqueue_in's statements, in this store's schema whatever the caller's search_path.

        The insert sends the NOTIFY itself when it inserts a row: one round
        trip a request, and the notification goes out at the caller's commit.
        Its times are the server's, as the claim's are, so that a caller's
        clock cannot hold a request back or start it early: the row is
        enqueued at the statement's time, and due ``delay`` later.
        """
        if self._enqueue_sql is None:
            qualified = f'"{self.schema}".tickler_requests'
            at = "extract(epoch FROM statement_timestamp())::float8"
            values = "VALUES (%s, %s, %s, %s, %s, %s)"
            insert = _psycopg_style(_INSERT).replace("tickler_requests", qualified, 1)
            assert values in insert
            insert = insert.replace(values, f"VALUES (%s, %s, %s, %s, {at} + %s, {at})")
            if self.notify:
                # The channel and queue are parameters' values, never SQL:
                # only the placeholders for them are added here.
                insert = f"WITH inserted AS ({insert}) SELECT id, pg_notify(%s, %s) FROM inserted"  # noqa: S608
            live = _psycopg_style(_LIVE_ID_OF_KEY).replace("tickler_requests", qualified, 1)
            self._enqueue_sql = {_INSERT: insert, _LIVE_ID_OF_KEY: live}
        return self._enqueue_sql

    def use_codec(self, queue: str, codec: Codec) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with ``codec`` (its service's)."""
        self._codecs[queue] = codec

    def listener(self, queue: str) -> Listener | None:
        """A LISTEN on this schema's channel for ``queue``, or None with notify=False."""
        return Listener(self, queue) if self.notify else None

    @property
    def channel(self) -> str:
        """The NOTIFY channel of this schema."""
        return f"tickler_{self.schema}"


class Listener:
    """LISTEN on a connection of its own, in the Trio thread; calls ``wake`` per notification.

    Connecting and the LISTEN run on a worker thread; the wait for
    notifications is ``trio.lowlevel.wait_readable`` on the connection's
    socket, then ``psycopg.pq`` reads them: no thread hop between a NOTIFY
    and the loop (see the README for the measurement). A lost connection is
    opened again every second, with a WARNING when it is lost and one when
    it listens again; the poll covers whatever was notified meanwhile.
    """

    def __init__(self, store: PostgresStore, queue: str) -> None:
        self.store = store
        self.queue = queue

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg
        import psycopg.sql

        listen = psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(self.store.channel))
        db = _open_connection(self.store.dsn)
        try:
            db.execute(listen)
        except BaseException:
            db.close()
            raise
        return db

    async def run(self, wake: Callable[[], None]) -> None:
        """Listen until cancelled."""
        import psycopg

        lost: str | None = None  # why the last connection failed, until one listens again
        queue = self.queue.encode()
        while True:
            try:
                db = await trio.to_thread.run_sync(self._connect)
            except psycopg.Error as exc:
                lost = self._lost(lost, exc)
                await trio.sleep(1.0)
                continue
            pgconn = db.pgconn
            socket = pgconn.socket
            try:
                if lost is not None:
                    logger.warning("service %r: listening for NOTIFY again", self.queue)
                    lost = None
                wake()  # what was notified before the LISTEN, or while it was lost
                while True:
                    await trio.lowlevel.wait_readable(socket)
                    pgconn.consume_input()  # raises once the connection is lost
                    while (notice := pgconn.notifies()) is not None:
                        if notice.extra == queue:
                            wake()
            except psycopg.Error as exc:
                lost = self._lost(lost, exc)
            finally:
                with trio.CancelScope(shield=True):
                    trio.lowlevel.notify_closing(socket)
                    await trio.to_thread.run_sync(db.close)
            await trio.sleep(1.0)  # (only a lost connection gets here)

    def _lost(self, lost: str | None, exc: Exception) -> str:
        if lost is None:
            lost = " ".join(str(exc).split()) or type(exc).__name__
            logger.warning(
                "service %r: the NOTIFY connection failed (%s); trying again every"
                " second, and polling every %s s meanwhile",
                self.queue,
                lost,
                self.store.poll_interval,
            )
        return lost


class PostgresConnection(Connection):
    """One service's connection to the server, used by one thread at a time."""

    claim_sql = _CLAIM
    lock_rows = " FOR UPDATE"
    reads_after_commit = True  # a pipeline's answers stay with their cursors
    # Replicas commit concurrently, so a row can become final with a time
    # earlier than a look that did not see it yet: reach back further (the
    # sweep every 30 looks catches a commit slower than this).
    finals_overlap = 10.0

    def _now(self) -> float:
        """The server's clock: one clock for every replica's leases and times.

        Also sets the shift from this process's clock to the server's. It is
        measured from this process's time before the question, so it is
        never less than the true one: a request enqueued here before the
        batch is due in the batch's claim, and a delay never ends early.
        """
        asked_at = time.time()
        row = self.db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        now = float(row[0])
        self._shift = now - asked_at
        return now

    def __init__(self, store: PostgresStore) -> None:
        self.pg_store = store
        self.db = self._open()
        # (queue, the answer) of the batch's _NEXT_DUE, which _ANY_LIVE reads too.
        self._due_and_live: tuple[str, _DueAndLive] | None = None
        self._pipeline: psycopg.Pipeline | None = None

    def _open(self) -> psycopg.Connection[Any]:
        import psycopg

        store = self.pg_store
        try:
            db = _open_connection(store.dsn)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from None
        try:
            self._check_schema(db, store.schema)
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _check_schema(db: psycopg.Connection[Any], schema: str) -> None:  # type: ignore[override]
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

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """Connection.run in psycopg's pipeline mode.

        A statement whose answer the batch does not read (BEGIN, the lease
        renewal, the end of cancelled orphans, the NOTIFY) waits to go out
        with the next one whose answer it reads: fewer round trips, each of
        which costs a wait for the GIL as well as the network.
        """
        self._reconnect_if_broken()
        self._due_and_live = None
        try:
            with self.db.pipeline() as pipeline:
                self._pipeline = pipeline
                try:
                    return super().run(queue, owner, lease, retention, batch)
                finally:
                    self._pipeline = None
        except BaseException:
            # The session's state after an error in pipeline mode is not
            # certain (the transaction, the prepared statements psycopg
            # believes the server holds): close it, which rolls the batch
            # back, and the next batch connects again.
            self._reset("a failed batch")
            raise

    def _x(self, sql: str, params: Any = ()) -> Any:
        if sql is _NEXT_DUE:
            # _ANY_LIVE comes next in the batch: one statement answers both,
            # read only when asked, so that it goes out with the claim.
            (queue,) = params
            self._due_and_live = (
                queue,
                _DueAndLive(self.db.execute(_DUE_AND_LIVE, {"queue": queue})),
            )
            return _Answer(self._due_and_live[1], 0)
        if sql is _ANY_LIVE and self._due_and_live is not None:
            queue, both = self._due_and_live
            if queue == params[0]:
                self._due_and_live = None
                return _Answer(both, 1)
        return self.db.execute(_psycopg_style(sql), params)

    def _insert_rows(self, marks: str, params: list[Any], expected: int) -> Iterable[int]:
        """As Connection's, but read back: other sessions draw from the same sequence."""
        rows = self._x(f"{_INSERT_MANY} {marks} RETURNING id", params).fetchall()
        # One statement allocates ids in the order of its rows.
        return sorted(request_id for (request_id,) in rows)

    def _mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        """As Connection's, with the ids as an array."""
        self.db.execute(
            "UPDATE tickler_requests SET started_at = %s WHERE id = ANY(%s::int8[])"
            " AND owner = %s AND state = 'running' AND started_at IS NULL",
            (now, list(ids), owner),
        )

    def _write_outcomes(
        self, owner: str, outcomes: list[tuple[str, int, tuple[Any, ...]]], now: float
    ) -> list[str | None]:
        """As Connection's, one statement per kind: its values as arrays, one per column."""
        by_kind: dict[str, list[tuple[Any, ...]]] = {}
        for kind, request_id, values in outcomes:
            if len(values) != len(_OUTCOME_TYPES.get(kind, ())):
                return super()._write_outcomes(owner, outcomes, now)  # a kind of another shape
            by_kind.setdefault(kind, []).append((request_id, *values, now))
        applied: dict[int, str] = {}
        for kind, rows in by_kind.items():
            arrays = [list(column) for column in zip(*rows, strict=True)]
            applied.update(self.db.execute(_outcome_sql(kind), [*arrays, owner]).fetchall())
        return [applied.get(request_id) for _, request_id, _ in outcomes]

    def _begin(self) -> None:
        self._reconnect_if_broken()  # the server went away, and the loop retries
        self.db.execute("BEGIN")

    def _commit(self) -> None:
        self.db.execute("COMMIT")
        if self._pipeline is not None:
            self._pipeline.sync()  # the COMMIT's answer, and its error, before run returns

    def _rollback(self) -> None:
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

    def _after_error_in_transaction(self) -> None:
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

    def _reset(self, after: str) -> None:
        """Close the session an error left in doubt; the next call connects again."""
        db = self.db
        if db.closed:
            return
        if not db.broken:  # (else the session was lost, not closed here)
            self._reset_after = after
        with contextlib.suppress(Exception):  # closed or not, it is not used again
            db.close()

    def _notify_if(self, batch: Batch, queue: str) -> None:
        # Once per batch, never per row: other replicas wake and claim.
        if self.pg_store.notify and batch.inserts:
            self.db.execute("SELECT pg_notify(%s, %s)", (self.pg_store.channel, queue))

    # psycopg learns that the server ended a session only when a statement
    # fails: these calls then connect again and try once more. (A batch
    # needs no such care: the loop retries it, and _begin reconnects.)

    # Any other error is rolled back (see _rollback), so that it cannot
    # fail the calls and batches after it.

    def lookup(self, queue: str, id_or_key: object) -> Any:
        return self._twice(super().lookup, queue, id_or_key)

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        return self._twice(super().cancel, queue, id_or_key)  # type: ignore[no-any-return]

    def statistics(self, queue: str) -> dict[str, int]:
        return self._twice(super().statistics, queue)  # type: ignore[no-any-return]

    def _twice(self, call: Any, *args: Any) -> Any:
        import psycopg

        self._reconnect_if_broken()
        try:
            return call(*args)
        except psycopg.OperationalError:
            lost = self.db.closed or self.db.broken
            self._rollback()
            if not lost:
                raise
        except BaseException:
            self._rollback()
            raise
        self._reconnect_if_broken()
        return call(*args)

    # Why this connection closed its last session itself, until it connects again.
    _reset_after: str | None = None

    def _reconnect_if_broken(self) -> None:
        if self.db.closed or self.db.broken:
            self.db = self._open()
            if self._reset_after is not None:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been closed"
                    " after %s",
                    self.pg_store,
                    self._reset_after,
                )
                self._reset_after = None
            else:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been lost",
                    self.pg_store,
                )

    def close(self) -> None:
        self.db.close()
