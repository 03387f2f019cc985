"""The queue's contract where the in-memory engine and SqliteStore share it: one suite, both."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler

Open = Callable[..., Any]

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def open_service(request: pytest.FixtureRequest, tmp_path: Path) -> Open:
    """open_service for the engine under test: in memory, a SqliteStore file, or PostgreSQL."""

    @asynccontextmanager
    async def opened(handler: Any, **options: Any) -> AsyncIterator[tickler.Service[Any, Any]]:
        if request.param == "sqlite":
            options.setdefault("name", "contract")
            options["store"] = tickler.SqliteStore(
                tmp_path / "queue.db", lease=2.0, poll_interval=0.05
            )
        elif request.param == "postgres":
            options.setdefault("name", "contract")
            options["store"] = tickler.PostgresStore(
                request.getfixturevalue("postgres_dsn"),
                schema=request.getfixturevalue("postgres_schema"),
                lease=2.0,
                poll_interval=0.05,
            )
        async with tickler.open_service(handler, **options) as service:
            yield service

    return opened


async def double(request: int) -> int:
    await trio.sleep(0.001)
    return request * 2


async def test_results_come_back_in_order(open_service: Open) -> None:
    async with open_service(double) as service:
        tickets = [service.enqueue_request(i) for i in range(20)]
        assert [await t.wait() for t in tickets] == [i * 2 for i in range(20)]
        assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
        assert all(t.attempts == 1 for t in tickets)


async def test_capacity_caps_the_attempts_in_flight(open_service: Open) -> None:
    running = peak = 0

    async def counted(request: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await trio.sleep(0.01)
        running -= 1

    async with open_service(counted, capacity=3) as service:
        for i in range(15):
            service.enqueue_request(i)
        await service.join()
    assert peak == 3


async def test_a_failure_raises_the_handlers_exception_and_calls_on_error_once(
    open_service: Open,
) -> None:
    seen: list[Exception] = []

    async def fail(request: int) -> None:
        raise KeyError(request)

    async with open_service(fail, on_error=lambda t, e: seen.append(e)) as service:
        ticket = service.enqueue_request(3)
        with pytest.raises(KeyError):
            await ticket.wait()
    assert ticket.status is tickler.Status.FAILED
    assert len(seen) == 1


async def test_retries_count_attempts(open_service: Open) -> None:
    calls = 0

    async def flaky(request: int) -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("again")
        return request

    retry = tickler.Retry(attempts=5, initial=0.01, jitter=False)
    async with open_service(flaky, retry=retry) as service:
        ticket = service.enqueue_request(7)
        assert await ticket.wait() == 7
    assert ticket.attempts == 3
    assert service.statistics().retried == 2


async def test_a_timeout_fails_the_attempt_with_timeout_error(open_service: Open) -> None:
    async def slow(request: int) -> None:
        await trio.sleep(10)

    async with open_service(slow, timeout=0.05, on_error=lambda t, e: None) as service:
        with pytest.raises(TimeoutError):
            await service.enqueue_request(1).wait()


async def test_a_live_key_is_not_enqueued_twice(open_service: Open) -> None:
    gate = trio.Event()

    async def held(request: int) -> int:
        await gate.wait()
        return request

    async with open_service(held) as service:
        first = await service.submit(1, key="k")
        second = await service.submit(2, key="k")
        assert second.id == first.id
        gate.set()
        assert (await first.wait(), await second.wait()) == (1, 1)
        assert service.statistics().deduplicated == 1
        third = await service.submit(3, key="k")
        assert third.id != first.id
        assert await third.wait() == 3


async def test_a_delay_holds_the_request_back(open_service: Open) -> None:
    async with open_service(double) as service:
        before = trio.current_time()
        ticket = await service.submit(4, delay=0.3)
        assert ticket.status is tickler.Status.SCHEDULED
        assert await ticket.wait() == 8
        assert ticket.started_at is not None
        assert ticket.started_at - before >= 0.25


async def test_join_waits_for_everything(open_service: Open) -> None:
    async with open_service(double, capacity=2) as service:
        tickets = [service.enqueue_request(i) for i in range(10)]
        delayed = service.enqueue_request(100, delay=0.2)
        await service.join()
        assert all(t.done for t in tickets)
        assert delayed.done


async def test_the_enqueuers_contextvars_reach_the_handler(open_service: Open) -> None:
    async def read(request: int) -> str:
        return REQUEST_ID.get("unset")

    async with open_service(read) as service:
        REQUEST_ID.set("req-1")
        first = service.enqueue_request(1)
        REQUEST_ID.set("req-2")
        second = service.enqueue_request(2)
        assert (await first.wait(), await second.wait()) == ("req-1", "req-2")


async def test_current_service_and_ticket_in_the_handler(open_service: Open) -> None:
    found: list[tuple[Any, Any]] = []

    async def look(request: int) -> None:
        found.append((tickler.current_service(), tickler.current_ticket()))

    async with open_service(look) as service:
        ticket = await service.submit(1)
        await ticket.wait()
    assert found == [(service, ticket)]


async def test_submit_waits_for_room(open_service: Open) -> None:
    async with open_service(double, max_queue_length=2) as service:
        tickets = [await service.submit(i) for i in range(10)]
        assert [await t.wait() for t in tickets] == [i * 2 for i in range(10)]
        assert service.statistics().rejected == 0


async def test_a_closed_service_refuses(open_service: Open) -> None:
    async with open_service(double) as service:
        pass
    with pytest.raises(tickler.ServiceClosed):
        service.enqueue_request(1)
    with pytest.raises(tickler.ServiceClosed):
        await service.submit(1)
