"""admin.replicas() and the dashboard's replicas page: every live replica, with its host
and PID, whether it holds work or not; a killed one leaves the list once its liveness
mark goes. Real worker processes (tests/store_worker.py) on a SQLite file and on a
PostgreSQL schema; and the migration that records hosts and PIDs (schema version 8).
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
import tickler.web

from .store_backends import owner_id
from .store_runs import log_lines, owner_of, worker
from .test_liveness import db_args, enqueue, starts, stop, store_of, wait_for
from .test_web import CHROMIUM, served


def replicas(store: Any) -> list[tickler.Replica]:
    async def run() -> list[tickler.Replica]:
        async with store.admin(read_only=True) as admin:
            found: list[tickler.Replica] = await admin.replicas()
            return found

    return trio.run(run)


@pytest.fixture
def two_workers(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Any, Path, subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A worker holding the queue's one request (it runs for 600 s), and an idle one (which
    would run it as long)."""
    kind = request.param
    store = store_of(kind, request, tmp_path)
    enqueue(store, ["r0"])
    log = tmp_path / "log"
    common = ("--lease", "300", "--poll-interval", "0.1", "--capacity", "1", "--sleep", "600")
    busy = worker(db_args(store), log, *common)
    idle = None
    try:
        wait_for(lambda: len(starts(log)) == 1, "the first worker never started the request")
        idle = worker(db_args(store), log, *common)
        wait_for(
            lambda: any(line[1] == "owner" and int(line[0]) == idle.pid for line in log_lines(log)),
            "the second worker never ran",
        )
        yield store, log, busy, idle
    finally:
        stop(busy, *([idle] if idle else []))


@pytest.mark.parametrize("two_workers", ["sqlite", "postgres"], indirect=True)
def test_every_live_replica_is_listed_with_its_host_and_pid(
    two_workers: tuple[Any, Path, subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    store, log, busy, idle = two_workers
    owners = {owner_of(log, busy.pid): busy.pid, owner_of(log, idle.pid): idle.pid}
    wait_for(
        lambda: {r.owner for r in replicas(store)} == set(owners),
        "the two workers were never both listed",
        30,
    )
    listed = {r.owner: r for r in replicas(store)}
    host = socket.gethostname()
    for owner, pid in owners.items():
        replica = listed[owner]
        assert (replica.host, replica.pid) == (host, pid)
        assert time.time() - 120 < replica.since <= time.time() + 1
    held, free = listed[owner_of(log, busy.pid)], listed[owner_of(log, idle.pid)]
    assert (held.leased, held.queues) == (1, ["jobs"])
    assert held.lease_until is not None
    assert time.time() < held.lease_until <= time.time() + 301
    assert (free.leased, free.queues, free.lease_until, free.last_renewed) == (0, [], None, None)

    # Killed: it leaves the list once its mark goes; the idle one rescues its request.
    busy.send_signal(signal.SIGKILL)
    busy.wait()
    wait_for(
        lambda: [r.owner for r in replicas(store)] == [free.owner],
        "the killed worker stayed listed",
        30,
    )
    wait_for(
        lambda: [r.leased for r in replicas(store)] == [1],
        "the idle worker never held the killed one's request",
        30,
    )
    (left,) = replicas(store)
    assert (left.owner, left.host, left.pid) == (free.owner, host, idle.pid)


@pytest.mark.parametrize("two_workers", ["sqlite", "postgres"], indirect=True)
def test_the_replicas_page_shows_every_live_replica(
    two_workers: tuple[Any, Path, subprocess.Popen[bytes], subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no {CHROMIUM} for the browser tests: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    store, log, busy, idle = two_workers
    wait_for(lambda: len(replicas(store)) == 2, "the two workers were never both listed", 30)
    artifacts = Path(os.environ.get("TICKLER_ARTIFACTS") or tmp_path / "artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    # The dashboard's store with the workers' lease, as docs/dashboard.md asks.
    shown: tickler.SqliteStore | tickler.PostgresStore
    if isinstance(store, tickler.SqliteStore):
        kind, shown = "sqlite", tickler.SqliteStore(store.path, lease=300)
    else:
        kind, shown = "postgres", tickler.PostgresStore(store.dsn, schema=store.schema, lease=300)
    with (
        served(tickler.web.app(shown, read_only=True)) as url,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            page.goto(url + "/replicas")
            for process, leased in ((busy, "1"), (idle, "0")):
                row = page.locator(f"tr[data-owner='{owner_of(log, process.pid)}']")
                assert row.locator("td[data-field=host]").inner_text() == socket.gethostname()
                assert row.locator("td[data-field=pid]").inner_text() == str(process.pid)
                assert row.locator("td[data-field=leased]").inner_text() == leased
            idle_row = page.locator(f"tr[data-owner='{owner_of(log, idle.pid)}']")
            assert idle_row.locator("td[data-field=until]").inner_text() == "—"
            busy_row = page.locator(f"tr[data-owner='{owner_of(log, busy.pid)}']")
            assert busy_row.locator("td[data-field=renewed]").inner_text().endswith(" ago")
            page.screenshot(path=artifacts / f"{kind}-replicas.png", full_page=True)
        finally:
            browser.close()


# -- The migration: version 7 to 8


def test_a_sqlite_file_of_version_7_is_migrated_and_records_its_replicas(
    tmp_path: Path,
) -> None:
    from tickler._stores import sqlite as sqlite_store

    path = tmp_path / "queue.db"
    tickler.SqliteStore(path).create_schema()
    with sqlite3.connect(path) as db:  # as version 7 had it
        db.execute("DROP TABLE tickler_owners")
        db.execute("UPDATE tickler_schema SET version = 7")
        db.execute(
            "INSERT INTO tickler_requests (queue, state, request, run_at, enqueued_at)"
            " VALUES ('jobs', 'queued', '\"r\"', 0, 0)"
        )
    db.close()
    store = tickler.SqliteStore(path)
    check_recorded(store)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM tickler_schema").fetchone() == (
            sqlite_store.SCHEMA_VERSION,
        )
        assert db.execute("SELECT count(*) FROM tickler_requests").fetchone() == (1,)
    db.close()


def test_a_postgres_schema_of_version_7_is_migrated_and_records_its_replicas(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores import postgres as postgres_store

    tickler.PostgresStore(postgres_dsn, schema=postgres_schema).create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as db:  # as version 7 had it
        db.execute(
            f'ALTER TABLE "{postgres_schema}".tickler_owners'
            " DROP COLUMN host, DROP pid, DROP backend_pid"
        )
        db.execute(f'UPDATE "{postgres_schema}".tickler_schema SET version = 7')  # noqa: S608
        older = f'INSERT INTO "{postgres_schema}".tickler_owners VALUES (%s, 0)'  # noqa: S608
        db.execute(older, ("old-owner",))
        db.execute(
            f'INSERT INTO "{postgres_schema}".tickler_requests'  # noqa: S608
            " (queue, state, request, run_at, enqueued_at) VALUES ('jobs', 'queued', '\"r\"', 0, 0)"
        )
    check_recorded(tickler.PostgresStore(postgres_dsn, schema=postgres_schema))
    with psycopg.connect(postgres_dsn) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchone()
        old = db.execute(
            f'SELECT host, pid FROM "{postgres_schema}".tickler_owners'  # noqa: S608
            " WHERE owner = 'old-owner'"
        ).fetchall()
    assert version == (postgres_store.SCHEMA_VERSION,)
    assert old == [(None, None)]  # a record of the older version, kept


def check_recorded(store: Any) -> None:
    """Migrated by create_schema() (twice: the second does nothing), a session taking its
    owner's liveness mark is listed with this process's host and pid, until it closes."""
    from tickler._stores._seam import Batch

    store.create_schema()
    store.create_schema()
    assert replicas(store) == []
    before = time.time()
    session = store.connect()
    try:
        session.run("jobs", owner_id("owner-a"), 30.0, 86400.0, Batch(claim=1))
        (replica,) = replicas(store)
        assert (replica.owner, replica.host, replica.pid) == (
            owner_id("owner-a"),
            socket.gethostname(),
            os.getpid(),
        )
        assert (replica.leased, replica.queues) == (1, ["jobs"])
        assert before - 5 <= replica.since <= time.time() + 5  # (PostgreSQL: its clock)
    finally:
        session.close()
    assert replicas(store) == []


def test_a_dead_owner_is_not_listed_while_another_session_looks_at_its_lock(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """A replica's look at a dead owner holds the owner's advisory lock for an instant
    (pg_try_advisory_xact_lock): the owner is not listed as live meanwhile."""
    import psycopg

    from tickler._stores._seam import Batch

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    enqueue(store, ["r0"])
    session = store.connect()
    session.run("jobs", owner_id("owner-a"), 30.0, 86400.0, Batch(claim=1))
    session.close()  # its lock goes; its record stays, as it runs a request
    with psycopg.connect(postgres_dsn) as db:
        # The closed session's backend drops its lock as it exits, which the server does
        # after close() returns: wait (bounded) until the lock can be taken.
        deadline = time.monotonic() + 10
        while True:
            (taken,) = db.execute(
                "SELECT pg_try_advisory_xact_lock(hashtextextended('tickler:owner:' || %s, 0))",
                (owner_id("owner-a"),),
            ).fetchone() or (None,)
            if taken is True:
                break
            db.rollback()
            assert time.monotonic() < deadline, "the closed session's lock was not freed in 10 s"
            time.sleep(0.01)
        assert replicas(store) == []
        db.rollback()
