"""join(): wait until the work is done, closing nothing."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

import tickler

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def sleeper(request: float) -> float:
    await trio.sleep(request)
    return request


async def test_join_returns_once_everything_queued_and_running_is_done(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Six 1-second requests at capacity 2: join returns at 3 s, and the service stays open."""
    async with tickler.open_service(sleeper, capacity=2) as service:
        tickets = [service.enqueue_request(1.0) for _ in range(6)]
        await service.join()
        assert trio.current_time() == 3.0
        assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
        assert not service.closed
        assert await service.enqueue_request(0.5).wait() == 0.5


async def test_join_on_an_idle_service_is_a_checkpoint(autojump_clock: trio.abc.Clock) -> None:
    """Idle: join returns at once, but still yields (Trio's always-a-checkpoint rule)."""
    async with tickler.open_service(sleeper) as service:
        with trio.CancelScope() as scope:
            scope.cancel()
            await service.join()
        assert scope.cancelled_caught
        await service.join()
        assert trio.current_time() == 0.0


async def test_join_waits_for_requests_enqueued_while_it_waits(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Work that arrives during the wait is waited for too."""
    async with tickler.open_service(sleeper, capacity=1) as service:
        service.enqueue_request(1.0)

        async def feed() -> None:
            await trio.sleep(0.5)
            service.enqueue_request(2.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            await service.join()
        assert trio.current_time() == 3.0


async def test_join_waits_for_retries(autojump_clock: trio.abc.Clock) -> None:
    """A request waiting for its retry is not done."""
    failures = 0

    async def flaky(request: int) -> int:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise ConnectionError("again")
        return request

    retry = tickler.Retry(attempts=3, initial=1.0, factor=1.0, jitter=False)
    async with tickler.open_service(flaky, retry=retry) as service:
        ticket = service.enqueue_request(7)
        await service.join()
        assert trio.current_time() == 2.0
        assert ticket.result() == 7


async def test_join_from_a_handler_is_refused_at_once() -> None:
    """It would wait for its own request."""

    async def handler(request: int) -> str:
        with pytest.raises(RuntimeError, match=r"would wait for itself$"):
            await service.join()
        return "refused"

    async with tickler.open_service(handler) as service:
        assert await service.enqueue_request(1).wait() == "refused"


async def test_join_returns_when_the_run_ends(autojump_clock: trio.abc.Clock) -> None:
    """A stop that cancels what runs also ends a join waiting for it."""

    async def forever(request: int) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever)
        await nursery.start(service.run)
        service.enqueue_request(1)
        await trio.testing.wait_all_tasks_blocked()  # it runs
        nursery.start_soon(functools.partial(service.stop, drain=False, timeout=5))
        await service.join()
        assert trio.current_time() == 5.0
