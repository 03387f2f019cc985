"""PostgresStore specifics on a real server: NOTIFY, bad input, sessions ended, a restart.

What every store must do is in tests/test_store_contract.py.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import trio

import tickler

from .conftest import Cluster
from .store_backends import owner_id
from .store_runs import driver_of, sync_of


async def double(request: int) -> int:
    return request * 2


def store(dsn: str, schema: str, **options: Any) -> tickler.PostgresStore:
    return tickler.PostgresStore(dsn, schema=schema, **options)


async def test_without_notify_an_idle_replica_finds_work_at_its_poll(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """notify=False (a pooler in transaction mode): no listener, and no NOTIFY; the poll finds it.

    With notify, the conformance suite checks the listener wakes the replica at once.
    """
    queue = store(postgres_dsn, postgres_schema, poll_interval=3.0, notify=False)
    assert queue.listener("jobs") is None
    async with tickler.open_service(double, store=queue, name="jobs") as service:
        await trio.sleep(0.3)  # the service's first look is behind it
        with psycopg.connect(postgres_dsn) as connection:
            request_id = queue.enqueue_in(connection, "jobs", 21)
        started = trio.current_time()
        with trio.fail_after(10):
            while (found := await service.lookup(request_id)) is None or not found.done:
                await trio.sleep(0.02)
        waited = trio.current_time() - started
        assert found.result() == 42
        assert waited > 0.5  # only the poll found it


async def test_bad_options_are_refused_at_once() -> None:
    with pytest.raises(ValueError, match="schema must be a lower-case SQL identifier"):
        tickler.PostgresStore("postgresql://", schema='x"; DROP TABLE y; --')
    with pytest.raises(TypeError, match="notify must be a bool"):
        tickler.PostgresStore("postgresql://", notify=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease must be > 0"):
        tickler.PostgresStore("postgresql://", lease=0)


async def test_a_dsn_that_cannot_connect_is_a_clear_error_from_run() -> None:
    queue = tickler.PostgresStore("postgresql://nobody@127.0.0.1:1/none", schema="x")
    service = tickler.Service(double, store=queue, name="jobs")
    with pytest.raises(tickler.StoreError, match="cannot connect to PostgreSQL"):
        await service.run()


async def test_a_foreign_schema_is_refused(postgres_dsn: str, postgres_schema: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{postgres_schema}"')
        connection.execute(f'CREATE TABLE "{postgres_schema}".customers (id int)')
    service = tickler.Service(double, store=store(postgres_dsn, postgres_schema), name="jobs")
    with pytest.raises(tickler.StoreError, match="not tickler's"):
        await service.run()


async def test_the_server_dropping_the_connection_loses_nothing(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """The server ends the service's session mid-run: it reconnects and commits everything."""
    queue = store(postgres_dsn, postgres_schema, poll_interval=0.05)
    async with tickler.open_service(double, store=queue, name="jobs") as service:
        await (await service.submit(0)).wait()
        stored = sync_of(service)
        assert stored is not None
        assert stored.connection is not None
        pid = driver_of(stored.connection).info.backend_pid
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        tickets = [service.enqueue_request(i) for i in range(1, 50)]
        with trio.fail_after(20):
            assert [await t.wait() for t in tickets] == [i * 2 for i in range(1, 50)]
        assert driver_of(stored.connection).info.backend_pid != pid  # a new session
        assert service.statistics().store_errors >= 1  # and the statistics say so
        assert (await service.store_statistics())["succeeded"] == 50


async def test_inspect_a_schema(postgres_dsn: str, postgres_schema: str) -> None:
    async def maybe(request: int) -> int:
        if request < 0:
            raise ValueError(f"negative {request}")
        return request

    queue = store(postgres_dsn, postgres_schema, poll_interval=0.05)
    async with tickler.open_service(
        maybe, store=queue, name="jobs", on_error=lambda t, e: None
    ) as service:
        for request in (1, -2):
            await service.submit(request)
        await service.join()
    command = [sys.executable, "-m", "tickler", "inspect", postgres_dsn]
    done = await trio.run_process([*command, "--schema", postgres_schema], capture_stdout=True)
    assert done.stdout.decode().splitlines() == [
        "queue 'jobs': 0 queued, 0 scheduled, 0 claimed, 0 running, 0 retrying,"
        " 1 succeeded, 1 failed, 0 cancelled",
        "  failed #2 after 1 attempt(s): ValueError: negative -2",
    ]
    missing = await trio.run_process(
        [*command, "--schema", "no_such_schema"], capture_stderr=True, check=False
    )
    assert missing.returncode == 2
    assert "not a tickler store" in missing.stderr.decode()


async def test_an_error_with_a_nul_character_fails_only_its_request(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Regression: PostgreSQL text cannot hold NUL; the batch failed for ever, blocking all."""

    async def bad(request: str) -> str:
        if request == "bad":
            raise ValueError("payload had a \x00 byte")
        return request

    queue = store(postgres_dsn, postgres_schema, poll_interval=0.05)
    async with tickler.open_service(
        bad, store=queue, name="jobs", on_error=lambda t, e: None
    ) as service:
        failing = await service.submit("bad")
        with trio.fail_after(5), pytest.raises(ValueError, match="payload"):
            await failing.wait()
        with trio.fail_after(5):
            assert await (await service.submit("good")).wait() == "good"
        found = await service.lookup(failing.id)
        assert found is not None
        with pytest.raises(tickler.RequestFailed, match=r"payload had a \\x00 byte"):
            found.result()
    with pytest.raises(ValueError, match="name must not contain NUL"):
        tickler.Service(bad, store=queue, name="jo\x00bs")


def test_a_schema_whose_channel_name_would_be_too_long_is_refused() -> None:
    """Regression: 56 to 63 characters passed, and then no NOTIFY (so no enqueue) ever committed."""
    tickler.PostgresStore("postgresql://", schema="s" * 55)
    with pytest.raises(ValueError, match="at most 55"):
        tickler.PostgresStore("postgresql://", schema="s" * 56)


async def test_an_outcome_committed_late_by_another_replica_is_seen_at_the_next_look(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Regression: a replica's commit that came seconds after its time was found only by the
    sweep 30 looks later, since replicas commit concurrently."""
    queue = store(postgres_dsn, postgres_schema, poll_interval=0.5)
    async with tickler.open_service(double, store=queue, name="jobs") as service:
        ticket = await service.submit(1, delay=600)
        await trio.sleep(1.2)  # a few looks go by
        with psycopg.connect(postgres_dsn) as connection:  # finished 5 s ago, committed now
            connection.execute(
                f'UPDATE "{postgres_schema}".tickler_requests SET state = %s, result = %s,'  # noqa: S608
                " finished_at = extract(epoch FROM clock_timestamp()) - 5 WHERE id = %s",
                ("succeeded", b"7", ticket.id),
            )
        with trio.fail_after(3):
            assert await ticket.wait() == 7


async def test_lookup_and_cancel_survive_a_session_the_server_ended(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Regression: the first call after pg_terminate_backend raised psycopg's AdminShutdown."""
    queue = store(postgres_dsn, postgres_schema, poll_interval=30)
    async with tickler.open_service(double, store=queue, name="jobs") as service:
        ticket = await service.submit(1, delay=600)
        stored = sync_of(service)
        assert stored is not None
        assert stored.connection is not None
        for call in (service.lookup, service.cancel):
            pid = driver_of(stored.connection).info.backend_pid
            with psycopg.connect(postgres_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            assert await call(ticket.id)


def test_a_keyed_insert_tries_again_when_the_live_row_ends_in_between() -> None:
    """Under READ COMMITTED the conflicting row can end before the select sees it.

    The statements' answers are scripted here: the race itself cannot be
    timed from a test; the helper's handling of it can.
    """
    from tickler._stores._sql import insert_keyed

    answers = iter([None, None, (5,)])  # conflict, no live row any more, inserted

    class Result:
        def __init__(self, row: Any) -> None:
            self.row = row

        def fetchone(self) -> Any:
            return self.row

    asked: list[bool] = []

    def execute(sql: str, params: Any) -> Result:
        asked.append(sql == "insert")
        return Result(next(answers))

    params = ("jobs", '"k"', "queued", b"1", 0.0, 0.0)
    assert insert_keyed(execute, "insert", "live", '"k"', params) == (5, True)
    assert asked == [True, False, True]


async def test_a_server_restart_mid_run_loses_nothing(
    postgres_cluster: Cluster, cluster_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops for 2 s while requests flow and attempts run, then starts again.

    The service keeps running: its batches fail and are retried with backoff
    on a new connection, every request accepted meanwhile is committed and
    runs once, attempts that ran across the restart keep their lease, the
    statistics and the log say so, and NOTIFY wakes it again. (Each request
    has a key, so that a batch whose COMMIT reply the stop cut off, retried,
    finds its rows rather than inserting them again: the count is exact.)
    """
    dsn = postgres_cluster.dsn
    starts: collections.Counter[int] = collections.Counter()

    async def handler(request: int) -> int:
        starts[request] += 1
        await trio.sleep(3.0 if request % 100 == 0 else 0.01)  # a few run across the restart
        return request * 2

    queue = store(dsn, cluster_schema, lease=10.0, poll_interval=2.0)
    tickets: list[tickler.Ticket[int, int]] = []
    async with tickler.open_service(handler, store=queue, name="jobs", capacity=50) as service:
        stored = sync_of(service)
        assert stored is not None

        async def enqueue_for(seconds: float) -> None:
            end = trio.current_time() + seconds
            while trio.current_time() < end:
                tickets.append(service.enqueue_request(len(tickets), key=f"r{len(tickets)}"))
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(enqueue_for, 4.0)
            await trio.sleep(0.5)
            running_at_stop = service.statistics().in_flight
            await trio.to_thread.run_sync(postgres_cluster.stop)
            stopped_at = trio.current_time()
            with trio.fail_after(10):
                while stored.failures < 3:  # the loop keeps trying, and backs off
                    await trio.sleep(0.01)
            await trio.sleep_until(stopped_at + 2.0)
            uncommitted = sum(1 for ticket in tickets if ticket.id == 0)
            await trio.to_thread.run_sync(postgres_cluster.start)
        assert running_at_stop > 0
        assert uncommitted > 100  # accepted while the server was away
        with trio.fail_after(30):
            results = [await ticket.wait() for ticket in tickets]
        assert results == [i * 2 for i in range(len(tickets))]
        assert set(starts) == set(range(len(tickets)))
        assert max(starts.values()) == 1  # none ran twice: leases held across the restart
        assert service.statistics().store_errors >= 3
        counts = await service.store_statistics()
        assert counts["succeeded"] == len(tickets)  # each committed once, nothing lost
        assert sum(counts.values()) == len(tickets)

        # The LISTEN connection is back too: an enqueue elsewhere wakes the
        # service well before its 2 s poll.
        with trio.fail_after(10):
            while not await trio.to_thread.run_sync(listening, dsn, queue.channel):
                await trio.sleep(0.05)
        with psycopg.connect(dsn) as connection:
            request_id = queue.enqueue_in(connection, "jobs", -1)
        started = trio.current_time()
        with trio.fail_after(10):
            while (found := await service.lookup(request_id)) is None or not found.done:
                await trio.sleep(0.02)
        assert trio.current_time() - started < 1.0
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "tickler"]
    for level, words in [
        ("ERROR", "service 'jobs': writing to the store failed"),
        ("WARNING", "service 'jobs': the NOTIFY connection failed"),
        ("WARNING", "connected to PostgreSQL again"),
        ("WARNING", "service 'jobs': listening for NOTIFY again"),
    ]:
        assert any(level == lv and words in message for lv, message in said), (words, said)


def listening(dsn: str, channel: str) -> bool:
    """Whether a session LISTENs on ``channel`` (its last statement was the LISTEN)."""
    with psycopg.connect(dsn) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s",
            (f'LISTEN "{channel}"',),
        ).fetchone()
    return row is not None and row[0] > 0


async def test_enqueue_in_through_a_connection_that_reads_rows_as_dicts(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Regression: enqueue_in failed with KeyError: 0 on a connection with dict_row."""
    import psycopg.rows

    queue = store(postgres_dsn, postgres_schema, poll_interval=0.05)
    queue.connect().close()  # creates the schema
    with psycopg.connect(postgres_dsn, row_factory=psycopg.rows.dict_row) as connection:
        plain = queue.enqueue_in(connection, "jobs", 1)
        keyed = queue.enqueue_in(connection, "jobs", 2, key="k")
        assert queue.enqueue_in(connection, "jobs", 3, key="k") == keyed  # the live one
    assert plain > 0
    assert keyed > plain
    async with tickler.open_service(double, store=queue, name="jobs") as service:
        with trio.fail_after(10):
            while (found := await service.lookup("k")) is None or not found.done:
                await trio.sleep(0.02)
        assert found.result() == 4


def _expire_with_cancel(dsn: str, schema: str, request_id: int) -> None:
    """The request as if a replica had claimed it, been asked to cancel it, and died."""
    with psycopg.connect(dsn) as connection:
        connection.execute(
            f'UPDATE "{schema}".tickler_requests SET state = %s, owner = %s,'  # noqa: S608
            " attempts = 1, started_at = extract(epoch FROM clock_timestamp()) - 60,"
            " lease_until = extract(epoch FROM clock_timestamp()) - 1,"
            " cancel_requested = TRUE WHERE id = %s",
            ("running", "a-replica-that-died", request_id),
        )


def test_the_claim_never_takes_an_expired_lease_whose_cancel_was_asked_for(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """The claim itself skips such a row: a cancel can commit between the batch's statements."""
    queue = store(postgres_dsn, postgres_schema)
    connection = queue.connect()
    try:
        with psycopg.connect(postgres_dsn) as caller:
            orphan = queue.enqueue_in(caller, "jobs", 1)
            lapsed = queue.enqueue_in(caller, "jobs", 2)
        _expire_with_cancel(postgres_dsn, postgres_schema, orphan)
        _expire_with_cancel(postgres_dsn, postgres_schema, lapsed)
        with psycopg.connect(postgres_dsn, autocommit=True) as caller:
            caller.execute(
                f'UPDATE "{postgres_schema}".tickler_requests'  # noqa: S608
                " SET cancel_requested = FALSE WHERE id = %s",
                (lapsed,),
            )
        now, _ = connection.now()
        claimed = connection.claim("jobs", owner_id("me"), now, now + 30, 10)()
        assert [row[0] for row in claimed] == [lapsed]  # only the one without a cancel
    finally:
        connection.close()


def statements_of(session: Any) -> list[tuple[str, Any]]:
    """The (sql, params) of every statement the session runs through execute() from now on."""
    asked: list[tuple[str, Any]] = []
    run = session.execute

    def spy(sql: str, params: Any = ()) -> Any:
        asked.append((sql, params))
        return run(sql, params)

    session.execute = spy
    return asked


async def test_lookup_of_a_finished_request_by_key_reads_an_index(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Regression: the index of keys held live rows only, so such a lookup read the whole table."""
    queue = store(postgres_dsn, postgres_schema)
    connection = queue.connect()
    try:
        table = f'"{postgres_schema}".tickler_requests'
        with psycopg.connect(postgres_dsn) as caller:
            caller.execute(
                f"INSERT INTO {table} (queue, key, state, request, run_at, enqueued_at,"  # noqa: S608
                " finished_at) SELECT 'jobs', '\"k' || i || '\"', 'succeeded', 'null', 0, 0, 0"
                " FROM generate_series(1, 5000) AS i"
            )
            caller.execute(f"ANALYZE {table}")
        asked = statements_of(connection)
        found = connection.lookup("jobs", "k77")
        assert found is not None
        assert found.state == "succeeded"
        ((sql, params),) = asked
        plan = "\n".join(row[0] for row in driver_of(connection).execute("EXPLAIN " + sql, params))
        assert "tickler_keys" in plan, plan
        assert "Seq Scan" not in plan, plan
    finally:
        connection.close()


async def test_connections_keep_tcp_alive_unless_the_dsn_says_otherwise(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """A server host that vanishes must not leave a batch or the listener waiting for ever."""
    import psycopg.conninfo

    for dsn, idle in [
        (postgres_dsn, "10"),
        (psycopg.conninfo.make_conninfo(postgres_dsn, keepalives_idle=77), "77"),
    ]:
        async with tickler.open_service(
            double, store=store(dsn, postgres_schema), name="jobs"
        ) as service:
            assert sync_of(service) is not None
            connection = sync_of(service).connection
            assert connection is not None
            said = driver_of(connection).info.get_parameters()
            assert (said.get("keepalives"), said.get("keepalives_idle")) == ("1", idle)
            assert await (await service.submit(1)).wait() == 2


async def test_enqueue_in_on_an_autocommit_connection_commits_at_once(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """No transaction of the caller's: each request is committed, and notified, by its statement."""
    queue = store(postgres_dsn, postgres_schema, poll_interval=30.0)
    started = trio.Event()
    release = trio.Event()

    async def held(request: int) -> int:
        started.set()
        await release.wait()
        return request * 2

    async with tickler.open_service(held, store=queue, name="jobs") as service:
        await trio.sleep(0.3)  # the service's first look is behind it
        with psycopg.connect(postgres_dsn, autocommit=True) as connection:
            first = queue.enqueue_in(connection, "jobs", 21, key="k")
            with trio.fail_after(5):  # its NOTIFY went out: no poll for 30 s
                await started.wait()
            again = queue.enqueue_in(connection, "jobs", 99, key="k")
            with psycopg.connect(postgres_dsn) as other:  # committed: seen elsewhere
                row = other.execute(
                    f'SELECT state FROM "{postgres_schema}".tickler_requests'  # noqa: S608
                    " WHERE id = %s",
                    (first,),
                ).fetchone()
            assert connection.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
        assert again == first  # the key was live
        assert row == ("running",)
        release.set()
        with trio.fail_after(10):
            while (found := await service.lookup(first)) is None or not found.done:
                await trio.sleep(0.02)
        assert found.result() == 42


@pytest.mark.parametrize("skew", [5.0, -5.0])
async def test_a_replica_whose_clock_is_off_goes_by_the_servers_clock(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """This process's clock is ``skew`` seconds off the server's.

    A request enqueued here, by the service or by enqueue_in, is due by the
    server's clock: ahead, nothing waits (or spins) for the server to catch
    up; behind, no delay ends early. A cancel's time is the server's too.
    """
    import time

    from tickler._stores._sync import StoreSync

    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    batches = 0
    run_batch = StoreSync.run_batch

    async def counted(self: StoreSync, *args: Any) -> Any:
        nonlocal batches
        batches += 1
        return await run_batch(self, *args)

    monkeypatch.setattr(StoreSync, "run_batch", counted)
    starts: dict[int, float] = {}
    waited: dict[int, float] = {}

    async def note(request: int) -> int:
        starts[request] = trio.current_time()
        enqueued_at = tickler.current_ticket().enqueued_at
        assert enqueued_at is not None
        waited[request] = starts[request] - enqueued_at
        return request

    queue = store(postgres_dsn, postgres_schema, poll_interval=30.0)
    async with tickler.open_service(note, store=queue, name="jobs") as service:
        await trio.sleep(0.3)  # the service's first look is behind it
        before = batches
        enqueued = trio.current_time()
        with trio.fail_after(2):
            assert await (await service.submit(1)).wait() == 1
        assert starts[1] - enqueued < 1.0
        assert batches - before <= 4  # its insert and claim, its outcome

        enqueued = trio.current_time()
        delayed = service.enqueue_request(2, delay=1.0)
        with trio.fail_after(4):
            assert await delayed.wait() == 2
        assert 1.0 <= starts[2] - enqueued < 2.0

        with psycopg.connect(postgres_dsn, autocommit=True) as caller:
            enqueued = trio.current_time()
            request_id = queue.enqueue_in(caller, "jobs", 3, delay=1.0)
        with trio.fail_after(4):
            while (found := await service.lookup(request_id)) is None or not found.done:
                await trio.sleep(0.02)
        assert 1.0 <= starts[3] - enqueued < 2.0
        assert 1.0 <= waited[3] < 2.0  # its enqueue time, read from the row, is Trio's now

        # A cancel from here ends the row at the server's time too.
        parked = await service.submit(4, delay=60.0)
        assert parked.id is not None
        assert await service.cancel(parked.id)
        with trio.fail_after(3), pytest.raises(tickler.RequestCancelled):
            await parked.wait()
        with psycopg.connect(postgres_dsn) as caller:
            row = caller.execute(
                "SELECT extract(epoch FROM clock_timestamp())::float8,"  # noqa: S608
                f' finished_at FROM "{postgres_schema}".tickler_requests WHERE id = %s',
                (parked.id,),
            ).fetchone()
        assert row is not None
        assert abs(row[0] - row[1]) < 1.0


def test_the_admin_reads_a_group_on_its_indexes_in_plans_for_any_parameters(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """tickler_by_group holds no running rows (a claim writes no entry into it). Every read
    of the admin API filtered by group names its state as a constant, so that a generic
    plan (psycopg prepares a statement run five times) is proven to fit that index; a
    group's running rows are read on the indexes that hold them."""
    from tickler._stores import _admin

    queue = store(postgres_dsn, postgres_schema)
    queue.create_schema()
    table = f'"{postgres_schema}".tickler_requests'
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        db.execute(
            f"INSERT INTO {table} (queue, state, request, run_at, enqueued_at, group_name,"  # noqa: S608
            " finished_at, owner, lease_until) SELECT 'jobs', s.state, 'null', 0, 0,"
            " 'g' || (i % 100), CASE WHEN s.state IN ('succeeded', 'failed') THEN i END,"
            " CASE WHEN s.state = 'running' THEN 'o' END,"
            " CASE WHEN s.state = 'running' THEN 1e12 END"
            " FROM generate_series(1, 20000) AS i, LATERAL (SELECT CASE"
            " WHEN i % 500 = 0 THEN 'running' WHEN i % 3 = 0 THEN 'succeeded'"
            " WHEN i % 7 = 0 THEN 'failed' ELSE 'queued' END AS state) AS s"
        )
        db.execute(f"ANALYZE {table}")
    session = queue.connect()
    asked = statements_of(session)
    try:
        filters: dict[str, Callable[[Any], int]] = {
            "page": lambda f: len(_admin._page(session, "jobs", f, None, 50)),
            "count": lambda f: _admin._count_where(session, "jobs", f),
        }
        asks = [(kind, state) for kind in filters for state in (None, "running", "failed")]
        seen: dict[tuple[str, str | None], int] = {}
        for kind, state in asks:
            seen[kind, state] = filters[kind](_admin._Filter.of(state, None, "g0"))
        # And the bulk actions, on the group g1 (none of whose rows run).
        g1 = _admin._Filter.of(None, None, "g1")
        waiting = _admin._count_where(session, "jobs", _admin._Filter.of("queued", None, "g1"))
        failed_g1 = _admin._count_where(session, "jobs", _admin._Filter.of("failed", None, "g1"))
        assert _admin._cancel_where(session, "jobs", g1) == waiting > 0
        assert _admin._retry_where(session, "jobs", g1) == waiting + failed_g1
        # Each bulk action: its write, and its read of the rows it left (held by a batch).
        asks += [("count", "queued"), ("count", "failed")]
        asks += [("cancel", None), ("cancel: held", None), ("retry", None), ("retry: held", None)]
        plans = []
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            db.execute(f'SET search_path TO "{postgres_schema}"')
            db.execute("SET plan_cache_mode = force_generic_plan")
            for number, (sql, params) in enumerate(asked):
                parts = sql.split("%s")
                numbered = "".join(f"{p}${i}" for i, p in enumerate(parts[:-1], 1)) + parts[-1]
                db.execute(f"PREPARE asked{number} AS {numbered}")
                cursor = psycopg.ClientCursor(db)
                arguments = ", ".join(["%s"] * len(params))
                cursor.execute(f"EXPLAIN EXECUTE asked{number}({arguments})", params)
                plans.append((sql, "\n".join(row[0] for row in cursor.fetchall())))
    finally:
        session.close()
    assert len(plans) == len(asks)
    for sql, plan in plans:
        assert "Seq Scan" not in plan, (sql, plan)
        if "'running'" not in sql or "<>" in sql or "state IN" in sql:
            # (tickler_groups: the ready rows by group, which the claims read.)
            assert "tickler_by_group" in plan or "tickler_groups" in plan, (sql, plan)
    # The group g0: rows 100, 200, ... of which 500, 1000, ... run.
    rows = list(range(100, 20001, 100))
    running = [i for i in rows if i % 500 == 0]
    failed = [i for i in rows if i % 500 and i % 3 and i % 7 == 0]
    assert (seen["count", None], seen["page", None]) == (len(rows), 50)
    assert seen["count", "running"] == seen["page", "running"] == len(running) == 40
    assert seen["count", "failed"] == seen["page", "failed"] == len(failed) > 0


def test_a_tests_owner_ids_are_its_own(postgres_dsn: str, postgres_schema: str) -> None:
    """Another test run's session holding the liveness lock of an owner id this test names
    (the lock is database-wide, by the id's hash) takes nothing from this test: each test's
    owner ids carry a suffix of its own (conftest sets it, store_backends.owner_id adds it)."""
    import psycopg

    from tickler._stores._seam import Batch

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as other_run:
        # Taken here, unless another test run holds it already: held elsewhere either way.
        other_run.execute(
            "SELECT pg_try_advisory_lock(hashtextextended('tickler:owner:' || %s, 0))", ("me",)
        )
        session = store.connect()
        try:
            result = session.run("jobs", owner_id("me"), 30.0, 86400.0, Batch(claim=1))
        finally:
            session.close()
    assert not result.lost


def _schema_shape(dsn: str, schema: str) -> tuple[dict[str, str], list[str]]:
    """The indexes of tickler_requests (name: definition, the schema's name left out) and
    the names of its triggers."""
    with psycopg.connect(dsn, autocommit=True) as db:
        indexes = {
            str(name): str(definition).replace(f"{schema}.", "")
            for name, definition in db.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s"
                " AND tablename = 'tickler_requests'",
                (schema,),
            )
        }
        triggers = sorted(
            str(name)
            for (name,) in db.execute(
                "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
                " AND tgrelid = (quote_ident(%s) || '.tickler_requests')::regclass",
                (schema,),
            )
        )
    return indexes, triggers


def test_a_schema_of_version_8_is_migrated_to_leaner_writes_with_its_rows_and_counts(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Version 9: tickler_by_state without the running rows, the finished rows' index
    without started_at, no tickler_finished, and the finished requests per minute counted
    by a row-level trigger (or by the outcome statement) instead of the statement-level
    one. A schema of version 8 is brought to the very shape of a new one, its rows and its
    minutes kept; a request ended by a plain UPDATE is counted once, as before."""
    from tickler._stores import postgres as postgres_store

    fresh = f"{postgres_schema}_fresh"
    tickler.PostgresStore(postgres_dsn, schema=fresh).create_schema()
    try:
        wanted = _schema_shape(postgres_dsn, fresh)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            db.execute(f'DROP SCHEMA "{fresh}" CASCADE')
    tickler.PostgresStore(postgres_dsn, schema=postgres_schema).create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as db:  # as version 8 had it
        db.execute(f'SET search_path TO "{postgres_schema}"')
        db.execute("DROP INDEX tickler_by_state")
        db.execute("DROP INDEX tickler_finished_by_queue")
        db.execute("DROP TRIGGER tickler_count_finished_row ON tickler_requests")
        db.execute("DROP FUNCTION tickler_count_finished_row()")
        db.execute(
            "CREATE INDEX tickler_finished ON tickler_requests (finished_at)"
            " WHERE state IN ('succeeded', 'failed', 'cancelled')"
        )
        for statement in postgres_store._statements(postgres_store._V4):
            db.execute(statement)
        db.execute("UPDATE tickler_schema SET version = 8")
        db.execute(
            "INSERT INTO tickler_requests (queue, state, request, run_at, enqueued_at, owner)"
            " VALUES ('jobs', 'running', '\"a\"', 0, 0, 'me'),"
            " ('jobs', 'running', '\"b\"', 0, 0, 'me')"
        )
        now = db.execute("SELECT extract(epoch FROM now())::float8").fetchone()[0]  # type: ignore[index]
        db.execute(  # counted by version 8's trigger
            "UPDATE tickler_requests SET state = 'succeeded', finished_at = %s, owner = NULL"
            " WHERE request = '\"a\"'",
            (now,),
        )
    assert _schema_shape(postgres_dsn, postgres_schema) != wanted
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    store.create_schema()  # again: nothing to do
    assert _schema_shape(postgres_dsn, postgres_schema) == wanted
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        db.execute(f'SET search_path TO "{postgres_schema}"')
        version = db.execute("SELECT version FROM tickler_schema").fetchone()
        db.execute(  # counted by version 9's row-level trigger
            "UPDATE tickler_requests SET state = 'failed', finished_at = %s, owner = NULL"
            " WHERE request = '\"b\"'",
            (now,),
        )
        rows = db.execute("SELECT request, state FROM tickler_requests ORDER BY id").fetchall()
        minutes = db.execute(
            "SELECT queue, minute, owner, succeeded, failed FROM tickler_minutes"
        ).fetchall()
    assert version == (postgres_store.SCHEMA_VERSION,) == (9,)
    assert rows == [(b'"a"', "succeeded"), (b'"b"', "failed")]
    assert minutes == [("jobs", int(now // 60), "me", 1, 1)]
