"""Promises that hold under misuse, cancellation, crashes and every context.

Each test guards one behaviour that once broke; its docstring names the old
failure. Every test runs twice (see ``enqueue_context``): with the harness's
contextvars at the enqueue, and with none, the path a plain Trio service takes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import logging
import math
import threading
import time
import types
import weakref
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import trio
import trio.testing

import tickler

from .conftest import HARNESS_VARIABLES, check_identity

pytestmark = pytest.mark.usefixtures("enqueue_context")


async def work(request: Any) -> Any:
    await trio.lowlevel.checkpoint()
    return ("done", request)


async def test_the_no_contextvars_mode_enqueues_with_no_contextvars(enqueue_context: str) -> None:
    """The fixture's two modes really reach the handler with and without contextvars."""

    async def handler(request: object) -> set[str]:
        await trio.lowlevel.checkpoint()
        return {var.name for var in contextvars.copy_context()}

    async with tickler.open_service(handler) as service:
        seen = await service.enqueue_request(None).wait()
    assert seen == (set() if enqueue_context == "no contextvars" else set(HARNESS_VARIABLES))


# -- a handler's failure stays that request's failure ----------------------------


async def _arity_two(first: object, second: object) -> None:
    await trio.lowlevel.checkpoint()


def _validating(request: str) -> Any:
    if request.startswith("bad"):
        raise ValueError(f"refused {request}")
    return work(request)


async def test_a_handler_that_raises_when_called_fails_only_its_own_request() -> None:
    """A sync wrapper raising before it returns an awaitable fails that request alone.

    Regression: the run died with UnboundLocalError and cancelled every other request.
    """
    errors: list[tuple[int, Exception]] = []
    async with tickler.open_service(
        _validating, capacity=2, on_error=lambda t, e: errors.append((t.id, e))
    ) as service:
        tickets = [service.enqueue_request(r) for r in ("a", "bad1", "b", "bad2", "c")]
        results = []
        for ticket in tickets:
            try:
                results.append(await ticket.wait())
            except ValueError as exc:
                results.append(str(exc))
    assert results == [("done", "a"), "refused bad1", ("done", "b"), "refused bad2", ("done", "c")]
    assert [(i, str(e)) for i, e in errors] == [(2, "refused bad1"), (4, "refused bad2")]
    stats = service.statistics()
    assert (stats.succeeded, stats.failed, stats.cancelled) == (3, 2, 0)


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param(_arity_two, id="async def with the wrong arity"),
        pytest.param(functools.partial(work, 1, 2), id="bad functools.partial"),  # type: ignore[call-arg]
    ],
)
async def test_a_handler_that_cannot_be_called_fails_each_request_with_its_type_error(
    handler: Any,
) -> None:
    """Every request fails with the TypeError of the call; the service keeps running."""
    async with tickler.open_service(handler, on_error=lambda t, e: None) as service:
        tickets = [service.enqueue_request(i) for i in range(3)]
        for ticket in tickets:
            with pytest.raises(TypeError, match="positional argument"):
                await ticket.wait()
        assert not service.closed
    stats = service.statistics()
    assert (stats.failed, stats.cancelled) == (3, 0)
    check_identity(stats)


class DelegatingAwaitable:
    """An awaitable object whose ``__await__`` delegates to a coroutine."""

    awaits = 0

    def __init__(self, request: int) -> None:
        self.request = request

    def __await__(self) -> Generator[Any, None, Any]:
        type(self).awaits += 1
        return work(self.request).__await__()


async def test_an_awaitable_handler_result_is_awaited_exactly_once() -> None:
    """``__await__`` is called once per attempt, and no coroutine is left never awaited.

    Regression: on the no-contextvars path ``__await__`` ran twice, with a
    "never awaited" warning (an error under this suite's filterwarnings).
    """
    DelegatingAwaitable.awaits = 0
    async with tickler.open_service(DelegatingAwaitable) as service:
        tickets = [service.enqueue_request(i) for i in range(5)]
        assert [await t.wait() for t in tickets] == [("done", i) for i in range(5)]
    gc.collect()  # a coroutine never awaited would warn when collected
    assert DelegatingAwaitable.awaits == 5


class PlainIteratorAwaitable:
    """An awaitable whose ``__await__`` returns a plain iterator, not a generator."""

    def __init__(self, request: int) -> None:
        self.request = request

    def __await__(self) -> Iterator[Any]:
        return iter(())


async def test_an_awaitable_returning_a_plain_iterator_works_on_every_path() -> None:
    """The result is the iterator's return value (None) with and without contextvars."""
    handler: Any = PlainIteratorAwaitable
    async with tickler.open_service(handler) as service:
        tickets = [service.enqueue_request(i) for i in range(3)]
        assert [await t.wait() for t in tickets] == [None, None, None]
    assert service.statistics().succeeded == 3


async def _async_hook(ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
    await trio.lowlevel.checkpoint()


class _AsyncCallable:
    async def __call__(self, ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize(
    "hook",
    [
        pytest.param(_async_hook, id="async def"),
        pytest.param(_AsyncCallable(), id="object with an async __call__"),
        pytest.param(functools.partial(_async_hook), id="partial of an async def"),
    ],
)
async def test_an_async_on_error_is_refused_at_construction(hook: Any) -> None:
    """Regression: its coroutine was silently dropped, and never awaited."""
    message = r"^on_error must be a plain function, not an async function$"
    with pytest.raises(TypeError, match=message):
        tickler.Service(work, on_error=hook)
    with pytest.raises(TypeError, match=message):
        async with tickler.open_service(work, on_error=hook):
            pass  # pragma: no cover - refused before the block


async def test_an_on_error_that_returns_an_awaitable_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain hook that returns a coroutine gets an error logged, and the coroutine is closed."""

    async def failing(request: object) -> None:
        raise ValueError("boom")

    def hook(ticket: tickler.Ticket[Any, Any], exc: Exception) -> Any:
        return _async_hook(ticket, exc)

    async with tickler.open_service(failing, on_error=hook) as service:
        ticket = service.enqueue_request(1)
        with pytest.raises(ValueError, match=r"^boom$"):
            await ticket.wait()
    gc.collect()  # an unclosed coroutine would warn when collected
    [record] = [r for r in caplog.records if r.name == "tickler"]
    assert "on_error hook raised for request #1" in record.getMessage()
    assert "on_error returned an awaitable; it must be a plain function" in record.getMessage()


async def test_waiting_from_another_trio_run_is_an_error_that_spares_the_service() -> None:
    """A ``wait()`` in another thread's ``trio.run`` raises there when the request is final.

    The service and its other requests are unaffected.

    Regression: the service's run died with an AssertionError from Trio and a
    bystander request was cancelled.
    """
    gate = trio.Event()

    async def held(request: str) -> str:
        await gate.wait()
        return request

    async with tickler.open_service(held, capacity=2) as service:
        ticket = service.enqueue_request("awaited elsewhere")
        bystander = service.enqueue_request("bystander")

        async def wait_elsewhere() -> str:
            try:
                await ticket.wait()
            except RuntimeError as exc:
                return str(exc)
            return "no error"  # pragma: no cover - the assertion below reports it

        async with trio.open_nursery() as nursery:

            async def wait_in_a_thread() -> None:
                messages.append(await trio.to_thread.run_sync(trio.run, wait_elsewhere))

            messages: list[str] = []
            nursery.start_soon(wait_in_a_thread)
            while type(ticket._state).__name__ != "Waiting":  # the other run waits
                await trio.sleep(0.001)
            gate.set()
            assert await ticket.wait() == "awaited elsewhere"
            assert await bystander.wait() == "bystander"
        [message] = messages
        assert message.startswith("Ticket.wait() for request #1 called from a different trio.run")
    assert service.statistics().succeeded == 2


async def test_a_waiter_in_another_run_before_the_service_runs_gets_the_error() -> None:
    """Waiting before the service runs, from a run it then does not run in, errs on completion."""
    service = tickler.Service(work)
    ticket = service.enqueue_request("early")
    outcome: list[str] = []
    parked = threading.Event()

    async def wait_elsewhere() -> None:
        async def report_parked() -> None:
            await trio.testing.wait_all_tasks_blocked()
            parked.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report_parked)
            try:
                await ticket.wait()
            except RuntimeError as exc:
                outcome.append(str(exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, trio.run, wait_elsewhere)
        await trio.to_thread.run_sync(parked.wait)
        await nursery.start(service.run)
        assert await ticket.wait() == ("done", "early")
        await service.stop()
    [message] = outcome
    assert message.startswith("Ticket.wait() for request #1 called from a different trio.run")


# -- stop, cancel and crash mean what the README says ------------------------------


async def test_stop_called_from_a_handler_waits_for_the_rest_but_not_for_itself(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A handler's ``stop()`` drains everything else, then returns while its handler runs.

    Regression: it hung forever.
    """
    returned: list[float] = []

    async def handler(request: str | float) -> str:
        if request == "stopper":
            await service.stop()
            returned.append(trio.current_time())
            await trio.sleep(1)
            return "stopper done"
        assert isinstance(request, float)
        await trio.sleep(request)
        return "slept"

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=2)
        await nursery.start(service.run)
        stopper = service.enqueue_request("stopper")
        others = [service.enqueue_request(3.0) for _ in range(3)]
        assert await service.stop() == []
        finished = trio.current_time()
    # The stopper's slot was busy, so the three 3-second sleeps ran one after
    # another in the other slot: done at 9, when the stop returned in the handler.
    assert returned == [9.0]
    assert finished == 10.0
    assert await stopper.wait() == "stopper done"
    assert [t.status for t in others] == [tickler.Status.SUCCEEDED] * 3


async def test_stop_without_drain_from_a_handler_cancels_the_queue_and_returns_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``stop(drain=False)`` from inside cancels what waits and returns it, not itself."""
    returned: list[list[tickler.Ticket[Any, Any]]] = []

    async def handler(request: str) -> str:
        if request == "stopper":
            returned.append(await service.stop(drain=False))
        else:
            await trio.sleep(1)
        return request

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=2)
        await nursery.start(service.run)
        running = service.enqueue_request("running")
        await trio.testing.wait_all_tasks_blocked()  # it runs before the stop
        stopper = service.enqueue_request("stopper")
        queued = [service.enqueue_request(f"q{i}") for i in range(3)]
        assert await stopper.wait() == "stopper"
        assert service.closed
        await service.stop()
    assert returned == [queued]
    assert trio.current_time() == 1.0
    assert await running.wait() == "running"
    assert [t.status for t in queued] == [tickler.Status.CANCELLED] * 3


async def test_open_service_ends_while_a_handler_is_in_stop(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The block's own drain and a handler's stop() both return; nothing hangs."""

    async def handler(request: str) -> str:
        if request == "stopper":
            await tickler_service.stop(timeout=100)
        await trio.sleep(2)
        return request

    async with tickler.open_service(handler, capacity=2) as tickler_service:
        tickets = [tickler_service.enqueue_request(r) for r in ("stopper", "a", "b")]
        await trio.sleep(1)  # the stopper is in stop() when the block ends
    assert trio.current_time() == 6.0  # a at 2, b at 4, then the stopper's own 2 seconds
    assert [await t.wait() for t in tickets] == ["stopper", "a", "b"]


async def test_a_handlers_stop_timeout_cancels_everything_by_its_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The deadline of a stop called from a handler cancels all that runs, its caller too."""

    async def handler(request: str) -> str:
        if request == "stopper":
            await tickler_service.stop(timeout=3)
            return "returned"  # pragma: no cover - the deadline cancels the caller first
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async with trio.open_nursery() as nursery:
        tickler_service = tickler.Service(handler, capacity=2)
        await nursery.start(tickler_service.run)
        stopper = tickler_service.enqueue_request("stopper")
        forever = tickler_service.enqueue_request("forever")
        await trio.testing.wait_all_tasks_blocked()  # the handler's stop came first
        assert tickler_service.closed
        cancelled = await tickler_service.stop()
    assert trio.current_time() == 3.0
    assert cancelled == [stopper, forever]


async def test_a_stop_keeps_its_deadline_when_its_first_caller_is_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The deadline belongs to the stop: a later ``stop()`` returns by it.

    Regression: after the first caller was cancelled, both calls hung forever.
    """

    async def forever(request: object) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        service = tickler.Service(forever)
        await nursery.start(service.run)
        ticket = service.enqueue_request("x")
        with trio.move_on_after(1):
            await service.stop(timeout=10)
        assert trio.current_time() == 1.0
        assert await service.stop() == [ticket]
        assert trio.current_time() == 10.0
    assert ticket.status is tickler.Status.CANCELLED


started: list[int] = []


async def _instant(request: int) -> int:
    """A handler that never yields."""
    started.append(request)
    return request


async def test_no_request_starts_after_the_runs_scope_is_cancelled() -> None:
    """Handlers that never yield stop being started the instant the run is cancelled.

    Regression: 5,000 of 5,000 queued requests still succeeded after the cancel.
    """
    started.clear()
    service = tickler.Service(_instant, capacity=1, max_queue_length=None)
    tickets = [service.enqueue_request(i) for i in range(5000)]
    at_cancel: list[int] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)

            async def cancel_once_running() -> None:
                while not started:
                    await trio.lowlevel.checkpoint()
                at_cancel.append(len(started))
                scope.cancel()

            nursery.start_soon(cancel_once_running)
    [count] = at_cancel
    assert 0 < count < 5000
    assert len(started) == count
    stats = service.statistics()
    assert (stats.succeeded, stats.cancelled, stats.started) == (count, 5000 - count, count)
    assert all(t.status is tickler.Status.CANCELLED for t in tickets[count:])
    check_identity(stats)


async def test_no_request_starts_after_a_handler_raises_a_base_exception() -> None:
    """A KeyboardInterrupt from one handler ends the run; no other processor starts more."""
    started.clear()

    async def handler(request: int) -> int:
        started.append(request)
        if request == 100:
            raise KeyboardInterrupt
        return request

    service = tickler.Service(handler, capacity=2, max_queue_length=None)
    tickets = [service.enqueue_request(i) for i in range(5000)]
    with pytest.RaisesGroup(KeyboardInterrupt, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
    assert 100 in started
    # Requests started before #100 failed, in order; none started after it.
    assert started[-1] == 100
    assert tickets[100].status is tickler.Status.FAILED
    stats = service.statistics()
    assert stats.started == len(started)
    assert stats.cancelled == 5000 - len(started)
    check_identity(stats)


def _is_queued(ticket: tickler.Ticket[Any, Any]) -> bool:
    return ticket.status is tickler.Status.QUEUED


async def test_stop_without_drain_never_starts_a_request_handed_to_a_parked_processor() -> None:
    """A request handed to a parked processor but not yet started is cancelled by the stop.

    Regression: the processor woke after the stop and ran it.
    """
    ran: list[str] = []

    async def handler(request: str) -> None:
        ran.append(request)
        await trio.lowlevel.checkpoint()

    for _ in range(100):
        ran.clear()
        async with trio.open_nursery() as nursery:
            service = tickler.Service(handler, capacity=1)
            await nursery.start(service.run)
            await service.enqueue_request("warm-up").wait()
            await trio.testing.wait_all_tasks_blocked()  # its processor is parked
            ticket = service.enqueue_request("handed")
            # Let the loop hand the request over, and catch it before it starts.
            while service.statistics().queued and ticket.status is tickler.Status.QUEUED:
                await trio.lowlevel.cancel_shielded_checkpoint()
            if not _is_queued(ticket):
                await service.stop()
                continue  # the processor started first this time; try again
            assert service.statistics().in_flight == 1  # handed, not started
            assert await service.stop(drain=False) == [ticket]
            break
    else:  # pragma: no cover - Trio's scheduler order made it impossible to catch
        pytest.fail("never caught a handed request before its start")
    assert ticket.status is tickler.Status.CANCELLED
    assert ticket.attempts == 0
    assert "handed" not in ran
    check_identity(service.statistics())


async def test_tickets_cancelled_by_a_stop_before_run_have_a_finish_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Regression: ``finished_at`` was None; the stop runs inside Trio and has its clock."""
    await trio.sleep(5)
    service = tickler.Service(work)
    ticket = service.enqueue_request(1)
    assert await service.stop() == [ticket]
    assert ticket.finished_at == 5.0
    assert ticket.enqueued_at is None  # it never reached a run


# -- context and memory ---------------------------------------------------------------

origin: contextvars.ContextVar[str] = contextvars.ContextVar("origin", default="unset")
scratch: contextvars.ContextVar[str] = contextvars.ContextVar("scratch", default="clean")


async def test_a_handlers_writes_reach_no_other_request_hook_or_log_record(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Writes stay with their attempt; ``on_error`` and log lines run in the request's context.

    Regression: on the no-contextvars path a handler's writes stayed in the
    processor, and the next request's ``on_error`` saw them.
    """
    seen: list[tuple[str, str, str]] = []
    hooks: list[tuple[int, str, str]] = []
    logged: list[tuple[int, str, str]] = []

    async def handler(request: str) -> str:
        seen.append((request, origin.get(), scratch.get()))
        origin.set(f"overwritten by {request}")
        scratch.set(f"written by {request}")
        if request.startswith("fail"):
            raise ValueError(request)
        await trio.lowlevel.checkpoint()
        return request

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append((record.levelno, origin.get(), scratch.get()))

    def on_error(ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
        hooks.append((ticket.id, origin.get(), scratch.get()))

    capture = Capture(logging.INFO)
    tickler_logger = logging.getLogger("tickler")
    level = tickler_logger.level
    tickler_logger.addHandler(capture)
    tickler_logger.setLevel(logging.INFO)
    try:
        retry = tickler.Retry(attempts=2, initial=0, jitter=False)
        async with tickler.open_service(
            handler, capacity=1, retry=retry, on_error=on_error
        ) as service:

            def enqueue_from(value: str | None, request: str) -> tickler.Ticket[Any, Any]:
                def enqueue() -> tickler.Ticket[Any, Any]:
                    if value is not None:
                        origin.set(value)
                    return service.enqueue_request(request)

                return contextvars.copy_context().run(enqueue)

            tickets = [
                enqueue_from(None, "fail-plain"),
                enqueue_from(None, "plain"),
                enqueue_from("A", "fail-a"),
                enqueue_from("A", "a"),
                enqueue_from("B", "b"),
                enqueue_from(None, "plain-again"),
            ]
            for ticket in tickets:
                with contextlib.suppress(ValueError):
                    await ticket.wait()
    finally:
        tickler_logger.removeHandler(capture)
        tickler_logger.setLevel(level)
    # Every attempt, retries included, starts from its enqueuer's values. (A
    # retry due at once runs before the requests queued after it.)
    assert seen == [
        ("fail-plain", "unset", "clean"),
        ("fail-plain", "unset", "clean"),
        ("plain", "unset", "clean"),
        ("fail-a", "A", "clean"),
        ("fail-a", "A", "clean"),
        ("a", "A", "clean"),
        ("b", "B", "clean"),
        ("plain-again", "unset", "clean"),
    ]
    # Hooks and tickler's log lines see their own request's context, its
    # handler's writes included, and never another request's.
    assert hooks == [
        (1, "overwritten by fail-plain", "written by fail-plain"),
        (3, "overwritten by fail-a", "written by fail-a"),
    ]
    retry_lines = [(o, s) for level, o, s in logged if level == logging.INFO]
    assert sorted(retry_lines) == [
        ("overwritten by fail-a", "written by fail-a"),
        ("overwritten by fail-plain", "written by fail-plain"),
    ]
    assert origin.get() == "unset"
    assert scratch.get() == "clean"


async def test_handlers_see_their_enqueuers_very_objects_never_equal_copies() -> None:
    """Requests whose contexts hold equal but distinct values each see their own object."""

    class Equal:
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Equal)

        __hash__ = object.__hash__

    tag: contextvars.ContextVar[Equal] = contextvars.ContextVar("tag")

    async def handler(request: int) -> Equal:
        await trio.lowlevel.checkpoint()
        return tag.get()

    values = [Equal() for _ in range(4)]
    async with tickler.open_service(handler, capacity=1) as service:

        def enqueue(request: int) -> tickler.Ticket[Any, Any]:
            tag.set(values[request // 2])
            first = service.enqueue_request(request)
            assert service.enqueue_request(request + 1000).request == request + 1000
            return first

        tickets = [contextvars.copy_context().run(enqueue, i) for i in range(8)]
        results = [await t.wait() for t in tickets]
    assert [id(r) for r in results] == [id(values[i // 2]) for i in range(8)]


async def test_a_final_ticket_can_be_awaited_from_another_trio_run() -> None:
    """Only waiting for an unfinished request needs the service's run."""
    async with tickler.open_service(work) as service:
        ticket = service.enqueue_request("done early")
        await ticket.wait()

        async def wait_elsewhere() -> Any:
            return await ticket.wait()

        assert await trio.to_thread.run_sync(trio.run, wait_elsewhere) == ("done", "done early")


class Payload:
    """A value that can be weakly referenced."""


async def test_an_idle_service_keeps_no_contextvar_value_of_a_finished_request() -> None:
    """Neither the enqueuer's values nor a handler's writes outlive their request."""
    refs: list[weakref.ref[Payload]] = []
    payloads: contextvars.ContextVar[Payload] = contextvars.ContextVar("payloads")
    written: contextvars.ContextVar[Payload] = contextvars.ContextVar("written")

    async def handler(request: int) -> None:
        value = Payload()
        refs.append(weakref.ref(value))
        written.set(value)
        del value
        await trio.lowlevel.checkpoint()

    async with tickler.open_service(handler, capacity=3) as service:

        def enqueue(request: int) -> tickler.Ticket[Any, Any]:
            value = Payload()
            refs.append(weakref.ref(value))
            payloads.set(value)
            return service.enqueue_request(request)

        tickets = [contextvars.copy_context().run(enqueue, i) for i in range(6)]
        for ticket in tickets:
            await ticket.wait()
        del ticket, tickets
        await trio.testing.wait_all_tasks_blocked()  # idle: processors parked
        gc.collect()
        assert [ref() for ref in refs] == [None] * 12
        assert not service.closed


async def test_a_failed_ticket_holds_no_reference_cycle() -> None:
    """Dropping an awaited failed ticket frees the handler's frame without the collector.

    Regression: ticket, exception, traceback and frame formed a cycle.
    """
    refs: list[weakref.ref[Payload]] = []

    async def handler(request: int) -> None:
        large = Payload()
        refs.append(weakref.ref(large))
        await trio.lowlevel.checkpoint()
        raise ValueError(f"failed {request}")

    async with tickler.open_service(handler, on_error=lambda t, e: None) as service:
        gc.collect()
        gc.disable()
        try:
            ticket = service.enqueue_request(1)
            for _ in range(2):
                with pytest.raises(ValueError, match=r"^failed 1$"):
                    await ticket.wait()
                with pytest.raises(ValueError, match=r"^failed 1$"):
                    ticket.result()
            del ticket
            await trio.testing.wait_all_tasks_blocked()
            [ref] = refs
            assert ref() is None
        finally:
            gc.enable()


async def test_raising_a_failed_tickets_exception_again_does_not_grow_its_traceback() -> None:
    """Each ``result()`` or ``wait()`` raises with the same traceback length."""

    async def handler(request: int) -> None:
        raise ValueError("boom")

    def depth(exc: BaseException) -> int:
        tb, n = exc.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        return n

    async with tickler.open_service(handler, on_error=lambda t, e: None) as service:
        ticket = service.enqueue_request(1)
        depths = []
        for _ in range(5):
            with pytest.raises(ValueError, match=r"^boom$") as first:
                await ticket.wait()
            depths.append(depth(first.value))
            with pytest.raises(ValueError, match=r"^boom$") as second:
                ticket.result()
            depths.append(depth(second.value))
    assert depths[0::2] == [depths[0]] * 5
    assert depths[1::2] == [depths[1]] * 5


# -- bad values -------------------------------------------------------------------------


async def test_capacity_set_from_another_thread_is_refused_and_changes_nothing() -> None:
    """Regression: the value was applied, an error raised anyway, and the loop wedged."""
    gate = trio.Event()

    async def held(request: int) -> int:
        await gate.wait()
        return request

    async with trio.open_nursery() as nursery:
        service = tickler.Service(held, capacity=2)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()

        def resize() -> None:
            service.capacity = 4

        with pytest.raises(RuntimeError, match=r"must be set from the thread running it$"):
            await trio.to_thread.run_sync(resize)
        assert service.capacity == 2
        await trio.testing.wait_all_tasks_blocked()
        assert service.statistics().in_flight == 2
        gate.set()
        assert [await t.wait() for t in tickets] == [0, 1, 2, 3]
        # The loop is not wedged: a cancel-stop ends at once.
        await service.stop(drain=False)


def test_zero_initial_backoff_stays_zero_for_every_attempt() -> None:
    """Regression: ``Retry(initial=0).backoff(k)`` jumped to ``maximum`` near k = 1,024."""
    retry = tickler.Retry(initial=0, maximum=30.0)
    assert {retry.backoff(k) for k in range(1, 5000)} == {0.0}
    assert {retry.delay(k) for k in range(1, 5000)} == {0.0}


@pytest.mark.parametrize("field", ["initial", "maximum"])
@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_infinite_retry_times_are_refused(field: str, value: float) -> None:
    """An infinite wait could never be scheduled; it is refused at construction."""
    with pytest.raises(ValueError, match=rf"^{field} must be finite$"):
        options: dict[str, Any] = {field: value}
        tickler.Retry(**options)


def test_retry_delays_are_always_finite_and_non_negative() -> None:
    """Huge factors and attempt numbers give ``maximum``, never NaN or infinity."""
    for retry in (
        tickler.Retry(initial=1e-300, factor=1e300, maximum=5.0),
        tickler.Retry(initial=0.5, factor=math.inf, maximum=7.0),
        tickler.Retry(initial=0, factor=math.inf, maximum=7.0),
        tickler.Retry(initial=1e308, factor=10.0, maximum=3153600000.0),  # 100 years
        tickler.Retry(initial=1, factor=2, maximum=60),  # ints: no exact integer powers
    ):
        for k in (1, 2, 3, 1_000, 10**6, 10**18):
            for value in (retry.backoff(k), retry.delay(k)):
                assert math.isfinite(value)
                assert 0 <= value <= retry.maximum


# -- found by trying to break the above -----------------------------------------------


async def _nursery_then_sleep(request: int) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 100)
        await trio.sleep(100)


async def test_a_handler_with_a_nursery_cut_off_by_a_stop_deadline_is_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The Cancelled that a handler's nursery wraps in a group still means CANCELLED, not FAILED."""
    async with trio.open_nursery() as nursery:
        service = tickler.Service(_nursery_then_sleep, capacity=2)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(i) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        assert await service.stop(timeout=5) == tickets
    stats = service.statistics()
    assert (stats.failed, stats.cancelled) == (0, 3)


async def test_a_handler_with_a_nursery_is_cancelled_with_the_run(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Cancelling the scope around run cancels such a handler's request, and starts nothing."""
    service = tickler.Service(_nursery_then_sleep, capacity=1)
    tickets = [service.enqueue_request(i) for i in range(2)]
    with trio.move_on_after(1):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
    assert [t.status for t in tickets] == [tickler.Status.CANCELLED] * 2
    assert tickets[0].attempts == 1
    assert await service.stop() == tickets


async def test_stop_from_a_handler_holding_every_slot_returns_and_the_rest_drains_after(
    autojump_clock: trio.abc.Clock,
) -> None:
    """With every slot held by handlers in stop(), waiting for the queue could never end."""
    order: list[str] = []

    async def handler(request: str) -> None:
        if request == "stopper":
            await service.stop()
        await trio.sleep(1)
        order.append(request)

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=1)
        await nursery.start(service.run)
        tickets = [service.enqueue_request(r) for r in ("stopper", "queued")]
        await trio.testing.wait_all_tasks_blocked()
        assert await service.stop() == []
    assert order == ["stopper", "queued"]
    assert trio.current_time() == 2.0
    assert [t.status for t in tickets] == [tickler.Status.SUCCEEDED] * 2


async def test_a_cancelled_stop_call_in_a_handler_does_not_strand_another(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two tasks of one handler wait in stop(); one gives up; the other still returns."""
    returned: list[float] = []

    async def handler(request: str) -> None:
        if request != "stopper":
            await trio.sleep(10)
            return

        async def patient() -> None:
            await service.stop()
            returned.append(trio.current_time())

        async def impatient() -> None:
            with trio.move_on_after(1):
                await service.stop()

        async with trio.open_nursery() as children:
            children.start_soon(patient)
            children.start_soon(impatient)

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=2)
        await nursery.start(service.run)
        service.enqueue_request("slow")
        service.enqueue_request("stopper")
        await trio.testing.wait_all_tasks_blocked()
        await service.stop()
    assert returned == [10.0]


async def test_a_parked_processor_keeps_no_finished_request() -> None:
    """Neither a request handed to a parked processor nor a retry it took stays alive."""
    refs: list[weakref.ref[Payload]] = []
    failed_once: set[int] = set()

    async def handler(request: Payload) -> Payload:
        await trio.lowlevel.checkpoint()
        if id(request) not in failed_once:
            failed_once.add(id(request))
            raise ValueError("once")
        result = Payload()
        refs.append(weakref.ref(result))
        return result

    retry = tickler.Retry(attempts=2, initial=0, jitter=False)
    async with tickler.open_service(handler, capacity=1, retry=retry) as service:
        for _ in range(3):
            request = Payload()
            refs.append(weakref.ref(request))
            await service.enqueue_request(request).wait()
            del request
            await trio.testing.wait_all_tasks_blocked()  # idle: the processor parks
        gc.collect()
        assert [ref() for ref in refs] == [None] * 6


async def test_a_waiter_before_run_gets_request_cancelled_from_a_stop_before_run() -> None:
    """A stop before run wakes the waiters of its run as waiters of that run."""
    service = tickler.Service(work)
    ticket = service.enqueue_request(1)
    async with trio.open_nursery() as nursery:

        async def waiter() -> None:
            with pytest.raises(tickler.RequestCancelled):
                await ticket.wait()

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert await service.stop() == [ticket]


async def test_debug_lines_for_a_request_run_in_its_context(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every DEBUG line naming a request sees that request's contextvars."""
    seen: list[tuple[str, str]] = []

    class Record(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if message.startswith(("request #", "processing request #")):
                seen.append((message.split("#")[1].split()[0], origin.get()))
            return True

    record_filter = Record()
    logging.getLogger("tickler").addFilter(record_filter)
    try:
        with caplog.at_level(logging.DEBUG, logger="tickler"):
            async with tickler.open_service(work, capacity=1) as service:

                def enqueue(request: int) -> tickler.Ticket[Any, Any]:
                    origin.set(f"origin of #{request}")
                    return service.enqueue_request(request)

                tickets = [contextvars.copy_context().run(enqueue, i + 1) for i in range(4)]
                for ticket in tickets:
                    await ticket.wait()
    finally:
        logging.getLogger("tickler").removeFilter(record_filter)
    assert len(seen) == 12  # added, dequeued and processing, for each of four
    assert all(value == f"origin of #{number}" for number, value in seen)


async def test_result_keeps_the_stored_exceptions_own_context() -> None:
    """Raising a failure inside the caller's except block does not chain the caller's error."""

    async def handler(request: int) -> None:
        raise ValueError("boom")

    async with tickler.open_service(handler, on_error=lambda t, e: None) as service:
        ticket = service.enqueue_request(1)
        with pytest.raises(ValueError, match=r"^boom$"):
            await ticket.wait()
        try:
            raise KeyError("the caller's own")  # noqa: TRY301 - the caller's handled error
        except KeyError:
            with pytest.raises(ValueError, match=r"^boom$") as raised:
                ticket.result()
        assert raised.value.__context__ is None
        with pytest.raises(ValueError, match=r"^boom$") as again:
            await ticket.wait()
        assert again.value.__context__ is None


@types.coroutine
def _generator_based(request: int) -> Generator[Any, Any, tuple[str, int]]:
    yield from trio.lowlevel.checkpoint().__await__()
    return ("generator", request)


async def test_a_generator_based_coroutine_is_awaited() -> None:
    """A ``@types.coroutine`` generator is awaitable and awaited like a coroutine."""
    handler: Any = _generator_based
    async with tickler.open_service(handler) as service:
        assert await service.enqueue_request(7).wait() == ("generator", 7)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tickler.Service(work, timeout=10**400), r"^timeout must be at most .* seconds$"),
        (lambda: tickler.Retry(initial=10**400), r"^initial must be finite$"),
        (lambda: tickler.Retry(maximum=10**400), r"^maximum must be finite$"),
    ],
)
def test_integers_too_large_for_a_float_are_refused_with_value_error(
    make: Any, message: str
) -> None:
    """Regression: they raised OverflowError from inside the conversion."""
    with pytest.raises(ValueError, match=message):
        make()


async def test_a_request_enqueued_by_a_hook_never_starts_before_it_was_enqueued() -> None:
    """Each start is read afresh, so ``enqueued_at <= started_at`` also for chained requests."""
    follow_ups: list[tickler.Ticket[Any, Any]] = []

    async def handler(request: str) -> str:
        await trio.lowlevel.checkpoint()
        if request == "bad":
            raise ValueError(request)
        return request

    def on_error(ticket: tickler.Ticket[Any, Any], exc: Exception) -> None:
        time.sleep(0.001)  # a hook that takes a while, on the real clock
        follow_ups.append(service.enqueue_request("compensate"))

    async with trio.open_nursery() as nursery:
        service = tickler.Service(handler, capacity=1, on_error=on_error)
        await nursery.start(service.run)
        bad = service.enqueue_request("bad")
        with pytest.raises(ValueError, match=r"^bad$"):
            await bad.wait()
        [follow_up] = follow_ups
        assert await follow_up.wait() == "compensate"
        await service.stop()
    assert follow_up.enqueued_at is not None
    assert follow_up.started_at is not None
    assert follow_up.enqueued_at <= follow_up.started_at


async def test_a_refused_callers_context_is_not_kept() -> None:
    """A closed service keeps nothing of the context of a caller it refused."""
    holder: contextvars.ContextVar[Payload] = contextvars.ContextVar("holder")
    service = tickler.Service(work)
    await service.stop()
    value = Payload()
    ref = weakref.ref(value)

    def enqueue(payload: Payload) -> None:
        holder.set(payload)
        with pytest.raises(tickler.ServiceClosed):
            service.enqueue_request(1)

    contextvars.copy_context().run(enqueue, value)
    del value
    gc.collect()
    assert ref() is None


async def test_a_clock_merely_named_like_trios_own_is_called() -> None:
    """Only Trio's own default clock is read as offset + perf_counter; any other is called."""

    class SystemClock(trio.abc.Clock):
        def __init__(self) -> None:
            self.offset = 5000.0

        def start_clock(self) -> None:
            pass

        def current_time(self) -> float:
            return self.offset + time.perf_counter()

        def deadline_to_sleep_time(self, deadline: float) -> float:
            return max(0.0, deadline - self.current_time())

    async def main() -> tickler.Ticket[Any, Any]:
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, SystemClock)
        async with tickler.open_service(work) as service:
            clock.offset += 100.0
            ticket = service.enqueue_request(1)
            await ticket.wait()
        return ticket

    before = 5100.0 + time.perf_counter()
    ticket = await trio.to_thread.run_sync(lambda: trio.run(main, clock=SystemClock()))
    assert ticket.enqueued_at is not None
    assert before <= ticket.enqueued_at <= 5100.0 + time.perf_counter()


async def test_the_slot_freed_line_carries_no_handlers_writes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line for no request runs in no request's context, not in the last handler's."""
    seen: list[str] = []

    async def handler(request: int) -> None:
        scratch.set(f"written by {request}")
        await trio.lowlevel.checkpoint()

    class Record(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.getMessage().startswith("slot freed"):
                seen.append(scratch.get())
            return True

    record_filter = Record()
    logging.getLogger("tickler").addFilter(record_filter)
    try:
        with caplog.at_level(logging.DEBUG, logger="tickler"):
            async with tickler.open_service(handler, capacity=1) as service:
                await service.enqueue_request(1).wait()
    finally:
        logging.getLogger("tickler").removeFilter(record_filter)
    assert seen
    assert set(seen) == {"clean"}
