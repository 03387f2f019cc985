"""Properties over random operation sequences: the counter identity and the cap.

hypothesis drives Trio by running each example in its own ``trio.run`` with an
autojumping MockClock, so every example runs in virtual time.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tickler

from .conftest import check_identity

# (kind, argument): enqueue a batch of (duration, fails) requests, let time
# pass, or resize the cap.
enqueue = st.tuples(
    st.just("enqueue"),
    st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), st.booleans()), max_size=6),
)
sleep = st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.25, 1.0, 2.5]))
resize = st.tuples(st.just("capacity"), st.integers(min_value=1, max_value=5))
operations = st.lists(st.one_of(enqueue, sleep, resize), max_size=25)

options = st.fixed_dictionaries(
    {
        "capacity": st.integers(min_value=1, max_value=4),
        "max_queue_length": st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
        "timeout": st.one_of(st.none(), st.sampled_from([0.75, 2.0])),
        "retry": st.one_of(
            st.none(),
            st.builds(
                tickler.Retry,
                attempts=st.integers(min_value=1, max_value=3),
                initial=st.sampled_from([0.0, 0.5, 1.0]),
                jitter=st.booleans(),
            ),
        ),
    }
)
stops = st.tuples(st.booleans(), st.one_of(st.none(), st.sampled_from([0.0, 0.5, 4.0])))


def run_scenario(
    opts: dict[str, Any], ops: list[tuple[str, Any]], stop: tuple[bool, float | None]
) -> None:
    async def main() -> None:
        running = 0
        starts_over_cap: list[tuple[int, int]] = []

        async def handler(request: tuple[float, bool]) -> None:
            nonlocal running
            running += 1
            stats = service.statistics()
            if stats.in_flight > service.capacity:
                starts_over_cap.append((stats.in_flight, service.capacity))
            try:
                await trio.sleep(request[0])
                if request[1]:
                    raise ValueError("planned failure")
            finally:
                running -= 1

        service = tickler.Service(handler, on_error=lambda ticket, exc: None, **opts)
        tickets: list[tickler.Ticket[Any, Any]] = []
        rejected = 0
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            for kind, argument in ops:
                if kind == "enqueue":
                    for request in argument:
                        try:
                            tickets.append(service.enqueue_request(request))
                        except tickler.QueueFull:
                            rejected += 1
                elif kind == "sleep":
                    await trio.sleep(argument)
                else:
                    service.capacity = argument
                await trio.testing.wait_all_tasks_blocked()
                stats = service.statistics()
                check_identity(stats)
                assert stats.in_flight == running
                assert stats.rejected == rejected
                assert stats.queued <= (opts["max_queue_length"] or stats.queued)
            drain, timeout = stop
            leftover = await service.stop(drain=drain, timeout=timeout)

        assert starts_over_cap == []
        stats = service.statistics()
        check_identity(stats)
        assert (stats.queued, stats.in_flight, stats.retrying) == (0, 0, 0)
        assert stats.enqueued == len(tickets)
        final = {tickler.Status.SUCCEEDED, tickler.Status.FAILED, tickler.Status.CANCELLED}
        assert all(t.status in final for t in tickets)
        cancelled = [t for t in tickets if t.status is tickler.Status.CANCELLED]
        assert leftover == cancelled
        assert stats.cancelled == len(cancelled)
        assert stats.succeeded == sum(t.status is tickler.Status.SUCCEEDED for t in tickets)
        assert stats.started == sum(t.attempts for t in tickets)
        # Every retry scheduled either started an attempt or was cancelled
        # while it waited.
        later_attempts = stats.started - sum(t.attempts > 0 for t in tickets)
        assert later_attempts <= stats.retried <= later_attempts + len(cancelled)
        if drain and timeout is None:
            assert cancelled == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opts=options, ops=operations, stop=stops)
def test_counter_identity_and_cap_hold_under_random_operations(
    opts: dict[str, Any], ops: list[tuple[str, Any]], stop: tuple[bool, float | None]
) -> None:
    """Random enqueues, completions, failures, resizes and a stop keep every invariant."""
    run_scenario(opts, ops, stop)
