"""The frozen snapshot that :meth:`tickler.Service.statistics` returns."""

from __future__ import annotations

import attrs


@attrs.frozen
class ServiceStatistics:
    """A consistent snapshot of a service's counters.

    At every moment ``enqueued == queued + scheduled + in_flight + retrying +
    succeeded + failed + cancelled``.
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
