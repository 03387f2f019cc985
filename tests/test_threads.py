"""Enqueueing from threads that are not running Trio."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

import tickler

from .conftest import check_identity

# Every test runs with the harness's contextvars and with none at the enqueue.
pytestmark = pytest.mark.usefixtures("enqueue_context")

THREADS = 8
PER_THREAD = 2_000


async def test_many_threads_enqueue_concurrently() -> None:
    """Requests from many threads at once are all accepted, unique and processed."""
    seen: list[tuple[int, int]] = []

    async def handler(request: tuple[int, int]) -> None:
        await trio.lowlevel.checkpoint()
        seen.append(request)

    tickets: list[list[tickler.Ticket[Any, Any]]] = [[] for _ in range(THREADS)]
    start = threading.Barrier(THREADS)

    def producer(index: int) -> None:
        start.wait()
        for i in range(PER_THREAD):
            tickets[index].append(service.enqueue_request((index, i)))

    with trio.fail_after(60):
        async with (
            tickler.open_service(handler, capacity=16, max_queue_length=None) as service,
            trio.open_nursery() as nursery,
        ):
            for index in range(THREADS):
                nursery.start_soon(trio.to_thread.run_sync, producer, index)
    all_tickets = [t for per_thread in tickets for t in per_thread]
    assert len({t.id for t in all_tickets}) == THREADS * PER_THREAD
    assert sorted(seen) == sorted((i, j) for i in range(THREADS) for j in range(PER_THREAD))
    for per_thread in tickets:  # each thread's requests were queued in its order
        ids = [t.id for t in per_thread]
        assert ids == sorted(ids)
    stats = service.statistics()
    assert stats.succeeded == stats.enqueued == THREADS * PER_THREAD
    check_identity(stats)


async def test_foreign_thread_wakes_an_idle_loop() -> None:
    """A single enqueue from another thread gets the idle supervisor going."""

    async def handler(request: str) -> str:
        return request.upper()

    with trio.fail_after(10):
        async with tickler.open_service(handler) as service:
            for word in ("one", "two", "three"):
                ticket = await trio.to_thread.run_sync(service.enqueue_request, word)
                assert await ticket.wait() == word.upper()
    assert service.statistics().wakeups >= 3


async def test_foreign_thread_gets_service_closed_after_stop() -> None:
    """Threads are refused as soon as a stop has begun."""

    async def handler(request: object) -> None:
        await trio.lowlevel.checkpoint()

    async with tickler.open_service(handler) as service:
        pass
    errors: list[BaseException] = []

    def late() -> None:
        try:
            service.enqueue_request("late")
        except tickler.ServiceClosed as exc:
            errors.append(exc)

    await trio.to_thread.run_sync(late)
    assert len(errors) == 1
    assert service.statistics().rejected == 1
