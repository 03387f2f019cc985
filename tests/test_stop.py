"""Stopping: drain or cancel, bounded by a timeout, returning what did not run."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import tickler

from .conftest import Recorder, check_identity

# Every test runs with the harness's contextvars and with none at the enqueue.
pytestmark = pytest.mark.usefixtures("enqueue_context")


async def sleeper(request: float) -> float:
    await trio.sleep(request)
    return request


async def test_stop_refuses_enqueue_from_the_first_instant() -> None:
    """Once stop() is called, enqueue_request raises ServiceClosed before stop yields."""
    service = tickler.Service(Recorder())
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        nursery.start_soon(service.stop)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(tickler.ServiceClosed, match=r"^service 'tickler' is closed$"):
            service.enqueue_request("late")
    assert service.statistics().rejected == 1
    assert isinstance(tickler.ServiceClosed(), tickler.TicklerError)


async def test_stop_sets_closed_synchronously() -> None:
    """The refusal starts when stop() is called, not when it first yields."""
    service = tickler.Service(Recorder())
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stopping = service.stop()
        assert not service.closed  # a coroutine not yet started does nothing
        await stopping
        assert service.closed
        assert service.stopping.is_set()


async def test_drain_runs_everything_queued(autojump_clock: trio.abc.Clock) -> None:
    """stop(drain=True) keeps dispatching until nothing is left."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=2)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(1.0) for _ in range(6)]
        assert await service.stop(drain=True) == []
        assert trio.current_time() == 3.0
    assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
    check_identity(service.statistics())


async def test_drain_false_starts_nothing_new(autojump_clock: trio.abc.Clock) -> None:
    """stop(drain=False) cancels the queue at once and lets running work finish."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=2)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(float(i + 1)) for i in range(5)]
        await trio.testing.wait_all_tasks_blocked()
        leftover = await service.stop(drain=False)
        assert trio.current_time() == 2.0  # waited for the two running ones
    assert leftover == tickets[2:]
    assert [t.status for t in tickets] == [tickler.Status.SUCCEEDED] * 2 + [
        tickler.Status.CANCELLED
    ] * 3
    assert all(t.attempts == 0 and t.finished_at == 0.0 for t in leftover)
    stats = service.statistics()
    assert (stats.succeeded, stats.cancelled, stats.started) == (2, 3, 2)
    check_identity(stats)


async def test_cancellation_wins_over_dequeue(autojump_clock: trio.abc.Clock) -> None:
    """A slot freed during a drain=False stop takes no queued request."""
    recorder = Recorder(gate=trio.Event())
    async with trio.open_nursery() as nursery:
        service = tickler.Service(recorder, capacity=1)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.gate is not None
        recorder.gate.set()  # the running request can now finish ...
        leftover = await service.stop(drain=False)  # ... but stop comes first
    assert recorder.seen == [0]
    assert leftover == tickets[1:]


async def test_timeout_cancels_what_still_runs(autojump_clock: trio.abc.Clock) -> None:
    """After the timeout, running attempts are cancelled and returned."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=2)
        await nursery.start(service.run)
        quick = service.enqueue_request(1.0)
        slow = service.enqueue_request(10.0)
        queued = [service.enqueue_request(1.0) for _ in range(3)]
        leftover = await service.stop(drain=True, timeout=2.5)
        assert trio.current_time() == 2.5
    # quick runs 0-1, queued[0] 1-2, queued[1] from 2 until cancelled; queued[2] never starts.
    assert quick.status is tickler.Status.SUCCEEDED
    assert queued[0].status is tickler.Status.SUCCEEDED
    assert leftover == [slow, queued[1], queued[2]]
    assert [t.attempts for t in leftover] == [1, 1, 0]
    assert slow.finished_at == 2.5
    assert slow.attempts == 1
    with pytest.raises(tickler.RequestCancelled):
        await slow.wait()
    check_identity(service.statistics())


async def test_timeout_zero_cancels_at_once(autojump_clock: trio.abc.Clock) -> None:
    """timeout=0 cancels running work without waiting at all."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=1)
        await nursery.start(service.run)
        running = service.enqueue_request(5.0)
        queued = service.enqueue_request(5.0)
        await trio.testing.wait_all_tasks_blocked()
        leftover = await service.stop(timeout=0)
        assert trio.current_time() == 0.0
    assert leftover == [running, queued]
    assert running.attempts == 1
    assert queued.attempts == 0


async def test_stop_is_idempotent(autojump_clock: trio.abc.Clock) -> None:
    """Concurrent and later stop() calls wait for the same stop and return the same tickets."""
    results: list[list[tickler.Ticket[Any, Any]]] = []

    async def stop_and_record(**kwargs: object) -> None:
        results.append(await service.stop(**kwargs))  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=1)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(3.0) for _ in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(stop_and_record)  # the first call decides
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(stop_and_record)
        nursery.start_soon(lambda: stop_and_record(drain=False, timeout=0))
    assert trio.current_time() == 9.0  # the drain ran to the end
    assert results == [[], [], []]
    assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
    assert await service.stop() == []


async def test_later_stop_returns_the_same_cancelled_tickets(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The tickets a stop returned are returned again by every later call."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=1)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(3.0) for _ in range(3)]
        first = await service.stop(drain=False, timeout=1)
    assert first == tickets
    assert await service.stop() == first
    assert await service.stop(drain=True) is not first  # a fresh list each time


async def test_stop_after_open_service_returns_its_tickets_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """open_service's own stop cancelled two requests; a later stop() returns them."""
    async with tickler.open_service(sleeper, capacity=1, shutdown_timeout=1) as service:
        tickets = [service.enqueue_request(3.0) for _ in range(2)]
    assert [t.status for t in tickets] == [tickler.Status.CANCELLED] * 2
    assert await service.stop() == tickets
    assert await service.stop(drain=False, timeout=0) == tickets


async def test_stop_before_run_cancels_the_queue() -> None:
    """Stopping a service that never ran cancels what waits; run is then refused."""
    service = tickler.Service(Recorder())
    tickets = [service.enqueue_request(i) for i in range(3)]
    assert await service.stop() == tickets
    assert all(t.status is tickler.Status.CANCELLED for t in tickets)
    with pytest.raises(tickler.ServiceClosed, match=r"^service 'tickler' is closed$"):
        await service.run()
    check_identity(service.statistics())


async def test_stopping_event_lets_handlers_wind_down(autojump_clock: trio.abc.Clock) -> None:
    """Handlers can watch service.stopping and finish early."""

    async def patient(request: object) -> str:
        await service.stopping.wait()
        return "wound down"

    async with trio.open_nursery() as nursery:
        service = tickler.Service(patient)
        await nursery.start(service.run)
        ticket = service.enqueue_request("x")
        await trio.sleep(7)
        assert await service.stop() == []
    assert await ticket.wait() == "wound down"
    assert ticket.finished_at == 7


async def test_run_ends_after_stop() -> None:
    """run() returns once the stop completes; enqueueing and running again are refused."""
    service = tickler.Service(Recorder())
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service.stop()
    with pytest.raises(tickler.ServiceClosed):
        service.enqueue_request("late")
    with pytest.raises(RuntimeError, match=r"^service 'tickler' has already run$"):
        await service.run()


async def test_open_service_drains_on_normal_exit(autojump_clock: trio.abc.Clock) -> None:
    """Leaving the block normally drains the service."""
    async with tickler.open_service(sleeper, capacity=2) as service:
        tickets = [service.enqueue_request(1.0) for _ in range(4)]
    assert trio.current_time() == 2.0
    assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
    assert service.closed


async def test_open_service_shutdown_timeout(autojump_clock: trio.abc.Clock) -> None:
    """shutdown_timeout bounds the drain on exit."""
    async with tickler.open_service(sleeper, shutdown_timeout=1.5) as service:
        ticket = service.enqueue_request(60.0)
    assert trio.current_time() == 1.5
    assert ticket.status is tickler.Status.CANCELLED


async def test_open_service_body_error_cancels_and_propagates(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An error in the body cancels work in flight and surfaces as itself."""
    with pytest.raises(KeyError, match="boom"):
        async with tickler.open_service(sleeper) as service:
            ticket = service.enqueue_request(60.0)
            await trio.sleep(1)
            raise KeyError("boom")
    assert trio.current_time() == 1.0
    assert ticket.status is tickler.Status.CANCELLED
    assert await service.stop() == [ticket]


async def test_stop_without_drain_waits_for_what_runs_unless_timeout_is_zero(
    autojump_clock: trio.abc.Clock,
) -> None:
    """stop(drain=False) waits for a running handler with no limit by default (here, until
    it returns an hour later); stop(drain=False, timeout=0) cancels a stuck one at once."""
    released = trio.Event()

    async def stuck(request: str) -> str:
        if request == "stuck":
            await trio.sleep_forever()
        await released.wait()
        return request

    async with trio.open_nursery() as nursery:
        waited = tickler.Service(stuck, capacity=1)
        await nursery.start(waited.run)
        running = waited.enqueue_request("released at 3600 s")
        queued = waited.enqueue_request("queued")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_release_later, released)
        assert await waited.stop(drain=False) == [queued]
        assert trio.current_time() == 3600
        assert running.status is tickler.Status.SUCCEEDED

    async with trio.open_nursery() as nursery:
        at_once = tickler.Service(stuck, capacity=1)
        await nursery.start(at_once.run)
        ticket = at_once.enqueue_request("stuck")
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        assert await at_once.stop(drain=False, timeout=0) == [ticket]
        assert trio.current_time() == start
        assert ticket.status is tickler.Status.CANCELLED


async def _release_later(released: trio.Event) -> None:
    await trio.sleep(3600)
    released.set()
