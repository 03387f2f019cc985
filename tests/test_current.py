"""current_service() and current_ticket(): a handler reaches its own service and ticket."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import tickler

pytestmark = pytest.mark.usefixtures("enqueue_context")

Seen = list[tuple[Any, ...]]


async def test_inside_a_handler_and_what_it_calls() -> None:
    seen: Seen = []

    def helper() -> tuple[Any, ...]:
        return (tickler.current_service(), tickler.current_ticket())

    async def handler(request: int) -> None:
        seen.append((request, *helper()))
        await trio.lowlevel.checkpoint()
        seen.append((request, *helper()))

    async with tickler.open_service(handler, capacity=2) as service:
        tickets = [service.enqueue_request(i) for i in range(20)]
    # Processors chain requests on one task; each attempt sees its own ticket.
    assert len(seen) == 40
    for request, found_service, found_ticket in seen:
        assert found_service is service
        assert found_ticket is tickets[request]


async def test_in_tasks_the_handler_spawns_and_in_its_threads() -> None:
    seen: Seen = []

    async def child(label: str) -> None:
        await trio.lowlevel.checkpoint()
        seen.append((label, tickler.current_ticket()))

    async def handler(request: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child, "child")
            nursery.start_soon(grandparent)

        def in_thread() -> tickler.Ticket[Any, Any]:
            return trio.from_thread.run_sync(tickler.current_ticket)

        seen.append(("thread", await trio.to_thread.run_sync(in_thread)))

    async def grandparent() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child, "grandchild")

    async with tickler.open_service(handler) as service:
        ticket = service.enqueue_request(1)
    assert sorted(label for label, _ in seen) == ["child", "grandchild", "thread"]
    assert all(found is ticket for _, found in seen)


async def test_in_the_on_error_hook() -> None:
    seen: Seen = []

    async def fail(request: int) -> None:
        raise ValueError(request)

    def on_error(ticket: tickler.Ticket[int, None], exc: Exception) -> None:
        seen.append((tickler.current_ticket(), ticket))

    async with tickler.open_service(fail, on_error=on_error) as service:
        service.enqueue_request(1)
    assert len(seen) == 1
    assert seen[0][0] is seen[0][1]


@pytest.mark.parametrize("function", [tickler.current_service, tickler.current_ticket])
async def test_outside_a_handler(function: Any) -> None:
    """In a test task, before and after a service runs, and in a plain thread."""
    message = rf"^{function.__name__}\(\) called outside a tickler handler$"
    with pytest.raises(RuntimeError, match=message):
        function()
    with pytest.raises(RuntimeError, match=message):
        await trio.to_thread.run_sync(function)

    async def handler(request: int) -> None:
        pass

    async with tickler.open_service(handler) as service:
        await service.enqueue_request(1).wait()
        with pytest.raises(RuntimeError, match=message):
            function()
    with pytest.raises(RuntimeError, match=message):
        function()


async def test_a_task_that_outlives_its_attempt_is_outside_the_handler(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Spawned into a nursery the handler does not own, a task is not part of the attempt.

    Regression guard: the processor moves on to the next request, so the
    task must not be told that request's ticket.
    """
    results: list[object] = []

    async def late(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(1)
        try:
            results.append(tickler.current_ticket())
        except RuntimeError as exc:
            results.append(exc)

    async with trio.open_nursery() as outer:

        async def handler(request: int) -> None:
            if request == 0:
                outer.start_soon(late)
            await trio.sleep(2)

        async with tickler.open_service(handler, capacity=1) as service:
            service.enqueue_request(0)
            service.enqueue_request(1)
    assert len(results) == 1
    assert isinstance(results[0], RuntimeError)


async def test_nested_services_see_the_innermost() -> None:
    seen: Seen = []

    async def inner(request: str) -> None:
        seen.append(("inner", tickler.current_service(), tickler.current_ticket()))

    async def outer(request: str) -> None:
        async with tickler.open_service(inner, name="inner") as service:
            await service.enqueue_request(request).wait()
        seen.append(("outer", tickler.current_service(), tickler.current_ticket()))

    async with tickler.open_service(outer, name="outer") as service:
        ticket = service.enqueue_request("x")
    (_, inner_service, inner_ticket), (_, outer_service, outer_ticket) = seen
    assert inner_service.name == "inner"
    assert inner_ticket.request == "x"
    assert inner_ticket is not ticket
    assert outer_service is service
    assert outer_ticket is ticket


async def test_nothing_is_kept_once_processors_park_or_exit(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The lookup table holds no request once the work is done, and no task once the run ends."""
    from tickler import _current

    async def handler(request: int) -> None:
        await trio.lowlevel.checkpoint()

    async with tickler.open_service(handler, capacity=3) as service:
        for i in range(10):
            service.enqueue_request(i)
        await service.join()
        await trio.testing.wait_all_tasks_blocked()
        attempts = [a for a in _current.ATTEMPTS.values() if a.service is service]
        assert attempts
        assert all(a.ticket is None for a in attempts)
    assert not [a for a in _current.ATTEMPTS.values() if a.service is service]
