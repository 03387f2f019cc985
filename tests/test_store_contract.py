"""The store conformance suite: what every store behind a service must do.

Each test here runs once per store in BACKENDS, against a real database: a
SQLite file, a fresh PostgreSQL schema. A test takes ``backend``: a factory
of store objects on one location (``backend.store(**options)``; two store
objects on it are two replicas, as two processes are) and the plain driver
connection an application has to it, for ``enqueue_in`` and for writing rows
as another process would. Tests use the public API, and the seam
(``store.connect()``'s session) where a test needs one batch exactly.

A store that lacks a capability is skipped for it by asking the store (a
``listener`` of None) or its backend (the faults it can inject), never by
its type.

Adding a store is one line in BACKENDS, naming its Backend
(tests/store_backends.py): how to make the store, and how to reach its
database as an application does.

The process tests start workers (tests/store_worker.py) that share a log
(tests/store_runs.py reads it): one killed with SIGKILL mid-run, and three
sharing one queue.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
from tickler._codec import MAX_KEY_BYTES, MAX_QUEUE_BYTES
from tickler._stores._seam import Batch, Insert

from .store_backends import Backend, PostgresBackend, SqliteBackend, owner_id
from .store_runs import check_killed_run, check_shared_run, wait_for_ends, worker


async def double(request: int) -> int:
    return request * 2


# -- The stores under test


# The stores every test below runs against: one line per store, naming its Backend.
BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "sqlite": SqliteBackend.for_test,
    "postgres": PostgresBackend.for_test,
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


async def create_schema(store: Any) -> None:
    await trio.to_thread.run_sync(store.create_schema)


async def until_done(service: tickler.Service[Any, Any], id_or_key: object) -> Any:
    """The request's final ticket, once the store has it final."""
    with trio.fail_after(10):
        while (found := await service.lookup(id_or_key)) is None or not found.done:
            await trio.sleep(0.02)
    return found


# -- Claims under a lease, renewed while the attempt runs


async def test_requests_run_from_the_store_and_their_rows_end_final(backend: Backend) -> None:
    store = backend.store()
    async with tickler.open_service(double, store=store, name="jobs", capacity=4) as service:
        tickets = [service.enqueue_request(i) for i in range(30)]
        assert all(t.id == 0 for t in tickets)  # not committed yet
        assert [await t.wait() for t in tickets] == [i * 2 for i in range(30)]
        assert sorted(t.id for t in tickets) == list(range(1, 31))
    assert backend.select("id, state, attempts") == [(i, "succeeded", 1) for i in range(1, 31)]
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.failed) == (30, 30, 0)


async def test_a_lease_is_renewed_while_the_handler_runs(backend: Backend) -> None:
    """Two replicas on one queue: a handler running 5 leases long is never taken over."""
    starts: list[str] = []

    def handler_for(name: str) -> Any:
        async def handler(request: str) -> str:
            starts.append(name)
            await trio.sleep(1.0)
            return request

        return handler

    async with (
        tickler.open_service(handler_for("a"), store=backend.store(lease=0.2), name="jobs") as a,
        tickler.open_service(handler_for("b"), store=backend.store(lease=0.2), name="jobs") as b,
    ):
        ticket = await a.submit("long")
        assert await ticket.wait() == "long"
        await b.join()
    assert len(starts) == 1
    assert backend.select("id, state, attempts") == [(1, "succeeded", 1)]


async def test_work_survives_the_service_and_runs_in_the_next(backend: Backend) -> None:
    store = backend.store()

    async def forever(request: int) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        first = tickler.Service(forever, store=store, name="jobs", capacity=1)
        await nursery.start(first.run)
        for i in range(3):
            await first.submit(i)
        await first.stop(drain=False)
    async with tickler.open_service(double, store=store, name="jobs") as second:
        await second.join()
    assert [state for _, state in backend.select("id, state")] == ["succeeded"] * 3


# -- Leases that lapsed: rescued by another replica, never by their own


async def test_a_rescued_request_goes_before_the_backlog_queued_after_it(
    backend: Backend,
) -> None:
    """Rows whose lease expired are claimed in the order they fell due, not of their expiry."""
    store = backend.store()
    await create_schema(store)
    with backend.connect(autocommit=False) as db:
        store.enqueue_in(db, "jobs", "rescued")
        db.commit()
    with backend.connect(autocommit=False) as db:
        for i in range(3):
            store.enqueue_in(db, "jobs", f"later {i}")
        db.commit()
    # Its process died; its lease expired after the others were enqueued.
    backend.execute(
        f"UPDATE {backend.table('tickler_requests')} SET state = 'running', owner = 'dead',"  # noqa: S608
        f" attempts = 1, lease_until = {backend.now} - 0.001 WHERE id = 1"
    )
    order: list[str] = []

    async def handler(request: str) -> None:
        order.append(request)

    async with tickler.open_service(handler, store=store, name="jobs", capacity=1) as service:
        await service.join()
        rescued = await service.lookup(1)
    assert order == ["rescued", "later 0", "later 1", "later 2"]
    assert rescued is not None
    assert rescued.attempts == 2


async def test_a_replica_does_not_claim_again_its_own_running_request_whose_lease_lapsed(
    backend: Backend,
) -> None:
    """Regression: a lease that lapsed while its replica could not write (a stall, a server
    away) was claimed again by that same replica, which then ran the request twice at once.

    Its next batch renews the lease instead; only another replica may take it over.
    """
    starts: list[int] = []
    release = trio.Event()

    async def handler(request: int) -> int:
        starts.append(request)
        if request == 1:
            await release.wait()
        return request

    store = backend.store(poll_interval=30.0, lease=30.0)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        held = await service.submit(1)
        with trio.fail_after(5):
            while starts != [1]:
                await trio.sleep(0.01)
        backend.execute(
            f"UPDATE {backend.table('tickler_requests')}"  # noqa: S608
            f" SET lease_until = {backend.now} - 1 WHERE id = {backend.mark}",
            (held.id,),
        )
        with trio.fail_after(5):  # a batch that claims, before the next look
            assert await (await service.submit(2)).wait() == 2
        release.set()
        with trio.fail_after(5):
            assert await held.wait() == 1
    assert starts == [1, 2]


async def test_a_ticket_follows_its_request_run_by_another_replica(backend: Backend) -> None:
    """Regression: another process (here, another store object) ran it; the ticket never ended."""
    gate = trio.Event()

    async def blocked(request: str) -> str:
        await gate.wait()
        return request

    async def shout(request: str) -> str:
        return request.upper()

    async with tickler.open_service(blocked, store=backend.store(), name="jobs", capacity=1) as a:
        await a.submit("blocker")  # a's only slot is taken: it claims nothing more
        with trio.fail_after(5):
            while a.statistics().in_flight < 1:
                await trio.sleep(0.01)
        ticket = await a.submit("hello")
        async with tickler.open_service(shout, store=backend.store(), name="jobs") as b:
            with trio.fail_after(5):
                assert await ticket.wait() == "HELLO"
            assert b.statistics().succeeded == 1
        gate.set()


async def test_a_start_is_marked_by_the_second_batch_that_finds_the_attempt_running(
    backend: Backend,
) -> None:
    """The first batch that finds an attempt running only notes it: an attempt that ends
    before the next batch gets its start from its outcome (its row written once more, not
    twice); one still running then is marked, with the first batch's time."""
    gates = {1: trio.Event(), 2: trio.Event()}
    started = {1: trio.Event(), 2: trio.Event()}

    async def held(request: int) -> int:
        started[request].set()
        await gates[request].wait()
        return request

    # Looks far apart, and one slot (a held attempt leaves nothing to claim): the batches
    # are the submits' and the outcomes'.
    store = backend.store(poll_interval=30.0, lease=90.0)
    async with tickler.open_service(held, store=store, name="jobs", capacity=1) as service:
        short = await service.submit(1)
        await started[1].wait()
        await service.submit(-1, delay=600)  # a batch that finds 1 running
        gates[1].set()
        assert await short.wait() == 1
        [(started_at, finished_at)] = backend.select("started_at, finished_at", f"id = {short.id}")
        assert started_at == finished_at  # from its outcome: no mark of its own

        long = await service.submit(2)
        await started[2].wait()
        await service.submit(-2, delay=600)  # finds 2 running: notes it
        [(noted,)] = backend.select("started_at", f"id = {long.id}")
        assert noted is None
        await service.submit(-3, delay=600)  # finds it running again: marks it
        [(marked,)] = backend.select("started_at", f"id = {long.id}")
        assert marked is not None
        gates[2].set()
        assert await long.wait() == 2
        [(kept, finished_at)] = backend.select("started_at, finished_at", f"id = {long.id}")
        assert kept == marked < finished_at
        await service.stop(drain=False)


# -- Keys


async def test_keys_and_delays_live_in_the_store(backend: Backend) -> None:
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        # The delay runs from the enqueue, which comes after this: measured from here, what
        # the test does meanwhile (however slow) cannot shorten it.
        before_enqueue = trio.current_time()
        first = await service.submit(1, key="k", delay=0.3)
        again = await service.submit(2, key="k")
        assert again.id == first.id
        assert service.statistics().deduplicated == 1
        counts = await service.store_statistics()
        assert counts["scheduled"] == 1
        await service.join()
        assert await first.wait() == 2
        assert await again.wait() == 2
        assert first.started_at is not None
        # The whole delay but for the clocks' reads (the store's run_at is the wall
        # clock's, the start Trio's).
        assert first.started_at - before_enqueue >= 0.25
        # Final: the key is free again.
        third = await service.submit(3, key="k")
        assert third.id != first.id
        assert await third.wait() == 6


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


@pytest.mark.parametrize("key", ["k", ("order", 7), "clé ☃"])
async def test_a_key_written_as_documented_by_another_driver_deduplicates(
    backend: Backend, key: Any
) -> None:
    """The documented INSERT from another driver, with a key as the store documents it."""
    store = backend.store()
    # The encoding is the stores' public word, in their documentation.
    assert 'json.dumps(key, separators=(",", ":"))' in (type(store).__doc__ or "")
    await create_schema(store)
    request = tickler.JsonCodec().encode(21)
    assert backend.insert_as_the_docs_say(key, request) == 1
    ((inserted, _, _, _),) = backend.rows()
    with backend.connect(autocommit=False) as connection:
        assert store.enqueue_in(connection, "jobs", 99, key=key) == inserted
        connection.commit()
    # The other driver meets the live key too: a unique violation, or
    # nothing inserted with ON CONFLICT DO NOTHING.
    with pytest.raises(Exception, match=r"(?i)unique"):
        backend.insert_as_the_docs_say(key, request)
    assert backend.insert_as_the_docs_say(key, request, then="ON CONFLICT DO NOTHING") == 0
    async with tickler.open_service(double, store=store, name="jobs") as service:
        found = await until_done(service, key)
    assert found.id == inserted
    assert found.result() == 42
    assert len(backend.rows()) == 1


# -- Cancel, of queued and of running requests, from any replica


async def test_cancel_a_queued_and_a_running_request(backend: Backend) -> None:
    started = trio.Event()

    async def slow(request: int) -> int:
        if request == 1:
            started.set()
            await trio.sleep_forever()
        return request

    async with tickler.open_service(
        slow, store=backend.store(), name="jobs", capacity=1
    ) as service:
        running = await service.submit(1)
        waiting = await service.submit(2, key="two")
        await started.wait()
        assert await service.cancel("two")
        assert await service.cancel(running.id)
        with pytest.raises(tickler.RequestCancelled):
            await running.wait()
        assert not await service.cancel(running.id)  # no longer live
        counts = await service.store_statistics()
        assert counts["cancelled"] == 2
        assert not await service.cancel(12345)
    assert backend.select("id, state, attempts") == [(1, "cancelled", 1), (2, "cancelled", 0)]
    assert waiting.status is not tickler.Status.SUCCEEDED


async def test_a_queued_request_cancelled_by_another_replica_ends_its_ticket(
    backend: Backend,
) -> None:
    async with (
        tickler.open_service(double, store=backend.store(), name="jobs") as owner,
        tickler.open_service(double, store=backend.store(), name="jobs") as other,
    ):
        ticket = await owner.submit(1, key="later", delay=60)
        assert await other.cancel("later")
        assert not await other.cancel("later")  # no longer live
        with trio.fail_after(5), pytest.raises(tickler.RequestCancelled):
            await ticket.wait()
        found = await owner.lookup(ticket.id)
    assert found is not None
    assert (found.status, found.attempts) == (tickler.Status.CANCELLED, 0)


@pytest.mark.parametrize("outcome", ["returns", "raises"])
async def test_a_request_cancelled_elsewhere_ends_cancelled_though_its_handler_ended_first(
    backend: Backend, outcome: str
) -> None:
    """cancel() returned True: the request ends CANCELLED, whatever its handler did next."""
    release = trio.Event()
    entered = trio.Event()

    async def handler(request: str) -> str:
        entered.set()
        await release.wait()
        if outcome == "raises":
            raise ValueError("late")
        return "done"

    async def shout(request: str) -> str:
        return request.upper()

    # Two replicas of one queue; the owner looks at the store every 5 s.
    async with (
        tickler.open_service(handler, store=backend.store(poll_interval=5.0), name="jobs") as owner,
        tickler.open_service(
            shout, store=backend.store(poll_interval=5.0), name="jobs", capacity=1
        ) as other,
    ):
        ticket = await owner.submit("step", key="site-1:fs")
        await entered.wait()
        assert await other.cancel("site-1:fs")
        release.set()  # the handler ends before its process looks at the store
        await owner.join()
        final = await other.lookup("site-1:fs")
    assert final is not None
    assert ticket.status is tickler.Status.CANCELLED
    assert final.status is tickler.Status.CANCELLED
    assert owner.statistics().cancelled == 1


async def test_a_cancel_asked_for_is_not_undone_by_a_stop(backend: Backend) -> None:
    """Regression: a stop handed the request back, and it ran again at the next start."""

    async def forever(request: int) -> None:
        await trio.sleep_forever()

    store = backend.store(poll_interval=60)  # the owner does not look again soon
    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever, store=store, name="jobs")
        await nursery.start(service.run)
        ticket = await service.submit(1)
        with trio.fail_after(5):
            while service.statistics().in_flight < 1:
                await trio.sleep(0.01)
        # Another process asks for the cancel, through its own session.
        other = await trio.to_thread.run_sync(backend.store().connect)
        assert await trio.to_thread.run_sync(other.cancel, "jobs", ticket.id) == (True, 1)
        other.close()
        await service.stop(drain=False)
    assert backend.select("id, state, owner") == [(1, "cancelled", None)]
    assert ticket.status is tickler.Status.CANCELLED


async def test_a_cancelled_request_whose_owner_died_ends_cancelled_unrun(
    backend: Backend,
) -> None:
    """Its cancel was accepted while it ran; its process died: nobody runs it again.

    Regression: another replica claimed it once the dead owner's lease lapsed, and ran it.
    """
    store = backend.store()
    await create_schema(store)
    with backend.connect(autocommit=False) as db:
        orphan = store.enqueue_in(db, "jobs", "step", key="site-1:fs")
        store.enqueue_in(db, "jobs", "other")
        db.commit()
    backend.execute(
        f"UPDATE {backend.table('tickler_requests')} SET state = 'running',"  # noqa: S608
        f" owner = 'a-replica-that-died', attempts = 1, started_at = {backend.now} - 60,"
        f" lease_until = {backend.now} - 1, cancel_requested = TRUE WHERE id = {backend.mark}",
        (orphan,),
    )
    ran: list[str] = []

    async def handler(request: str) -> str:
        ran.append(request)
        return request

    async with tickler.open_service(handler, store=store, name="jobs") as service:
        with trio.fail_after(5):
            assert await (await service.submit("claims")).wait() == "claims"
        await service.join()
        found = await until_done(service, "site-1:fs")
    assert (found.id, found.status, found.attempts) == (orphan, tickler.Status.CANCELLED, 1)
    assert sorted(ran) == ["claims", "other"]


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


# -- Lookup


async def test_a_final_failure_keeps_its_error_in_the_row(backend: Backend) -> None:
    async def fail(request: int) -> None:
        raise ValueError(f"bad {request}")

    errors: list[Exception] = []
    async with tickler.open_service(
        fail, store=backend.store(), name="jobs", on_error=lambda t, e: errors.append(e)
    ) as service:
        ticket = service.enqueue_request(5)
        with pytest.raises(ValueError, match="bad 5"):
            await ticket.wait()
        found = await service.lookup(ticket.id)
    assert found is not None
    assert found.status is tickler.Status.FAILED
    with pytest.raises(tickler.RequestFailed, match="ValueError: bad 5") as info:
        found.result()
    assert "Traceback" in info.value.error_traceback
    assert len(errors) == 1


async def test_ids_out_of_range_are_not_found(backend: Backend) -> None:
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        assert await service.lookup(2**70) is None
        assert not await service.cancel(2**70)
        assert await service.lookup(-1) is None
        assert await service.lookup("no such key") is None


# -- enqueue_in: in the caller's transaction, woken by the store's listener if it has one


async def test_enqueue_in_is_part_of_the_callers_transaction(backend: Backend) -> None:
    store = backend.store()
    async with tickler.open_service(double, store=store, name="jobs") as service:
        with backend.connect(autocommit=False) as connection:
            store.enqueue_in(connection, "jobs", 1)
            connection.rollback()
            request_id = store.enqueue_in(connection, "jobs", 21, key="k")
            assert store.enqueue_in(connection, "jobs", 22, key="k") == request_id
            connection.commit()
        with trio.fail_after(10):
            while (await service.store_statistics())["succeeded"] < 1:
                await trio.sleep(0.02)
        found = await service.lookup(request_id)
        assert found is not None
        assert found.result() == 42
    # The rolled-back request left nothing.
    assert backend.select("id, state, attempts") == [(request_id, "succeeded", 1)]


async def test_an_enqueue_elsewhere_wakes_an_idle_service_by_its_listener_or_its_poll(
    backend: Backend,
) -> None:
    """With a listener, the service runs it at once; without (None), at its next poll."""
    store = backend.store(poll_interval=3.0)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        await trio.sleep(0.3)  # the service's first look is behind it
        with backend.connect(autocommit=False) as connection:
            request_id = store.enqueue_in(connection, "jobs", 21)
            connection.commit()
        started = trio.current_time()
        found = await until_done(service, request_id)
        waited = trio.current_time() - started
    assert found.result() == 42
    if store.listener("jobs") is None:
        assert waited > 0.5  # only the poll found it
    else:
        assert waited < 1.0


async def test_create_schema_lets_enqueue_in_come_first(backend: Backend) -> None:
    store = backend.store()
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(tickler.StoreError, match=r"store\.create_schema\(\)") as raised:
            store.enqueue_in(connection, "jobs", 1)
        if backend.failed_statement_aborts_transaction:
            assert "transaction" in str(raised.value)  # the caller's, aborted: it says so
    await create_schema(store)
    await create_schema(store)  # again: nothing to do
    await create_schema(backend.store())  # and from another replica
    with backend.connect(autocommit=False) as connection:
        request_id = store.enqueue_in(connection, "jobs", 21)
        connection.commit()
    async with tickler.open_service(double, store=store, name="jobs") as service:
        found = await until_done(service, request_id)
    assert found.result() == 42


# -- Retention


async def test_final_rows_are_deleted_after_the_retention(backend: Backend) -> None:
    async with tickler.open_service(
        double, store=backend.store(retention=0.2), name="jobs"
    ) as service:
        for i in range(5):
            await (await service.submit(i)).wait()
        assert len(backend.rows()) == 5
        # Each look keeps what the next may report final for as far as it
        # reaches back (a session's finals_overlap): up to 10 s on PostgreSQL.
        with trio.fail_after(30):
            while backend.rows():
                await trio.sleep(0.05)
        live = await service.submit(9, delay=5)
        await trio.sleep(0.5)
        assert [r[0] for r in backend.rows()] == [live.id]  # live rows are kept
        assert await service.cancel(live.id)


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


async def test_a_zero_retention_does_not_strand_a_ticket(backend: Backend) -> None:
    """Regression: the row was pruned in the same look that reported it final; wait hung."""
    async with tickler.open_service(
        double, store=backend.store(retention=0), name="jobs"
    ) as service:
        ticket = await service.submit(1, delay=60)
        assert await service.cancel(ticket.id)
        with trio.fail_after(5), pytest.raises(tickler.RequestCancelled):
            await ticket.wait()
        with trio.fail_after(5):
            await service.join()


# -- Batches that fail


@pytest.fixture(params=["raise", "deadlock", "serialization", "sleep"])
def fault(request: pytest.FixtureRequest, backend: Backend) -> str:
    """A fault to inject in the store's database, for each the backend can inject."""
    if request.param not in backend.faults:
        pytest.skip(f"the store's backend cannot inject a {request.param}")
    return str(request.param)


async def test_a_batch_that_fails_once_is_retried_and_loses_nothing(
    backend: Backend, fault: str
) -> None:
    """A trigger fails the batch holding an insert; once disarmed, the retry commits it.

    On PostgreSQL every batch after the first error used to fail too (the
    session's transaction aborted, then its prepared statements gone), and
    every accepted request ended FAILED at the stop.
    """
    # "sleep": the statement outlasts the session's statement_timeout.
    options = {"dsn_options": "-c statement_timeout=1000"} if fault == "sleep" else {}
    store = backend.store(**options)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        # Enough batches for a driver to prepare the batch's statements.
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


def test_a_row_the_store_refuses_does_not_stop_the_rest_of_an_isolated_batch(
    backend: Backend,
) -> None:
    """With isolate, each insert has a savepoint: the refused one is reported, the rest commit.

    At the seam (a session's run), as the loop's retry of a failed batch runs
    it. Several rounds on one session, so that a driver's prepared statements
    (PostgreSQL's pipeline) go through the savepoints too.
    """
    store = backend.store()
    store.create_schema()
    backend.add_fault(condition="NEW.key = '\"poison\"'")
    session = store.connect()
    try:
        kept: list[int] = []
        for round_ in range(7):
            now = time.time()
            batch = Batch(
                inserts=[
                    Insert(None, "queued", b"1", now),
                    Insert('"poison"', "queued", b"2", now),
                    Insert(f'"fine {round_}"', "queued", b"3", now),
                ],
                claim=5,
                isolate=True,
            )
            result = session.run("jobs", owner_id("owner"), 30.0, 86400.0, batch)
            assert set(result.refused) == {1}, result.refused
            assert "injected fault" in result.refused[1]
            assert "\n" not in result.refused[1]
            first, refused, last = result.inserted
            assert refused == (0, False)
            assert first[1]
            assert last[1]
            # The batch went on after the refused row: it claimed the others.
            assert sorted(row.id for row in result.claimed) == [first[0], last[0]]
            kept += [first[0], last[0]]
        # Without isolate the batch fails as a whole, and the next one commits.
        poisoned = Batch(inserts=[Insert(None, "queued", b"4", time.time()), *batch.inserts[1:2]])
        with pytest.raises(Exception, match="injected fault"):
            session.run("jobs", owner_id("owner"), 30.0, 86400.0, poisoned)
        result = session.run(
            "jobs",
            owner_id("owner"),
            30.0,
            86400.0,
            Batch(inserts=[Insert(None, "queued", b"5", time.time())]),
        )
        assert result.refused == {}
        kept.append(result.inserted[0][0])
    finally:
        session.close()
    assert [row[0] for row in backend.rows()] == kept
    assert not backend.rows("key = '\"poison\"'")


# -- Processes: killed with SIGKILL, and three sharing one queue


def enqueue(backend: Backend, requests: list[str], due: float | None = None) -> None:
    """The requests, due at once, or at the epoch time ``due``."""
    store = backend.store()
    store.create_schema()
    delay = None if due is None else max(0.0, due - time.time())
    with backend.connect(autocommit=False) as connection:
        for request in requests:
            key = request if request == "blocker" else None
            store.enqueue_in(connection, "jobs", request, key=key, delay=delay)
        connection.commit()


def test_a_worker_killed_mid_run_loses_nothing(backend: Backend, tmp_path: Path) -> None:
    """SIGKILL mid-run, another worker on the same store: all end; only those running ran twice."""
    log = tmp_path / "log"
    enqueue(backend, [f"r{i}" for i in range(60)])
    options = ("--capacity", "8", "--lease", "1")
    first = worker(backend.worker_args(), log, *options, "--sleep", "0.1")
    wait_for_ends(first, log, 20)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = backend.states()
    second = worker(backend.worker_args(), log, *options, "--sleep", "0.01")
    assert second.wait(timeout=120) == 0
    check_killed_run(log, at_kill, backend.states(), 60)


def test_three_workers_share_one_queue(backend: Backend, tmp_path: Path) -> None:
    """10,000 requests run once each; keys de-duplicate across workers; a cancel crosses them."""
    log = tmp_path / "log"
    # Every request falls due at one time for all three workers, late enough that each has
    # started by then, and has enqueued its keyed requests while the others' are still
    # live (a worker slow to start would otherwise find a key's first row already run, and
    # make a second; or find the 10,000 run by the other two, and take no part).
    due = time.time() + 5
    enqueue(backend, [f"r{i}" for i in range(10_000)] + ["blocker"], due)
    keys_due = str(due)
    options = ("--capacity", "50", "--keys", "100", "--keys-due", keys_due, "--cancel-blocker")
    workers: list[subprocess.Popen[bytes]] = [
        worker(backend.worker_args(), log, *options) for _ in range(3)
    ]
    for process in workers:
        assert process.wait(timeout=300) == 0
    check_shared_run(log, backend.states(), 3)
