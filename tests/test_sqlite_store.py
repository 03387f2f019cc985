"""SqliteStore specifics on real SQLite files: its file, its faults, its schema's versions.

What every store must do is in tests/test_store_contract.py.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
from tickler._stores._sqlite_live import Liveness

from .store_runs import driver_of, sync_of

FAST: dict[str, Any] = {"lease": 2.0, "poll_interval": 0.05}


def store_at(tmp_path: Path, **options: Any) -> tickler.SqliteStore:
    return tickler.SqliteStore(tmp_path / "queue.db", **{**FAST, **options})


def rows(path: Path, sql: str = "SELECT id, state, attempts FROM tickler_requests") -> list[Any]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute(sql).fetchall()
    finally:
        connection.close()


async def double(request: int) -> int:
    await trio.sleep(0.001)
    return request * 2


async def test_submit_returns_once_the_row_is_committed(tmp_path: Path) -> None:
    gate = trio.Event()

    async def held(request: int) -> int:
        await gate.wait()
        return request

    store = store_at(tmp_path)
    async with tickler.open_service(held, store=store, name="jobs") as service:
        ticket = await service.submit(7)
        assert ticket.id == 1
        # Committed: another connection sees the row at once.
        assert rows(store.path, "SELECT id, request FROM tickler_requests") == [(1, b"7")]
        gate.set()
        assert await ticket.wait() == 7


async def test_retries_live_in_the_row_and_count_attempts(tmp_path: Path) -> None:
    calls = 0

    async def flaky(request: str) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OSError("down")
        return request

    retry = tickler.Retry(attempts=None, initial=0.01, jitter=False)
    store = store_at(tmp_path)
    async with tickler.open_service(flaky, store=store, name="jobs", retry=retry) as service:
        ticket = service.enqueue_request("x")
        assert await ticket.wait() == "x"
        assert ticket.attempts == 3
    assert rows(store.path) == [(1, "succeeded", 3)]
    assert service.statistics().retried == 2


async def test_a_stop_hands_back_what_it_claimed_and_commits_what_it_accepted(
    tmp_path: Path,
) -> None:
    """A stop without drain: running attempts go back to the store, nothing is lost."""

    async def forever(request: int) -> None:
        await trio.sleep_forever()

    store = store_at(tmp_path)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever, store=store, name="jobs", capacity=2)
        await nursery.start(service.run)
        for i in range(5):
            service.enqueue_request(i)
        with trio.fail_after(10):
            while service.statistics().in_flight < 2:
                await trio.sleep(0.01)
        late = service.enqueue_request(99)  # accepted, not committed yet
        handed_back = await service.stop(drain=False)
    assert [(t.id, t.attempts) for t in handed_back] == [(1, 1), (2, 1)]
    assert all(t.status is tickler.Status.QUEUED for t in handed_back)
    assert late.id != 0
    states = rows(store.path, "SELECT state, owner, attempts FROM tickler_requests")
    assert states == [("queued", None, 1)] * 2 + [("queued", None, 0)] * 4


async def test_one_file_holds_many_queues(tmp_path: Path) -> None:
    async def negate(request: int) -> int:
        return -request

    store = store_at(tmp_path)
    async with (
        tickler.open_service(double, store=store, name="double") as doubler,
        tickler.open_service(negate, store=store, name="negate") as negater,
    ):
        a = await doubler.submit(3)
        b = await negater.submit(3)
        assert (await a.wait(), await b.wait()) == (6, -3)
        assert (await doubler.store_statistics())["succeeded"] == 1


async def test_the_codec_refuses_at_the_enqueue_and_fails_the_attempt(tmp_path: Path) -> None:
    async def give_back(request: Any) -> Any:
        return {1, 2} if request == "set" else request

    store = store_at(tmp_path)
    async with tickler.open_service(
        give_back, store=store, name="jobs", on_error=lambda t, e: None
    ) as service:
        with pytest.raises(TypeError, match="JsonCodec cannot encode object"):
            service.enqueue_request(object())
        assert service.statistics().enqueued == 0
        ticket = await service.submit("set")
        with pytest.raises(TypeError, match="cannot encode the result, a set"):
            await ticket.wait()
    assert rows(store.path) == [(1, "failed", 1)]


async def test_a_custom_codec(tmp_path: Path) -> None:
    class Reversed:
        def encode(self, obj: Any) -> bytes:
            return str(obj)[::-1].encode()

        def decode(self, data: bytes) -> Any:
            return data.decode()[::-1]

    async def upper(request: str) -> str:
        return request.upper()

    store = store_at(tmp_path)
    async with tickler.open_service(upper, store=store, name="jobs", codec=Reversed()) as service:
        assert await (await service.submit("abc")).wait() == "ABC"
    assert rows(store.path, "SELECT request, result FROM tickler_requests") == [(b"cba", b"CBA")]


@pytest.mark.parametrize("kind", ["directory", "not a database", "foreign schema"])
async def test_a_bad_file_is_refused_by_run_before_anything_starts(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "queue.db"
    if kind == "directory":
        path.mkdir()
    elif kind == "not a database":
        path.write_bytes(b"this is not SQLite" * 100)
    else:
        connection = sqlite3.connect(path)
        connection.execute("CREATE TABLE tickler_requests (id INTEGER, what TEXT)")
        connection.commit()
        connection.close()
    before = path.read_bytes() if path.is_file() else None
    service = tickler.Service(double, store=tickler.SqliteStore(path), name="jobs")
    service.enqueue_request(1)
    with pytest.raises(tickler.StoreError, match=r"directory|not a SQLite database|foreign schema"):
        await service.run()
    if before is not None:
        assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"synchronous": "OFF"}, ValueError, 'synchronous must be "FULL" or "NORMAL"'),
        ({"lease": 0}, ValueError, "lease must be > 0"),
        ({"poll_interval": float("inf")}, ValueError, "poll_interval must be finite"),
        ({"retention": -1}, ValueError, "retention must be >= 0"),
        ({"lease": "30"}, TypeError, "lease must be a number of seconds"),
    ],
)
def test_bad_store_options(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        tickler.SqliteStore(tmp_path / "q.db", **options)


def test_bad_service_options_with_a_store(tmp_path: Path) -> None:
    message = r"store must be a tickler\.SqliteStore, a tickler\.PostgresStore or None"
    with pytest.raises(TypeError, match=message):
        tickler.Service(double, store="queue.db")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codec is for a service with a store"):
        tickler.Service(double, codec=tickler.JsonCodec())
    with pytest.raises(TypeError, match="codec must have encode"):
        tickler.Service(double, store=store_at(tmp_path), codec=object())  # type: ignore[arg-type]


async def test_store_keys_must_be_storable(tmp_path: Path) -> None:
    service = tickler.Service(double, store=store_at(tmp_path), name="jobs")
    message = r"^key must be a str or a tuple of strs and ints for a service with a store, not "
    with pytest.raises(TypeError, match=message + "float$"):
        service.enqueue_request(1, key=1.5)
    # A bare int would read as an id in cancel() and lookup().
    with pytest.raises(TypeError, match=message + "int$"):
        service.enqueue_request(1, key=7)
    service.enqueue_request(1, key=("order", 7))
    assert service.statistics().enqueued == 1


async def test_a_full_disk_delays_the_commit_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite's own "database or disk is full": the loop retries the batch with backoff."""
    store = store_at(tmp_path)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        await (await service.submit(0)).wait()
        stored = sync_of(service)
        assert stored is not None
        assert stored.connection is not None
        db = driver_of(stored.connection)
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
        tickets = [service.enqueue_request(i) for i in range(1, 200)]
        with trio.fail_after(10):
            while stored.failures < 2:
                await trio.sleep(0.01)
        assert all(t.id == 0 for t in tickets)  # none committed, none dropped
        db.execute("PRAGMA max_page_count = 1073741823")
        assert [await t.wait() for t in tickets] == [i * 2 for i in range(1, 200)]
    assert "database or disk is full" in caplog.text
    assert len(rows(store.path)) == 200
    assert service.statistics().store_errors >= 2


async def test_inspect_prints_counts_and_latest_failures(tmp_path: Path) -> None:
    async def maybe(request: int) -> int:
        if request < 0:
            raise ValueError(f"negative {request}")
        return request

    store = store_at(tmp_path)
    async with tickler.open_service(
        maybe, store=store, name="jobs", on_error=lambda t, e: None
    ) as service:
        for request in (1, 2, -3):
            await service.submit(request)
        await service.submit(4, delay=60)
        with trio.fail_after(10):
            while (await service.store_statistics())["failed"] < 1:
                await trio.sleep(0.02)
        done = await trio.run_process(
            [sys.executable, "-m", "tickler", "inspect", f"sqlite:///{store.path}"],
            capture_stdout=True,
        )
        await service.cancel(4)
    assert done.stdout.decode().splitlines() == [
        "queue 'jobs': 0 queued, 1 scheduled, 0 claimed, 0 running, 0 retrying,"
        " 2 succeeded, 1 failed, 0 cancelled",
        "  failed #3 after 1 attempt(s): ValueError: negative -3",
    ]


@pytest.mark.parametrize("kind", ["missing", "foreign", "not sqlite", "bad url"])
async def test_inspect_refuses_a_missing_or_foreign_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "queue.db"
    url = f"sqlite:///{path}"
    if kind == "foreign":
        connection = sqlite3.connect(path)
        connection.execute("CREATE TABLE customers (id INTEGER)")
        connection.close()
    elif kind == "not sqlite":
        path.write_text("hello")
    elif kind == "bad url":
        url = str(path)
    done = await trio.run_process(
        [sys.executable, "-m", "tickler", "inspect", url], capture_stderr=True, check=False
    )
    assert done.returncode == 2
    assert done.stderr.decode().startswith("python -m tickler: ")
    assert not path.exists() or kind != "missing"


async def test_a_renewal_that_finds_the_lease_gone_cancels_the_attempt(tmp_path: Path) -> None:
    """Another process took the request over: this attempt is cancelled, its outcome dropped."""
    cancelled = trio.Event()

    async def patient(request: int) -> int:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    store = store_at(tmp_path)
    async with tickler.open_service(patient, store=store, name="jobs") as service:
        ticket = await service.submit(1)
        with trio.fail_after(5):
            while service.statistics().in_flight < 1:
                await trio.sleep(0.01)
        # Another owner holds the lease now (and its liveness lock: it lives), and will
        # finish the request.
        elsewhere = Liveness(store.path)
        assert not elsewhere.hold("elsewhere", check=False)
        connection = sqlite3.connect(store.path)
        with connection:
            connection.execute("UPDATE tickler_requests SET owner = 'elsewhere' WHERE id = 1")
        with trio.fail_after(5):
            await cancelled.wait()
        assert not ticket.done  # it waits for the other owner's outcome
        with connection:
            connection.execute(
                "UPDATE tickler_requests SET state = 'succeeded', result = ?,"
                " finished_at = ?, owner = NULL WHERE id = 1",
                (b"7", time.time()),
            )
        connection.close()
        elsewhere.release()
        with trio.fail_after(5):
            assert await ticket.wait() == 7
        stored = sync_of(service)
        assert stored is not None
        assert not stored.local  # (regression: lost attempts stayed in it)
    assert service.statistics().succeeded == 0  # not this process's outcome


async def test_attempts_and_retries_survive_a_restart(tmp_path: Path) -> None:
    calls: list[int] = []

    async def always_down(request: int) -> None:
        calls.append(request)
        raise ConnectionError("down")

    retry = tickler.Retry(attempts=None, initial=0.05, jitter=False)
    store = store_at(tmp_path)
    async with trio.open_nursery() as nursery:
        first = tickler.Service(always_down, store=store, name="jobs", retry=retry)
        await nursery.start(first.run)
        ticket = await first.submit(1)
        with trio.fail_after(5):
            while len(calls) < 3:
                await trio.sleep(0.01)
        await first.stop(drain=False)
    attempts_before = rows(store.path)[0][2]
    assert attempts_before >= 3

    async def up(request: int) -> str:
        return "up"

    async with tickler.open_service(up, store=store, name="jobs", retry=retry) as second:
        await second.join()
        found = await second.lookup(ticket.id)
    assert found is not None
    assert found.result() == "up"
    assert found.attempts == attempts_before + 1


async def test_another_process_holding_the_write_lock_is_waited_for(tmp_path: Path) -> None:
    """SQLITE_BUSY: the batch waits on the busy timeout; submit returns once it commits."""
    store = store_at(tmp_path)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        await (await service.submit(0)).wait()
        locker = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
        locker.execute("BEGIN IMMEDIATE")
        release_at = trio.current_time() + 0.5

        async def release() -> None:
            await trio.sleep_until(release_at)
            locker.execute("COMMIT")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release)
            ticket = await service.submit(21)
            assert trio.current_time() >= release_at
        locker.close()
        assert await ticket.wait() == 42


async def _claimed_ahead(
    tmp_path: Path,
) -> tuple[tickler.SqliteStore, tickler.Service[int, None], trio.Event]:
    """A service whose only slot is held by request 1 while request 2 waits, claimed.

    Request 0 ends at once: the batch that writes its outcome claims two
    requests (twice the attempts that ended) more than the free slot, to wait
    in the queue.
    """
    gate = trio.Event()

    async def handler(request: int) -> None:
        if request:
            await gate.wait()

    store = store_at(tmp_path)
    service = tickler.Service(handler, store=store, name="jobs", capacity=1)
    return store, service, gate


async def _until_claimed_ahead(service: tickler.Service[int, None], waiting: int = 1) -> None:
    with trio.fail_after(10):
        while (service.statistics().in_flight, service.statistics().queued) != (1, waiting):
            await trio.sleep(0.01)


async def test_a_request_claimed_ahead_goes_back_at_a_stop_without_an_attempt(
    tmp_path: Path,
) -> None:
    store, service, _ = await _claimed_ahead(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for i in range(5):
            service.enqueue_request(i)  # one batch inserts all five
        await _until_claimed_ahead(service, waiting=2)
        claimed = "SELECT state FROM tickler_requests WHERE id IN (3, 4)"
        assert rows(store.path, claimed) == [("running",)] * 2
        handed_back = await service.stop(drain=False)
    assert [(t.id, t.attempts) for t in handed_back] == [(2, 1), (3, 0), (4, 0)]
    assert rows(
        store.path, "SELECT id, state, attempts, started_at IS NULL FROM tickler_requests"
    ) == [
        (1, "succeeded", 1, 0),
        (2, "queued", 1, 0),
        (3, "queued", 0, 1),
        (4, "queued", 0, 1),
        (5, "queued", 0, 1),
    ]


async def test_a_request_claimed_ahead_and_cancelled_here_never_starts(tmp_path: Path) -> None:
    store, service, gate = await _claimed_ahead(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(3)]
        await _until_claimed_ahead(service)
        assert await service.cancel(tickets[2].id)
        assert service.statistics().queued == 0
        gate.set()
        with pytest.raises(tickler.RequestCancelled):
            await tickets[2].wait()
        await service.stop()
    assert tickets[2].attempts == 0
    assert rows(store.path) == [(1, "succeeded", 1), (2, "succeeded", 1), (3, "cancelled", 0)]


async def test_a_request_claimed_ahead_and_cancelled_elsewhere_never_starts(
    tmp_path: Path,
) -> None:
    store, service, gate = await _claimed_ahead(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(3)]
        await _until_claimed_ahead(service)
        # Another store object on the file: another replica, as another process is.
        async with tickler.open_service(double, store=store_at(tmp_path), name="jobs") as other:
            assert await other.cancel(tickets[2].id)
        # The holder sees the cancel at its next look, before any slot frees.
        with pytest.raises(tickler.RequestCancelled):
            await tickets[2].wait()
        gate.set()
        await service.stop()
    assert rows(store.path) == [(1, "succeeded", 1), (2, "succeeded", 1), (3, "cancelled", 0)]


async def test_a_request_dropped_unstarted_whose_lease_was_gone_follows_its_row(
    tmp_path: Path,
) -> None:
    """Cancelled here while claimed ahead, but another process held it by then."""
    store, service, gate = await _claimed_ahead(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(3)]
        await _until_claimed_ahead(service)
        with sqlite3.connect(store.path) as db:  # another process took it over
            db.execute("UPDATE tickler_requests SET owner = 'other' WHERE id = 3")
        assert await service.cancel(tickets[2].id)
        with sqlite3.connect(store.path) as db:  # which then saw the cancel
            db.execute(
                "UPDATE tickler_requests SET state = 'cancelled', finished_at = ?,"
                " owner = NULL WHERE id = 3",
                (time.time(),),
            )
        with trio.fail_after(10), pytest.raises(tickler.RequestCancelled):
            await tickets[2].wait()
        gate.set()
        await service.stop()


async def test_each_ticket_gets_its_own_rows_id_across_many_statements(tmp_path: Path) -> None:
    # Rows without a key go many to a statement, keyed ones one by one; the
    # ids a batch hands out must be the ids of the tickets' own rows.
    gate = trio.Event()

    async def held(request: Any) -> Any:
        await gate.wait()
        return request

    store = store_at(tmp_path)
    async with tickler.open_service(held, store=store, name="jobs", capacity=1) as service:
        with trio.fail_after(10):
            first = await service.submit("first")  # ids 1.. are taken before this batch
        tickets = [
            service.enqueue_request(f"r{i}", key=f"k{i}" if i % 97 == 0 else None)
            for i in range(700)
        ]
        with trio.fail_after(10):
            await service.submit("last")
        gate.set()
    by_id = dict(rows(store.path, "SELECT id, request FROM tickler_requests"))
    assert len({t.id for t in tickets}) == 700
    assert all(t.id > first.id for t in tickets)
    assert all(by_id[t.id] == f'"r{i}"'.encode() for i, t in enumerate(tickets))


async def test_a_none_result_is_kept_as_null_and_read_back_as_none(tmp_path: Path) -> None:
    class Tagged:
        """A codec that would tell None apart, were it asked."""

        def encode(self, obj: Any) -> bytes:
            return b"tag:" + repr(obj).encode()

        def decode(self, data: bytes) -> Any:
            assert data.startswith(b"tag:")
            return data[4:].decode()

    async def nothing(request: int) -> None:
        return None

    store = store_at(tmp_path)
    async with tickler.open_service(nothing, store=store, name="jobs", codec=Tagged()) as service:
        ticket = await service.submit(1)
        await ticket.wait()
        assert ticket.result() is None
        found = await service.lookup(ticket.id)
    assert found is not None
    assert found.status is tickler.Status.SUCCEEDED
    assert found.result() is None
    assert rows(store.path, "SELECT request, result FROM tickler_requests") == [(b"tag:1", None)]


@pytest.mark.parametrize(
    "obj",
    [
        0,
        -17,
        10**40,
        2.5,
        -0.0,
        1e300,
        True,
        "",
        "é \n \u2028 \x00",
        [],
        [1, [2, [3, None]]],
        {"a": 1, "b": {"c": [True, False]}},
        {1: "int key", 2.5: "float key", None: "none key"},
        ("a", 1),
    ],
)
def test_json_codec_writes_what_json_writes(obj: Any) -> None:
    import json

    codec = tickler.JsonCodec()
    data = codec.encode(obj)
    assert data == json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    assert codec.decode(data) == json.loads(data)


def test_json_codec_refuses_with_type_error() -> None:
    codec = tickler.JsonCodec()
    cycle: list[Any] = []
    cycle.append(cycle)
    for bad, says in [
        (float("nan"), "float"),
        (float("inf"), "float"),
        ([1, float("-inf")], "list"),
        (cycle, "contains itself"),
        ({"a": object()}, "not JSON serializable"),
        ({(1, 2): "tuple key"}, "keys must be"),
        ({1, 2}, "set"),
    ]:
        with pytest.raises(TypeError, match=says):
            codec.encode(bad)


async def test_a_version_1_file_is_migrated_and_keeps_its_requests(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path, **FAST)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        assert await (await service.submit(1)).wait() == 2
        service.enqueue_request(2)  # committed by the stop, not run
        await service.stop(drain=False)
    # Make the file what version 1 wrote.
    connection = sqlite3.connect(path)
    connection.executescript(
        """
        DROP INDEX tickler_finished;
        CREATE INDEX tickler_finished ON tickler_requests (finished_at)
            WHERE state IN ('succeeded', 'failed', 'cancelled');
        DROP INDEX tickler_ready;
        CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)
            WHERE state IN ('queued', 'scheduled', 'retrying');
        DROP INDEX tickler_live_keys;
        CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)
            WHERE key IS NOT NULL AND state IN ('queued', 'scheduled', 'running', 'retrying');
        UPDATE tickler_schema SET version = 1;
        """
    )
    connection.close()

    def indexed() -> str:
        return " ".join(
            sql for (sql,) in rows(path, "SELECT sql FROM sqlite_master WHERE type = 'index'")
        )

    assert indexed().count("state IN") == 3
    async with tickler.open_service(
        double, store=tickler.SqliteStore(path, **FAST), name="jobs"
    ) as again:
        with trio.fail_after(10):
            while (await again.store_statistics())["succeeded"] < 2:
                await trio.sleep(0.02)
    from tickler._stores.sqlite import SCHEMA_VERSION

    assert rows(path, "SELECT version FROM tickler_schema") == [(SCHEMA_VERSION,)]
    assert "state IN" not in indexed()
    assert "WHERE finished_at IS NOT NULL" in indexed()
    assert rows(path, "SELECT id, state, result FROM tickler_requests") == [
        (1, "succeeded", b"2"),
        (2, "succeeded", b"4"),
    ]
    # A version this tickler does not know is refused, with nothing written.
    connection = sqlite3.connect(path)
    connection.execute("UPDATE tickler_schema SET version = ?", (SCHEMA_VERSION + 1,))
    connection.commit()
    connection.close()
    with pytest.raises(tickler.StoreError, match=f"version {SCHEMA_VERSION + 1}"):
        await tickler.Service(double, store=tickler.SqliteStore(path), name="jobs").run()


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


@pytest.mark.parametrize("ending", ["returns", "raises"])
async def test_an_attempt_that_ends_by_itself_after_its_cancel_frees_its_slot(
    tmp_path: Path, ending: str
) -> None:
    # The loop takes a running attempt away by cancelling its processor's
    # scope. A handler that shields itself ends on its own instead: the
    # request still ends CANCELLED, the processor ends, and its slot serves
    # the next request.
    started, gate = trio.Event(), trio.Event()

    async def stubborn(request: int) -> int:
        if request == 1:
            started.set()
            with trio.CancelScope(shield=True):
                await gate.wait()
            if ending == "raises":
                raise ValueError("ended by itself")
        return request * 10

    store = store_at(tmp_path)
    async with tickler.open_service(
        stubborn, store=store, name="jobs", capacity=1, on_error=lambda t, e: None
    ) as service:
        first = await service.submit(1)
        await started.wait()
        assert await service.cancel(first.id)
        await until_withdrawn(service)
        gate.set()
        with pytest.raises(tickler.RequestCancelled):
            await first.wait()
        with trio.fail_after(10):
            assert await (await service.submit(2)).wait() == 20
        assert service.statistics().in_flight == 0
        assert sync_of(service) is not None
        assert sync_of(service).reasons == {}
        assert sync_of(service).scopes == {}
    assert rows(store.path) == [(1, "cancelled", 1), (2, "succeeded", 1)]


async def until_withdrawn(service: Any) -> None:
    """Until the cancel has reached the running attempt (its processor's scope is cancelled)."""
    with trio.fail_after(10):
        while not sync_of(service).reasons:
            await trio.sleep(0.01)
