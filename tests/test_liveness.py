"""Liveness by lock, with real processes on both stores: a dead worker's rows are rescued
within two polls whatever their lease, a late result of the old owner never counts, a
stopped worker keeps its rows, and random kills lose nothing.

Each worker (tests/store_worker.py) holds a lock only its process can hold: an advisory
lock on a connection of its own (PostgreSQL), an open file description lock on a byte
of a file beside the database (SQLite). Leases here are 300 s: only the locks can
rescue within the tests' time.
"""

from __future__ import annotations

import collections
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tickler

from .conftest import Cluster
from .store_backends import owner_id
from .store_runs import caller_connection, log_lines, owner_of, worker

LEASE = "300"


def store_of(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if kind == "sqlite":
        return tickler.SqliteStore(tmp_path / "queue.db", synchronous="NORMAL")
    dsn = request.getfixturevalue("postgres_dsn")
    return tickler.PostgresStore(dsn, schema=request.getfixturevalue("postgres_schema"))


def db_args(store: Any) -> list[str]:
    """The worker's arguments naming the store."""
    if isinstance(store, tickler.SqliteStore):
        return [str(store.path)]
    return [store.dsn, "--schema", store.schema]


def enqueue(store: Any, requests: list[str]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            store.create_schema()
            break
        except tickler.StoreError as exc:  # a throwaway cluster still starting up
            if "starting up" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    connection = caller_connection(store)
    try:
        if isinstance(store, tickler.SqliteStore):
            with connection:
                store.enqueue_many_in(connection, "jobs", requests)
        else:
            store.enqueue_many_in(connection, "jobs", requests)
    finally:
        connection.close()


def rows(store: Any) -> dict[int, tuple[str, str | None, Any]]:
    """Each row's (state, rescued, result)."""
    connection = caller_connection(store)
    try:
        query = "SELECT id, state, rescued, result FROM tickler_requests"
        if not isinstance(store, tickler.SqliteStore):
            query = query.replace("tickler_requests", f'"{store.schema}".tickler_requests')
        found = connection.execute(query).fetchall()
    finally:
        connection.close()
    return {
        row[0]: (row[1], row[2], None if row[3] is None else json.loads(bytes(row[3])))
        for row in found
    }


def held_by(store: Any, owner: str) -> set[int]:
    """The rows the store has running under ``owner``'s lease."""
    connection = caller_connection(store)
    try:
        table = "tickler_requests"
        if not isinstance(store, tickler.SqliteStore):
            table = f'"{store.schema}".tickler_requests'
        query = f"SELECT id FROM {table} WHERE state = 'running' AND owner = '{owner}'"  # noqa: S608
        return {row[0] for row in connection.execute(query).fetchall()}
    finally:
        connection.close()


def starts(log: Path) -> list[tuple[int, int, int, float]]:
    """(pid, id, attempt, time) of every start."""
    return [
        (int(line[0]), int(line[2]), int(line[4]), float(line[5]))
        for line in log_lines(log)
        if line[1] == "start"
    ]


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def stop(*processes: subprocess.Popen[bytes]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def stop_outside_a_transaction(process: subprocess.Popen[bytes], store: Any) -> None:
    """SIGSTOP ``process``; with SqliteStore, again until it is stopped outside a batch's
    transaction: one stopped inside holds the database's write lock, and every other
    process waits until it runs again (see docs/failures.md)."""
    while True:
        process.send_signal(signal.SIGSTOP)
        if not isinstance(store, tickler.SqliteStore):
            return
        import sqlite3

        probe = sqlite3.connect(store.path, isolation_level=None, timeout=0.5)
        try:
            probe.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            locked = str(exc)
        else:
            probe.execute("ROLLBACK")
            return
        finally:
            probe.close()
        assert "locked" in locked, locked
        process.send_signal(signal.SIGCONT)
        time.sleep(0.05)


def statistics(store: Any) -> dict[str, int]:
    session = store.connect()
    try:
        return session.statistics("jobs")  # type: ignore[no-any-return]
    finally:
        session.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_killed_workers_rows_start_again_within_two_polls(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    poll = 0.25
    store = store_of(kind, request, tmp_path)
    enqueue(store, [f"r{i}" for i in range(20)])
    log = tmp_path / "log"
    common = ("--lease", LEASE, "--poll-interval", str(poll), "--capacity", "20")
    victim = worker(db_args(store), log, *common, "--sleep", "600")
    sibling = None
    try:
        wait_for(lambda: len(starts(log)) == 20, "the victim never held 20 rows")
        sibling = worker(db_args(store), log, *common, "--sleep", "0.2")
        wait_for(lambda: any(line[1] == "owner" for line in log_lines(log)[20:]), "no sibling")
        time.sleep(2 * poll)  # the sibling's looks go on, and find the victim alive
        assert {pid for pid, *_ in starts(log)} == {victim.pid}
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        wait_for(lambda: len(starts(log)) == 40, "the rows never started again", 30)
        assert sibling.wait(timeout=30) == 0
    finally:
        stop(victim, *([sibling] if sibling else []))
    again = [s for s in starts(log) if s[0] != victim.pid]
    assert len(again) == 20
    assert {attempt for _, _, attempt, _ in again} == {2}  # none a third time
    late = max(at for *_, at in again) - killed_at
    assert late < 2 * poll, late
    final = rows(store)
    assert {state for state, _, _ in final.values()} == {"succeeded"}
    assert {rescued for _, rescued, _ in final.values()} == {"owner_died"}
    counts = statistics(store)
    assert counts["rescued_owner_died"] == 20
    assert counts["rescued_lease_lapsed"] == 0


def liveness_backend(dsn: str, owner: str) -> int:
    """The backend pid holding ``owner``'s advisory lock."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute(
            "SELECT hashtextextended('tickler:owner:' || %s, 0)", (owner,)
        ).fetchone()
        assert row is not None
        key = row[0] & 0xFFFFFFFFFFFFFFFF
        found = connection.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
            (key >> 32, key & 0xFFFFFFFF),
        ).fetchall()
    assert len(found) == 1, found
    return int(found[0][0])


def test_a_terminated_liveness_session_never_records_the_old_owners_result(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    import psycopg

    store = store_of("postgres", request, tmp_path)
    n = 30
    enqueue(store, [f"r{i}" for i in range(n)])
    log = tmp_path / "log"
    common = ("--lease", LEASE, "--poll-interval", "0.1", "--capacity", "5", "--result-attempt")
    first = worker(db_args(store), log, *common, "--sleep", "0.6")
    second = None
    try:
        wait_for(lambda: len(starts(log)) >= 5, "the first worker never started")
        second = worker(db_args(store), log, *common, "--sleep", "0.3")
        owner = owner_of(log, first.pid)
        with psycopg.connect(store.dsn, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(%s)", (liveness_backend(store.dsn, owner),)
            )
        assert first.wait(timeout=60) == 0
        assert second.wait(timeout=60) == 0
    finally:
        stop(first, *([second] if second else []))
    lines = log_lines(log)
    assert [line[1] for line in lines if line[1] == "reowner" and int(line[0]) == first.pid] == [
        "reowner"
    ]
    final = rows(store)
    assert len(final) == n
    assert {state for state, _, _ in final.values()} == {"succeeded"}  # one final state each
    last_start: dict[int, tuple[int, str]] = {}
    for line in lines:
        if line[1] == "start":
            last_start[int(line[2])] = (int(line[4]), line[3])
    rescued = {i for i, (_, why, _) in final.items() if why is not None}
    assert rescued, "the old owner's rows were rescued"
    assert {final[i][1] for i in rescued} == {"owner_died"}
    for request_id, (_, _, result) in final.items():
        attempt, name = last_start[request_id]
        # The result is the last attempt's: a late one of the old owner never counts.
        assert result == f"{name}@{attempt}", (request_id, result, attempt)
    assert statistics(store)["rescued_owner_died"] == len(rescued)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_stopped_worker_keeps_its_rows(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    poll = 0.1
    store = store_of(kind, request, tmp_path)
    enqueue(store, [f"r{i}" for i in range(10)])
    log = tmp_path / "log"
    common = ("--lease", "30", "--poll-interval", str(poll), "--capacity", "10")
    stopped = worker(db_args(store), log, *common, "--sleep", "1.5")
    sibling = None
    try:
        wait_for(lambda: len(starts(log)) == 10, "the worker never held 10 rows")
        sibling = worker(db_args(store), log, *common, "--sleep", "0")
        wait_for(lambda: len(log_lines(log)) > 10, "no sibling")
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(10 * poll)  # ten of the sibling's looks
        stopped.send_signal(signal.SIGCONT)
        assert stopped.wait(timeout=30) == 0
        assert sibling.wait(timeout=30) == 0
    finally:
        if stopped.poll() is None:
            stopped.send_signal(signal.SIGCONT)
        stop(stopped, *([sibling] if sibling else []))
    assert {(pid, attempt) for pid, _, attempt, _ in starts(log)} == {(stopped.pid, 1)}
    ends = [line for line in log_lines(log) if line[1] == "end"]
    assert {int(line[0]) for line in ends} == {stopped.pid}
    assert len(ends) == 10
    final = rows(store)
    assert {(state, why) for state, why, _ in final.values()} == {("succeeded", None)}


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_random_kills_lose_nothing_and_repeat_only_what_ran(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store = store_of(kind, request, tmp_path)
    n = 400
    enqueue(store, [f"r{i}" for i in range(n)])
    log = tmp_path / "log"
    options = ("--lease", LEASE, "--poll-interval", "0.1", "--capacity", "5", "--sleep", "0.05")
    chance = random.Random(24)
    slots = [worker(db_args(store), log, *options) for _ in range(3)]
    in_flight_at_kill: dict[int, set[int]] = {}  # by killed pid: its rows running
    try:
        for _ in range(10):
            time.sleep(0.4)
            slot = chance.randrange(3)
            victim = slots[slot]
            wait_for(
                lambda v=victim: any(
                    line[1] == "owner" and int(line[0]) == v.pid for line in log_lines(log)
                ),
                "a worker never ran",
            )
            # Stopped first (it keeps its lock), its rows read, then killed: the rows the
            # store has running under its owner at the kill.
            victim.send_signal(signal.SIGSTOP)
            owners = [
                line[2]
                for line in log_lines(log)
                if line[1] in ("owner", "reowner") and int(line[0]) == victim.pid
            ]
            in_flight_at_kill[victim.pid] = held_by(store, owners[-1])
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            slots[slot] = worker(db_args(store), log, *options)
        for process in slots:
            assert process.wait(timeout=120) == 0
    finally:
        stop(*slots)
    final = rows(store)
    assert len(final) == n
    assert {state for state, _, _ in final.values()} == {"succeeded"}
    by_row: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for pid, request_id, attempt, _ in starts(log):
        by_row[request_id].append((pid, attempt))
    repeats = 0
    for request_id, attempts in by_row.items():
        # (A claim a kill cut short before its attempt started counts an attempt too.)
        numbers = [number for _, number in attempts]
        assert numbers == sorted(set(numbers)), (request_id, attempts)  # in order, none twice
        for pid, _ in attempts[:-1]:
            # Started again only if its worker was killed while the attempt was in flight.
            assert request_id in in_flight_at_kill.get(pid, ()), (request_id, attempts)
            repeats += 1
    assert repeats <= sum(len(held) for held in in_flight_at_kill.values())
    assert set(by_row) == set(final)


def test_a_server_restart_loses_nothing_and_rescues_nothing_alive(
    tmp_path: Path, postgres_cluster: Cluster, cluster_schema: str
) -> None:
    store = tickler.PostgresStore(postgres_cluster.dsn, schema=cluster_schema)
    n = 60
    enqueue(store, [f"r{i}" for i in range(n)])
    log = tmp_path / "log"
    common = ("--lease", LEASE, "--poll-interval", "0.1", "--capacity", "5", "--sleep", "0.3")
    workers = [worker(db_args(store), log, *common) for _ in range(2)]
    try:
        wait_for(
            lambda: {pid for pid, *_ in starts(log)} == {w.pid for w in workers},
            "both workers never ran",
        )
        postgres_cluster.stop()
        postgres_cluster.start()
        for process in workers:
            assert process.wait(timeout=60) == 0
    finally:
        stop(*workers)
    lines = log_lines(log)
    assert not [line for line in lines if line[1] == "reowner"]  # each took its lock again
    assert any(line[1] == "store_errors" for line in lines)  # the restart was felt
    final = rows(store)
    assert len(final) == n
    assert {(state, why) for state, why, _ in final.values()} == {("succeeded", None)}
    # Every row ran once: none was taken from a live worker.
    assert sorted(request_id for _, request_id, _, _ in starts(log)) == sorted(final)
    assert {attempt for _, _, attempt, _ in starts(log)} == {1}
    counts = statistics(store)
    assert (counts["rescued_owner_died"], counts["rescued_lease_lapsed"]) == (0, 0)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_stuck_worker_is_rescued_by_its_lease_and_its_late_results_never_count(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store = store_of(kind, request, tmp_path)
    enqueue(store, [f"r{i}" for i in range(5)])
    log = tmp_path / "log"
    common = ("--poll-interval", "0.1", "--capacity", "5", "--result-attempt")
    # Stopped inside a batch's transaction, it holds its rows' locks: the sibling's looks
    # end its session once that transaction outlived its lease (see docs/failures.md).
    stuck = worker(db_args(store), log, *common, "--lease", "1", "--sleep", "2")
    sibling = None
    try:
        wait_for(lambda: len(starts(log)) == 5, "the worker never held 5 rows")
        stop_outside_a_transaction(stuck, store)  # alive, with its lock: only the lease
        sibling = worker(db_args(store), log, *common, "--lease", "30", "--sleep", "0")
        assert sibling.wait(timeout=60) == 0  # it ran all five again
        stuck.send_signal(signal.SIGCONT)
        assert stuck.wait(timeout=60) == 0
    finally:
        if stuck.poll() is None:
            stuck.send_signal(signal.SIGCONT)
        stop(stuck, *([sibling] if sibling else []))
    final = rows(store)
    assert {(state, why) for state, why, _ in final.values()} == {("succeeded", "lease_lapsed")}
    # The sibling's results, attempt 2: the stuck worker's, late, were never recorded.
    assert {result for _, _, result in final.values()} == {f"r{i}@2" for i in range(5)}
    counts = statistics(store)
    assert (counts["rescued_owner_died"], counts["rescued_lease_lapsed"]) == (0, 5)
    url = f"sqlite:///{store.path}" if kind == "sqlite" else store.dsn
    extra = [] if kind == "sqlite" else ["--schema", store.schema]
    shown = subprocess.run(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "tickler", "inspect", url, *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "  rescued: 0 owner_died, 5 lease_lapsed\n" in shown + "\n", shown


def test_a_batch_stopped_mid_transaction_is_ended_once_it_outlives_its_lease(
    postgres_dsn: str, postgres_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped inside a batch keeps its liveness lock, and its transaction keeps
    its rows' locks, which claims skip: another replica's look ends that session once its
    transaction outlived its lease, and then rescues the rows by their lapsed lease. Here
    the batch's thread is held right after its renewal, as a SIGSTOP there would."""
    import threading

    from tickler._stores._seam import Batch

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    enqueue(store, [f"r{i}" for i in range(5)])
    stuck, rescuer = store.connect(), store.connect()
    held, go_on = threading.Event(), threading.Event()
    failed: list[BaseException] = []
    try:
        first = stuck.run("jobs", owner_id("stuck"), 1.0, 86400.0, Batch(claim=5))
        mine = {row[0] for row in first.claimed}
        assert len(mine) == 5
        execute = stuck.execute

        def held_after_the_renewal(sql: str, params: Any = ()) -> Any:
            cursor = execute(sql, params)
            if sql == stuck.statements.renew:
                held.set()
                go_on.wait(60)
            return cursor

        stuck.execute = held_after_the_renewal  # type: ignore[method-assign]

        def look() -> None:
            try:
                stuck.run("jobs", owner_id("stuck"), 1.0, 86400.0, Batch(renew=True))
            except BaseException as exc:  # checked below
                failed.append(exc)

        thread = threading.Thread(target=look)
        thread.start()
        assert held.wait(10)
        # The rows are locked by the held transaction until the server ends it.
        deadline = time.monotonic() + 20
        taken: set[int] = set()
        while len(taken) < 5:
            assert time.monotonic() < deadline, f"rescued only {taken} of {mine}"
            result = rescuer.run(
                "jobs", owner_id("rescuer"), 30.0, 86400.0, Batch(claim=5, renew=True)
            )
            taken |= {row[0] for row in result.claimed if row[7] == "lease_lapsed"}
            time.sleep(0.1)
        assert taken == mine
        assert "waited on its client in a batch's transaction" in caplog.text
        go_on.set()
        thread.join(10)
        assert failed  # its session was ended: the batch failed, and nothing of it counted
    finally:
        go_on.set()
        stuck.close()
        rescuer.close()
    assert {state for state, _, _ in rows(store).values()} == {"running"}
    counts = statistics(store)
    assert (counts["rescued_owner_died"], counts["rescued_lease_lapsed"]) == (0, 5)


def test_a_stuck_batch_is_ended_only_by_a_role_allowed_to(postgres_dsn: str) -> None:
    """The rule that ends a stuck batch's session asks first whether this role may: a
    role that may not (another role's session, a superuser's) ends nothing and gets no
    error, which would fail its looks."""
    import uuid

    import psycopg

    from tickler._stores._pg_live import _END_STUCK, BATCH_LOCK

    role = f"tickler_probe_{uuid.uuid4().hex[:8]}"
    with (
        psycopg.connect(postgres_dsn, autocommit=True) as stuck,
        psycopg.connect(postgres_dsn, autocommit=True) as other,
    ):
        stuck.execute("BEGIN")
        stuck.execute("SELECT pg_advisory_xact_lock_shared(%s, 1)", (BATCH_LOCK,))
        pid = stuck.info.backend_pid
        time.sleep(0.05)  # its transaction outlives its lease of 1 ms, waiting on us
        other.execute(f"CREATE ROLE {role} NOLOGIN")
        try:
            other.execute(f"SET ROLE {role}")
            assert other.execute(_END_STUCK).fetchall() == []  # not allowed: left alone
            other.execute("RESET ROLE")
            assert other.execute(_END_STUCK).fetchall() == [(pid, True)]
        finally:
            other.execute("RESET ROLE")
            other.execute(f"DROP ROLE {role}")
        with pytest.raises(psycopg.OperationalError):
            stuck.execute("SELECT 1")


def check_rescues_counted(store: Any) -> None:
    """A store migrated from the version before rescues: a dead owner's row is rescued and
    counted, with its reason in the row."""
    from tickler._stores._seam import Batch

    store.create_schema()
    store.create_schema()  # again: nothing to do
    session = store.connect()
    try:
        first = session.run("jobs", owner_id("first"), 30.0, 86400.0, Batch(claim=1))
        [(old, *_)] = first.claimed  # the row of the older version, due first
        session.close()  # its owner's lock goes with the session
        session = store.connect()
        # (A look: SQLite asks for dead owners in the claims of its looks.)
        result = session.run("jobs", owner_id("second"), 30.0, 86400.0, Batch(claim=1, renew=True))
        assert [(row[0], row[7]) for row in result.claimed] == [(old, "owner_died")]
        counts = session.statistics("jobs")
        assert (counts["rescued_owner_died"], counts["rescued_lease_lapsed"]) == (1, 0)
    finally:
        session.close()
    assert rows(store)[old][:2] == ("running", "owner_died")


def test_a_sqlite_file_of_version_4_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    from tickler._stores import sqlite as sqlite_store

    from .test_store_scheduling import _SQLITE_V2

    path = tmp_path / "queue.db"
    with sqlite3.connect(path) as connection:
        connection.executescript(_SQLITE_V2)
        sqlite_store._to_v3(connection)
        sqlite_store._to_v4(connection)
        connection.execute("UPDATE tickler_schema SET version = 4")
        connection.execute(
            "INSERT INTO tickler_requests (queue, state, request, run_at, enqueued_at)"
            " VALUES ('jobs', 'queued', '\"r\"', 0, 0)"
        )
    connection.close()
    check_rescues_counted(tickler.SqliteStore(path))
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM tickler_schema").fetchone() == (8,)
    db.close()


def test_a_postgres_schema_of_version_3_is_migrated(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores import postgres as postgres_store

    from .test_store_scheduling import _POSTGRES_V1

    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{postgres_schema}"')
        connection.execute(f'SET search_path TO "{postgres_schema}"')
        older = ";".join(
            (_POSTGRES_V1, postgres_store._MIGRATIONS[1], postgres_store._MIGRATIONS[2])
        )
        for statement in older.split(";"):
            if statement.strip():
                connection.execute(statement)
        connection.execute("UPDATE tickler_schema SET version = 3")
        connection.execute(
            "INSERT INTO tickler_requests (queue, state, request, run_at, enqueued_at)"
            " VALUES ('jobs', 'queued', '\"r\"', 0, 0)"
        )
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    check_rescues_counted(store)
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchone()
    assert version == (9,)


def test_a_postgres_schema_of_version_6_is_migrated_to_an_index_of_groups_without_running_rows(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Version 7's tickler_by_group holds no running rows (a claim writes no entry into it):
    the index as versions 4 to 6 built it is built again, the rows kept."""
    import psycopg

    from tickler._stores import postgres as postgres_store

    from .test_store_scheduling import _POSTGRES_V1

    def index() -> str:
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            row = db.execute(
                "SELECT indexdef FROM pg_indexes WHERE schemaname = %s"
                " AND indexname = 'tickler_by_group'",
                (postgres_schema,),
            ).fetchone()
        assert row is not None
        return str(row[0])

    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{postgres_schema}"')
        connection.execute(f'SET search_path TO "{postgres_schema}"')
        older = ";".join((_POSTGRES_V1, *(postgres_store._MIGRATIONS[v] for v in range(1, 6))))
        for statement in postgres_store._statements(older):
            connection.execute(statement)
        # Version 4's index, as it was.
        connection.execute(
            "CREATE INDEX tickler_by_group ON tickler_requests (queue, group_name, state, id)"
            " WHERE group_name IS NOT NULL"
        )
        connection.execute("UPDATE tickler_schema SET version = 6")
        connection.execute(
            "INSERT INTO tickler_requests (queue, state, request, run_at, enqueued_at, group_name)"
            " VALUES ('jobs', 'queued', '\"r\"', 0, 0, 'g')"
        )
    assert "running" not in index()
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    assert index().endswith("WHERE ((group_name IS NOT NULL) AND (state <> 'running'::text))")
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchone()
        grouped = db.execute(
            f'SELECT group_name, state FROM "{postgres_schema}".tickler_requests'  # noqa: S608
            " WHERE group_name IS NOT NULL"
        ).fetchall()
    assert version == (9,)
    assert grouped == [("g", "queued")]
    fresh = f"{postgres_schema}_fresh"
    tickler.PostgresStore(postgres_dsn, schema=fresh).create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        defs = {
            schema: str(row[0]).replace(f'"{schema}".', "").replace(f"{schema}.", "")
            for schema in (postgres_schema, fresh)
            for row in db.execute(
                "SELECT indexdef FROM pg_indexes WHERE schemaname = %s"
                " AND indexname = 'tickler_by_group'",
                (schema,),
            )
        }
        db.execute(f'DROP SCHEMA "{fresh}" CASCADE')
    assert defs[postgres_schema] == defs[fresh]
