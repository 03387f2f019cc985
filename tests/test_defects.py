"""Regressions of defects found by using tickler as a new user and by attacking it.

Each test names the defect it guards. Where a store is involved, each runs
against a real SQLite file and a real PostgreSQL schema.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity
from .store_runs import caller_connection, make_store, sync_of

STORES = ["sqlite", "postgres"]


async def echo(request: Any) -> Any:
    return request


# -- 3 and 15: names a store cannot keep, and one service per queue and store


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("jobs-\udcff", "no lone surrogates"),
        ("j\x00obs", "NUL"),
        ("q" * 1001, "at most 1000 bytes"),
        ("\u00e9" * 501, "at most 1000 bytes"),
    ],
)
def test_a_queue_name_a_store_cannot_keep_is_refused_at_construction(
    tmp_path: Path, name: str, rule: str
) -> None:
    store = tickler.SqliteStore(tmp_path / "queue.db")
    with pytest.raises(ValueError, match=f"^name must .*{rule}"):
        tickler.Service(echo, store=store, name=name)
    # Without a store the name is only a label.
    tickler.Service(echo, name=name)


async def test_a_second_service_on_one_queue_and_store_is_refused(tmp_path: Path) -> None:
    store = tickler.SqliteStore(tmp_path / "queue.db")
    first = tickler.Service(echo, store=store, name="jobs")
    with pytest.raises(ValueError, match="name 'jobs': a service of this process already runs"):
        tickler.Service(echo, store=store, name="jobs")
    tickler.Service(echo, store=store, name="other")  # another queue is fine
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        with pytest.raises(ValueError, match="already runs"):
            tickler.Service(echo, store=store, name="jobs")
        await first.stop()
    # Once the first has ended, its queue may have a new service.
    async with tickler.open_service(echo, store=store, name="jobs") as again:
        assert await (await again.submit(1)).wait() == 1


# -- 9: a store that cannot open raises StoreError itself


async def test_open_service_raises_the_stores_own_error(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(b"SQLite format 3\x00" + b"\x00" * 50)
    stores = [
        tickler.SqliteStore(tmp_path / "missing" / "queue.db"),
        tickler.SqliteStore(truncated),
        tickler.SqliteStore(tmp_path),  # a directory
    ]
    for store in stores:
        with pytest.raises(tickler.StoreError):
            async with tickler.open_service(echo, store=store, name="jobs"):
                pytest.fail("the block must not run")  # pragma: no cover


async def test_open_service_raises_store_error_for_a_refused_dsn() -> None:
    import socket

    with socket.socket() as bound:  # a port that refuses: bound, never listening
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        store = tickler.PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/postgres")
        with pytest.raises(tickler.StoreError, match="cannot connect"):
            async with tickler.open_service(echo, store=store, name="jobs"):
                pytest.fail("the block must not run")  # pragma: no cover


# -- 10: with a store, the handler always gets the codec's round trip


@pytest.mark.parametrize("kind", STORES)
async def test_the_handler_and_the_ticket_get_the_codecs_round_trip(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    seen: list[Any] = []

    async def handler(value: Any) -> Any:
        seen.append(value)
        return (value, {1: "one"})

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        ticket = service.enqueue_request(("a", 1))
        assert ticket.request == ["a", 1]
        result = await ticket.wait()
        submitted = await (await service.submit({2: (3,)})).wait()
    # As a request from another replica, or read back after a restart, would be.
    assert seen == [["a", 1], {"2": [3]}]
    assert result == [["a", 1], {"1": "one"}]
    assert submitted == [{"2": [3]}, {"1": "one"}]


# -- 11: a stop that refuses a handler's follow-up ends the handler's request


async def test_a_stop_without_drain_cancels_handlers_whose_follow_up_it_refuses(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.abc.Clock
) -> None:
    errors: list[Any] = []
    stopping = trio.Event()

    async def crawl(page: int) -> int:
        await stopping.wait()
        await trio.sleep(0.1)  # the stop has begun: the follow-up is refused
        tickler.current_service().enqueue_request(page + 100)
        return page

    caplog.set_level(logging.INFO, logger="tickler")
    async with trio.open_nursery() as nursery:
        service = tickler.Service(crawl, capacity=4, on_error=lambda t, e: errors.append(e))
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        stopping.set()
        with trio.CancelScope(shield=True):
            stopped = await service.stop(drain=False, timeout=5)
    assert [t.status for t in tickets] == [tickler.Status.CANCELLED] * 4
    assert stopped == tickets
    assert errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    stats = service.statistics()
    assert (stats.cancelled, stats.failed) == (4, 0)
    check_identity(stats)


@pytest.mark.parametrize("kind", STORES)
async def test_with_a_store_a_refused_follow_up_hands_the_request_back(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[Any] = []
    stopping = trio.Event()

    async def crawl(page: int) -> int:
        await stopping.wait()
        await trio.sleep(0.05)
        tickler.current_service().enqueue_request(page + 100)
        return page

    store = make_store(kind, request, tmp_path)
    caplog.set_level(logging.INFO, logger="tickler")
    async with trio.open_nursery() as nursery:
        service = tickler.Service(
            crawl, store=store, name="crawl", on_error=lambda t, e: errors.append(e)
        )
        await nursery.start(service.run)
        tickets = [await service.submit(i) for i in range(3)]
        with trio.fail_after(5):
            while service.statistics().in_flight < 3:
                await trio.sleep(0.01)
        stopping.set()
        stopped = await service.stop(drain=False, timeout=5)
    assert {t.id for t in stopped} == {t.id for t in tickets}
    assert errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Back in the store, never failed: the next run runs them.
    async with tickler.open_service(echo, store=store, name="crawl") as again:
        for ticket in tickets:
            found = await again.lookup(ticket.id)
            assert found is not None
            with trio.fail_after(10):
                assert await found.wait() == ticket.request


# -- 12: a result the codec cannot encode fails at once


@pytest.mark.parametrize("kind", STORES)
async def test_a_result_the_codec_cannot_encode_fails_at_once(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    calls = 0

    async def send_mail(address: str) -> object:
        nonlocal calls
        calls += 1  # the side effect
        return object()

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(
        send_mail,
        store=store,
        name="mail",
        retry=tickler.Retry(attempts=5, initial=0.01, jitter=False),
        on_error=lambda t, e: None,
    ) as service:
        ticket = await service.submit("a@example.com")
        with pytest.raises(TypeError, match="the codec cannot encode the result, a object"):
            await ticket.wait()
        found = await service.lookup(ticket.id)
    assert calls == 1
    assert found is not None
    assert (found.status, found.attempts) == (tickler.Status.FAILED, 1)
    assert service.statistics().retried == 0


# -- 13: deduplicated calls are not counted as enqueued


@pytest.mark.parametrize("kind", STORES)
async def test_deduplicated_submits_do_not_count_as_enqueued(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    gate = trio.Event()

    async def held(value: str) -> str:
        await gate.wait()
        return value

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(held, store=store, name="jobs") as service:
        tickets = [await service.submit("r", key="k") for _ in range(3)]
        assert len({t.id for t in tickets}) == 1
        stats = service.statistics()
        assert (stats.enqueued, stats.deduplicated) == (1, 2)
        gate.set()
    stats = service.statistics()
    assert (stats.enqueued, stats.deduplicated, stats.succeeded) == (1, 2, 1)


# -- 6: cancel and lookup see what was accepted before them


@pytest.mark.parametrize("kind", STORES)
async def test_a_cancel_right_after_an_enqueue_cancels_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ran: list[str] = []

    async def handler(value: str) -> str:
        ran.append(value)
        return value

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        for round_ in range(5):
            ticket = service.enqueue_request(f"r{round_}", key=f"k{round_}", delay=0.5)
            assert await service.cancel(f"k{round_}")
            with trio.fail_after(5), pytest.raises(tickler.RequestCancelled):
                await ticket.wait()
        plain = service.enqueue_request("plain", key="p", delay=0.5)
        found = await service.lookup("p")  # the lookup sees it too
        assert found is not None
        assert found.id == plain.id
        assert await service.cancel("p")
    assert "plain" not in ran
    assert ran == []


@pytest.mark.parametrize("kind", STORES)
async def test_a_cancel_after_a_duplicate_of_a_live_key_cancels_both(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ran: list[str] = []

    async def handler(value: str) -> str:
        ran.append(value)
        return value

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        first = await service.submit("first", key="k", delay=30)
        duplicate = service.enqueue_request("duplicate", key="k")
        assert await service.cancel("k")
        with trio.fail_after(5):
            for ticket in (first, duplicate):
                with pytest.raises(tickler.RequestCancelled):
                    await ticket.wait()
        await trio.sleep(0.3)  # several polls: nothing else of the key runs
    assert duplicate.id == first.id
    assert ran == []


# -- 7: a ticket from lookup() follows its row


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("where", ["here", "elsewhere"])
async def test_a_ticket_from_lookup_resolves(
    kind: str, where: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    gate = trio.Event()

    async def held(value: int) -> int:
        await gate.wait()
        return value * 2

    store = make_store(kind, request, tmp_path)
    observer_store = make_store(kind, request, tmp_path)
    connection = caller_connection(store)
    try:
        async with (
            tickler.open_service(held, store=store, name="jobs") as runner,
            tickler.open_service(held, store=observer_store, name="jobs", capacity=1) as other,
        ):
            # "here": the service that runs it looks it up; "elsewhere": a
            # replica that does not run it (its one slot is kept busy).
            watcher = runner if where == "here" else other
            if where == "elsewhere":
                await other.submit(0)
                with trio.fail_after(5):
                    while other.statistics().in_flight < 1:
                        await trio.sleep(0.01)
            if kind == "sqlite":
                connection.execute("BEGIN")
                request_id = store.enqueue_in(connection, "jobs", 21)
                connection.execute("COMMIT")
            else:
                with connection.transaction():
                    request_id = store.enqueue_in(connection, "jobs", 21)
            found = await watcher.lookup(request_id)
            assert found is not None
            assert not found.done
            with trio.fail_after(5):
                while (await runner.lookup(request_id)).status is not tickler.Status.RUNNING:  # type: ignore[union-attr]
                    await trio.sleep(0.01)
            gate.set()
            with trio.fail_after(10):
                assert await found.wait() == 42
            assert found.status is tickler.Status.SUCCEEDED
    finally:
        connection.close()


# -- 8: join() trusts only a look begun after it was called


@pytest.mark.parametrize("kind", STORES)
async def test_join_waits_for_a_row_committed_while_a_look_was_under_way(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from tickler._stores._sync import StoreSync

    store = make_store(kind, request, tmp_path, poll_interval=0.2)
    connection = caller_connection(store)
    hold = threading.Event()
    held = threading.Event()
    holding = False
    run_batch = StoreSync.run_batch

    async def slow_look(self: StoreSync, queue: str, batch: Any) -> Any:
        # The look has read the store; its answer comes back only once the
        # test has committed a row and called join().
        result = await run_batch(self, queue, batch)
        if holding and batch.finished_since is not None:
            held.set()
            await trio.to_thread.run_sync(hold.wait)
        return result

    monkeypatch.setattr(StoreSync, "run_batch", slow_look)
    try:
        async with tickler.open_service(echo, store=store, name="jobs") as service:
            await service.join()
            holding = True
            await trio.to_thread.run_sync(held.wait)
            request_id = store.enqueue_in(connection, "jobs", 7)  # committed at once
            if kind == "sqlite":
                connection.commit()
            holding = False

            async def release() -> None:
                await trio.sleep(0.05)  # join() is waiting by now
                hold.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(release)
                with trio.fail_after(10):
                    await service.join()
            found = await service.lookup(request_id)
            assert found is not None
            assert found.status is tickler.Status.SUCCEEDED
    finally:
        hold.set()
        connection.close()


# -- 5: a step back of the wall clock does not stall the store loop


@pytest.mark.parametrize("kind", STORES)
async def test_a_step_back_of_the_wall_clock_does_not_stall_the_loop(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts: list[int] = []

    async def slow(value: int) -> int:
        starts.append(value)
        if value == 1:
            await trio.sleep(2.5)  # longer than the lease: renewals must go on
        return value

    store = make_store(kind, request, tmp_path, lease=0.9, poll_interval=0.2)
    other = make_store(kind, request, tmp_path, lease=0.9, poll_interval=0.2)
    connection = caller_connection(store)
    real_time = time.time
    try:
        async with tickler.open_service(slow, store=store, name="jobs") as service:
            await service.join()
            monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
            await trio.sleep(0.3)
            # A replica started after the step, which would run request 1
            # again if its lease lapsed.
            replica = await service_in_background(slow, other)
            renewals = count_renewals(service, monkeypatch)
            ticket = await service.submit(1)
            request_id = store.enqueue_in(connection, "jobs", 2)
            if kind == "sqlite":
                connection.commit()
            with trio.fail_after(2):
                while (found := await service.lookup(request_id)) is None or not found.done:
                    await trio.sleep(0.05)
            with trio.fail_after(5):
                assert await ticket.wait() == 1
            assert replica.statistics().started <= 1  # request 2, at most
            # Its lease was renewed every lease / 3 while request 1 ran.
            assert len(renewals) >= 4, renewals
            await replica.stop()
    finally:
        connection.close()
    assert sorted(starts) == [1, 2]


def count_renewals(
    service: tickler.Service[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """A list that grows by one for each batch of ``service`` that renews its leases."""
    from tickler._stores._sync import StoreSync

    renewals: list[int] = []
    build = StoreSync.build

    def counted(self: StoreSync, *args: Any) -> Any:
        built = build(self, *args)
        if self is sync_of(service) and built[0].renew:
            renewals.append(1)
        return built

    monkeypatch.setattr(StoreSync, "build", counted)
    return renewals


async def service_in_background(handler: Any, store: Any) -> tickler.Service[Any, Any]:
    """A service on ``store``'s queue "jobs", run in a system task until stopped."""
    service: tickler.Service[Any, Any] = tickler.Service(handler, store=store, name="jobs")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
        started.set()

    started = trio.Event()
    trio.lowlevel.spawn_system_task(run)
    with trio.fail_after(5):
        while service.statistics().wakeups == 0:
            await trio.sleep(0.01)
    return service


# -- 17: cancel one request in memory


def in_plain_context(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` with no contextvars, as a plain Trio service's enqueuers do."""
    return contextvars.Context().run(fn, *args)


@pytest.mark.parametrize("by", ["id", "key"])
async def test_cancel_in_memory_ends_a_waiting_request_cancelled(
    by: str, autojump_clock: trio.abc.Clock
) -> None:
    gate = trio.Event()
    ran: list[str] = []

    async def handler(value: str) -> str:
        ran.append(value)
        await gate.wait()
        return value

    async with tickler.open_service(
        handler, capacity=1, retry=tickler.Retry(attempts=3, initial=1.0, jitter=False)
    ) as service:
        blocker = in_plain_context(service.enqueue_request, "blocker")
        queued = in_plain_context(service.enqueue_request, "queued")
        scheduled = service.enqueue_request("scheduled", key="s", delay=5)
        keyed = service.enqueue_request("keyed", key="q")
        await trio.testing.wait_all_tasks_blocked()
        targets = {
            "id": [queued.id, scheduled.id, keyed.id],
            "key": ["s", "q"],
        }[by]
        for target in targets:
            assert await service.cancel(target)
            assert not await service.cancel(target)  # final now: not live
        assert not await service.cancel(12345)
        cancelled = [scheduled, keyed] + ([queued] if by == "id" else [])
        assert all(t.status is tickler.Status.CANCELLED for t in cancelled)
        with pytest.raises(tickler.RequestCancelled):
            await keyed.wait()
        # The key is free again.
        again = service.enqueue_request("again", key="q")
        assert again is not keyed
        stats = service.statistics()
        check_identity(stats)
        assert stats.cancelled == len(cancelled)
        gate.set()
    assert blocker.status is tickler.Status.SUCCEEDED
    assert "scheduled" not in ran
    assert "keyed" not in ran
    check_identity(service.statistics())


async def test_cancel_in_memory_cancels_a_running_attempt_and_a_retrying_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    cancelled_inside: list[str] = []
    attempts: dict[str, int] = {}

    async def handler(value: str) -> str:
        attempts[value] = attempts.get(value, 0) + 1
        if value == "flaky":
            raise ValueError("try again")
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            cancelled_inside.append(value)
            raise
        return value

    async with tickler.open_service(
        handler,
        capacity=2,
        retry=tickler.Retry(attempts=5, initial=10.0, jitter=False),
        on_error=lambda t, e: None,
    ) as service:
        running = in_plain_context(service.enqueue_request, "running")
        flaky = service.enqueue_request("flaky", key="f")
        await trio.sleep(1)
        assert running.status is tickler.Status.RUNNING
        assert flaky.status is tickler.Status.RETRYING
        assert await service.cancel(running.id)
        assert await service.cancel("f")
        with pytest.raises(tickler.RequestCancelled):
            await running.wait()
        with pytest.raises(tickler.RequestCancelled):
            await flaky.wait()
        assert cancelled_inside == ["running"]
        assert attempts == {"running": 1, "flaky": 1}  # never retried
        # The service goes on: the cancelled processor's slot is free again.
        later = [service.enqueue_request(f"later{i}") for i in range(3)]
        await trio.sleep(1)
        assert all(t.status is tickler.Status.RUNNING for t in later[:2])
        for ticket in later:
            assert await service.cancel(ticket.id)
        for ticket in later:
            # A running attempt ends CANCELLED once the cancellation reaches it.
            with pytest.raises(tickler.RequestCancelled):
                await ticket.wait()
        stats = service.statistics()
        check_identity(stats)
        assert stats.cancelled == 5
        assert stats.in_flight == 0
    assert service.statistics().succeeded == 0


async def test_cancel_in_memory_from_inside_a_handler_and_from_a_thread(
    autojump_clock: trio.abc.Clock,
) -> None:
    gate = trio.Event()

    async def handler(value: Any) -> Any:
        if isinstance(value, int):
            # A handler cancels another request, and then itself.
            service = tickler.current_service()
            assert await service.cancel("victim")
            assert await service.cancel(tickler.current_ticket().id)
            await trio.sleep(1)  # the cancel reaches it here
            return "not reached"
        await gate.wait()
        return value

    async with tickler.open_service(handler, capacity=2) as service:
        victim = service.enqueue_request("victim", key="victim")
        await trio.testing.wait_all_tasks_blocked()
        killer = service.enqueue_request(1)
        with pytest.raises(tickler.RequestCancelled):
            await killer.wait()
        with pytest.raises(tickler.RequestCancelled):
            await victim.wait()

        parked = service.enqueue_request("parked", delay=50)
        token = trio.lowlevel.current_trio_token()

        def from_thread() -> bool:
            return trio.from_thread.run(service.cancel, parked.id, trio_token=token)

        assert await trio.to_thread.run_sync(from_thread)
        assert parked.status is tickler.Status.CANCELLED
        gate.set()
    check_identity(service.statistics())


async def test_cancel_in_memory_from_another_run_is_refused() -> None:
    async with tickler.open_service(echo) as service:
        ticket = service.enqueue_request("x", delay=5)

        def other_run() -> None:
            async def call() -> None:
                with pytest.raises(RuntimeError, match="from the Trio run running it"):
                    await service.cancel(ticket.id)

            trio.run(call)

        await trio.to_thread.run_sync(other_run)
        assert await service.cancel(ticket.id)


async def test_cancel_in_memory_refuses_an_unhashable_key() -> None:
    async with tickler.open_service(echo) as service:
        with pytest.raises(TypeError, match="key must be hashable"):
            await service.cancel(["a"])  # type: ignore[arg-type]


async def test_cancel_in_memory_of_a_request_taken_but_not_started(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Right after an enqueue the loop may have handed it to a processor not yet running."""
    ran: list[int] = []

    async def handler(value: int) -> int:
        ran.append(value)
        await trio.sleep(1)
        return value

    async with tickler.open_service(handler, capacity=3) as service:
        for round_ in range(20):
            ticket = in_plain_context(service.enqueue_request, round_)
            for _ in range(round_ % 4):
                await trio.lowlevel.checkpoint()  # let the loop take it, or not
            assert await service.cancel(ticket.id)
            with pytest.raises(tickler.RequestCancelled):
                await ticket.wait()
        check_identity(service.statistics())
        assert service.statistics().cancelled == 20


# -- 2: whatever one row does, the others commit


@pytest.mark.parametrize("kind", STORES)
async def test_a_row_the_store_always_refuses_fails_alone(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from .store_backends import Backend, PostgresBackend, SqliteBackend

    store = make_store(kind, request, tmp_path)
    backend: Backend
    if kind == "sqlite":
        backend = SqliteBackend(store.path)
    else:
        backend = PostgresBackend(store.dsn, store.schema)
    await trio.to_thread.run_sync(store.create_schema)
    backend.add_fault(condition="NEW.key = '\"poison\"'")
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        before = [service.enqueue_request(i) for i in range(3)]
        poisoned = service.enqueue_request("x", key="poison")
        after = [service.enqueue_request(i) for i in range(3, 6)]
        with trio.fail_after(10):
            assert [await t.wait() for t in before + after] == list(range(6))
            with pytest.raises(
                tickler.StoreError, match=r"the store refused the request: .*injected"
            ):
                await poisoned.wait()
            with pytest.raises(tickler.StoreError, match="the store refused the request"):
                await service.submit("y", key="poison")
            assert await (await service.submit(6)).wait() == 6
        stats = service.statistics()
    assert (stats.succeeded, stats.failed) == (7, 2)
    check_identity(stats)
    refusals = [r for r in caplog.records if "the store refused a request" in r.getMessage()]
    assert len(refusals) == 2


# -- 20: rows claimed ahead are counted apart from running ones


@pytest.mark.parametrize("kind", STORES)
async def test_store_statistics_count_claimed_ahead_rows_apart_from_running(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    import subprocess
    import sys

    gate = trio.Event()

    async def quick_then_held(value: int) -> int:
        if value >= 100:
            await gate.wait()
        return value

    store = make_store(kind, request, tmp_path)
    async with tickler.open_service(quick_then_held, store=store, name="jobs", capacity=2) as svc:
        # Two quick attempts in one batch with the held ones: the batch that
        # writes their outcomes claims ahead of the free slots (twice the
        # attempts that ended), to wait in this process's queue.
        for value in (0, 1, *range(100, 110)):
            svc.enqueue_request(value)
        with trio.fail_after(10):
            # (How many depends on how the quick ones' outcomes fall into batches.)
            while svc.statistics().in_flight < 2 or svc.statistics().queued == 0:
                await trio.sleep(0.01)
            while (counts := await svc.store_statistics())["running"] < 2:
                await trio.sleep(0.01)
        waiting_here = svc.statistics().queued
        assert waiting_here > 0  # claimed ahead, not started
        assert counts["running"] == 2  # never more than the capacity
        assert counts["claimed"] == waiting_here
        assert counts["claimed"] + counts["running"] + counts["queued"] == 10
        url = f"sqlite:///{store.path}" if kind == "sqlite" else store.dsn
        schema = [] if kind == "sqlite" else ["--schema", store.schema]
        shown = subprocess.run(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", "tickler", "inspect", url, *schema],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"{waiting_here} claimed, 2 running" in shown
        gate.set()
    found = await svc_lookup_after(store, 100)
    assert found is not None
    assert found.started_at is not None


async def svc_lookup_after(store: Any, request_id_or_value: int) -> Any:
    """The row of the request whose value is given, read by a new service on the store."""
    async with tickler.open_service(echo, store=store, name="jobs") as service:
        for request_id in range(1, 40):
            found = await service.lookup(request_id)
            if found is not None and found.request == request_id_or_value:
                return found
    return None
