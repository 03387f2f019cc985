"""Delays: a request that waits in the loop's timer as SCHEDULED, holding no slot."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def sleeper(request: float) -> float:
    await trio.sleep(request)
    return request


async def test_a_delayed_request_starts_when_due(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(sleeper) as service:
        await trio.sleep(1.0)
        ticket = service.enqueue_request(0.5, delay=3.0)
        assert ticket.status is tickler.Status.SCHEDULED
        assert ticket.enqueued_at == 1.0
        stats = service.statistics()
        assert (stats.scheduled, stats.queued, stats.in_flight) == (1, 0, 0)
        check_identity(stats)
        await trio.sleep(2.9)
        assert ticket.status is tickler.Status.SCHEDULED
        assert await ticket.wait() == 0.5
        assert ticket.started_at == 4.0
        assert ticket.finished_at == 4.5
    stats = service.statistics()
    assert (stats.scheduled, stats.succeeded) == (0, 1)
    check_identity(stats)


async def test_delayed_requests_start_in_due_order_and_hold_no_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Capacity 1: queued work runs while delayed requests wait; they then start by due time."""
    order: list[str] = []

    async def record(request: str) -> None:
        order.append(request)
        await trio.sleep(0.1)

    async with tickler.open_service(record, capacity=1) as service:
        service.enqueue_request("late", delay=2.0)
        service.enqueue_request("soon", delay=1.0)
        service.enqueue_request("zero", delay=0)
        for i in range(3):
            service.enqueue_request(f"now-{i}")
        await service.join()
    assert order[-2:] == ["soon", "late"]
    assert set(order[:4]) == {"zero", "now-0", "now-1", "now-2"}
    assert trio.current_time() == pytest.approx(2.1)


async def test_a_delayed_request_counts_against_max_queue_length() -> None:
    """Admitted work: two delayed requests fill a queue of two, for the hot path too."""
    service = tickler.Service(sleeper, max_queue_length=2)
    service.enqueue_request(1.0, delay=5)
    service.enqueue_request(1.0, delay=5)
    with pytest.raises(
        tickler.QueueFull,
        match=r"^service 'tickler' has room for 0 more requests, not 1 \(max_queue_length 2\);"
        r" none was enqueued$",
    ):
        service.enqueue_request(1.0)
    with pytest.raises(tickler.QueueFull):
        service.enqueue_request(1.0, delay=1)
    stats = service.statistics()
    assert (stats.scheduled, stats.rejected, stats.enqueued) == (2, 2, 2)
    check_identity(stats)


async def test_a_started_delayed_request_gives_its_place_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with tickler.open_service(sleeper, max_queue_length=1) as service:
        service.enqueue_request(10.0, delay=1)
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request(1.0)
        await trio.sleep(1.5)
        assert service.statistics().in_flight == 1
        assert await service.enqueue_request(1.0).wait() == 1.0


async def test_a_delay_given_before_run_counts_from_the_start_of_the_run(
    autojump_clock: trio.abc.Clock,
) -> None:
    service = tickler.Service(sleeper)
    ticket = service.enqueue_request(0.0, delay=2.0)
    assert ticket.enqueued_at is None
    await trio.sleep(5)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        assert ticket.enqueued_at == 5.0
        await ticket.wait()
        assert ticket.started_at == 7.0
        await service.stop()


async def test_a_delay_from_another_thread(mock_clock: trio.testing.MockClock) -> None:
    # Time stands still until the check: with the clock jumping whenever
    # every task waits, it could jump past the delay while this task waits
    # for the thread's answer, and the request would already have run.
    async with tickler.open_service(sleeper) as service:
        ticket = await trio.to_thread.run_sync(lambda: service.enqueue_request(0.0, delay=1.0))
        assert ticket.status is tickler.Status.SCHEDULED
        mock_clock.autojump_threshold = 0
        await ticket.wait()
        assert ticket.started_at is not None
        assert ticket.enqueued_at is not None
        assert ticket.started_at - ticket.enqueued_at == pytest.approx(1.0)


async def test_join_and_a_drain_wait_for_scheduled_requests(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with tickler.open_service(sleeper) as service:
        ticket = service.enqueue_request(0.0, delay=3.0)
        await service.join()
        assert ticket.status is tickler.Status.SUCCEEDED
        assert trio.current_time() == 3.0
        late = service.enqueue_request(0.0, delay=2.0)
    # open_service's drain ran it when due.
    assert late.status is tickler.Status.SUCCEEDED
    assert trio.current_time() == 5.0


async def test_stop_without_drain_cancels_scheduled_requests_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper)
        await nursery.start(service.run)
        ticket = service.enqueue_request(0.0, delay=3.0)
        await trio.testing.wait_all_tasks_blocked()
        stopped = await service.stop(drain=False)
        assert stopped == [ticket]
        assert ticket.status is tickler.Status.CANCELLED
        assert trio.current_time() == 0.0
    stats = service.statistics()
    assert (stats.scheduled, stats.cancelled) == (0, 1)
    check_identity(stats)


async def test_a_drain_whose_timeout_ends_before_the_due_time_cancels(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        service = tickler.Service(sleeper)
        await nursery.start(service.run)
        soon = service.enqueue_request(0.0, delay=1.0)
        late = service.enqueue_request(0.0, delay=10.0)
        assert await service.stop(timeout=2.0) == [late]
    assert soon.status is tickler.Status.SUCCEEDED
    assert late.status is tickler.Status.CANCELLED
    assert trio.current_time() == 2.0
    check_identity(service.statistics())


async def test_a_stop_before_run_cancels_scheduled_requests() -> None:
    service = tickler.Service(sleeper)
    ticket = service.enqueue_request(0.0, delay=1.0)
    assert await service.stop() == [ticket]
    assert ticket.status is tickler.Status.CANCELLED
    stats = service.statistics()
    assert (stats.scheduled, stats.cancelled) == (0, 1)
    check_identity(stats)


async def test_a_scheduled_request_with_a_key(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(sleeper) as service:
        ticket = service.enqueue_request(0.0, key="k", delay=1.0)
        assert service.enqueue_request(0.0, key="k") is ticket
        await ticket.wait()
        assert service.enqueue_request(0.0, key="k") is not ticket


@pytest.mark.parametrize(
    ("delay", "error", "message"),
    [
        (-1, ValueError, r"^delay must be >= 0$"),
        (-0.001, ValueError, r"^delay must be >= 0$"),
        (math.nan, ValueError, r"^delay must be >= 0$"),
        (math.inf, ValueError, r"^delay must be finite$"),
        (10**400, ValueError, r"^delay must be at most 3153600000\.0 seconds \(100 years\)$"),
        (1e12, ValueError, r"^delay must be at most 3153600000\.0 seconds \(100 years\)$"),
        (
            3153600000.001,
            ValueError,
            r"^delay must be at most 3153600000\.0 seconds \(100 years\)$",
        ),
        ("1", TypeError, r"^delay must be a number of seconds or None, not str$"),
        (True, TypeError, r"^delay must be a number of seconds or None, not bool$"),
    ],
)
async def test_a_bad_delay_is_refused_and_nothing_is_enqueued(
    delay: object, error: type[Exception], message: str
) -> None:
    service = tickler.Service(sleeper)
    with pytest.raises(error, match=message):
        service.enqueue_request(1.0, delay=delay)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        service.enqueue_many([1.0, 2.0], delay=delay)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        await service.submit(1.0, delay=delay)  # type: ignore[arg-type]
    stats = service.statistics()
    assert (stats.enqueued, stats.scheduled, stats.rejected) == (0, 0, 0)


def test_a_retry_waits_at_most_as_long_as_a_delay_may() -> None:
    with pytest.raises(
        ValueError, match=r"^maximum must be at most 3153600000\.0 seconds \(100 years\)$"
    ):
        tickler.Retry(maximum=1e12)
    assert tickler.Retry(initial=1e12, maximum=3153600000.0).backoff(1) == 3153600000.0
