"""submit(): enqueue_request that waits for room, as Trio's send is to send_nowait."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def sleeper(request: float) -> float:
    await trio.sleep(request)
    return request


async def test_submit_with_room_enqueues_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(sleeper) as service:
        ticket = await service.submit(1.0)
        assert ticket.status is tickler.Status.QUEUED
        assert trio.current_time() == 0.0
        assert await ticket.wait() == 1.0
        keyed = await service.submit(1.0, key="k", delay=2.0)
        assert keyed.status is tickler.Status.SCHEDULED
        assert await service.submit(5.0, key="k") is keyed


async def test_submit_is_always_a_checkpoint() -> None:
    """A cancelled caller gets Cancelled, and nothing is enqueued, even with room."""
    service = tickler.Service(sleeper)
    with trio.CancelScope() as scope:
        scope.cancel()
        await service.submit(1.0)
    assert scope.cancelled_caught
    assert service.statistics().enqueued == 0


async def test_submit_waits_for_room(autojump_clock: trio.abc.Clock) -> None:
    """A full queue: submit returns as soon as a processor takes a request out."""
    async with tickler.open_service(sleeper, capacity=1, max_queue_length=2) as service:
        service.enqueue_request(1.0)  # runs
        await trio.testing.wait_all_tasks_blocked()
        service.enqueue_request(1.0)
        service.enqueue_request(1.0)
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request(1.0)
        ticket = await service.submit(0.5)
        assert trio.current_time() == 1.0
        assert ticket.status is tickler.Status.QUEUED
        assert await ticket.wait() == 0.5
        assert trio.current_time() == 3.5
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.rejected) == (4, 4, 1)
    check_identity(stats)


async def test_many_waiters_each_get_room_in_turn(autojump_clock: trio.abc.Clock) -> None:
    """Ten producers on a queue of one: every request is enqueued exactly once and runs."""
    done: list[int] = []

    async def record(request: int) -> None:
        await trio.sleep(0.1)
        done.append(request)

    async with tickler.open_service(record, capacity=2, max_queue_length=1) as service:

        async def produce(base: int) -> None:
            for i in range(5):
                await service.submit(base + i)

        async with trio.open_nursery() as nursery:
            for base in range(0, 100, 10):
                nursery.start_soon(produce, base)
    assert sorted(done) == [base + i for base in range(0, 100, 10) for i in range(5)]
    stats = service.statistics()
    assert (stats.enqueued, stats.rejected) == (50, 0)


async def test_a_waiter_cancelled_while_waiting_leaves_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with tickler.open_service(sleeper, capacity=1, max_queue_length=1) as service:
        service.enqueue_request(10.0)
        await trio.testing.wait_all_tasks_blocked()
        service.enqueue_request(10.0)
        with trio.move_on_after(1.0) as scope:
            await service.submit(1.0)
        assert scope.cancelled_caught
        stats = service.statistics()
        assert (stats.enqueued, stats.queued) == (2, 1)
        assert service._submitters == 0
        # Room later goes to nobody: the cancelled waiter is gone.
        await trio.sleep(10)
        assert service.statistics().queued == 0
        await service.stop(drain=False)
    assert service.statistics().enqueued == 2


async def test_a_waiter_gets_service_closed_when_the_service_closes(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper, capacity=1, max_queue_length=1)
        await nursery.start(service.run)
        service.enqueue_request(10.0)
        await trio.testing.wait_all_tasks_blocked()
        service.enqueue_request(10.0)
        outcome: list[BaseException] = []

        async def waiter() -> None:
            try:
                await service.submit(1.0)
            except tickler.ServiceClosed as exc:
                outcome.append(exc)

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await service.stop(drain=False, timeout=0)
    assert len(outcome) == 1
    assert trio.current_time() == 0.0
    assert service.statistics().enqueued == 2


async def test_submit_from_a_handler_raises_queue_full_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Inside the service, waiting for room could wait for itself."""
    outcome: list[BaseException] = []

    async def parent(request: str) -> None:
        if request == "parent":
            await trio.sleep(0.5)
            try:
                await tickler.current_service().submit("child")
            except tickler.QueueFull as exc:
                outcome.append(exc)
        else:
            await trio.sleep(1)

    async with tickler.open_service(parent, capacity=1, max_queue_length=1) as service:
        service.enqueue_request("parent")
        await trio.testing.wait_all_tasks_blocked()
        service.enqueue_request("filler")
    assert len(outcome) == 1
    assert trio.current_time() == 1.5
    assert service.statistics().rejected == 1


async def test_submit_from_a_thread(autojump_clock: trio.abc.Clock) -> None:
    """The README's way: trio.from_thread.run(service.submit, request)."""
    async with tickler.open_service(sleeper, capacity=1, max_queue_length=1) as service:

        def produce() -> list[tickler.Ticket[float, float]]:
            return [trio.from_thread.run(service.submit, 0.5) for _ in range(5)]

        tickets = await trio.to_thread.run_sync(produce)
        for ticket in tickets:
            assert await ticket.wait() == 0.5
    assert service.statistics().rejected == 0


async def test_submit_from_another_run_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(sleeper) as service:

        def other_run() -> BaseException | None:
            try:
                trio.run(service.submit, 1.0)
            except RuntimeError as exc:
                return exc
            return None

        error = await trio.to_thread.run_sync(other_run)
        assert isinstance(error, RuntimeError)
        assert "submitted to from the Trio run running it" in str(error)
    assert service.statistics().enqueued == 0
