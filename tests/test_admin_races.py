"""The admin's writes racing the replicas on PostgreSQL: no deadlock, whatever the timing.

A replica's batch writes its rows in several statements (the attempts started, each
kind of outcome, the renewal of its leases), each taking its rows' locks in an order of
its own; the admin's bulk writes must never wait for a row while holding another, or
they close a cycle with such a batch (see docs/operating.md, Writes that race the replicas).

Two worker processes (tests/race_worker.py) drain a queue the test keeps feeding, with
leases renewed while their attempts run; one is killed (SIGKILL) halfway through, and its
rows are rescued by the others. Meanwhile the admin, whose session finds deadlocks after
20 ms of waiting (deadlock_timeout: the server checks the waiter for a cycle then, and a
short timeout makes the admin the side that finds it), runs each of its writes over and
over. Every deadlock the server finds in the test's own database is counted, whichever
session it ended (pg_stat_database.deadlocks), with every error the admin raised and
every batch a worker failed.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio

import tickler

from . import store_runs
from .store_backends import PostgresBackend

# Seconds each admin write races the workers.
PHASE = 3.5
# The workers' lease: renewed every third of it, while attempts run up to 0.3 s.
LEASE = 0.6


def _with_database(dsn: str, database: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        pytest.fail(f"the race tests need a postgresql:// URL as the DSN, not {dsn!r}")
    return parts._replace(scheme="postgresql", path=f"/{database}").geturl()


def _with_settings(dsn: str, *, application_name: str | None = None, **settings: str) -> str:
    """The DSN with server settings for its sessions (libpq's ``options``), and a name."""
    parts = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qsl(parts.query)
    query += [("options", f"-c {name}={value}") for name, value in settings.items()]
    if application_name is not None:
        query.append(("application_name", application_name))
    encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return parts._replace(query=encoded).geturl()


@pytest.fixture
def race_dsn(postgres_dsn: str) -> Iterator[str]:
    """A database of the test's own, whose deadlocks no other test's sessions count in."""
    name = f"tickler_race_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(postgres_dsn, name)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _deadlocks(dsn: str) -> int:
    """The deadlocks the server found in the database, once every session of it but this
    one has ended (a session reports its count at the latest as it ends, and leaves
    pg_stat_activity after that)."""
    with psycopg.connect(dsn, autocommit=True) as db:
        deadline = time.monotonic() + 20
        while db.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "the sessions on the test's database did not end"
            time.sleep(0.05)
        db.execute("SELECT pg_stat_clear_snapshot()")
        row = db.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


@attrs.define
class Place(store_runs.Place):
    """The worker processes of tests/race_worker.py on the queue "jobs", and their log."""

    worker = "tests.race_worker"
    lease = LEASE
    poll_interval = 0.05

    @classmethod
    def on(cls, dsn: str, tmp_path: Path) -> Place:
        """The workers of the store at ``dsn`` (its schema "tickler"), logging in ``tmp_path``."""
        return cls(PostgresBackend(dsn, "tickler"), 2, tmp_path / "log", tmp_path / "stop")

    def running(self, pid: int) -> bool:
        """Whether the worker ``pid`` holds running rows now (its owner's, in the store)."""
        lines = self.lines()
        owners = [line.fields[0] for line in lines if (line.kind, line.pid) == ("owner", pid)]
        with self.backend.connect() as db:
            row = db.execute(
                f"SELECT count(*) FROM {self.backend.table('tickler_requests')}"  # noqa: S608
                " WHERE state = 'running' AND owner = ANY(%s)",
                (owners,),
            ).fetchone()
        return row is not None and row[0] > 0


def test_the_admins_writes_race_claims_renewals_and_rescues_without_a_deadlock(
    race_dsn: str, tmp_path: Path
) -> None:
    store = tickler.PostgresStore(race_dsn, lease=LEASE)
    store.create_schema()
    workers = Place.on(race_dsn, tmp_path)
    try:
        first, _ = workers.launch(), workers.launch()
        workers.wait_ready()
        errors, done = trio.run(_race, store, workers, first)
        workers.finish()
    finally:
        workers.kill_all()
    store_errors = [line for line in workers.lines() if line.kind == "store_errors"]
    deadlocks = _deadlocks(race_dsn)
    assert (deadlocks, dict(errors), store_errors) == (0, {}, [])
    # Each write did something, racing the workers, which ran and rescued.
    assert done["cancel_where"] > 0, done
    assert done["retry_where"] > 0, done
    assert done["cancel"] > 0, done
    assert done["pause"] > 0, done
    assert done["resume"] > 0, done
    assert done["rescued"] > 0, done
    assert sum(1 for line in workers.lines() if line.kind == "done") > 0


async def _race(
    store: tickler.PostgresStore, workers: Place, first: subprocess.Popen[bytes]
) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Each admin write, over and over for PHASE seconds, while the feed keeps the workers
    busy; the first worker killed halfway (once it runs rows), and another launched.
    The errors the admin raised, by type; and what its writes did, by write."""
    admin_store = tickler.PostgresStore(_with_settings(store.dsn, deadlock_timeout="20ms"))
    errors: collections.Counter[str] = collections.Counter()
    done: collections.Counter[str] = collections.Counter()
    fed = 0

    def feed(db: psycopg.Connection[Any]) -> None:
        nonlocal fed
        requests = [f"{'fail' if n % 4 == 0 else 'ok'}-{n}" for n in range(fed, fed + 40)]
        store.enqueue_many_in(db, "jobs", requests)
        for n in range(fed, fed + 10):
            store.enqueue_in(db, "jobs", f"ok-{n}", key=f"k{n % 20}")
        fed += 40

    async def cancel_where(admin: Any, n: int) -> None:
        done["cancel_where"] += await admin.cancel_where("jobs")

    async def retry_where(admin: Any, n: int) -> None:
        done["retry_where"] += await admin.retry_where("jobs")

    async def cancel(admin: Any, n: int) -> None:
        done["cancel"] += await admin.cancel("jobs", f"k{n % 20}")

    async def pause(admin: Any, n: int) -> None:
        if n % 2:
            await admin.resume("jobs")
            done["resume"] += 1
        else:
            await admin.pause("jobs")
            done["pause"] += 1

    phases: list[Callable[[Any, int], Any]] = [cancel_where, retry_where, cancel, pause]
    with psycopg.connect(store.dsn, autocommit=True) as db:
        async with admin_store.admin() as admin:
            for number, write in enumerate(phases):
                end = time.monotonic() + PHASE
                n = 0
                while time.monotonic() < end:
                    await trio.to_thread.run_sync(feed, db)
                    try:
                        await write(admin, n)
                    except Exception as exc:
                        errors[f"{write.__name__}: {type(exc).__name__}"] += 1
                    n += 1
                    await trio.sleep(0.01)
                if number == 1:
                    # Halfway: the first worker dies holding rows; the others rescue them.
                    deadline = time.monotonic() + 20
                    while not await trio.to_thread.run_sync(workers.running, first.pid):
                        assert time.monotonic() < deadline, "the first worker ran nothing"
                        await trio.to_thread.run_sync(feed, db)
                        await trio.sleep(0.01)
                    os.kill(first.pid, signal.SIGKILL)
                    first.wait()
                    workers.launch()
            await admin.resume("jobs")
            counts = await admin.counts("jobs")
            done["rescued"] = counts["rescued_owner_died"] + counts["rescued_lease_lapsed"]
    return errors, done


# -- One race at a time, in the order that closes a cycle


def _admin_store(dsn: str, deadlock_timeout: str) -> tickler.PostgresStore:
    """A store whose admin's sessions find a deadlock after ``deadlock_timeout`` of
    waiting, and name themselves, so that the test sees them wait."""
    named = _with_settings(
        dsn, application_name="tickler-race-admin", deadlock_timeout=deadlock_timeout
    )
    return tickler.PostgresStore(named)


async def _until_the_admin_waits_for_a_lock(dsn: str) -> None:
    def waits() -> bool:
        with psycopg.connect(dsn, autocommit=True) as db:
            row = db.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = 'tickler-race-admin' AND wait_event_type = 'Lock'"
            ).fetchone()
        return row is not None and row[0] > 0

    with trio.fail_after(20):  # (what it waits for: the admin's session waiting on a lock)
        while not await trio.to_thread.run_sync(waits):
            await trio.sleep(0.01)


@pytest.mark.parametrize("write", ["cancel_where", "retry_where"])
async def test_a_bulk_write_holds_no_row_while_it_waits_for_one_a_batch_holds(
    race_dsn: str, write: str
) -> None:
    """A batch holds a row, as its first statement wrote it; the admin's bulk write needs
    it; the batch's next statement writes the others. The admin writes every row but the
    held one at once, then that one once the batch commits: no deadlock, and none found
    (its deadlock_timeout of 2 s would find one: the batch waits within it)."""
    store = tickler.PostgresStore(race_dsn)
    store.create_schema()
    with psycopg.connect(race_dsn, autocommit=True) as db:
        ids = store.enqueue_many_in(db, "jobs", list(range(20)))
    admin_store = _admin_store(race_dsn, "2s")
    held = max(ids)
    async with admin_store.admin() as admin:
        if write == "retry_where":
            assert await admin.cancel_where("jobs") == 20
        batch = psycopg.connect(_with_settings(race_dsn, deadlock_timeout="30s"))
        try:
            batch.execute("UPDATE tickler.tickler_requests SET priority = 1 WHERE id = %s", (held,))
            written: list[int] = []
            async with trio.open_nursery() as nursery:

                async def bulk() -> None:
                    written.append(await getattr(admin, write)("jobs"))

                nursery.start_soon(bulk)
                await _until_the_admin_waits_for_a_lock(race_dsn)

                def next_statement() -> None:
                    batch.execute(
                        "UPDATE tickler.tickler_requests SET priority = 1"
                        " WHERE queue = 'jobs' AND id <> %s",
                        (held,),
                    )
                    batch.commit()

                await trio.to_thread.run_sync(next_statement)
        finally:
            batch.close()
        assert written == [20]
        states = {(await admin.lookup("jobs", i)).state for i in ids}  # type: ignore[union-attr]
    assert states == {"cancelled" if write == "cancel_where" else "queued"}
    assert _deadlocks(race_dsn) == 0


async def test_the_admin_runs_again_a_transaction_the_server_ended_to_break_a_deadlock(
    race_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry makes a key live again while another transaction inserts that key (the
    retry waits for it), and that transaction then waits for the retried row: a cycle
    no order of rows avoids. The server ends the admin's transaction (its deadlock_timeout
    runs out first); the admin runs it again, which waits for the other transaction, and
    retries the row once it rolled back."""
    store = tickler.PostgresStore(race_dsn)
    store.create_schema()
    with psycopg.connect(race_dsn, autocommit=True) as db:
        retried = store.enqueue_in(db, "jobs", 1, key="k")
    admin_store = _admin_store(race_dsn, "2s")
    async with admin_store.admin() as admin:
        assert await admin.cancel("jobs", "k")
        other = psycopg.connect(_with_settings(race_dsn, deadlock_timeout="30s"))
        try:
            store.enqueue_in(other, "jobs", 2, key="k")  # not committed
            written: list[int] = []
            async with trio.open_nursery() as nursery:

                async def retry_where() -> None:
                    written.append(await admin.retry_where("jobs"))

                nursery.start_soon(retry_where)
                await _until_the_admin_waits_for_a_lock(race_dsn)  # for the key
                lock = "SELECT 1 FROM tickler.tickler_requests WHERE id = %s FOR UPDATE"
                await trio.to_thread.run_sync(lambda: other.execute(lock, (retried,)))
                other.rollback()
        finally:
            other.close()
        assert written == [1]
        found = await admin.lookup("jobs", "k")
    assert found is not None
    assert (found.id, found.state) == (retried, "queued")
    assert _deadlocks(race_dsn) == 1
    assert "ended by the server to break a deadlock" in caplog.text


async def test_the_admin_runs_a_transaction_ended_by_deadlocks_three_times_at_most(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """The server ends every try (a trigger raises PostgreSQL's deadlock error, and counts
    the tries in a sequence, which no rollback undoes): the error, after three tries
    (DEADLOCK_TRIES)."""
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    table = f'"{postgres_schema}".tickler_requests'
    tries, function = f'"{postgres_schema}".test_tries', f'"{postgres_schema}".test_deadlock'
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        store.enqueue_in(db, "jobs", 1)
        db.execute(f"CREATE SEQUENCE {tries}")
        db.execute(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$"
            f" BEGIN PERFORM nextval('{tries}');"
            " RAISE EXCEPTION 'injected deadlock' USING ERRCODE = 'deadlock_detected'; END $$"
        )
        db.execute(
            f"CREATE TRIGGER test_deadlock BEFORE UPDATE ON {table}"
            f" FOR EACH ROW EXECUTE FUNCTION {function}()"
        )
    async with store.admin() as admin:
        with pytest.raises(psycopg.errors.DeadlockDetected):
            await admin.cancel_where("jobs")
        assert (await admin.counts("jobs"))["queued"] == 1
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        assert db.execute(f"SELECT last_value FROM {tries}").fetchone() == (3,)  # noqa: S608
