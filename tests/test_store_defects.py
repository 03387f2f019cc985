"""Store defects, each test failing before its fix, on a SQLite file and on PostgreSQL alike.

A batch's SQL error that broke the PostgreSQL session for good; long keys and
queue names that poisoned a batch, and a row the store refuses, which must
not stop the rest of its batch; one queue's retention deleting every queue's
rows; ``enqueue_in`` before any service created the schema; and the key's
encoding in the row, which another driver must be able to write.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import tickler
from tickler._codec import MAX_KEY_BYTES, MAX_QUEUE_BYTES
from tickler._stores._seam import Batch

FAST: dict[str, Any] = {"lease": 5.0, "poll_interval": 0.05}

Store = tickler.SqliteStore | tickler.PostgresStore


async def double(request: int) -> int:
    return request * 2


@attrs.define
class Backend:
    """One store's location (a SQLite file, or a PostgreSQL schema) and plain SQL on it."""

    kind: str
    location: str  # the file's path, or the DSN
    schema: str = ""

    def store(self, *, dsn_options: str = "", **options: Any) -> Store:
        """A new store object on this location."""
        if self.kind == "sqlite":
            return tickler.SqliteStore(self.location, **{**FAST, **options})
        import psycopg.conninfo

        dsn = self.location
        if dsn_options:
            dsn = psycopg.conninfo.make_conninfo(dsn, options=dsn_options)
        return tickler.PostgresStore(dsn, schema=self.schema, **{**FAST, **options})

    @contextlib.contextmanager
    def connect(self, *, autocommit: bool = True) -> Iterator[Any]:
        """A plain driver connection, as an application has: sqlite3's or psycopg's."""
        if self.kind == "sqlite":
            db = sqlite3.connect(self.location, isolation_level=None if autocommit else "DEFERRED")
            try:
                yield db
            finally:
                db.close()
        else:
            import psycopg

            with psycopg.connect(self.location, autocommit=autocommit) as connection:
                yield connection

    def table(self, name: str) -> str:
        return name if self.kind == "sqlite" else f'"{self.schema}".{name}'

    def execute(self, *statements: str) -> None:
        with self.connect() as connection:
            for statement in statements:
                connection.execute(statement)

    def rows(self, where: str = "TRUE") -> list[tuple[Any, ...]]:
        with self.connect() as connection:
            return list(
                connection.execute(
                    f"SELECT id, queue, key, state FROM {self.table('tickler_requests')}"  # noqa: S608
                    f" WHERE {where} ORDER BY id"
                )
            )

    def add_fault(
        self, *, when: str = "INSERT", condition: str = "TRUE", fault: str = "raise"
    ) -> None:
        """A trigger BEFORE ``when`` on tickler_requests, which fails while armed and ``condition``.

        ``fault``: "raise" an error; on PostgreSQL also "deadlock" and
        "serialization" (the error codes of a deadlock and of a
        serialization failure), and "sleep" (beyond any statement_timeout).
        The trigger is armed until disarm().
        """
        flag, requests = self.table("test_fault"), self.table("tickler_requests")
        self.execute(
            f"CREATE TABLE {flag} (armed INTEGER NOT NULL)",
            f"INSERT INTO {flag} VALUES (1)",  # noqa: S608
        )
        if self.kind == "sqlite":
            assert fault == "raise"
            self.execute(
                f"CREATE TRIGGER test_fault BEFORE {when} ON tickler_requests"  # noqa: S608
                f" WHEN (SELECT armed FROM test_fault) AND {condition}"
                " BEGIN SELECT RAISE(ABORT, 'injected fault'); END"
            )
            return
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
        self.execute(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$"  # noqa: S608
            f" BEGIN IF (SELECT armed FROM {flag}) = 1 THEN {action} END IF; RETURN NEW; END $$",
            f"CREATE TRIGGER test_fault BEFORE {when} ON {requests} FOR EACH ROW"
            f" WHEN ({condition}) EXECUTE FUNCTION {function}()",
        )

    def disarm(self) -> None:
        self.execute(f"UPDATE {self.table('test_fault')} SET armed = 0")  # noqa: S608


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", str(tmp_path / "queue.db"))
    dsn: str = request.getfixturevalue("postgres_dsn")
    schema: str = request.getfixturevalue("postgres_schema")
    return Backend("postgres", dsn, schema)


async def create_schema(store: Store) -> None:
    await trio.to_thread.run_sync(store.create_schema)


# -- 1. One SQL error in a batch must not break the store for the batches after it


@pytest.mark.parametrize(
    ("backend", "fault"),
    [
        ("sqlite", "raise"),
        ("postgres", "raise"),
        ("postgres", "deadlock"),
        ("postgres", "serialization"),
        ("postgres", "sleep"),
    ],
    indirect=["backend"],
)
async def test_a_batch_that_fails_once_is_retried_and_loses_nothing(
    backend: Backend, fault: str
) -> None:
    """A trigger fails the batch holding an insert; once disarmed, the retry commits it.

    On PostgreSQL every batch after the first error used to fail too (the
    session's transaction aborted, then its prepared statements gone), and
    every accepted request ended FAILED at the stop.
    """
    # "sleep": the statement outlasts the session's statement_timeout.
    options = "-c statement_timeout=1000" if fault == "sleep" else ""
    store = backend.store(dsn_options=options)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        # Enough batches for psycopg to prepare the batch's statements.
        for i in range(8):
            assert await (await service.submit(i)).wait() == i * 2
        backend.add_fault(fault=fault)
        ticket = service.enqueue_request(100)
        # Two failures: the batch after a failed one runs (and fails) as it should.
        with trio.fail_after(20):
            while service.statistics().store_errors < 2:
                await trio.sleep(0.01)
        backend.disarm()
        with trio.fail_after(20):
            assert await ticket.wait() == 200
            assert await (await service.submit(101)).wait() == 202
        counts = await service.store_statistics()
        found = await service.lookup(ticket.id)
    assert counts["succeeded"] == 10
    assert sum(counts.values()) == 10
    assert found is not None
    assert found.result() == 200


async def test_a_cancel_that_fails_once_does_not_break_the_store(backend: Backend) -> None:
    """A statement of cancel() fails: it raises, and the next calls and batches go on."""
    store = backend.store()
    async with tickler.open_service(double, store=store, name="jobs") as service:
        ticket = await service.submit(1, delay=60.0)
        backend.add_fault(when="UPDATE", condition="NEW.state = 'cancelled'")
        with pytest.raises(Exception, match="injected fault"):
            await service.cancel(ticket.id)
        backend.disarm()
        with trio.fail_after(10):
            assert await service.cancel(ticket.id)
            found = await service.lookup(ticket.id)
            assert await (await service.submit(2)).wait() == 4
        assert found is not None
        assert found.status is tickler.Status.CANCELLED
        counts = await service.store_statistics()
    assert counts["cancelled"] == 1
    assert counts["succeeded"] == 1


# -- 2. Long keys and queue names, and a row the store refuses


async def test_keys_and_queue_names_over_their_bounds_are_refused_at_the_call(
    backend: Backend,
) -> None:
    store = backend.store()
    longest = "k" * (MAX_KEY_BYTES - 2)  # its quotes make it MAX_KEY_BYTES
    too_long = "k" * (MAX_KEY_BYTES - 1)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        for key in (too_long, ("k" * 600, "k" * 600)):
            with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
                service.enqueue_request(1, key=key)
        with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
            await service.submit(1, key=too_long)
        with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
            await service.cancel(too_long)
        with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
            await service.lookup(too_long)
        with backend.connect() as connection:
            with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
                store.enqueue_in(connection, "jobs", 1, key=too_long)
            with pytest.raises(ValueError, match=f"at most {MAX_QUEUE_BYTES} bytes"):
                store.enqueue_in(connection, "q" * (MAX_QUEUE_BYTES + 1), 1)
            with pytest.raises(ValueError, match=f"at most {MAX_QUEUE_BYTES} bytes"):
                store.enqueue_in(connection, "\u00e9" * (MAX_QUEUE_BYTES // 2 + 1), 1)
            # At their bounds, together: one entry of the index of live keys.
            at_bounds = store.enqueue_in(connection, "q" * MAX_QUEUE_BYTES, 1, key=longest)
            assert at_bounds > 0
        # Nothing refused reached the store, and the service goes on.
        with trio.fail_after(10):
            assert await (await service.submit(3, key=longest)).wait() == 6
        assert service.statistics().store_errors == 0
    assert [row[1:] for row in backend.rows()] == [
        ("q" * MAX_QUEUE_BYTES, json.dumps(longest), "queued"),
        ("jobs", json.dumps(longest), "succeeded"),
    ]


def test_a_row_the_store_refuses_does_not_stop_the_rest_of_an_isolated_batch(
    backend: Backend,
) -> None:
    """With isolate, each insert has a savepoint: the refused one is reported, the rest commit.

    At the Connection level, as the loop's retry of a failed batch runs it.
    Several rounds on one connection, so that PostgreSQL's pipeline goes
    through the savepoints with its statements prepared too.
    """
    store = backend.store()
    store.create_schema()
    backend.add_fault(condition="NEW.key = '\"poison\"'")
    connection = store.connect()
    try:
        kept: list[int] = []
        for round_ in range(7):
            now = time.time()
            batch = Batch(
                inserts=[
                    (None, "queued", b"1", now),
                    ('"poison"', "queued", b"2", now),
                    (f'"fine {round_}"', "queued", b"3", now),
                ],
                claim=5,
                isolate=True,
            )
            result = connection.run("jobs", "owner", 30.0, 86400.0, batch)
            assert set(result.refused) == {1}, result.refused
            assert "injected fault" in result.refused[1]
            assert "\n" not in result.refused[1]
            first, refused, last = result.inserted
            assert refused == (0, False)
            assert first[1]
            assert last[1]
            # The batch went on after the refused row: it claimed the others.
            assert sorted(row[0] for row in result.claimed) == [first[0], last[0]]
            kept += [first[0], last[0]]
        # Without isolate the batch fails as a whole, and the next one commits.
        poisoned = Batch(inserts=[(None, "queued", b"4", time.time()), *batch.inserts[1:2]])
        with pytest.raises(Exception, match="injected fault"):
            connection.run("jobs", "owner", 30.0, 86400.0, poisoned)
        result = connection.run(
            "jobs", "owner", 30.0, 86400.0, Batch(inserts=[(None, "queued", b"5", time.time())])
        )
        assert result.refused == {}
        kept.append(result.inserted[0][0])
    finally:
        connection.close()
    assert [row[0] for row in backend.rows()] == kept
    assert not backend.rows("key = '\"poison\"'")


# -- 3. One queue's retention deletes only its own rows


async def test_a_queues_retention_keeps_to_its_own_rows(backend: Backend) -> None:
    """'scratch' keeps nothing; 'important', on the same file or schema, keeps its row a day.

    Both rows are made an hour old, beyond any look's reach back (a look
    keeps what it reported final until the next one reads it).
    """
    important_store = backend.store()
    scratch_store = backend.store(retention=0)
    requests = backend.table("tickler_requests")
    async with tickler.open_service(double, store=important_store, name="important") as important:
        kept = await important.submit(1)
        assert await kept.wait() == 2
        async with tickler.open_service(double, store=scratch_store, name="scratch") as scratch:
            gone = await scratch.submit(2)
            assert await gone.wait() == 4
            backend.execute(f"UPDATE {requests} SET finished_at = finished_at - 3600")  # noqa: S608
            # Scratch's next look prunes its own row.
            with trio.fail_after(10):
                while backend.rows("queue = 'scratch'"):
                    await trio.sleep(0.05)
            await trio.sleep(0.3)  # a few more looks, each pruning
        found = await important.lookup(kept.id)
    assert found is not None
    assert found.result() == 2
    assert [row[1] for row in backend.rows()] == ["important"]


# -- 4. The schema before any service


async def test_create_schema_lets_enqueue_in_come_first(backend: Backend) -> None:
    store = backend.store()
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(tickler.StoreError, match=r"store\.create_schema\(\)") as raised:
            store.enqueue_in(connection, "jobs", 1)
        if backend.kind == "postgres":
            assert "transaction" in str(raised.value)  # the caller's, aborted
    await create_schema(store)
    await create_schema(store)  # again: nothing to do
    with backend.connect(autocommit=False) as connection:
        request_id = store.enqueue_in(connection, "jobs", 21)
        connection.commit()
    async with tickler.open_service(double, store=store, name="jobs") as service:
        with trio.fail_after(10):
            while (found := await service.lookup(request_id)) is None or not found.done:
                await trio.sleep(0.02)
    assert found.result() == 42


async def test_create_schema_upgrades_an_older_sqlite_file(tmp_path: Path) -> None:
    """create_schema() migrates as a service's start does: the file is at the current version."""
    from tickler._stores.sqlite import _INDEXES_OF_V2, SCHEMA_VERSION

    store = tickler.SqliteStore(tmp_path / "queue.db")
    store.create_schema()
    connection = sqlite3.connect(tmp_path / "queue.db", isolation_level=None)
    try:
        connection.execute("UPDATE tickler_schema SET version = 1")
        store.create_schema()
        assert connection.execute("SELECT version FROM tickler_schema").fetchone() == (
            SCHEMA_VERSION,
        )
        names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    finally:
        connection.close()
    assert set(_INDEXES_OF_V2) <= names


# -- 5. The key's encoding in the row, as another driver writes it


def insert_as_the_readme_says(backend: Backend, key: Any, request: bytes, *, then: str = "") -> int:
    """The README's INSERT from another driver, with the key encoded as documented.

    ``then`` follows the VALUES (an ON CONFLICT clause). Returns the rows inserted.
    """
    encoded = json.dumps(key, separators=(",", ":"))
    with backend.connect(autocommit=False) as connection:
        if backend.kind == "sqlite":
            inserted = connection.execute(
                "INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)"  # noqa: S608
                " VALUES (:queue, :key, 'queued', :request,"
                " (julianday('now') - 2440587.5) * 86400, (julianday('now') - 2440587.5) * 86400)"
                f" {then}",
                {"queue": "jobs", "key": encoded, "request": request},
            ).rowcount
        else:
            inserted = connection.execute(
                f"INSERT INTO {backend.table('tickler_requests')}"  # noqa: S608
                " (queue, key, state, request, run_at, enqueued_at)"
                " VALUES (%s, %s, 'queued', %s,"
                " extract(epoch FROM statement_timestamp()),"
                f" extract(epoch FROM statement_timestamp())) {then}",
                ("jobs", encoded, request),
            ).rowcount
            connection.execute("SELECT pg_notify(%s, %s)", (f"tickler_{backend.schema}", "jobs"))
        connection.commit()
    return int(inserted)


@pytest.mark.parametrize("key", ["k", ("order", 7), "clé ☃"])
async def test_a_key_written_as_documented_by_another_driver_deduplicates(
    backend: Backend, key: Any
) -> None:
    """The README's INSERT from another driver, with a key as the store documents it."""
    store = backend.store()
    # The encoding is the stores' public word, in their documentation.
    assert 'json.dumps(key, separators=(",", ":"))' in (type(store).__doc__ or "")
    await create_schema(store)
    request = tickler.JsonCodec().encode(21)
    assert insert_as_the_readme_says(backend, key, request) == 1
    ((inserted, _, _, _),) = backend.rows()
    with backend.connect(autocommit=False) as connection:
        assert store.enqueue_in(connection, "jobs", 99, key=key) == inserted
        connection.commit()
    # The other driver meets the live key too: a unique violation, or
    # nothing inserted with ON CONFLICT DO NOTHING.
    with pytest.raises(Exception, match=r"(?i)unique"):
        insert_as_the_readme_says(backend, key, request)
    assert insert_as_the_readme_says(backend, key, request, then="ON CONFLICT DO NOTHING") == 0
    async with tickler.open_service(double, store=store, name="jobs") as service:
        with trio.fail_after(10):
            while (found := await service.lookup(key)) is None or not found.done:
                await trio.sleep(0.02)
    assert found.id == inserted
    assert found.result() == 42
    assert len(backend.rows()) == 1
