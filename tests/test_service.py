"""The core service: enqueueing, dispatch, the cap, tickets and statistics."""

from __future__ import annotations

import contextvars
import gc
import inspect
import logging
import weakref
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import tickler

from .conftest import Recorder, check_identity

# Every test runs with the harness's contextvars and with none at the enqueue.
pytestmark = pytest.mark.usefixtures("enqueue_context")


async def test_requests_run_and_tickets_report_results(autojump_clock: trio.abc.Clock) -> None:
    """Each request runs once and its ticket returns the handler's result."""
    recorder = Recorder()
    async with tickler.open_service(recorder, capacity=3) as service:
        tickets = [service.enqueue_request(i) for i in range(10)]
        results = [await ticket.wait() for ticket in tickets]
    assert results == [("done", i) for i in range(10)]
    assert [t.status for t in tickets] == [tickler.Status.SUCCEEDED] * 10
    assert [t.id for t in tickets] == list(range(1, 11))
    assert all(t.attempts == 1 for t in tickets)
    stats = service.statistics()
    assert (stats.enqueued, stats.started, stats.succeeded) == (10, 10, 10)
    check_identity(stats)


def test_enqueue_request_is_a_plain_function() -> None:
    """enqueue_request never awaits: it is a plain def returning a Ticket."""
    assert not inspect.iscoroutinefunction(tickler.Service.enqueue_request)
    ticket = tickler.Service(Recorder()).enqueue_request("x")
    assert isinstance(ticket, tickler.Ticket)


async def test_enqueue_does_not_yield() -> None:
    """A burst of enqueues runs without giving any other task a turn."""
    service = tickler.Service(Recorder(), max_queue_length=None)
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        nursery.start_soon(other)
        for i in range(100):
            service.enqueue_request(i)
        assert not ran
        await service.stop()
    assert ran


async def test_timestamps_come_from_the_trio_clock(autojump_clock: trio.abc.Clock) -> None:
    """enqueued_at, started_at and finished_at are exact virtual times."""

    async def slow(request: float) -> None:
        await trio.sleep(request)

    async with tickler.open_service(slow, capacity=1) as service:
        t0 = trio.current_time()
        first = service.enqueue_request(2.0)
        second = service.enqueue_request(3.0)
        assert [first.finished_at, second.started_at] == [None, None]
        await second.wait()
    assert first.enqueued_at == second.enqueued_at == t0
    assert (first.started_at, first.finished_at) == (t0, t0 + 2.0)
    assert (second.started_at, second.finished_at) == (t0 + 2.0, t0 + 5.0)


async def test_requests_enqueued_before_run_are_processed(autojump_clock: trio.abc.Clock) -> None:
    """Requests queued before run starts are dispatched once it runs."""
    recorder = Recorder()
    service = tickler.Service(recorder, capacity=2)
    early = [service.enqueue_request(i) for i in range(5)]
    assert all(t.enqueued_at is None for t in early)
    await trio.sleep(1)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        assert [await t.wait() for t in early] == [("done", i) for i in range(5)]
        await service.stop()
    assert all(t.status is tickler.Status.SUCCEEDED for t in early)
    assert all(t.enqueued_at == 1.0 for t in early)  # stamped when the run started


def test_requests_enqueued_outside_trio_are_stamped_when_run_starts() -> None:
    """Without a Trio clock at enqueue time, enqueued_at is the run's start."""
    service = tickler.Service(Recorder())
    ticket = service.enqueue_request("early")
    assert ticket.enqueued_at is None

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            await trio.sleep(5)
            started = trio.current_time()
            await nursery.start(service.run)
            await ticket.wait()
            await service.stop()
        return started

    started = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ticket.enqueued_at == started


async def test_fifo_order_at_capacity_one(autojump_clock: trio.abc.Clock) -> None:
    """At capacity 1 handlers run in enqueue order."""
    recorder = Recorder()
    async with tickler.open_service(recorder, capacity=1) as service:
        for i in range(50):
            service.enqueue_request(i)
    assert recorder.seen == list(range(50))


async def test_never_more_than_capacity_in_flight(autojump_clock: trio.abc.Clock) -> None:
    """The cap holds however many requests wait."""

    async def handler(request: int) -> None:
        await trio.sleep(request % 3)

    running = 0
    peak = 0

    async def counted(request: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await handler(request)
        finally:
            running -= 1

    async with tickler.open_service(counted, capacity=4) as service:
        for i in range(40):
            service.enqueue_request(i)
    assert peak == 4


async def test_queue_full_is_refused_at_once() -> None:
    """At max_queue_length queued requests, enqueue raises QueueFull and counts it."""
    service = tickler.Service(Recorder(), max_queue_length=3)
    for i in range(3):
        service.enqueue_request(i)
    with pytest.raises(
        tickler.QueueFull,
        match=r"^service 'tickler' has room for 0 more requests, not 1 \(max_queue_length 3\);"
        r" none was enqueued$",
    ):
        service.enqueue_request(3)
    assert isinstance(tickler.QueueFull(), tickler.TicklerError)
    stats = service.statistics()
    assert (stats.queued, stats.rejected, stats.enqueued) == (3, 1, 3)
    check_identity(stats)


async def test_requests_in_flight_do_not_count_against_the_queue() -> None:
    """max_queue_length caps what waits, not what runs."""
    recorder = Recorder(gate=trio.Event())
    async with trio.open_nursery() as nursery:
        service = tickler.Service(recorder, capacity=2, max_queue_length=2)
        await nursery.start(service.run)
        for i in range(2):
            service.enqueue_request(i)
        await trio.testing.wait_all_tasks_blocked()
        assert service.statistics().in_flight == 2
        service.enqueue_request(2)
        service.enqueue_request(3)
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request(4)
        assert recorder.gate is not None
        recorder.gate.set()
        await service.stop()


async def test_unbounded_queue() -> None:
    """max_queue_length=None never refuses for length."""
    service = tickler.Service(Recorder(), max_queue_length=None)
    for i in range(20_000):
        service.enqueue_request(i)
    assert service.statistics().max_queue_length is None
    assert service.statistics().queued == 20_000


async def test_burst_of_enqueues_wakes_the_loop_once() -> None:
    """1,000 enqueues without yielding cost one supervisor wake-up."""
    recorder = Recorder(gate=trio.Event())
    async with trio.open_nursery() as nursery:
        service = tickler.Service(recorder, capacity=5, max_queue_length=None)
        await nursery.start(service.run)
        await trio.testing.wait_all_tasks_blocked()
        before = service.statistics().wakeups
        for i in range(1000):
            service.enqueue_request(i)
        await trio.testing.wait_all_tasks_blocked()
        stats = service.statistics()
        assert stats.wakeups == before + 1
        assert (stats.in_flight, stats.queued) == (5, 995)
        assert recorder.gate is not None
        recorder.gate.set()
        await service.stop()


async def test_the_peak_counts_requests_ranked_by_priority(
    autojump_clock: trio.abc.Clock,
) -> None:
    """peak_queued is the most ever queued, also when they waited ranked by priority and
    were all gone before statistics() was read."""
    async with tickler.open_service(Recorder(), capacity=6) as service:
        for i in range(6):  # all six before the loop runs
            service.enqueue_request(i, priority=1)
        await service.stop()
    stats = service.statistics()
    assert (stats.queued, stats.succeeded) == (0, 6)
    assert stats.peak_queued == 6


async def test_the_peak_counts_requests_held_for_their_group(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Requests held for their group's limit are queued too: the peak counts them."""
    gate = trio.Event()
    async with tickler.open_service(
        Recorder(gate=gate), capacity=2, limits=tickler.Limit(concurrency=1)
    ) as service:
        for i in range(3):
            service.enqueue_request(i, group="g")
        await trio.testing.wait_all_tasks_blocked()  # one runs, two are held
        for i in range(4):
            service.enqueue_request(10 + i)  # the first takes the free slot
        await trio.testing.wait_all_tasks_blocked()
        assert (service.statistics().queued, service.statistics().in_flight) == (5, 2)
        gate.set()
        await service.stop()
    stats = service.statistics()
    assert (stats.queued, stats.succeeded) == (0, 7)
    assert stats.peak_queued == 6  # four plain and two held, just before that take


async def test_statistics_are_frozen_and_consistent() -> None:
    """statistics() is a frozen value satisfying the counter identity."""
    recorder = Recorder(gate=trio.Event())
    async with trio.open_nursery() as nursery:
        service = tickler.Service(recorder, capacity=2, max_queue_length=5)
        await nursery.start(service.run)
        for i in range(4):
            service.enqueue_request(i)
        await trio.testing.wait_all_tasks_blocked()
        stats = service.statistics()
        with pytest.raises(AttributeError):
            stats.queued = 0  # type: ignore[misc]
        assert (stats.queued, stats.in_flight, stats.capacity, stats.max_queue_length) == (
            2,
            2,
            2,
            5,
        )
        assert stats.peak_queued == 4
        check_identity(stats)
        assert recorder.gate is not None
        recorder.gate.set()
        await service.stop()
    stats = service.statistics()
    assert (stats.succeeded, stats.queued, stats.in_flight) == (4, 0, 0)
    check_identity(stats)


async def test_raising_capacity_starts_waiting_requests_at_once() -> None:
    """A higher cap fills its new slots without waiting for a completion."""
    recorder = Recorder(gate=trio.Event())
    async with trio.open_nursery() as nursery:
        service = tickler.Service(recorder, capacity=2)
        await nursery.start(service.run)
        for i in range(10):
            service.enqueue_request(i)
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.running == 2
        service.capacity = 6
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.running == 6
        assert service.statistics().in_flight == 6
        assert recorder.gate is not None
        recorder.gate.set()
        await service.stop()


async def test_lowering_capacity_cancels_nothing_and_delays_starts(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Below the new cap nothing starts; running work finishes normally."""
    concurrency: list[int] = []
    running = 0

    async def handler(request: int) -> int:
        nonlocal running
        running += 1
        concurrency.append(running)
        try:
            await trio.sleep(1 + request)
        finally:
            running -= 1
        return request

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=4)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(8)]
        await trio.testing.wait_all_tasks_blocked()
        assert running == 4
        service.capacity = 1
        await trio.sleep(0.5)
        assert running == 4  # nothing was cancelled
        # Completions at t=1, 2, 3 leave 3, 2, 1 running: no new start yet.
        await trio.sleep(3.0)
        assert running == 1
        assert service.statistics().queued == 4
        await service.stop()
    assert [t.status for t in tickets] == [tickler.Status.SUCCEEDED] * 8
    assert max(concurrency[4:]) == 1


async def test_handler_error_fails_the_request_not_the_service(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An Exception marks its request FAILED; the other requests carry on."""
    calls: list[tuple[int, str]] = []

    def on_error(ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
        calls.append((ticket.id, str(exc)))

    recorder = Recorder(fail=lambda r: r % 2 == 1)
    async with tickler.open_service(recorder, capacity=2, on_error=on_error) as service:
        tickets = [service.enqueue_request(i) for i in range(4)]
    assert [t.status for t in tickets] == [
        tickler.Status.SUCCEEDED,
        tickler.Status.FAILED,
        tickler.Status.SUCCEEDED,
        tickler.Status.FAILED,
    ]
    with pytest.raises(ValueError, match=r"^failed 1$"):
        await tickets[1].wait()
    assert calls == [(2, "failed 1"), (4, "failed 3")]
    stats = service.statistics()
    assert (stats.succeeded, stats.failed) == (2, 2)
    check_identity(stats)


async def test_default_on_error_logs_with_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Without on_error, a final failure is logged on 'tickler' with its traceback."""

    async def broken(request: object) -> None:
        raise KeyError("missing thing")

    with caplog.at_level(logging.ERROR, logger="tickler"):
        async with tickler.open_service(broken) as service:
            ticket = service.enqueue_request("x")
    assert ticket.status is tickler.Status.FAILED
    [record] = [r for r in caplog.records if r.name == "tickler"]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert message.startswith("request #1 failed after 1 attempt(s)\nTraceback")
    assert "KeyError: 'missing thing'" in message
    assert "in broken" in message


async def test_on_error_that_raises_is_logged_and_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hook's own error is logged; the service and later requests are unaffected."""

    def bad_hook(ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
        raise RuntimeError("hook broke")

    recorder = Recorder(fail=lambda r: r == 0)
    with caplog.at_level(logging.ERROR, logger="tickler"):
        async with tickler.open_service(recorder, on_error=bad_hook) as service:
            first = service.enqueue_request(0)
            await trio.testing.wait_all_tasks_blocked()
            second = service.enqueue_request(1)
            assert await second.wait() == ("done", 1)
    assert first.status is tickler.Status.FAILED
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("on_error hook raised for request #1") and "hook broke" in m for m in messages
    )


async def test_non_awaitable_result_fails_with_type_error() -> None:
    """A handler that returns a non-awaitable fails that request with TypeError."""

    def sync_handler(request: int) -> int:
        return request

    handler: Any = sync_handler  # not an async function: what this test is about
    async with tickler.open_service(handler, on_error=lambda t, e: None) as service:
        ticket = service.enqueue_request(5)
        with pytest.raises(TypeError, match=r"^handler must return an awaitable, not int$"):
            await ticket.wait()
        later = service.enqueue_request(6)
        with pytest.raises(TypeError):
            await later.wait()
    assert service.statistics().failed == 2


async def test_awaitable_objects_are_accepted() -> None:
    """A handler may return any awaitable, not only a coroutine."""

    class Later:
        def __init__(self, value: int) -> None:
            self.value = value

        def __await__(self) -> Any:
            yield from trio.lowlevel.checkpoint().__await__()
            return self.value * 2

    async with tickler.open_service(Later) as service:
        assert await service.enqueue_request(21).wait() == 42


class Crash(BaseException):
    """A BaseException that is not an Exception."""


async def test_base_exception_propagates_out_of_the_service() -> None:
    """A handler's BaseException ends the run and reaches the caller."""

    async def crashing(request: object) -> None:
        await trio.lowlevel.checkpoint()
        raise Crash

    service = tickler.Service(crashing, capacity=1)
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            ticket = service.enqueue_request("x")
            queued = service.enqueue_request("y")
            await trio.sleep_forever()
    assert info.group_contains(Crash)
    assert ticket.status is tickler.Status.FAILED
    assert queued.status is tickler.Status.CANCELLED
    assert service.closed
    check_identity(service.statistics())


async def test_cancellation_is_never_swallowed(autojump_clock: trio.abc.Clock) -> None:
    """Cancelling the run cancels the handlers, and the cancel reaches its scope."""

    async def forever(request: object) -> None:
        await trio.sleep_forever()

    service = tickler.Service(forever, capacity=1)
    running = service.enqueue_request(1)
    waiting = service.enqueue_request(2)
    with trio.move_on_after(3) as scope:
        await service.run()
    assert scope.cancelled_caught
    assert trio.current_time() == 3
    assert running.status is tickler.Status.CANCELLED
    assert running.finished_at == 3
    assert waiting.status is tickler.Status.CANCELLED
    with pytest.raises(tickler.RequestCancelled, match=r"^request #1 was cancelled$"):
        await running.wait()
    with pytest.raises(tickler.ServiceClosed):
        service.enqueue_request(3)
    assert await service.stop() == [running, waiting]


async def test_run_twice_is_refused() -> None:
    """A service runs once."""
    service = tickler.Service(Recorder())
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        with pytest.raises(RuntimeError, match=r"^service 'tickler' has already run$"):
            await service.run()
        await service.stop()


var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


async def test_handlers_see_the_enqueuers_contextvars() -> None:
    """Each handler runs with the contextvars of the code that enqueued it."""

    async def handler(request: str) -> str:
        await trio.lowlevel.checkpoint()
        return var.get()

    async with tickler.open_service(handler, capacity=1) as service:
        var.set("supervisor's")  # set after the service started: not the enqueuer's below
        tickets: list[tickler.Ticket[Any, Any]] = []

        async def enqueue_with(value: str) -> None:
            var.set(value)
            tickets.append(service.enqueue_request(value))

        async with trio.open_nursery() as nursery:
            for value in ("a", "b", "c"):
                nursery.start_soon(enqueue_with, value)
        var.set("main")
        tickets.append(service.enqueue_request("main"))
        results = {t.request: await t.wait() for t in tickets}
    assert results == {"a": "a", "b": "b", "c": "c", "main": "main"}


async def test_a_handlers_contextvar_changes_do_not_leak() -> None:
    """Changes a handler makes are invisible to the next handler in the same processor."""

    async def handler(request: str) -> str:
        seen = var.get()
        var.set(f"leaked by {request}")
        await trio.lowlevel.checkpoint()
        return seen

    async with tickler.open_service(handler, capacity=1) as service:
        plain = [service.enqueue_request(f"p{i}") for i in range(3)]
        token = var.set("mine")
        marked = service.enqueue_request("m")
        var.reset(token)
        after = service.enqueue_request("q")
        assert [await t.wait() for t in plain] == ["unset"] * 3
        assert await marked.wait() == "mine"
        assert await after.wait() == "unset"
    assert var.get() == "unset"


async def test_contextvars_of_a_failing_handler_do_not_leak() -> None:
    """A handler that sets a var and raises leaves the next one clean."""

    async def handler(request: str) -> str:
        seen = var.get()
        var.set("dirty")
        if request == "bad":
            raise ValueError(request)
        return seen

    async with tickler.open_service(handler, capacity=1, on_error=lambda t, e: None) as service:
        bad = service.enqueue_request("bad")
        good = service.enqueue_request("good")
        assert await good.wait() == "unset"
    assert bad.status is tickler.Status.FAILED


class Request:
    """A request object that can be weakly referenced."""


async def test_service_keeps_no_reference_to_finished_requests() -> None:
    """Once a request is final and its ticket dropped, the request is freed."""

    async def handler(request: Request) -> str:
        await trio.lowlevel.checkpoint()
        return "ok"

    async with tickler.open_service(handler, capacity=2) as service:
        refs = []
        for _ in range(5):
            request = Request()
            refs.append(weakref.ref(request))
            ticket = service.enqueue_request(request)
            del request
        await ticket.wait()
        del ticket
        await trio.testing.wait_all_tasks_blocked()
        # Successes form no reference cycles: no collection needed.
        assert [r() for r in refs] == [None] * 5


async def test_failed_and_logged_requests_are_freed(caplog: pytest.LogCaptureFixture) -> None:
    """Failures, retries and DEBUG log records keep no request alive."""

    async def handler(request: Request) -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("no")

    refs = []
    with caplog.at_level(logging.DEBUG, logger="tickler"):
        async with tickler.open_service(
            handler, retry=tickler.Retry(attempts=2, initial=0, jitter=False)
        ) as service:
            for _ in range(3):
                request = Request()
                refs.append(weakref.ref(request))
                service.enqueue_request(request)
                del request
    assert service.statistics().failed == 3
    assert len(caplog.records) > 10  # the records are still held
    gc.collect()
    assert [r() for r in refs] == [None] * 3


async def test_ticket_result_before_completion_is_an_error() -> None:
    """result() on a ticket that is not final says so."""
    ticket = tickler.Service(Recorder()).enqueue_request("x")
    with pytest.raises(RuntimeError, match=r"^request #1 is queued, not final$"):
        ticket.result()
    assert not ticket.done


def test_reprs_show_live_state() -> None:
    """Service and Ticket reprs help debugging."""
    service = tickler.Service(Recorder(), capacity=3, name="mail")
    ticket = service.enqueue_request("hello")
    assert repr(service) == "<tickler.Service 'mail' 0/3 in flight, 1 queued, 0 retrying>"
    assert repr(ticket) == "<tickler.Ticket #1 queued attempts=0 request='hello'>"


async def test_due_retry_without_a_free_slot_waits_quietly(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Regression: a due retry with every slot busy must not spin the supervisor loop."""
    gate = trio.Event()

    async def handler(request: str) -> str:
        if request == "flaky":
            raise ValueError("try again")
        await gate.wait()
        return request

    async with trio.open_nursery() as nursery:
        service = tickler.Service(
            handler, capacity=1, retry=tickler.Retry(attempts=2, initial=0.5, jitter=False)
        )
        await nursery.start(service.run)
        flaky = service.enqueue_request("flaky")
        holder = service.enqueue_request("holder")
        await trio.testing.wait_all_tasks_blocked()
        assert flaky.status is tickler.Status.RETRYING
        mock_clock.jump(1.0)  # the retry is now due, but "holder" keeps the only slot
        for _ in range(5):  # let the loop's timer fire
            await trio.lowlevel.checkpoint()
        before = service.statistics().wakeups
        for _ in range(20):
            await trio.lowlevel.checkpoint()
        assert service.statistics().wakeups == before
        gate.set()
        assert await holder.wait() == "holder"
        with pytest.raises(ValueError, match="try again"):
            await flaky.wait()
        assert flaky.attempts == 2
        await service.stop()


async def test_handlers_that_never_yield_cannot_starve_other_tasks() -> None:
    """A processor chaining non-yielding handlers still gives the scheduler regular turns."""

    async def instant(request: int) -> int:
        return request

    turns = 0
    done = False

    async def watcher() -> None:
        nonlocal turns
        while not done:
            await trio.lowlevel.checkpoint()
            turns += 1

    async with trio.open_nursery() as nursery:
        service = tickler.Service(instant, capacity=1, max_queue_length=None)
        await nursery.start(service.run)
        nursery.start_soon(watcher)
        tickets = [service.enqueue_request(i) for i in range(1000)]
        await tickets[-1].wait()
        done = True
        await service.stop()
    # One processor ran all 1000; it yielded at least once every 64 requests.
    assert service.statistics().succeeded == 1000
    assert turns >= 1000 // 64


async def test_an_idle_service_reuses_parked_processors() -> None:
    """A processor with no work parks, and the loop hands it the next start instead of spawning."""
    tasks: list[trio.lowlevel.Task] = []

    async def handler(request: int) -> None:
        tasks.append(trio.lowlevel.current_task())
        await trio.lowlevel.checkpoint()

    async with tickler.open_service(handler, capacity=3) as service:
        for i in range(5):
            await service.enqueue_request(i).wait()
            await trio.testing.wait_all_tasks_blocked()  # idle again between requests
    assert len(tasks) == 5
    assert len(set(tasks)) == 1


async def test_parked_processors_never_outnumber_the_cap() -> None:
    """After a burst, at most `capacity` idle processors stay parked; stop releases them."""
    gate = trio.Event()

    async def handler(request: int) -> None:
        await gate.wait()

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=4)
        await nursery.start(service.run)
        for i in range(4):
            service.enqueue_request(i)
        await trio.testing.wait_all_tasks_blocked()
        service.capacity = 2
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        [service_nursery] = [
            child for task in nursery.child_tasks for child in task.child_nurseries
        ]
        # Four processors finished; two stay parked (the loop runs in run's own task).
        assert len(service_nursery.child_tasks) == 2
        await service.stop()
        assert service_nursery.child_tasks == frozenset()


async def test_timestamps_agree_with_the_default_trio_clock() -> None:
    """With Trio's own clock (read without a call on the hot paths) times still order exactly."""
    before = trio.current_time()
    async with tickler.open_service(Recorder()) as service:
        ticket = service.enqueue_request(1)
        await ticket.wait()
    after = trio.current_time()
    assert ticket.enqueued_at is not None
    assert ticket.started_at is not None
    assert ticket.finished_at is not None
    assert before <= ticket.enqueued_at <= ticket.started_at <= ticket.finished_at <= after


def test_an_enqueued_ticket_has_every_field_set() -> None:
    """enqueue_request builds tickets field by field: no field of Ticket may be left out."""
    service = tickler.Service(Recorder())
    ticket = service.enqueue_request("x")
    for field in attrs.fields(tickler.Ticket):
        getattr(ticket, field.name)  # raises AttributeError for a slot never set
    assert (ticket.request, ticket.id, ticket.status, ticket.attempts) == (
        "x",
        1,
        tickler.Status.QUEUED,
        0,
    )
    assert (ticket.enqueued_at, ticket.started_at, ticket.finished_at) == (None, None, None)
