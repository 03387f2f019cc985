"""SqliteStore edges found by trying to break it; each test failed before its fix."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import tickler

from .store_runs import driver_of, sync_of

FAST: dict[str, Any] = {"lease": 2.0, "poll_interval": 0.05}


def store_at(tmp_path: Path, **options: Any) -> tickler.SqliteStore:
    return tickler.SqliteStore(tmp_path / "queue.db", **{**FAST, **options})


def rows(path: Path) -> list[Any]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute("SELECT id, state, owner FROM tickler_requests").fetchall()
    finally:
        connection.close()


async def echo(request: Any) -> Any:
    return request


async def settled(service: tickler.Service[Any, Any]) -> Any:
    """Wait until the loop has taken its first look at the store and sleeps in receive()."""
    stored = sync_of(service)
    assert stored is not None
    with trio.fail_after(5):
        while stored.checks == 0 or stored.committing:
            await trio.sleep(0.005)
    await trio.testing.wait_all_tasks_blocked()
    return stored


async def test_cancelling_a_waiting_request_finishes_its_ticket(tmp_path: Path) -> None:
    """Regression: the row was cancelled, the ticket stayed SCHEDULED for ever."""
    async with tickler.open_service(echo, store=store_at(tmp_path), name="jobs") as service:
        ticket = await service.submit(1, delay=60)
        assert await service.cancel(ticket.id)
        with trio.fail_after(5), pytest.raises(tickler.RequestCancelled):
            await ticket.wait()
        assert ticket.status is tickler.Status.CANCELLED


async def test_an_error_message_the_store_cannot_encode_still_fails_the_request(
    tmp_path: Path,
) -> None:
    """Regression: a lone surrogate in the message crashed the loop and lost requests."""

    async def bad(request: int) -> int:
        if request == 0:
            raise ValueError(b"caf\xe9".decode("utf-8", "surrogateescape"))
        return request

    store = store_at(tmp_path)
    async with tickler.open_service(
        bad, store=store, name="jobs", on_error=lambda t, e: None
    ) as service:
        ticket = await service.submit(0)
        with pytest.raises(ValueError, match="caf"):
            await ticket.wait()
        found = await service.lookup(ticket.id)
        assert found is not None
        with pytest.raises(tickler.RequestFailed, match=r"caf\\udce9"):
            found.result()
        assert await (await service.submit(1)).wait() == 1


async def test_a_cancel_before_the_first_batch_still_commits_everything(tmp_path: Path) -> None:
    """Regression: the batch raised Cancelled before it ran, and its requests were dropped."""
    store = store_at(tmp_path, poll_interval=30)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(echo, store=store, name="jobs")
        await nursery.start(service.run)
        await settled(service)
        # The loop is woken with the requests to commit, and its run is
        # cancelled before it gets to run: its next batch meets the cancel.
        tickets = [service.enqueue_request(i) for i in range(8)]
        nursery.cancel_scope.cancel()
    assert all(t.id != 0 for t in tickets)
    assert len(rows(store.path)) == 8
    assert all(owner is None for _, _, owner in rows(store.path))


async def test_a_stop_while_a_claim_is_in_flight_hands_the_claim_back(tmp_path: Path) -> None:
    """Regression: claimed rows arrived after stop(drain=False) had emptied the queue: a hang."""

    async def forever(request: int) -> None:
        await trio.sleep_forever()

    store = store_at(tmp_path, poll_interval=30)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever, store=store, name="jobs")
        await nursery.start(service.run)
        stored = await settled(service)
        service.enqueue_request(1)  # the next batch commits and claims it
        with trio.fail_after(5):
            while not stored.committing:
                await trio.lowlevel.checkpoint()
            await service.stop(drain=False)
    assert rows(store.path) == [(1, "queued", None)]


async def test_stop_without_drain_from_a_handler_spares_the_caller(tmp_path: Path) -> None:
    """Regression: the handler's own attempt was taken away and ran again at every start."""

    async def stopper(request: str) -> str:
        if request == "stop":
            await tickler.current_service().stop(drain=False)
        return request

    store = store_at(tmp_path)
    async with tickler.open_service(stopper, store=store, name="jobs") as service:
        ticket = await service.submit("stop")
        with trio.fail_after(5):
            assert await ticket.wait() == "stop"
    assert rows(store.path) == [(1, "succeeded", None)]


async def test_join_looks_at_the_store_afresh(tmp_path: Path) -> None:
    """Regression: join trusted the last look, and returned with a row just committed."""
    store = store_at(tmp_path, poll_interval=30)
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        await (await service.submit(0)).wait()
        connection = sqlite3.connect(store.path)
        with connection:
            store.enqueue_in(connection, "jobs", 1)
        connection.close()
        with trio.fail_after(5):
            await service.join()
        assert (await service.store_statistics())["succeeded"] == 2


async def test_a_result_this_process_cannot_decode_fails_only_its_ticket(
    tmp_path: Path,
) -> None:
    """Regression: another process's result in another codec crashed this service's run."""
    store = store_at(tmp_path)
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        ticket = await service.submit(1, delay=60)
        connection = sqlite3.connect(store.path)
        with connection:  # another process ran it, and pickled its result
            connection.execute(
                "UPDATE tickler_requests SET state = 'succeeded', result = ?,"
                " finished_at = ? WHERE id = ?",
                (b"\x80\x04K\x01.", time.time(), ticket.id),
            )
        connection.close()
        with trio.fail_after(5), pytest.raises(UnicodeDecodeError):
            await ticket.wait()
        assert await (await service.submit(2)).wait() == 2


async def test_an_outcome_the_look_missed_is_found_by_the_sweep(tmp_path: Path) -> None:
    """Regression: a row final with a finished_at before the look's window (a clock step
    back) was never reported, and its ticket never ended; every 30 looks sweep them."""
    store = store_at(tmp_path, poll_interval=0.02)
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        ticket = await service.submit(1, delay=60)
        connection = sqlite3.connect(store.path)
        with connection:
            connection.execute(
                "UPDATE tickler_requests SET state = 'succeeded', result = ?,"
                " finished_at = ? WHERE id = ?",
                (b"5", time.time() - 30, ticket.id),  # before any look's window
            )
        connection.close()
        with trio.fail_after(10):
            assert await ticket.wait() == 5


async def test_a_stops_deadline_holds_while_the_store_keeps_failing(tmp_path: Path) -> None:
    """Regression: while its batches failed, the loop never looked at the stop's deadline,
    so a handler that never returns was cancelled only once the store came back."""
    cancelled_at: list[float] = []

    async def forever(request: int) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())

    store = store_at(tmp_path)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever, store=store, name="jobs")
        await nursery.start(service.run)
        await service.submit(0)
        with trio.fail_after(5):
            while service.statistics().in_flight < 1:
                await trio.sleep(0.01)
        stored = sync_of(service)
        assert stored is not None
        assert stored.connection is not None
        db = driver_of(stored.connection)
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        for i in range(1, 300):
            service.enqueue_request(i)
        with trio.fail_after(5):
            while stored.failures < 1:
                await trio.sleep(0.01)

        async def recover() -> None:
            await trio.sleep(2.0)  # the final flush then commits what was accepted
            db.execute("PRAGMA max_page_count = 1073741823")

        nursery.start_soon(recover)
        stop_at = trio.current_time()
        with trio.fail_after(10):
            handed_back = await service.stop(timeout=0.3)
    assert cancelled_at[0] - stop_at < 1.0  # at the deadline, not when the store came back
    assert [t.request for t in handed_back] == [0]
    assert len(rows(store.path)) == 300


async def test_rows_held_without_knowing_are_handed_back(tmp_path: Path) -> None:
    """Regression: a claim committed whose reply was lost left rows this process renewed for
    ever without running them. Here the store is made to say so directly."""
    store = store_at(tmp_path)
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        ticket = await service.submit(1, delay=600)
        stored = sync_of(service)
        assert stored is not None
        connection = sqlite3.connect(store.path)
        with connection:  # claimed for this process, as a lost reply would leave it
            connection.execute(
                "UPDATE tickler_requests SET state = 'running', owner = ?, run_at = 0,"
                " lease_until = ?, attempts = 1 WHERE id = ?",
                (stored.owner, time.time() + 3600, ticket.id),
            )
        connection.close()
        with trio.fail_after(5):
            assert await ticket.wait() == 1
        assert ticket.attempts == 1  # the lost claim, never started, is no attempt


async def shout(request: str) -> str:
    return request.upper()


async def test_the_store_shares_the_applications_file(tmp_path: Path) -> None:
    """enqueue_in writes in the application's transaction: its tables share the file."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE sites (id INTEGER PRIMARY KEY, state TEXT)")
    store = tickler.SqliteStore(path, **FAST)
    store.connect().close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO sites (state) VALUES ('creating')")
        request_id = store.enqueue_in(db, "jobs", "step", key="site-1")
    async with tickler.open_service(shout, store=store, name="jobs") as service:
        await service.join()
        ticket = await service.lookup("site-1")
    assert ticket is not None
    assert (ticket.id, ticket.status, ticket.result()) == (
        request_id,
        tickler.Status.SUCCEEDED,
        "STEP",
    )
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT state FROM sites").fetchall() == [("creating",)]
        # A finished request is found by its key through an index, not a scan.
        plan = db.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM tickler_requests WHERE queue = ? AND key = ?",
            ("jobs", "site-1"),
        ).fetchall()
    assert "INDEX tickler_keys" in str(plan)


async def test_requests_the_final_flush_cannot_commit_fail_and_say_why(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Regression: accepted requests that no batch could commit by the end of the run kept
    QUEUED tickets, as if they were in the store, and their waiters waited for ever."""
    store = store_at(tmp_path)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(echo, store=store, name="jobs")
        await nursery.start(service.run)
        assert await (await service.submit(0)).wait() == 0
        stored = sync_of(service)
        assert stored is not None
        assert stored.connection is not None
        db = driver_of(stored.connection)
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        tickets = [service.enqueue_request(i) for i in range(1, 300)]
        await service.stop(timeout=1.0)  # the disk stays full
    for ticket in tickets:
        assert ticket.status is tickler.Status.FAILED
        with pytest.raises(tickler.StoreError, match="could not be committed to the store"):
            await ticket.wait()
    with pytest.raises(tickler.StoreError, match="database or disk is full"):
        tickets[0].result()
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.failed) == (300, 1, 299)
    assert len(rows(store.path)) == 1
