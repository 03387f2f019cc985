"""Site status objects, kept in the same database as tickler's queue.

One SQLite file (a single replica), or one PostgreSQL database shared by any
number of replicas. Because the status table and the queue share a database,
a request that changes a site's state enqueues its step in the same
transaction (``enqueue_in``): both exist, or neither does.

Every call runs on a worker thread, one at a time per replica.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

import tickler

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")

# tickler's queue, and the name of the service that runs it.
QUEUE = "site_manager"

STEPS = ("metadata", "fs", "db", "bootstrap", "delete")
FLAGS = ("metadata_ready", "fs_ready", "db_ready", "bootstrapped")

_COLUMNS = """
    name TEXT NOT NULL,
    tagline TEXT NOT NULL,
    domain TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('creating', 'running', 'deleting', 'deleted')),
    metadata_ready INTEGER NOT NULL DEFAULT 0,
    fs_ready INTEGER NOT NULL DEFAULT 0,
    db_ready INTEGER NOT NULL DEFAULT 0,
    bootstrapped INTEGER NOT NULL DEFAULT 0
);
-- A domain is taken while a site holding it is not deleted.
CREATE UNIQUE INDEX IF NOT EXISTS live_domain ON sites (domain) WHERE state != 'deleted';
CREATE INDEX IF NOT EXISTS unfinished ON sites (state) WHERE state IN ('creating', 'deleting')
"""
SQLITE_SCHEMA = "CREATE TABLE IF NOT EXISTS sites (id INTEGER PRIMARY KEY AUTOINCREMENT," + _COLUMNS
POSTGRES_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sites (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    + _COLUMNS
)

# A PostgreSQL schema for the status table; tickler's queue goes in
# "<schema>_queue", which tickler caps at 55 characters.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,48}$")


def queue_schema(schema: str) -> str:
    """The PostgreSQL schema of tickler's queue, next to the status table's."""
    return f"{schema}_queue"


@attrs.frozen
class Step:
    """One tickler request: run step ``name`` of site ``site_id``.

    In the queue it is its key, ``"{site_id}:{name}"``: a step enqueued
    while the same step of the same site is live is not enqueued again.
    """

    site_id: int
    name: str

    @property
    def key(self) -> str:
        return f"{self.site_id}:{self.name}"

    @classmethod
    def parse(cls, key: str) -> Step:
        site_id, name = key.split(":")
        return cls(int(site_id), name)


class DomainTaken(Exception):
    """Another live site already has this domain."""


class TooManyPending(Exception):
    """As many sites as allowed are being created or deleted already."""


def as_status(row: dict[str, Any]) -> dict[str, Any]:
    """The JSON status body of a site row (tickler adds the attempts)."""
    return {
        "id": row["id"],
        "name": row["name"],
        "tagline": row["tagline"],
        "domain": row["domain"],
        "state": row["state"],
        **{flag: bool(row[flag]) for flag in FLAGS},
    }


class Transaction:
    """What a function run in a transaction can do: read and write rows, and enqueue steps."""

    def __init__(self, database: Database) -> None:
        self._database = database

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """Run one statement, written with ``?`` placeholders; its rows as dicts."""
        return self._database.rows(sql, params)

    def enqueue(self, step: Step) -> None:
        """Enqueue ``step``, keyed by itself, in this transaction: it exists once we commit."""
        database = self._database
        database.store.enqueue_in(database.connection, QUEUE, step.key, key=step.key)


class Database:
    """One connection to the database of the status table and tickler's queue."""

    store: tickler.SqliteStore | tickler.PostgresStore
    connection: Any
    # Errors a step retries: the database was busy or went away.
    transient: tuple[type[Exception], ...] = ()
    integrity_error: type[Exception] = Exception

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, fn: Callable[[Transaction], T], *, write: bool = True) -> T:
        """Call ``fn`` in one transaction on the worker thread; commit if it returns."""
        return await trio.to_thread.run_sync(self._transaction, fn, write, limiter=self._limiter)

    def _transaction(self, fn: Callable[[Transaction], T], write: bool) -> T:
        raise NotImplementedError

    def rows(self, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        self.connection.close()


class SqliteDatabase(Database):
    """The status table and tickler's queue in one SQLite file (WAL mode)."""

    transient = (sqlite3.OperationalError,)
    integrity_error = sqlite3.IntegrityError

    def __init__(self, path: Path, *, lease: float, poll_interval: float) -> None:
        super().__init__()
        self.store = tickler.SqliteStore(path, lease=lease, poll_interval=poll_interval)
        # tickler creates its tables only in a file that holds no other
        # tables: let it create them before the status table.
        self.store.connect().close()
        self.connection = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, timeout=60
        )
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=FULL")
        self.connection.executescript(SQLITE_SCHEMA)

    def _transaction(self, fn: Callable[[Transaction], T], write: bool) -> T:
        self.connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            result = fn(Transaction(self))
        except BaseException:
            self.connection.execute("ROLLBACK")
            raise
        self.connection.execute("COMMIT")
        return result

    def rows(self, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        cursor = self.connection.execute(sql, params)
        if cursor.description is None:
            return []
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


class PostgresDatabase(Database):
    """The status table in a schema of a PostgreSQL database, tickler's queue in another."""

    def __init__(self, dsn: str, schema: str, *, lease: float, poll_interval: float) -> None:
        import psycopg
        import psycopg.sql

        super().__init__()
        self.transient = (psycopg.OperationalError,)
        self.integrity_error = psycopg.errors.UniqueViolation
        self.dsn = dsn
        self.schema = schema
        self.store = tickler.PostgresStore(
            dsn, schema=queue_schema(schema), lease=lease, poll_interval=poll_interval
        )
        self.connection = self._connect()
        with self.connection.transaction():
            # One replica creates the table; the others wait for it here.
            self.connection.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"site_manager:{schema}",)
            )
            self.connection.execute(
                psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    psycopg.sql.Identifier(schema)
                )
            )
            for statement in POSTGRES_SCHEMA.split(";"):
                self.connection.execute(statement.encode())

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg
        import psycopg.sql

        connection = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        connection.execute(
            psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(self.schema))
        )
        return connection

    def _transaction(self, fn: Callable[[Transaction], T], write: bool) -> T:
        if self.connection.closed or self.connection.broken:
            self.connection = self._connect()  # the server went away: the step is retried
        with self.connection.transaction():
            return fn(Transaction(self))

    def rows(self, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        from psycopg.rows import dict_row

        cursor = self.connection.cursor(row_factory=dict_row)
        cursor.execute(sql.replace("?", "%s").encode(), params)
        return cursor.fetchall() if cursor.description is not None else []


def open_database(
    data: Path, postgres: str | None, schema: str, *, lease: float, poll_interval: float
) -> Database:
    """Connect: to PostgreSQL if a DSN is given, else to the SQLite file in ``data``."""
    if postgres is not None:
        return PostgresDatabase(postgres, schema, lease=lease, poll_interval=poll_interval)
    data.mkdir(parents=True, exist_ok=True)
    return SqliteDatabase(data / "site_manager.sqlite3", lease=lease, poll_interval=poll_interval)


@attrs.define(eq=False)
class Sites:
    """The status table, and the transactions that enqueue steps with a change of state."""

    database: Database

    async def create(
        self, name: str, tagline: str, domain: str, *, max_pending: int
    ) -> dict[str, Any]:
        """Insert a `creating` site and enqueue its first step, in one transaction."""

        def create(tx: Transaction) -> dict[str, Any]:
            [pending] = tx.rows(
                "SELECT count(*) AS n FROM sites WHERE state IN ('creating', 'deleting')"
            )
            if pending["n"] >= max_pending:
                raise TooManyPending
            try:
                [row] = tx.rows(
                    "INSERT INTO sites (name, tagline, domain, state)"
                    " VALUES (?, ?, ?, 'creating') RETURNING *",
                    (name, tagline, domain),
                )
            except self.database.integrity_error:
                raise DomainTaken(domain) from None
            tx.enqueue(Step(row["id"], "metadata"))
            return as_status(row)

        return await self.database.run(create)

    async def get(self, site_id: int) -> dict[str, Any] | None:
        rows = await self.database.run(
            lambda tx: tx.rows("SELECT * FROM sites WHERE id = ?", (site_id,)), write=False
        )
        return as_status(rows[0]) if rows else None

    async def set_flag(self, site_id: int, flag: str) -> None:
        """Set a creation flag, only while the site is still being created."""
        assert flag in FLAGS
        await self.database.run(
            lambda tx: tx.rows(
                f"UPDATE sites SET {flag} = 1 WHERE id = ? AND state = 'creating'",  # noqa: S608 - flag is one of FLAGS
                (site_id,),
            )
        )

    async def mark_running(self, site_id: int) -> bool:
        """`creating` to `running` once every flag is set (whichever step sets the last)."""
        rows = await self.database.run(
            lambda tx: tx.rows(
                "UPDATE sites SET state = 'running' WHERE id = ? AND state = 'creating'"
                " AND metadata_ready = 1 AND fs_ready = 1 AND db_ready = 1 AND bootstrapped = 1"
                " RETURNING id",
                (site_id,),
            )
        )
        return bool(rows)

    async def mark_deleting(self, site_id: int) -> dict[str, Any] | None:
        """Set `deleting` and enqueue the delete step, in one transaction."""

        def mark(tx: Transaction) -> dict[str, Any] | None:
            # An UPDATE whatever the state: it holds the row until we commit,
            # so the delete step cannot mark it deleted (and end) in between.
            rows = tx.rows(
                "UPDATE sites SET state = CASE WHEN state IN ('creating', 'running')"
                " THEN 'deleting' ELSE state END WHERE id = ? RETURNING *",
                (site_id,),
            )
            if not rows:
                return None
            if rows[0]["state"] == "deleting":
                tx.enqueue(Step(site_id, "delete"))  # live already: enqueued once
            return as_status(rows[0])

        return await self.database.run(mark)

    async def mark_deleted(self, site_id: int) -> None:
        await self.database.run(
            lambda tx: tx.rows(
                "UPDATE sites SET state = 'deleted', metadata_ready = 0, fs_ready = 0,"
                " db_ready = 0, bootstrapped = 0 WHERE id = ? AND state = 'deleting'",
                (site_id,),
            )
        )
