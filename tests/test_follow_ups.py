"""Follow-ups: requests a service's own handlers enqueue while a drain runs."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import tickler

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def test_a_drain_runs_the_follow_ups_of_its_handlers(autojump_clock: trio.abc.Clock) -> None:
    """A crawl that feeds itself finishes when open_service's block ends at once.

    Regression: follow-ups got ServiceClosed and the crawl ended after one page.
    """
    crawled: list[int] = []

    async def crawl(page: int) -> None:
        await trio.sleep(1)
        crawled.append(page)
        if page < 40:
            service.enqueue_request(2 * page)
            service.enqueue_request(2 * page + 1)

    async with tickler.open_service(crawl, capacity=4) as service:
        service.enqueue_request(1)
    assert sorted(crawled) == list(range(1, 80))  # pages 1-39 link to 2-79
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.rejected) == (79, 79, 0)


async def test_other_callers_are_refused_from_the_first_instant_of_a_drain() -> None:
    """Only the service's own handlers may add work once the stop began."""
    gate = trio.Event()

    async def held(request: int) -> None:
        await gate.wait()

    async with trio.open_nursery() as nursery:
        service = tickler.Service(held)
        await nursery.start(service.run)
        service.enqueue_request(1)
        nursery.start_soon(service.stop)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(tickler.ServiceClosed):
            service.enqueue_request(2)
        assert await trio.to_thread.run_sync(_refused_from_a_thread, service)
        gate.set()
    assert service.statistics().rejected == 2


def _refused_from_a_thread(service: tickler.Service[int, None]) -> bool:
    try:
        service.enqueue_request(3)
    except tickler.ServiceClosed:
        return True
    return False


async def test_a_stop_without_drain_refuses_follow_ups(autojump_clock: trio.abc.Clock) -> None:
    """stop(drain=False) takes no new work at all."""
    refused: list[str] = []

    async def handler(request: int) -> None:
        await trio.sleep(1)
        try:
            service.enqueue_request(request + 1)
        except tickler.ServiceClosed as exc:
            refused.append(str(exc))

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler)
        await nursery.start(service.run)
        service.enqueue_request(1)
        await trio.testing.wait_all_tasks_blocked()
        await service.stop(drain=False)
    assert refused == ["service 'tickler' is closed"]
    assert service.statistics().succeeded == 1


async def test_max_queue_length_still_bounds_follow_ups(autojump_clock: trio.abc.Clock) -> None:
    """A drain's follow-ups get QueueFull when the queue is full."""
    outcomes: list[str] = []

    async def handler(request: int) -> None:
        if request == 0:
            for i in range(1, 5):
                try:
                    service.enqueue_request(i)
                    outcomes.append("queued")
                except tickler.QueueFull:
                    outcomes.append("full")
        await trio.sleep(1)

    async with tickler.open_service(handler, capacity=1, max_queue_length=2) as service:
        service.enqueue_request(0)
    assert outcomes == ["queued", "queued", "full", "full"]
    assert service.statistics().succeeded == 3


async def test_a_drain_of_endless_follow_ups_ends_at_its_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Work that always feeds itself is bounded by the stop's timeout."""

    async def endless(request: int) -> None:
        await trio.sleep(1)
        service.enqueue_request(request + 1)

    async with trio.open_nursery() as nursery:
        service = tickler.Service(endless)
        await nursery.start(service.run)
        service.enqueue_request(0)
        left = await service.stop(timeout=10.5)
    assert trio.current_time() == 10.5
    assert [t.request for t in left] == [10]
    stats = service.statistics()
    assert (stats.succeeded, stats.cancelled) == (10, 1)
