"""Edges of keys, delays and submit found by trying to break them."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity

pytestmark = pytest.mark.usefixtures("enqueue_context")


class SteppingClock(trio.abc.Clock):
    """A virtual clock that moves on by ``tick`` every time it is read.

    Every reading differs from the one before, as a real clock's does: code
    that reads the clock twice sees time pass in between. When every task is
    blocked it jumps to the next deadline, as an autojumping MockClock does.
    """

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.now = 0.0

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        now = self.now
        self.now += self.tick
        return now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if deadline == math.inf:
            return 86400.0  # nothing to wait for but I/O: a real wait
        self.now = max(self.now, deadline)
        return 0.0


def test_a_request_falling_due_between_two_clock_readings_still_starts() -> None:
    """Regression: due after _dispatch looked but before the loop set its timer, it hung.

    The loop then slept with no timer and nothing in flight to tickle it;
    join() never returned. Delays in steps of a third of a tick land in that
    window for some of them.
    """

    async def nothing(request: int) -> None:
        pass

    async def main() -> None:
        async with tickler.open_service(nothing) as service:
            for k in range(60):
                service.enqueue_request(k, delay=k / 3)
                with trio.fail_after(1_000):
                    await service.join()
            assert service.statistics().succeeded == 60

    trio.run(main, clock=SteppingClock(tick=1.0))


async def test_a_waiter_woken_for_room_it_does_not_use_passes_the_wake_up_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Regression: a deduplicated waiter kept its wake-up; the others stayed parked.

    Waiters C, A (key "k") and B park in that order. X's start wakes C, but
    X's handler takes that place with Y (key "k"); Y's start wakes A, which
    finds "k" live and uses no place. B and C must still get in at once.
    """

    async def handler(request: str) -> None:
        if request == "X":
            tickler.current_service().enqueue_request("Y", key="k")
        await trio.sleep(1)

    got: dict[str, tuple[str, float]] = {}
    async with tickler.open_service(handler, capacity=1, max_queue_length=1) as service:

        async def submitter(name: str, key: str | None) -> None:
            ticket = await service.submit(name, key=key)
            got[name] = (ticket.request, trio.current_time())

        with trio.fail_after(100):  # (before the fix, B and C waited for ever)
            async with trio.open_nursery() as nursery:
                service.enqueue_request("R0")
                await trio.sleep(0.1)
                service.enqueue_request("X")
                for name, key in [("C", None), ("A", "k"), ("B", None)]:
                    nursery.start_soon(submitter, name, key)
                    await trio.sleep(0.01)
    assert got["A"][0] == "Y"
    assert got["A"][1] == pytest.approx(2.0)
    # B got Y's freed place at 2.0 at the latest; C the next one.
    assert got["B"][1] <= 2.0 + 1e-9
    assert got["C"][1] <= 3.0 + 1e-9
    check_identity(service.statistics())


def test_a_service_waited_on_before_it_ran_must_run_in_that_run() -> None:
    """Regression: a submit parked in one run, then run() in another, broke both runs."""

    async def nothing(request: int) -> None:
        pass

    service = tickler.Service(nothing, max_queue_length=1)
    service.enqueue_request(0)
    parked = threading.Event()
    outcome: list[BaseException] = []

    async def waiter() -> None:
        async with trio.open_nursery() as nursery:

            async def submit() -> None:
                await service.submit(1)

            nursery.start_soon(submit)
            await trio.testing.wait_all_tasks_blocked()
            parked.set()
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    def other() -> None:
        parked.wait()
        try:
            trio.run(service.run)
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    trio.run(waiter)
    thread.join()
    assert len(outcome) == 1
    assert "was waited on from another Trio run before it ran" in str(outcome[0])
    stats = service.statistics()
    assert (stats.enqueued, stats.queued) == (1, 1)


async def test_a_zero_delay_from_a_handler_goes_before_what_is_queued_after_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Regression: the processor's chain took the queued request first."""
    order: list[str] = []

    async def handler(request: str) -> None:
        order.append(request)
        if request == "A":
            service = tickler.current_service()
            service.enqueue_request("B", delay=0)
            service.enqueue_request("C")

    async with tickler.open_service(handler, capacity=1) as service:
        service.enqueue_request("A")
    assert order == ["A", "B", "C"]


class MutableKey:
    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MutableKey) and other.value == self.value


async def test_a_key_whose_hash_changes_while_live_does_not_break_the_service(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: freeing the key raised KeyError in the loop; the ticket never became final."""
    key = MutableKey(1)

    async def handler(request: str) -> str:
        key.value = 2
        return request

    async with tickler.open_service(handler) as service:
        ticket = service.enqueue_request("a", key=key)
        assert await ticket.wait() == "a"
        assert await service.enqueue_request("b", key=MutableKey(1)).wait() == "b"
    assert not service._intake.keys
    assert not service._intake.key_of
    check_identity(service.statistics())


async def test_a_key_whose_hash_fails_late_enqueues_nothing() -> None:
    """Regression: the id was given before the key was stored, so `enqueued` counted a ghost."""

    class LateFailure:
        calls = 0

        def __hash__(self) -> int:
            LateFailure.calls += 1
            if LateFailure.calls == 3:
                raise ValueError("hash failed")
            return 1

    service = tickler.Service(_nothing)
    with pytest.raises(ValueError, match="hash failed"):
        service.enqueue_request(1, key=LateFailure())
    stats = service.statistics()
    assert (stats.enqueued, stats.queued) == (0, 0)
    assert service.enqueue_request(2).id == 1
    check_identity(service.statistics())


async def test_a_key_whose_repr_raises_is_enqueued_with_debug_logging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: the debug line formatted the key eagerly and raised after enqueueing."""

    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    caplog.set_level(logging.DEBUG, logger="tickler")
    logging.raiseExceptions = False  # logging reports its own formatting errors on stderr
    try:
        async with tickler.open_service(_nothing) as service:
            ticket = service.enqueue_request(1, key=NoRepr())
        assert ticket.status is tickler.Status.SUCCEEDED
    finally:
        logging.raiseExceptions = True


async def _nothing(request: int) -> None:
    pass
