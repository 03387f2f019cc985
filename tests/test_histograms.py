"""statistics().wait_time and run_time: exact counts and sums under the autojump clock."""

from __future__ import annotations

import bisect
import itertools
import sqlite3
from pathlib import Path

import pytest
import trio
import trio.testing

import tickler
from tickler import TIME_BUCKETS

pytestmark = pytest.mark.usefixtures("enqueue_context")


def expected(durations: list[float]) -> tuple[list[int], float]:
    """Counts per bucket (le bounds, then above them all) and the sum, computed independently."""
    counts = [0] * (len(TIME_BUCKETS) + 1)
    for duration in durations:
        below = [i for i, bound in enumerate(TIME_BUCKETS) if duration <= bound]
        counts[below[0] if below else len(TIME_BUCKETS)] += 1
    return counts, sum(durations)


def check(histogram: tickler.Histogram | None, durations: list[float]) -> None:
    assert histogram is not None
    counts, total = expected(durations)
    assert histogram.bounds == TIME_BUCKETS
    assert list(histogram.counts) == counts
    assert histogram.count == len(durations)
    assert histogram.sum == pytest.approx(total, rel=1e-9, abs=1e-12)


async def noop(request: object) -> None:
    pass


def test_the_buckets_are_roughly_logarithmic_from_100_microseconds_to_an_hour() -> None:
    assert TIME_BUCKETS[0] == 0.0001
    assert TIME_BUCKETS[-1] == 3600.0
    assert list(TIME_BUCKETS) == sorted(set(TIME_BUCKETS))
    assert all(1.3 < b / a <= 2.5 for a, b in itertools.pairwise(TIME_BUCKETS))
    check(tickler.Service(noop, histograms=True).statistics().wait_time, [])
    check(tickler.Service(noop, histograms=True).statistics().run_time, [])


async def test_waits_and_runs_land_in_their_buckets(autojump_clock: trio.abc.Clock) -> None:
    # One slot: each request waits for the ones before it to run.
    runs = [0.00005, 0.0003, 0.002, 0.04, 0.7, 3.0, 30.0, 4000.0]

    async def sleep_for(seconds: float) -> None:
        await trio.sleep(seconds)

    async with tickler.open_service(
        sleep_for, capacity=1, max_queue_length=None, histograms=True
    ) as service:
        tickets = [service.enqueue_request(seconds) for seconds in runs]
        await service.join()
        statistics = service.statistics()
    waits = [sum(runs[:i]) for i in range(len(runs))]
    check(statistics.wait_time, waits)
    check(statistics.run_time, runs)
    assert statistics.run_time is not None
    assert statistics.run_time.cumulative()[-1] == len(runs)
    # The same durations, as the tickets' own times give them.
    assert [t.started_at - t.enqueued_at for t in tickets] == pytest.approx(waits)  # type: ignore[operator]


async def test_every_attempt_counts_a_run_and_each_request_one_wait(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Failures, retries, timeouts and a stop's cancellation all end attempts."""

    async def flaky(request: str) -> None:
        await trio.sleep(0.02)
        if request == "fails" or (request == "retried" and tickler.current_ticket().attempts < 3):
            raise ValueError(request)
        if request == "slow":
            await trio.sleep(100)

    service = tickler.Service(
        flaky,
        capacity=4,
        retry=tickler.Retry(attempts=3, initial=1.0, factor=1.0, jitter=False),
        timeout=4.0,
        histograms=True,
        on_error=lambda ticket, exc: None,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for request in ("ok", "fails", "retried", "slow"):
            service.enqueue_request(request)
        await trio.sleep(20)  # every retry has run; "slow" timed out three times
        service.enqueue_request("stopped")
        await trio.sleep(0.003)
        await service.stop(drain=False, timeout=0)  # cancels the attempt
    statistics = service.statistics()
    assert statistics.started == 1 + 3 + 3 + 3 + 1
    check(statistics.wait_time, [0.0] * 5)
    # ok; fails x3; retried x3 (the last succeeds); slow times out x3; cancelled at 3 ms.
    check(statistics.run_time, [0.02] * 7 + [4.0] * 3 + [0.003])


async def test_a_delayed_request_waits_its_delay(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(noop, histograms=True) as service:
        service.enqueue_request(1, delay=2.0)
        await service.join()
        check(service.statistics().wait_time, [2.0])
        check(service.statistics().run_time, [0.0])


async def test_a_store_counts_the_wait_from_the_rows_enqueue(tmp_path: Path) -> None:
    """A request enqueued long ago, by another process: its wait starts at its row's enqueue."""
    store = tickler.SqliteStore(tmp_path / "queue.db", poll_interval=0.05)
    async with tickler.open_service(noop, store=store, name="jobs"):
        pass  # creates the schema
    with sqlite3.connect(store.path) as connection:
        store.enqueue_in(connection, "jobs", "old")
        connection.execute("UPDATE tickler_requests SET enqueued_at = enqueued_at - 7")
    async with tickler.open_service(noop, store=store, name="jobs", histograms=True) as service:
        await service.join()
        wait_time = service.statistics().wait_time
    assert wait_time is not None
    assert wait_time.count == 1
    # Between 7 s and the time this test took, in the bucket up to 10 s.
    assert 7.0 <= wait_time.sum < 7.0 + 2.0
    assert wait_time.counts[bisect.bisect_left(TIME_BUCKETS, 10.0)] == 1


async def test_histograms_are_on_by_default_and_can_be_turned_off(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with tickler.open_service(noop) as service:
        await service.submit(1)
        await service.join()
    check(service.statistics().wait_time, [0.0])
    check(service.statistics().run_time, [0.0])
    async with tickler.open_service(noop, histograms=False) as service:
        await service.submit(1)
        await service.join()
        statistics = service.statistics()
    assert statistics.succeeded == 1
    assert statistics.wait_time is None
    assert statistics.run_time is None


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_histograms_must_be_a_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="histograms must be True or False"):
        tickler.Service(noop, histograms=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "durations",
    [
        [0.00001] * 5,  # all in the first bucket
        [0.02, 0.021, 0.019, 0.02],  # all in one bucket in the middle
        [TIME_BUCKETS[3]] * 3,  # on a bound: in that bucket
        [1e9, 2e9],  # all above the last bound
        [0.00001, 0.5, 0.02, 1e9, TIME_BUCKETS[3], 0.3, 0.0],  # spread, unsorted
    ],
)
def test_a_tally_counts_as_one_by_one(durations: list[float]) -> None:
    from tickler._statistics import tally

    counts = [0] * (len(TIME_BUCKETS) + 1)
    pending = list(durations)
    total = tally(pending, counts)
    assert pending == []
    assert (counts, total) == expected(durations)
