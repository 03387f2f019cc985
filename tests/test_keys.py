"""Keys: one live request per key; the key is free again once that request is final."""

from __future__ import annotations

import inspect
import threading

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def sleeper(request: float) -> float:
    await trio.sleep(request)
    return request


async def test_a_live_key_returns_the_live_ticket(autojump_clock: trio.abc.Clock) -> None:
    """Queued, then running: the same key gives the same ticket, creates nothing, is counted."""
    async with tickler.open_service(sleeper, capacity=1) as service:
        blocker = service.enqueue_request(1.0)
        first = service.enqueue_request(1.0, key="page-1")
        assert service.enqueue_request(2.0, key="page-1") is first
        assert service.statistics().queued == 2
        await trio.sleep(1.5)
        assert first.status is tickler.Status.RUNNING
        assert service.enqueue_request(3.0, key="page-1") is first
        stats = service.statistics()
        assert (stats.enqueued, stats.deduplicated) == (2, 2)
        check_identity(stats)
        assert await first.wait() == 1.0
        # Final: the key is free again, and a new request takes it.
        again = service.enqueue_request(0.5, key="page-1")
        assert again is not first
        assert again.id == 3
        assert await again.wait() == 0.5
        assert blocker.done
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.deduplicated) == (3, 3, 2)
    check_identity(stats)


async def test_keys_are_compared_by_equality_and_distinct_keys_do_not_collide(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with tickler.open_service(sleeper) as service:
        a = service.enqueue_request(1.0, key=("site", 1))
        b = service.enqueue_request(1.0, key=("site", 2))
        assert a is not b
        assert service.enqueue_request(1.0, key=("site", 1)) is a
        assert service.enqueue_request(1.0, key=(("site", 1))) is a
        # An int key equal to a float key is the same key, as in a dict.
        c = service.enqueue_request(1.0, key=1)
        assert service.enqueue_request(1.0, key=1.0) is c


async def test_a_retrying_request_keeps_its_key(autojump_clock: trio.abc.Clock) -> None:
    """A parent retried while its follow-up is retrying does not enqueue the follow-up twice."""
    calls = 0

    async def flaky(request: str) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OSError("relay down")
        return request

    retry = tickler.Retry(attempts=5, initial=1.0, jitter=False)
    async with tickler.open_service(flaky, retry=retry) as service:
        ticket = service.enqueue_request("mail", key="mail-1")
        await trio.sleep(0.5)
        assert ticket.status is tickler.Status.RETRYING
        assert service.enqueue_request("mail", key="mail-1") is ticket
        assert await ticket.wait() == "mail"
    assert calls == 3
    assert service.statistics().enqueued == 1


@pytest.mark.parametrize("outcome", ["fails", "is cancelled"])
async def test_a_key_is_freed_when_its_request_fails_or_is_cancelled(
    autojump_clock: trio.abc.Clock, outcome: str
) -> None:
    async def handler(request: int) -> int:
        if outcome == "fails":
            raise ValueError("no")
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, on_error=lambda ticket, exc: None)
        await nursery.start(service.run)
        first = service.enqueue_request(1, key="k")
        await trio.testing.wait_all_tasks_blocked()
        if outcome == "is cancelled":
            assert service.statistics().in_flight == 1
            await service.stop(timeout=0)
            assert first.status is tickler.Status.CANCELLED
            with pytest.raises(tickler.ServiceClosed):
                service.enqueue_request(2, key="k")
        else:
            assert first.status is tickler.Status.FAILED
            second = service.enqueue_request(2, key="k")
            assert second is not first
            await trio.testing.wait_all_tasks_blocked()
            assert second.status is tickler.Status.FAILED
            await service.stop()
    # No key outlives its request.
    assert not service._intake.keys
    assert not service._intake.key_of


async def test_a_live_key_is_returned_even_when_the_queue_is_full() -> None:
    """Deduplication creates nothing, so it needs no room."""
    service = tickler.Service(sleeper, max_queue_length=2)
    first = service.enqueue_request(1.0, key="a")
    service.enqueue_request(1.0)
    assert service.enqueue_request(1.0, key="a") is first
    with pytest.raises(tickler.QueueFull):
        service.enqueue_request(1.0, key="b")
    stats = service.statistics()
    assert (stats.enqueued, stats.deduplicated, stats.rejected) == (2, 1, 1)


async def test_a_closed_service_refuses_a_live_key() -> None:
    """Refusal comes first: a closed service hands out no ticket, live or not."""
    service = tickler.Service(sleeper)
    service.enqueue_request(1.0, key="a")
    await service.stop(drain=False)
    with pytest.raises(tickler.ServiceClosed):
        service.enqueue_request(1.0, key="a")


@pytest.mark.parametrize("key", [[1, 2], {"a": 1}, {1}, ([1],)])
async def test_an_unhashable_key_is_refused_and_nothing_is_enqueued(key: object) -> None:
    service = tickler.Service(sleeper)
    with pytest.raises(TypeError, match=r"^key must be hashable, not (list|dict|set|tuple)$"):
        service.enqueue_request(1.0, key=key)
    stats = service.statistics()
    assert (stats.enqueued, stats.queued, stats.rejected) == (0, 0, 0)


async def test_keys_are_exact_under_many_threads() -> None:
    """Eight threads race to enqueue the same 200 keys: exactly one request per key."""
    gate = trio.Event()

    async def held(request: int) -> int:
        await gate.wait()
        return request

    keys = 200
    threads = 8
    results: list[list[tickler.Ticket[int, int]]] = [[] for _ in range(threads)]
    async with tickler.open_service(held, capacity=4, max_queue_length=None) as service:
        start = threading.Barrier(threads)

        def produce(index: int) -> None:
            start.wait()
            for key in range(keys):
                results[index].append(service.enqueue_request(key, key=key))

        def produce_all() -> None:
            workers = [threading.Thread(target=produce, args=(i,)) for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()

        await trio.to_thread.run_sync(produce_all)
        for key in range(keys):
            tickets = {id(results[i][key]) for i in range(threads)}
            assert len(tickets) == 1, key
        stats = service.statistics()
        assert stats.enqueued == keys
        assert stats.deduplicated == keys * (threads - 1)
        check_identity(stats)
        gate.set()
    assert service.statistics().succeeded == keys


async def test_a_follow_up_with_a_key_during_a_drain(autojump_clock: trio.abc.Clock) -> None:
    """A parent that enqueues the same follow-up twice during a drain makes it once."""
    seen: list[str] = []

    async def crawl(url: str) -> None:
        seen.append(url)
        if url == "/":
            service = tickler.current_service()
            for _ in range(2):
                for link in ("/a", "/b"):
                    service.enqueue_request(link, key=link)
            await trio.sleep(1)

    async with tickler.open_service(crawl) as service:
        service.enqueue_request("/")
    assert sorted(seen) == ["/", "/a", "/b"]
    stats = service.statistics()
    assert (stats.enqueued, stats.succeeded, stats.deduplicated) == (3, 3, 2)


async def test_key_and_delay_are_keyword_only(enqueue_context: str) -> None:
    """By position they are refused, and nothing is enqueued; the signature says so."""
    service = tickler.Service(sleeper)
    with pytest.raises(
        TypeError, match=r"key, delay, priority, unique_for and group are keyword-only$"
    ):
        service.enqueue_request(1.0, "k")  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"key, delay, priority, unique_for and group are keyword-only$"
    ):
        service.enqueue_request(1.0, None)  # type: ignore[call-arg]
    assert service.statistics().enqueued == 0
    if enqueue_context == "harness contextvars":  # (the other run wraps the method)
        signature = inspect.signature(service.enqueue_request)
        assert (
            str(signature)
            == "(request, *, key=None, delay=None, priority=0, unique_for=None, group=None)"
        )
