"""The frozen snapshot that :meth:`tickler.Service.statistics` returns."""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right

import attrs

TIME_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0, 25.0, 50.0,
    100.0, 250.0, 500.0,
    1000.0, 2500.0, 3600.0,
)  # fmt: skip
"""The upper bounds, in seconds, of the buckets of the wait and run time histograms:
1, 2.5 and 5 in each decade from 100 µs, and one hour."""


@attrs.frozen
class Histogram:
    """Durations counted into fixed buckets, as Prometheus histograms count them.

    ``counts[i]`` counts the durations ``d`` with ``bounds[i - 1] < d <= bounds[i]``;
    the last count, one more than there are bounds, those above the last bound.
    """

    bounds: tuple[float, ...]
    """The buckets' upper bounds in seconds, ascending (:data:`TIME_BUCKETS`)."""
    counts: tuple[int, ...]
    """The durations in each bucket, and last those above every bound."""
    sum: float
    """The sum of the durations, in seconds."""

    @property
    def count(self) -> int:
        """How many durations were counted."""
        return sum(self.counts)

    def cumulative(self) -> tuple[int, ...]:
        """The durations at or below each bound, then all of them: Prometheus's ``le`` buckets."""
        return tuple(itertools.accumulate(self.counts))


@attrs.frozen
class ServiceStatistics:
    """A consistent snapshot of a service's counters.

    For the in-memory engine, at every moment ``enqueued == queued + scheduled +
    in_flight + retrying + succeeded + failed + cancelled``. With a store, requests
    move between processes (and arrive through ``enqueue_in``), so the counters are
    this process's and need not add up.
    """

    queued: int
    """Requests waiting in the queue."""
    scheduled: int
    """Requests enqueued with a delay that have not started yet; they hold no slot, but
    count against ``max_queue_length``."""
    in_flight: int
    """Attempts running now; each holds one capacity slot."""
    retrying: int
    """Requests waiting for their next attempt; they hold no slot and no queue place."""
    capacity: int
    """The current cap on attempts in flight."""
    max_queue_length: int | None
    """The cap on queued requests, or ``None`` for no cap."""
    enqueued: int
    """Requests ever accepted by ``enqueue_request`` or ``submit``; a deduplicated
    call accepts none."""
    started: int
    """Attempts ever started, retries included."""
    succeeded: int
    """Requests whose handler returned."""
    failed: int
    """Requests whose final attempt raised."""
    cancelled: int
    """Requests cancelled by a stop or by cancellation of the run."""
    retried: int
    """Retries ever scheduled."""
    deduplicated: int
    """Enqueues that found a live request with the same key, and created nothing."""
    rejected: int
    """Calls to ``enqueue_request`` refused with ``QueueFull`` or ``ServiceClosed``."""
    wakeups: int
    """Times the supervisor loop woke up."""
    peak_queued: int
    """The largest number of requests ever queued at once."""
    store_errors: int = 0
    """With a store: batches that failed and were retried (a full disk, a lost connection)."""
    rescued_owner_died: int = 0
    """With a store: running requests of another process that this process's claims
    rescued because that process's liveness lock was free (it died, or lost its lock)."""
    rescued_lease_lapsed: int = 0
    """With a store: running requests of another process that this process's claims
    rescued because their lease ran out (a process alive but stuck, or cut off)."""
    limited: int = 0
    """Requests waiting only because their group is at its limit (``limits=``)."""
    paused: bool = False
    """Whether starts are paused (``Service.pause``; with a store, by any process or the CLI)."""
    wait_time: Histogram | None = None
    """How long requests waited from their enqueue to their first start: one duration
    per request that started (a delayed request's includes its delay). ``None`` if the
    service was made with ``histograms=False``."""
    run_time: Histogram | None = None
    """How long attempts ran, from start to end, whatever their outcome: one duration
    per attempt that ended. ``None`` if the service was made with
    ``histograms=False``."""


def tally(durations: list[float], counts: list[int]) -> float:
    """Count ``durations`` into ``counts`` (by :data:`TIME_BUCKETS`) and empty the list;
    return their sum.

    Sorted first, so that they are counted in C, not one by one: each bucket from the
    shortest's to the longest's is one bisection.
    """
    if not durations:
        return 0.0
    durations.sort()
    first = bisect_left(TIME_BUCKETS, durations[0])
    last = bisect_left(TIME_BUCKETS, durations[-1])
    low = 0
    for bucket in range(first, last):
        high = bisect_right(durations, TIME_BUCKETS[bucket], low)
        counts[bucket] += high - low
        low = high
    counts[last] += len(durations) - low
    total = sum(durations)
    durations.clear()
    return total
