"""tickler.prometheus.Collector: each scrape, parsed by prometheus_client, is statistics()."""

from __future__ import annotations

import logging
import re
import sqlite3
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import tickler
import tickler.prometheus

from .store_runs import sync_of

ROOT = Path(__file__).parent.parent

# A sample's name and labels; an `le` label is compared as a number.
Key = tuple[str, tuple[tuple[str, str | float], ...]]

# The names the README documents, written out here rather than taken from the module.
COUNTERS = {
    "tickler_requests_enqueued_total": "enqueued",
    "tickler_requests_succeeded_total": "succeeded",
    "tickler_requests_failed_total": "failed",
    "tickler_requests_cancelled_total": "cancelled",
    "tickler_requests_retried_total": "retried",
    "tickler_requests_rejected_total": "rejected",
    "tickler_requests_deduplicated_total": "deduplicated",
    "tickler_attempts_started_total": "started",
}
GAUGES = {
    "tickler_requests_queued": "queued",
    "tickler_requests_scheduled": "scheduled",
    "tickler_requests_in_flight": "in_flight",
    "tickler_requests_retrying": "retrying",
    "tickler_capacity": "capacity",
    "tickler_paused": "paused",
    "tickler_requests_limited": "limited",
}
HISTOGRAMS = {
    "tickler_request_wait_seconds": "wait_time",
    "tickler_attempt_run_seconds": "run_time",
}


def key(name: str, **labels: str) -> Key:
    return name, tuple(
        sorted((label, float(value) if label == "le" else value) for label, value in labels.items())
    )


def parse(text: str) -> tuple[dict[Key, float], dict[str, str]]:
    """Every sample of a scrape, by name and labels, and each family's type."""
    samples: dict[Key, float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            sample_key = key(sample.name, **sample.labels)
            assert sample_key not in samples, sample_key
            samples[sample_key] = sample.value
    return samples, types


def expected(
    service: str,
    statistics: tickler.ServiceStatistics,
    *,
    has_store: bool = False,
    store: dict[str, int] | None = None,
    store_up: bool | None = None,
) -> dict[Key, float]:
    """The samples a scrape must show for one service with these statistics."""
    samples: dict[Key, float] = {}
    for name, field in COUNTERS.items() | GAUGES.items():
        samples[key(name, service=service)] = getattr(statistics, field)
    if has_store:
        samples[key("tickler_store_errors_total", service=service)] = statistics.store_errors
        for reason in ("owner_died", "lease_lapsed"):
            count = getattr(statistics, f"rescued_{reason}")
            samples[key("tickler_rescues_total", service=service, reason=reason)] = count
    if statistics.max_queue_length is not None:
        samples[key("tickler_max_queue_length", service=service)] = statistics.max_queue_length
    for name, field in HISTOGRAMS.items():
        histogram: tickler.Histogram | None = getattr(statistics, field)
        if histogram is None:
            continue
        les = [str(bound) for bound in histogram.bounds] + ["+Inf"]
        for le, count in zip(les, histogram.cumulative(), strict=True):
            samples[key(f"{name}_bucket", service=service, le=le)] = count
        samples[key(f"{name}_count", service=service)] = histogram.count
        samples[key(f"{name}_sum", service=service)] = histogram.sum
    for status, count in (store or {}).items():
        if status.startswith("rescued_"):
            reason = status.removeprefix("rescued_")
            samples[key("tickler_store_rescues_total", service=service, reason=reason)] = count
        elif status not in ("paused", "limited"):  # tickler_paused, tickler_requests_limited
            samples[key("tickler_store_requests", service=service, status=status)] = count
    if store_up is not None:
        samples[key("tickler_store_up", service=service)] = 1 if store_up else 0
    return samples


def of_service(samples: dict[Key, float], service: str) -> dict[Key, float]:
    return {k: v for k, v in samples.items() if ("service", service) in k[1]}


def registry_of(*services: tickler.Service[Any, Any]) -> prometheus_client.CollectorRegistry:
    # auto_describe: registering must not scrape (from the Trio thread it could not read a store).
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    registry.register(tickler.prometheus.Collector(*services))
    return registry


def scrape(registry: prometheus_client.CollectorRegistry) -> str:
    return prometheus_client.generate_latest(registry).decode()


async def test_a_scrape_is_statistics_at_that_moment(autojump_clock: trio.abc.Clock) -> None:
    """Four services in every state: each sample equals statistics() read with the scrape."""
    gate = trio.Event()

    async def handler(request: str) -> None:
        if request.startswith("fail"):
            raise ValueError(request)
        if request.startswith("hold"):
            await gate.wait()
        await trio.sleep(0.3)

    busy = tickler.Service(
        handler,
        name="busy",
        capacity=2,
        max_queue_length=3,
        retry=tickler.Retry(attempts=3, initial=100.0, jitter=False),
        histograms=True,
    )
    plain = tickler.Service(
        handler, name="plain", max_queue_length=None, on_error=lambda t, e: None
    )
    stopped = tickler.Service(handler, name="stopped", histograms=True)
    idle = tickler.Service(handler, name="idle")  # never started
    idle.enqueue_request("waits")
    registry = registry_of(busy, plain, stopped, idle)
    async with trio.open_nursery() as nursery:
        for service in (busy, plain, stopped):
            await nursery.start(service.run)
        busy.enqueue_request("ok")
        busy.enqueue_request("fail")  # retrying, due in 100 s
        plain.enqueue_request("ok")
        plain.enqueue_request("fail")
        for i in range(3):
            stopped.enqueue_request(f"hold {i}")
        await trio.sleep(1)
        await stopped.stop(drain=False, timeout=0)  # cancels them
        busy.enqueue_request("hold 1")
        busy.enqueue_request("hold 2")
        await trio.sleep(0.1)  # both slots held
        busy.enqueue_request("queued", key="k")
        busy.enqueue_request("queued", key="k")  # deduplicated
        busy.enqueue_request("later", delay=50)
        busy.enqueue_request("queued 2")  # the queue is full
        with pytest.raises(tickler.QueueFull):
            busy.enqueue_request("refused")
        await trio.sleep(1)
        # No checkpoint from here to the end of the scrape: nothing else runs.
        services = {"busy": busy, "plain": plain, "stopped": stopped, "idle": idle}
        before = {name: service.statistics() for name, service in services.items()}
        text = scrape(registry)
        after = {name: service.statistics() for name, service in services.items()}
        assert before == after
        gate.set()
        await busy.stop(drain=False, timeout=0)
        await plain.stop()

    samples, types = parse(text)
    for name, statistics in before.items():
        assert of_service(samples, name) == expected(name, statistics), name
    assert len(samples) == sum(len(expected(n, s)) for n, s in before.items())
    busy_statistics = before["busy"]
    assert (busy_statistics.in_flight, busy_statistics.queued) == (2, 2)
    assert (busy_statistics.scheduled, busy_statistics.retrying) == (1, 1)
    assert (busy_statistics.deduplicated, busy_statistics.rejected) == (1, 1)
    assert (before["plain"].failed, before["stopped"].cancelled) == (1, 3)
    assert before["idle"].queued == 1
    assert types == {
        **{name.removesuffix("_total"): "counter" for name in COUNTERS},
        **dict.fromkeys(GAUGES, "gauge"),
        "tickler_max_queue_length": "gauge",
        **dict.fromkeys(HISTOGRAMS, "histogram"),
    }
    # The stopped service's statistics are final: the scrape shows them as they stand.
    stopped_samples = of_service(samples, "stopped")
    assert stopped_samples[key("tickler_requests_cancelled_total", service="stopped")] == 3


async def test_histogram_buckets_are_cumulative_with_their_sum(
    autojump_clock: trio.abc.Clock,
) -> None:
    runs = [0.00005, 0.0003, 0.002, 0.04, 0.7, 3.0, 30.0, 4000.0]

    async def sleep_for(seconds: float) -> None:
        await trio.sleep(seconds)

    async with tickler.open_service(
        sleep_for, capacity=1, max_queue_length=None, name="sleeper", histograms=True
    ) as service:
        registry = registry_of(service)
        for seconds in runs:
            service.enqueue_request(seconds)
        await service.join()
        statistics = service.statistics()
        samples, types = parse(scrape(registry))
    for name, field in HISTOGRAMS.items():
        histogram: tickler.Histogram | None = getattr(statistics, field)
        assert histogram is not None
        assert types[name] == "histogram"
        buckets = sorted(
            (dict(labels)["le"], value)
            for (sample, labels), value in samples.items()
            if sample == f"{name}_bucket"
        )
        assert buckets == list(
            zip((*tickler.TIME_BUCKETS, float("inf")), histogram.cumulative(), strict=True)
        )
        assert samples[key(f"{name}_sum", service="sleeper")] == histogram.sum
        assert samples[key(f"{name}_count", service="sleeper")] == histogram.count
    # The run over an hour is counted only in +Inf; every wait is below it.
    run_buckets = dict(
        (dict(labels)["le"], value)
        for (sample, labels), value in samples.items()
        if sample == "tickler_attempt_run_seconds_bucket"
    )
    assert (run_buckets[3600.0], run_buckets[float("inf")]) == (len(runs) - 1, len(runs))


async def noop(request: object) -> None:
    pass


@asynccontextmanager
async def settled_store_service(tmp_path: Path) -> AsyncIterator[tickler.Service[str, None]]:
    """A service on a SqliteStore with requests in every status, held there until the block ends."""
    gate = trio.Event()

    async def handler(request: str) -> None:
        if request == "fail":
            raise ValueError(request)
        if request == "hold":
            await gate.wait()

    store = tickler.SqliteStore(tmp_path / "queue.db", poll_interval=0.05)
    async with tickler.open_service(
        handler, name="jobs", store=store, capacity=2, on_error=lambda t, e: None
    ) as service:
        for request in ("ok", "ok", "ok", "fail"):
            await service.submit(request)
        await service.join()
        await service.submit("hold")
        await service.submit("hold")
        await service.submit("waits")
        await service.submit("waits")
        await service.submit("cancelled", key="c")
        await service.submit("later", delay=600)
        assert await service.cancel("c")
        settled = {
            "queued": 2,
            "scheduled": 1,
            "claimed": 0,  # "waits" are not claimed: both slots are held
            "running": 2,
            "retrying": 0,
            "succeeded": 3,
            "failed": 1,
            "cancelled": 1,
            "paused": 0,  # a flag beside the counts: 1 while the queue is paused
            "limited": 0,  # ready rows held back by a group's limit
            "rescued_owner_died": 0,  # rescues over every process, by reason
            "rescued_lease_lapsed": 0,
        }
        with trio.fail_after(10):
            while await service.store_statistics() != settled:
                await trio.sleep(0.02)
        try:
            yield service
        finally:
            gate.set()
            await service.stop(drain=False)  # what did not run stays in the store


async def test_store_gauges_equal_store_statistics_from_a_worker_thread(tmp_path: Path) -> None:
    async with settled_store_service(tmp_path) as service:
        registry = registry_of(service)
        # In the Trio thread the store cannot be awaited: the scrape says where to run.
        with pytest.raises(RuntimeError, match=re.escape("trio.to_thread.run_sync(")):
            scrape(registry)
        before = (service.statistics(), await service.store_statistics())
        text = await trio.to_thread.run_sync(scrape, registry)
        after = (service.statistics(), await service.store_statistics())
    samples, _ = parse(text)
    want = expected("jobs", before[0], has_store=True, store=before[1], store_up=True)
    assert want == expected("jobs", after[0], has_store=True, store=after[1], store_up=True)
    assert samples == want
    assert samples[key("tickler_store_requests", service="jobs", status="running")] == 2

    # Stopped: its statistics, final, and no store gauges; the Trio thread may scrape now.
    samples, _ = parse(scrape(registry))
    assert samples == expected("jobs", service.statistics(), has_store=True)


async def test_a_scrape_from_prometheus_clients_http_thread(tmp_path: Path) -> None:
    async with settled_store_service(tmp_path) as service:
        server, thread = prometheus_client.start_http_server(
            0, addr="127.0.0.1", registry=registry_of(service)
        )
        try:
            url = f"http://127.0.0.1:{server.server_port}/metrics"

            def get() -> tuple[str, str]:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return response.headers["Content-Type"], response.read().decode()

            store = await service.store_statistics()
            content_type, text = await trio.to_thread.run_sync(get)
            statistics = service.statistics()
            assert await service.store_statistics() == store
        finally:
            await trio.to_thread.run_sync(server.shutdown)
            server.server_close()
            await trio.to_thread.run_sync(thread.join)
    assert content_type.startswith("text/plain; version=")
    samples, _ = parse(text)
    assert samples == expected("jobs", statistics, has_store=True, store=store, store_up=True)


async def test_a_failed_store_read_still_reports_the_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(queue: str) -> dict[str, int]:
        raise sqlite3.OperationalError("disk I/O error")

    async with settled_store_service(tmp_path) as service:
        registry = registry_of(service)
        assert sync_of(service) is not None
        monkeypatch.setattr(sync_of(service).connection, "statistics", broken)
        statistics = service.statistics()
        text = await trio.to_thread.run_sync(scrape, registry)
        after = service.statistics()
        monkeypatch.undo()
    samples, _ = parse(text)
    want = expected("jobs", statistics, has_store=True, store_up=False)
    assert want == expected("jobs", after, has_store=True, store_up=False)
    assert samples == want
    [record] = [r for r in caplog.records if r.name == "tickler"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "metrics: reading the store of service 'jobs' failed: OperationalError: disk I/O error"
    )


async def test_a_service_of_another_trio_run() -> None:
    """Scraped from a worker thread it is read in its own run; from this run's thread, refused."""
    ready = threading.Event()
    done = threading.Event()
    services: list[tickler.Service[object, None]] = []

    def other_run() -> None:
        async def main() -> None:
            async with tickler.open_service(noop, name="elsewhere") as service:
                await service.submit(1)
                await service.join()
                services.append(service)
                ready.set()
                await trio.to_thread.run_sync(done.wait)

        trio.run(main)

    thread = threading.Thread(target=other_run)
    thread.start()
    try:
        await trio.to_thread.run_sync(ready.wait)
        [service] = services
        registry = registry_of(service)
        with pytest.raises(RuntimeError, match="another Trio run"):
            scrape(registry)
        samples, _ = parse(await trio.to_thread.run_sync(scrape, registry))
        assert samples[key("tickler_requests_succeeded_total", service="elsewhere")] == 1
    finally:
        done.set()
        await trio.to_thread.run_sync(thread.join)
    # That run has ended: the service's final statistics, from any thread.
    samples, _ = parse(scrape(registry))
    assert samples == expected("elsewhere", service.statistics())


def test_bad_services_are_refused() -> None:
    service = tickler.Service(noop, name="a")
    with pytest.raises(TypeError, match=r"^services must be tickler\.Service objects, not str$"):
        tickler.prometheus.Collector(service, "b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"distinct names .*'a' names two of them"):
        tickler.prometheus.Collector(service, tickler.Service(noop, name="a"))
    with pytest.raises(ValueError, match="'a' names two of them"):
        tickler.prometheus.Collector(service, service)
    assert parse(scrape(registry_of())) == ({}, {})


def test_describe_names_every_family_without_samples() -> None:
    families = list(tickler.prometheus.Collector(tickler.Service(noop)).describe())
    assert all(not family.samples for family in families)
    assert {family.name for family in families} == {
        *(name.removesuffix("_total") for name in COUNTERS),
        "tickler_store_errors",
        "tickler_rescues",
        *GAUGES,
        "tickler_max_queue_length",
        *HISTOGRAMS,
        "tickler_store_requests",
        "tickler_store_rescues",
        "tickler_store_up",
    }


def test_tickler_imports_without_prometheus_client() -> None:
    program = """
import sys
sys.modules["prometheus_client"] = None  # as if it were not installed
import tickler
print(tickler.Service.__name__)
try:
    import tickler.prometheus
except ImportError as exc:
    print(exc)
"""
    result = subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout == (
        "Service\ntickler.prometheus needs prometheus_client:"
        " pip install 'trio-tickler[prometheus]'\n"
    )


async def test_a_paused_service_shows_tickler_paused() -> None:
    registry = prometheus_client.CollectorRegistry()
    service = tickler.Service(noop, name="paused")
    registry.register(tickler.prometheus.Collector(service))
    samples, _ = parse(prometheus_client.generate_latest(registry).decode())
    assert samples[key("tickler_paused", service="paused")] == 0
    service.pause()
    samples, _ = parse(prometheus_client.generate_latest(registry).decode())
    assert samples[key("tickler_paused", service="paused")] == 1
