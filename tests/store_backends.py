"""Each store's Backend for the store tests: how to make it, and reach its database.

A Backend is one store's location (a SQLite file, a PostgreSQL schema): a
factory of store objects on it, and the plain driver connection an
application has to it, for ``enqueue_in`` and for writing rows as another
process would. tests/test_store_contract.py runs every store's Backend.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

import tickler

FAST: dict[str, Any] = {"lease": 5.0, "poll_interval": 0.05}

# This test's own suffix of the owner ids it names (conftest sets it before each test).
# A PostgreSQL owner's liveness lock is database-wide (its key is the owner id's hash),
# so a fixed id ("me") would be shared with any other test run on the server at once,
# or with a session a test left behind.
_owner_suffix = "0"


def set_owner_suffix(suffix: str) -> None:
    global _owner_suffix
    _owner_suffix = suffix


def owner_id(name: str) -> str:
    """The owner id ``name`` of this test alone: ``name`` and this test's suffix."""
    return f"{name}-{_owner_suffix}"


@attrs.define
class Backend:
    """One store's location, and plain SQL on it as an application writes it."""

    # SQL for the store's clock now, in seconds since the epoch.
    now: ClassVar[str]
    # The placeholder of its driver's statements.
    mark: ClassVar[str]
    # The faults add_fault() can inject.
    faults: ClassVar[tuple[str, ...]] = ("raise",)
    # Whether a failed statement aborts the caller's transaction.
    failed_statement_aborts_transaction: ClassVar[bool] = False

    @classmethod
    def for_test(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
        """A fresh location for one test."""
        raise NotImplementedError

    def store(self, **options: Any) -> Any:
        """A new store object on this location: another replica of the others."""
        raise NotImplementedError

    def connect(self, *, autocommit: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A plain driver connection, as an application has; closed at the end, uncommitted."""
        raise NotImplementedError

    def table(self, name: str) -> str:
        raise NotImplementedError

    def worker_args(self) -> list[str]:
        """The database argument of tests/store_worker.py for this location."""
        raise NotImplementedError

    def add_fault(
        self, *, when: str = "INSERT", condition: str = "TRUE", fault: str = "raise"
    ) -> None:
        """A trigger BEFORE ``when`` on tickler_requests, which fails while armed and
        ``condition``: ``fault`` is one of ``faults``. Armed until disarm()."""
        raise NotImplementedError

    def insert_as_the_docs_say(self, key: Any, request: bytes, *, then: str = "") -> int:
        """The store's documented INSERT from another driver, the key encoded as documented.

        ``then`` follows the VALUES (an ON CONFLICT clause). Returns the rows inserted.
        """
        raise NotImplementedError

    def execute(self, sql: str, params: Any = ()) -> None:
        with self.connect() as connection:
            connection.execute(sql, params)
            connection.commit()

    def select(self, columns: str, where: str = "TRUE") -> list[tuple[Any, ...]]:
        with self.connect() as connection:
            return [
                tuple(row)
                for row in connection.execute(
                    f"SELECT {columns} FROM {self.table('tickler_requests')}"  # noqa: S608
                    f" WHERE {where} ORDER BY id"
                )
            ]

    def rows(self, where: str = "TRUE") -> list[tuple[Any, ...]]:
        return self.select("id, queue, key, state", where)

    def states(self) -> dict[int, str]:
        return {row[0]: row[1] for row in self.select("id, state")}

    def disarm(self) -> None:
        self.execute(f"UPDATE {self.table('test_fault')} SET armed = 0")  # noqa: S608


@attrs.define
class SqliteBackend(Backend):
    path: Path

    now = "((julianday('now') - 2440587.5) * 86400.0)"
    mark = "?"

    @classmethod
    def for_test(cls, request: pytest.FixtureRequest, tmp_path: Path) -> SqliteBackend:
        return cls(tmp_path / "queue.db")

    def store(self, **options: Any) -> tickler.SqliteStore:
        return tickler.SqliteStore(self.path, **{**FAST, **options})

    @contextlib.contextmanager
    def connect(self, *, autocommit: bool = True) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, isolation_level=None if autocommit else "DEFERRED")
        try:
            yield db
        finally:
            db.close()

    def table(self, name: str) -> str:
        return name

    def worker_args(self) -> list[str]:
        return [str(self.path)]

    def add_fault(
        self, *, when: str = "INSERT", condition: str = "TRUE", fault: str = "raise"
    ) -> None:
        assert fault in self.faults
        with self.connect() as db:
            db.execute("CREATE TABLE test_fault (armed INTEGER NOT NULL)")
            db.execute("INSERT INTO test_fault VALUES (1)")
            db.execute(
                f"CREATE TRIGGER test_fault BEFORE {when} ON tickler_requests"  # noqa: S608
                f" WHEN (SELECT armed FROM test_fault) AND {condition}"
                " BEGIN SELECT RAISE(ABORT, 'injected fault'); END"
            )

    def insert_as_the_docs_say(self, key: Any, request: bytes, *, then: str = "") -> int:
        encoded = json.dumps(key, separators=(",", ":"))
        with self.connect(autocommit=False) as connection:
            inserted = connection.execute(
                "INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)"  # noqa: S608
                " VALUES (:queue, :key, 'queued', :request,"
                " (julianday('now') - 2440587.5) * 86400, (julianday('now') - 2440587.5) * 86400)"
                f" {then}",
                {"queue": "jobs", "key": encoded, "request": request},
            ).rowcount
            connection.commit()
        return int(inserted)


@attrs.define
class PostgresBackend(Backend):
    dsn: str
    schema: str

    now = "extract(epoch FROM clock_timestamp())"
    mark = "%s"
    # Besides an error: the codes of a deadlock and of a serialization
    # failure, and a sleep beyond any statement_timeout.
    faults = ("raise", "deadlock", "serialization", "sleep")
    failed_statement_aborts_transaction = True

    @classmethod
    def for_test(cls, request: pytest.FixtureRequest, tmp_path: Path) -> PostgresBackend:
        """A fresh schema (postgres_schema) on the test server (postgres_dsn)."""
        return cls(
            request.getfixturevalue("postgres_dsn"), request.getfixturevalue("postgres_schema")
        )

    def store(self, *, dsn_options: str = "", **options: Any) -> tickler.PostgresStore:
        import psycopg.conninfo

        dsn = self.dsn
        if dsn_options:
            dsn = psycopg.conninfo.make_conninfo(dsn, options=dsn_options)
        return tickler.PostgresStore(dsn, schema=self.schema, **{**FAST, **options})

    @contextlib.contextmanager
    def connect(self, *, autocommit: bool = True) -> Iterator[Any]:
        import psycopg

        connection = psycopg.connect(self.dsn, autocommit=autocommit)
        try:
            yield connection
        finally:
            connection.close()

    def table(self, name: str) -> str:
        return f'"{self.schema}".{name}'

    def worker_args(self) -> list[str]:
        return [self.dsn, "--schema", self.schema]

    def add_fault(
        self, *, when: str = "INSERT", condition: str = "TRUE", fault: str = "raise"
    ) -> None:
        flag, requests = self.table("test_fault"), self.table("tickler_requests")
        action = {
            "raise": "RAISE EXCEPTION 'injected fault';",
            "deadlock": "RAISE EXCEPTION 'injected deadlock' USING ERRCODE = 'deadlock_detected';",
            "serialization": (
                "RAISE EXCEPTION 'injected serialization failure'"
                " USING ERRCODE = 'serialization_failure';"
            ),
            "sleep": "PERFORM pg_sleep(60);",
        }[fault]
        function = self.table("test_fault_fn")
        with self.connect() as db:
            db.execute(f"CREATE TABLE {flag} (armed INTEGER NOT NULL)")
            db.execute(f"INSERT INTO {flag} VALUES (1)")  # noqa: S608
            db.execute(
                f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$"  # noqa: S608
                f" BEGIN IF (SELECT armed FROM {flag}) = 1 THEN {action} END IF; RETURN NEW;"
                " END $$"
            )
            db.execute(
                f"CREATE TRIGGER test_fault BEFORE {when} ON {requests} FOR EACH ROW"
                f" WHEN ({condition}) EXECUTE FUNCTION {function}()"
            )

    def insert_as_the_docs_say(self, key: Any, request: bytes, *, then: str = "") -> int:
        encoded = json.dumps(key, separators=(",", ":"))
        with self.connect(autocommit=False) as connection:
            inserted = connection.execute(
                f"INSERT INTO {self.table('tickler_requests')}"  # noqa: S608
                " (queue, key, state, request, run_at, enqueued_at)"
                " VALUES (%s, %s, 'queued', %s,"
                " extract(epoch FROM statement_timestamp()),"
                f" extract(epoch FROM statement_timestamp())) {then}",
                ("jobs", encoded, request),
            ).rowcount
            connection.execute("SELECT pg_notify(%s, %s)", (f"tickler_{self.schema}", "jobs"))
            connection.commit()
        return int(inserted)
