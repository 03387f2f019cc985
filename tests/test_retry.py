"""Per-attempt timeouts and retries held by the supervisor loop."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

import tickler

from .conftest import check_identity

# Every test runs with the harness's contextvars and with none at the enqueue.
pytestmark = pytest.mark.usefixtures("enqueue_context")


class Flaky:
    """Fails the first `failures` attempts of each request, recording attempt times."""

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures = failures
        self.error = error
        self.times: dict[Any, list[float]] = {}

    async def __call__(self, request: Any) -> str:
        times = self.times.setdefault(request, [])
        times.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if len(times) <= self.failures:
            raise self.error(f"attempt {len(times)} of {request!r}")
        return f"ok {request}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, r"^attempts must be >= 1 or None$"),
        ({"initial": -0.1}, r"^initial must be >= 0$"),
        ({"factor": 0.5}, r"^factor must be >= 1$"),
        ({"maximum": -1}, r"^maximum must be >= 0$"),
        ({"on": ()}, r"^on must name at least one exception type$"),
    ],
)
def test_bad_retry_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """Each bad field raises ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        tickler.Retry(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 2.0}, r"^attempts must be an int or None$"),
        ({"initial": "1"}, r"^initial must be a number$"),
        ({"jitter": 1}, r"^jitter must be a bool$"),
        ({"on": (KeyboardInterrupt,)}, r"^on must be an Exception subclass or a tuple of them$"),
        ({"on": "ValueError"}, r"^on must be an Exception subclass or a tuple of them$"),
    ],
)
def test_retry_values_of_the_wrong_type_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """Wrong types raise TypeError naming the field."""
    with pytest.raises(TypeError, match=message):
        tickler.Retry(**kwargs)


def test_retry_is_a_frozen_value() -> None:
    """Retry compares by value, cannot change, and accepts a single exception type."""
    assert tickler.Retry() == tickler.Retry(3, 0.1, 2.0, 30.0, True, (Exception,))
    assert tickler.Retry(on=OSError).on == (OSError,)
    with pytest.raises(AttributeError):
        tickler.Retry().attempts = 5  # type: ignore[misc]


async def test_attempts_follow_the_backoff_exactly(autojump_clock: trio.abc.Clock) -> None:
    """Attempts start at t0, t0+initial, t0+initial+initial*factor, ... capped at maximum."""
    flaky = Flaky(failures=4)
    retry = tickler.Retry(attempts=5, initial=1.0, factor=3.0, maximum=5.0, jitter=False)
    async with tickler.open_service(flaky, retry=retry) as service:
        t0 = trio.current_time()
        ticket = service.enqueue_request("r")
        assert await ticket.wait() == "ok r"
    # waits: 1, 3, min(5, 9) = 5, min(5, 27) = 5
    assert flaky.times["r"] == [t0, t0 + 1, t0 + 4, t0 + 9, t0 + 14]
    assert ticket.attempts == 5
    stats = service.statistics()
    assert (stats.started, stats.retried, stats.succeeded) == (5, 4, 1)


def test_backoff_values() -> None:
    """backoff() is min(maximum, initial * factor ** (attempt - 1)), even for huge attempts."""
    retry = tickler.Retry(initial=0.5, factor=2.0, maximum=3.0)
    assert [retry.backoff(k) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert retry.backoff(10_000) == 3.0


def test_jitter_stays_within_its_bounds() -> None:
    """With jitter the wait is drawn from [half, all] of the backoff; without, it is exact."""
    retry = tickler.Retry(initial=2.0, factor=2.0, maximum=100.0)
    delays = [retry.delay(3) for _ in range(2000)]
    assert all(4.0 <= d <= 8.0 for d in delays)
    assert min(delays) < 4.5
    assert max(delays) > 7.5
    exact = tickler.Retry(initial=2.0, factor=2.0, jitter=False)
    assert {exact.delay(3) for _ in range(10)} == {8.0}


async def test_jittered_attempts_happen_within_bounds(autojump_clock: trio.abc.Clock) -> None:
    """Jittered retries wait between half and all of the backoff."""
    flaky = Flaky(failures=2)
    retry = tickler.Retry(attempts=3, initial=4.0, factor=2.0)
    async with tickler.open_service(flaky, retry=retry, capacity=50) as service:
        for i in range(50):
            service.enqueue_request(i)
    for times in flaky.times.values():
        first_wait, second_wait = times[1] - times[0], times[2] - times[1]
        assert 2.0 <= first_wait <= 4.0
        assert 4.0 <= second_wait <= 8.0
    assert len({times[1] for times in flaky.times.values()}) > 1


async def test_only_listed_errors_are_retried(autojump_clock: trio.abc.Clock) -> None:
    """An error outside `on` fails at once."""
    errors: list[Exception] = []
    retry = tickler.Retry(attempts=5, initial=1.0, on=(ConnectionError, TimeoutError))
    async with tickler.open_service(
        Flaky(failures=10, error=KeyError), retry=retry, on_error=lambda t, e: errors.append(e)
    ) as service:
        ticket = service.enqueue_request("r")
    assert ticket.status is tickler.Status.FAILED
    assert ticket.attempts == 1
    assert service.statistics().retried == 0
    assert [type(e) for e in errors] == [KeyError]


async def test_exhaustion_reports_once_with_the_last_error(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """on_error runs once after the final attempt; earlier errors are logged at INFO."""
    calls: list[tuple[int, int, str]] = []
    retry = tickler.Retry(attempts=3, initial=0.5, factor=2.0, jitter=False)
    with caplog.at_level(logging.INFO, logger="tickler"):
        async with tickler.open_service(
            Flaky(failures=99),
            retry=retry,
            on_error=lambda t, e: calls.append((t.id, t.attempts, str(e))),
        ) as service:
            ticket = service.enqueue_request("r")
    assert calls == [(1, 3, "attempt 3 of 'r'")]
    with pytest.raises(ConnectionError, match=r"^attempt 3 of 'r'$"):
        await ticket.wait()
    retried = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert retried == [
        "request #1 attempt 1 failed (ConnectionError: attempt 1 of 'r'),"
        " retrying in 0.500 seconds",
        "request #1 attempt 2 failed (ConnectionError: attempt 2 of 'r'),"
        " retrying in 1.000 seconds",
    ]
    # The final failure went to this test's on_error, not to the default's ERROR.
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    stats = service.statistics()
    assert (stats.failed, stats.retried, stats.started) == (1, 2, 3)


async def test_a_waiting_retry_holds_no_slot(autojump_clock: trio.abc.Clock) -> None:
    """While a request waits for its retry, another request runs in its slot."""
    flaky = Flaky(failures=1)
    retry = tickler.Retry(attempts=2, initial=10.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(flaky, capacity=1, retry=retry)
        await nursery.start(service.run)
        waiting = service.enqueue_request("a")
        await trio.sleep(1)
        assert waiting.status is tickler.Status.RETRYING
        stats = service.statistics()
        assert (stats.retrying, stats.in_flight, stats.queued) == (1, 0, 0)
        check_identity(stats)
        other = service.enqueue_request("b")
        await trio.sleep(1)
        assert other.status is tickler.Status.RETRYING  # it ran and failed while "a" waited
        assert flaky.times["b"] == [1.0]
        await service.stop()
    assert flaky.times["a"] == [0.0, 10.0]


async def test_due_retries_run_before_newer_queued_requests(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A due retry takes the next free slot ahead of requests queued after it fell due.

    Equal priorities start in the order they became ready: a queued request
    when it was enqueued, a retry when it fell due (the stores' order too).
    """
    order: list[tuple[str, int]] = []
    attempts: dict[str, int] = {}

    async def handler(request: str) -> None:
        attempts[request] = attempts.get(request, 0) + 1
        order.append((request, attempts[request]))
        if request == "blocker":
            await trio.sleep(5)
        elif request == "flaky" and attempts[request] == 1:
            raise ConnectionError("once")
        else:
            await trio.sleep(1)

    retry = tickler.Retry(attempts=2, initial=1.0, jitter=False)
    async with tickler.open_service(handler, capacity=1, retry=retry) as service:
        service.enqueue_request("flaky")  # fails at t=0, due again at t=1
        service.enqueue_request("blocker")  # holds the slot 0..5
        service.enqueue_request("old")  # queued before the retry fell due
        await trio.sleep(2)
        for i in range(3):
            service.enqueue_request(f"new{i}")  # queued after it fell due
    assert order == [
        ("flaky", 1),
        ("blocker", 1),
        ("old", 1),
        ("flaky", 2),
        ("new0", 1),
        ("new1", 1),
        ("new2", 1),
    ]


async def test_full_queue_never_blocks_a_retry(autojump_clock: trio.abc.Clock) -> None:
    """With max_queue_length=1 and capacity 1, pending retries never deadlock the service."""
    flaky = Flaky(failures=2)
    retry = tickler.Retry(attempts=3, initial=0.5, jitter=False)
    tickets: list[tickler.Ticket[Any, Any]] = []
    refused = 0
    async with tickler.open_service(flaky, capacity=1, max_queue_length=1, retry=retry) as service:
        for i in range(40):
            for j in range(2):  # the second of each pair finds the queue full
                try:
                    tickets.append(service.enqueue_request((i, j)))
                except tickler.QueueFull:
                    refused += 1
            await trio.sleep(0.1)
            stats = service.statistics()
            assert stats.queued <= 1
            check_identity(stats)
    assert all(t.status is tickler.Status.SUCCEEDED for t in tickets)
    assert all(t.attempts == 3 for t in tickets)
    assert refused == 40
    assert len(tickets) == 40
    assert service.statistics().rejected == refused


async def test_timeout_fires_at_exactly_its_deadline(autojump_clock: trio.abc.Clock) -> None:
    """An attempt is cancelled at started_at + timeout and fails with TimeoutError."""

    async def hang(request: object) -> None:
        await trio.sleep_forever()

    async with tickler.open_service(hang, timeout=2.5, on_error=lambda t, e: None) as service:
        await trio.sleep(1)
        ticket = service.enqueue_request("x")
        with pytest.raises(TimeoutError, match=r"^attempt timed out after 2.5 seconds$"):
            await ticket.wait()
    assert ticket.started_at == 1.0
    assert ticket.finished_at == 3.5
    assert ticket.status is tickler.Status.FAILED


async def test_no_timeout_just_before_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    """An attempt that finishes just before its deadline succeeds."""

    async def almost(request: float) -> str:
        await trio.sleep(request)
        return "in time"

    async with tickler.open_service(almost, timeout=2.5) as service:
        ticket = service.enqueue_request(2.5 - 1e-6)
    assert await ticket.wait() == "in time"


async def test_queue_time_does_not_count_against_the_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The timeout starts with the attempt, not with the enqueue."""

    async def work(request: float) -> float:
        await trio.sleep(request)
        return request

    async with tickler.open_service(work, capacity=1, timeout=2.0) as service:
        tickets = [service.enqueue_request(1.5) for _ in range(4)]
    assert [t.status for t in tickets] == [tickler.Status.SUCCEEDED] * 4
    assert tickets[-1].started_at == 4.5


async def test_timeouts_are_retried(autojump_clock: trio.abc.Clock) -> None:
    """A timed-out attempt is a failure like any other and is retried."""
    durations = iter([10.0, 10.0, 0.5])

    async def slow_then_fast(request: object) -> str:
        await trio.sleep(next(durations))
        return "finally"

    retry = tickler.Retry(attempts=3, initial=1.0, factor=1.0, jitter=False)
    async with tickler.open_service(slow_then_fast, timeout=2.0, retry=retry) as service:
        ticket = service.enqueue_request("x")
    assert await ticket.wait() == "finally"
    assert ticket.attempts == 3
    assert ticket.finished_at == 2.0 + 1.0 + 2.0 + 1.0 + 0.5


async def test_drain_keeps_retrying_until_done(autojump_clock: trio.abc.Clock) -> None:
    """stop(drain=True) waits for retries to succeed."""
    flaky = Flaky(failures=2)
    retry = tickler.Retry(attempts=3, initial=1.0, factor=2.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(flaky, retry=retry)
        await nursery.start(service.run)
        ticket = service.enqueue_request("r")
        await trio.testing.wait_all_tasks_blocked()
        assert await service.stop(drain=True) == []
        assert trio.current_time() == 3.0
    assert ticket.status is tickler.Status.SUCCEEDED


async def test_drain_with_timeout_cancels_pending_retries(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A drain bounded by its timeout returns the retries still waiting."""
    flaky = Flaky(failures=5)
    retry = tickler.Retry(attempts=6, initial=1.0, factor=2.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(flaky, retry=retry)
        await nursery.start(service.run)
        ticket = service.enqueue_request("r")
        assert await service.stop(drain=True, timeout=4.0) == [ticket]
        assert trio.current_time() == 4.0
    assert flaky.times["r"] == [0.0, 1.0, 3.0]
    assert ticket.status is tickler.Status.CANCELLED
    stats = service.statistics()
    assert (stats.retrying, stats.cancelled) == (0, 1)
    check_identity(stats)


async def test_stop_without_drain_cancels_retries_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """stop(drain=False) returns retrying requests at once, and no timer outlives the service."""
    flaky = Flaky(failures=5)
    retry = tickler.Retry(attempts=6, initial=100.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(flaky, retry=retry)
        await nursery.start(service.run)
        ticket = service.enqueue_request("r")
        await trio.sleep(1)
        assert service.statistics().retrying == 1
        assert await service.stop(drain=False) == [ticket]
    assert trio.current_time() == 1.0  # the run ended without waiting for the timer
    assert ticket.status is tickler.Status.CANCELLED
    assert service.statistics().retrying == 0


async def test_attempt_failing_during_a_cancel_stop_is_not_retried(
    autojump_clock: trio.abc.Clock,
) -> None:
    """During stop(drain=False), an attempt that fails and would be retried is cancelled."""

    async def fails_late(request: object) -> None:
        await trio.sleep(2)
        raise ConnectionError("late")

    retry = tickler.Retry(attempts=3, initial=1.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(fails_late, retry=retry)
        await nursery.start(service.run)
        ticket = service.enqueue_request("r")
        await trio.sleep(1)
        assert await service.stop(drain=False) == [ticket]
        assert trio.current_time() == 2.0
    assert ticket.status is tickler.Status.CANCELLED
    assert ticket.attempts == 1
    assert service.statistics().retried == 0


async def test_retried_attempts_log_their_traceback_only_at_debug(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A program that configured no logging prints nothing for a retried attempt."""
    retry = tickler.Retry(attempts=2, initial=0.5, jitter=False)
    with caplog.at_level(logging.DEBUG, logger="tickler"):
        async with tickler.open_service(Flaky(failures=1), retry=retry) as service:
            assert await service.enqueue_request("r").wait() == "ok r"
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert [r.levelno for r in tracebacks] == [logging.DEBUG]
    assert "request #1 attempt 1 failed\nTraceback" in tracebacks[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_attempts_none_retries_without_end() -> None:
    """``Retry(attempts=None)`` retries whatever the attempt number."""
    retry = tickler.Retry(attempts=None)
    assert all(retry.should_retry(k, ValueError()) for k in (1, 2, 10**6, 10**18))
    only = tickler.Retry(attempts=None, on=ConnectionError)
    assert not only.should_retry(5, ValueError())


async def test_retry_forever_runs_until_success(autojump_clock: trio.abc.Clock) -> None:
    """A request failing 200 times with attempts=None succeeds on attempt 201."""
    retry = tickler.Retry(attempts=None, initial=0.01, maximum=1.0, jitter=False)
    async with tickler.open_service(Flaky(failures=200), retry=retry) as service:
        ticket = service.enqueue_request("r")
        assert await ticket.wait() == "ok r"
    assert ticket.attempts == 201
    assert service.statistics().retried == 200


async def test_retry_forever_ends_at_a_stops_deadline(autojump_clock: trio.abc.Clock) -> None:
    """Only a stop's timeout (or a cancel) ends a request that never succeeds."""
    retry = tickler.Retry(attempts=None, initial=1.0, maximum=1.0, jitter=False)
    async with trio.open_nursery() as nursery:
        service = tickler.Service(Flaky(failures=10**9), retry=retry)
        await nursery.start(service.run)
        ticket = service.enqueue_request("r")
        assert await service.stop(timeout=30) == [ticket]
    assert trio.current_time() == 30.0
    assert ticket.status is tickler.Status.CANCELLED
    assert 25 <= ticket.attempts <= 31
