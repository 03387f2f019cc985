"""The engine on both paths of tickler._lowlevel: Trio's private attributes, and the fallbacks."""

from __future__ import annotations

import contextvars

import pytest
import trio
import trio.testing

import tickler
from tickler import _lowlevel

from .conftest import check_identity

mark = contextvars.ContextVar[str]("mark")


@pytest.fixture(params=["private", "public"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on Trio's private attributes, and on the public fallbacks."""
    if request.param == "public":
        monkeypatch.setattr(_lowlevel, "PRIVATE_CANCEL_STATUS", False)
        monkeypatch.setattr(_lowlevel, "CONTEXT_ASSIGNABLE", False)
    return str(request.param)


def test_this_trio_has_the_private_attributes() -> None:
    """On the Trio the project pins, the fast paths are taken (the bench measures them)."""
    assert _lowlevel.PRIVATE_CANCEL_STATUS
    assert _lowlevel.CONTEXT_ASSIGNABLE


async def test_the_public_cancel_status_says_what_the_private_one_does() -> None:
    task = trio.lowlevel.current_task()
    with trio.CancelScope() as scope:
        private = _lowlevel.cancel_status(task)
        public = _lowlevel._PUBLIC_CANCEL_STATUS
        assert (private.effectively_cancelled, public.effectively_cancelled) == (False, False)
        scope.cancel()
        assert (private.effectively_cancelled, public.effectively_cancelled) == (True, True)


async def test_a_handlers_own_contextvars_never_reach_the_next_request(
    path: str, autojump_clock: trio.abc.Clock
) -> None:
    seen: list[str | None] = []

    async def handler(request: int) -> int:
        seen.append(mark.get(None))
        mark.set(f"set by {request}")
        await trio.sleep(1)
        return request

    async with tickler.open_service(handler, capacity=1) as service:
        tickets = [contextvars.Context().run(service.enqueue_request, i) for i in range(5)]
        assert [await t.wait() for t in tickets] == list(range(5))
    assert seen == [None] * 5
    check_identity(service.statistics())


async def test_nothing_starts_after_a_stop_without_drain(
    path: str, autojump_clock: trio.abc.Clock
) -> None:
    started: list[int] = []

    async def handler(request: int) -> int:
        started.append(request)
        await trio.sleep(1)
        return request

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=2)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(10)]
        await trio.sleep(1.5)  # two have run, two run now
        stopped = await service.stop(drain=False, timeout=0)
    assert sorted(started) == [0, 1, 2, 3]
    assert [t.id for t in stopped] == [t.id for t in tickets[2:]]
    check_identity(service.statistics())


async def test_cancel_in_memory_on_either_path(path: str, autojump_clock: trio.abc.Clock) -> None:
    async def handler(request: int) -> int:
        await trio.sleep(10)
        return request

    async with tickler.open_service(handler, capacity=1) as service:
        first = service.enqueue_request(1)
        second = service.enqueue_request(2)
        await trio.sleep(1)
        assert await service.cancel(first.id)
        with pytest.raises(tickler.RequestCancelled):
            await first.wait()
        assert await second.wait() == 2
    check_identity(service.statistics())
