"""Prometheus metrics of tickler services: :class:`Collector`.

Needs the ``prometheus`` extra (``pip install 'trio-tickler[prometheus]'``, which
brings ``prometheus_client``); ``import tickler`` itself does not.

::

    registry = prometheus_client.CollectorRegistry()
    registry.register(tickler.prometheus.Collector(mailer, provisioner))
    # in a Trio task: the scrape runs in a worker thread (see Collector)
    body = await trio.to_thread.run_sync(prometheus_client.generate_latest, registry)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import trio

try:
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.utils import floatToGoString as _float_to_go_string
except ImportError as exc:  # pragma: no cover - tested in a subprocess
    raise ImportError(
        "tickler.prometheus needs prometheus_client: pip install 'trio-tickler[prometheus]'"
    ) from exc

from . import Histogram, Service, ServiceStatistics

logger = logging.getLogger("tickler")

__all__ = ["Collector"]

# How prometheus_client writes an `le` bound (0.0001, 1.0, +Inf): the same as its own histograms.
_le: Callable[[float], str] = _float_to_go_string

# (name without _total, ServiceStatistics field, help). prometheus_client adds _total.
_COUNTERS = (
    (
        "tickler_requests_enqueued",
        "enqueued",
        "Requests accepted by enqueue_request or submit; a deduplicated call accepts none.",
    ),
    ("tickler_requests_succeeded", "succeeded", "Requests whose handler returned."),
    ("tickler_requests_failed", "failed", "Requests whose final attempt raised."),
    (
        "tickler_requests_cancelled",
        "cancelled",
        "Requests that ended cancelled: by a stop, a cancellation of the run or cancel().",
    ),
    ("tickler_requests_retried", "retried", "Retries scheduled after a failed attempt."),
    (
        "tickler_requests_rejected",
        "rejected",
        "Enqueues refused with QueueFull or ServiceClosed.",
    ),
    (
        "tickler_requests_deduplicated",
        "deduplicated",
        "Enqueues that found a live request with the same key and created nothing.",
    ),
    ("tickler_attempts_started", "started", "Attempts started, retries included."),
)
_STORE_ERRORS = (
    "tickler_store_errors",
    "Batches of the store that failed and were retried (services with a store only).",
)
_RESCUES = (
    "tickler_rescues",
    "Running requests of another process that this process's claims rescued, by reason:"
    " owner_died (that process's liveness lock was free) or lease_lapsed (its lease ran"
    " out). Services with a store only.",
)
_STORE_RESCUES = (
    "tickler_store_rescues",
    "Rescues of the service's queue in its store, by reason, over every process"
    " (running services with a store only).",
)
# The reasons of a rescue, as ServiceStatistics and store_statistics() name their counts.
_REASONS = ("owner_died", "lease_lapsed")
_GAUGES = (
    ("tickler_requests_queued", "queued", "Requests waiting in the queue for a free slot."),
    (
        "tickler_requests_scheduled",
        "scheduled",
        "Requests enqueued with a delay that have not started yet.",
    ),
    (
        "tickler_requests_in_flight",
        "in_flight",
        "Attempts running now; each holds one slot of the capacity.",
    ),
    ("tickler_requests_retrying", "retrying", "Requests waiting for their next attempt."),
    ("tickler_capacity", "capacity", "The cap on attempts in flight."),
    (
        "tickler_requests_limited",
        "limited",
        "Requests waiting only because their group is at its limit (one series: no label"
        " per group).",
    ),
    (
        "tickler_paused",
        "paused",
        "1 while starts are paused (Service.pause, or with a store any process or the CLI).",
    ),
)
_MAX_QUEUE_LENGTH = (
    "tickler_max_queue_length",
    "The cap on queued requests (absent for a service with no cap).",
)
_HISTOGRAMS = (
    (
        "tickler_request_wait_seconds",
        "wait_time",
        "Time from a request's enqueue to its first start, per request that started.",
    ),
    (
        "tickler_attempt_run_seconds",
        "run_time",
        "Time from an attempt's start to its end, whatever its outcome, per attempt that ended.",
    ),
)
_STORE_REQUESTS = (
    "tickler_store_requests",
    "Requests of the service's queue in its store, by status, over every process"
    " (running services with a store only).",
)
_STORE_UP = (
    "tickler_store_up",
    "1 if this scrape read the store's counts, 0 if that read failed"
    " (running services with a store only).",
)


@attrs.frozen
class _Reading:
    """What one scrape read of one service."""

    name: str
    statistics: ServiceStatistics
    has_store: bool
    store: dict[str, int] | None = None
    """The store's counts by status; None when not read."""
    store_up: bool | None = None
    """Whether the store was read; None when it was not tried (no store, not running)."""


def _store_open(service: Service[Any, Any]) -> bool:
    """Whether store_statistics() can be awaited now (the final flush has not closed it)."""
    return service.store is not None and service.running


def _read_directly(service: Service[Any, Any]) -> _Reading:
    return _Reading(service.name, service.statistics(), service.store is not None)


async def _read_in_run(services: list[Service[Any, Any]]) -> list[_Reading]:
    """In the services' own Trio run: their statistics at one moment, then their stores."""
    readings = [_read_directly(service) for service in services]

    async def read_store(index: int) -> None:
        service = services[index]
        # No checkpoint between this check and store_statistics() taking the connection.
        if not _store_open(service):
            return
        try:
            store = await service.store_statistics()
        except Exception as exc:
            logger.warning(
                "metrics: reading the store of service %r failed: %s: %s",
                service.name,
                type(exc).__name__,
                exc,
            )
            readings[index] = attrs.evolve(readings[index], store_up=False)
        else:
            readings[index] = attrs.evolve(readings[index], store=store, store_up=True)

    async with trio.open_nursery() as nursery:
        for index in range(len(services)):
            nursery.start_soon(read_store, index)
    return readings


class Collector:
    """A ``prometheus_client`` collector of tickler services' statistics.

    Register it once (``registry.register(Collector(*services))``); every
    scrape then reads each service's :meth:`~tickler.Service.statistics` and,
    for a running service with a store, its
    :meth:`~tickler.Service.store_statistics`. Each sample is labelled with
    the service's name (label ``service``), so the names must be distinct.

    **Threads.** ``statistics()`` is read in the service's Trio thread, and
    the store's counts are awaited in the service's run. A scrape from a
    thread that is not running Trio (the HTTP server thread of
    ``prometheus_client.start_http_server``, or a worker thread:
    ``await trio.to_thread.run_sync(prometheus_client.generate_latest,
    registry)``) makes one blocking call into each run
    (``trio.from_thread.run``) that reads the statistics of all of that
    run's services at one moment, then their stores. A scrape in the Trio
    thread of a service's own run reads its statistics directly, but cannot
    await the store: for a running service with a store it raises
    ``RuntimeError``, as does a scrape in the Trio thread of another run
    (it would block that run). Scrape from a worker thread instead.

    **Services not running** (never started, or stopped) report their
    statistics as they stand (final once stopped) and no store gauges. If
    reading a running service's store fails, the scrape still reports its
    statistics, ``tickler_store_up`` is 0 for it, and a WARNING is logged on
    the ``tickler`` logger.

    Raises:
        TypeError: an argument is not a :class:`tickler.Service`.
        ValueError: two services have the same name.
    """

    def __init__(self, *services: Service[Any, Any]) -> None:
        names: set[str] = set()
        for service in services:
            if not isinstance(service, Service):
                raise TypeError(
                    f"services must be tickler.Service objects, not {type(service).__name__}"
                )
            if service.name in names:
                raise ValueError(
                    f"services must have distinct names (the 'service' label):"
                    f" {service.name!r} names two of them"
                )
            names.add(service.name)
        self._services = services

    def describe(self) -> Iterator[Metric]:
        """The metric families a scrape may yield, without samples (read by registries)."""
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        """Read every service (see the class's docstring for which thread may call this)."""
        readings = self._read()
        for family in self._families(readings):
            if family.samples:
                yield family

    def _read(self) -> list[_Reading]:
        current = trio.lowlevel.current_trio_token() if trio.lowlevel.in_trio_run() else None
        read: dict[int, _Reading] = {}
        runs: dict[trio.lowlevel.TrioToken, list[int]] = {}
        for index, service in enumerate(self._services):
            token = service.trio_token
            if token is None or not service.running:
                read[index] = _read_directly(service)
            else:
                runs.setdefault(token, []).append(index)
        for token, indices in runs.items():
            services = [self._services[index] for index in indices]
            if token is current:
                readings = self._read_here(services)
            elif current is not None:
                raise RuntimeError(
                    f"service {services[0].name!r} runs in another Trio run, which a scrape"
                    " from this Trio thread would block; scrape from a worker thread:"
                    " await trio.to_thread.run_sync(prometheus_client.generate_latest, registry)"
                )
            else:
                try:
                    readings = trio.from_thread.run(_read_in_run, services, trio_token=token)
                except (trio.RunFinishedError, trio.Cancelled):
                    # The run ended since: its services are stopped, their statistics final.
                    readings = [_read_directly(service) for service in services]
            read.update(zip(indices, readings, strict=True))
        return [read[index] for index in range(len(self._services))]

    @staticmethod
    def _read_here(services: list[Service[Any, Any]]) -> list[_Reading]:
        for service in services:
            if _store_open(service):
                raise RuntimeError(
                    f"the store of service {service.name!r} is read with an await, which a"
                    " scrape in its Trio thread cannot do; scrape from a worker thread:"
                    " await trio.to_thread.run_sync(prometheus_client.generate_latest, registry)"
                )
        return [_read_directly(service) for service in services]

    @staticmethod
    def _families(readings: Iterable[_Reading]) -> Iterator[Metric]:
        readings = list(readings)
        for name, field, documentation in _COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=["service"])
            for reading in readings:
                counter.add_metric([reading.name], getattr(reading.statistics, field))
            yield counter
        store_errors = CounterMetricFamily(*_STORE_ERRORS, labels=["service"])
        for reading in readings:
            if reading.has_store:
                store_errors.add_metric([reading.name], reading.statistics.store_errors)
        yield store_errors
        rescues = CounterMetricFamily(*_RESCUES, labels=["service", "reason"])
        for reading in readings:
            if reading.has_store:
                for reason in _REASONS:
                    count = getattr(reading.statistics, f"rescued_{reason}")
                    rescues.add_metric([reading.name, reason], count)
        yield rescues
        for name, field, documentation in _GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["service"])
            for reading in readings:
                gauge.add_metric([reading.name], getattr(reading.statistics, field))
            yield gauge
        limit = GaugeMetricFamily(*_MAX_QUEUE_LENGTH, labels=["service"])
        for reading in readings:
            if reading.statistics.max_queue_length is not None:
                limit.add_metric([reading.name], reading.statistics.max_queue_length)
        yield limit
        for name, field, documentation in _HISTOGRAMS:
            histogram = HistogramMetricFamily(name, documentation, labels=["service"])
            for reading in readings:
                durations: Histogram | None = getattr(reading.statistics, field)
                if durations is not None:
                    buckets = [
                        (_le(bound), float(count))
                        for bound, count in zip(
                            (*durations.bounds, float("inf")), durations.cumulative(), strict=True
                        )
                    ]
                    histogram.add_metric([reading.name], buckets, durations.sum)
            yield histogram
        store = GaugeMetricFamily(*_STORE_REQUESTS, labels=["service", "status"])
        store_rescues = CounterMetricFamily(*_STORE_RESCUES, labels=["service", "reason"])
        up = GaugeMetricFamily(*_STORE_UP, labels=["service"])
        for reading in readings:
            if reading.store is not None:
                for status, count in reading.store.items():
                    if status.startswith("rescued_"):
                        store_rescues.add_metric([reading.name, status[len("rescued_") :]], count)
                    elif status not in ("paused", "limited"):  # tickler_paused, _requests_limited
                        store.add_metric([reading.name, status], count)
            if reading.store_up is not None:
                up.add_metric([reading.name], 1 if reading.store_up else 0)
        yield store
        yield store_rescues
        yield up
