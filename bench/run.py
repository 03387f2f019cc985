"""tickler's benchmarks, side by side with their baselines in one process.

    python -m bench            # the full run (a few minutes)
    python -m bench --quick    # a tiny smoke run, as CI does
    python -m bench --postgres-only    # only the PostgreSQL rows (bench/postgres.py)
    python -m bench --admin    # only the admin API's rows (bench/admin.py)

Every figure is a median over rounds; within a round the variants run one
after another, so drift hits them alike. Ratios compare variants measured in
the same run, never against remembered numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import gc
import importlib
import importlib.util
import os
import platform
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import trio

import tickler

from . import postgres
from ._table import Row, markdown

T = TypeVar("T")

# Importing trio.testing sets the decimal module's context variable in the
# importing context. Import it in a throwaway context, so that the benchmark's
# own context holds exactly the variables each variant sets on purpose.
contextvars.Context().run(importlib.import_module, "trio.testing")
import trio.testing  # noqa: E402 - imported above, in its own context

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("bench_request_id")


def in_context(with_var: bool, fn: Callable[..., T], *args: object) -> T:
    """Run fn in a fresh context: empty, or with one request-id variable set."""
    context = contextvars.Context()
    if with_var:
        context.run(REQUEST_ID.set, "request-42")
    return context.run(fn, *args)


def _set_request_id_and_call(request_id: str, fn: Callable[[int], object], request: int) -> None:
    REQUEST_ID.set(request_id)
    fn(request)


def in_own_context(fn: Callable[[int], object], request: int) -> None:
    """Call fn(request) from a new context holding this request's own id.

    As an ASGI tracing middleware or a structlog binding does: every request
    comes from a distinct Context with one distinct variable value.
    """
    contextvars.Context().run(_set_request_id_and_call, f"req-{request}", fn, request)


try:
    import aiojobs
except ImportError:  # the `bench` extra is optional
    aiojobs = None  # type: ignore[assignment]


def has_huey() -> bool:
    """Whether huey can be imported (the bench extra).

    huey (and psycopg, for bench.admin) is imported where it is used, not
    with this module: what a module imports stays alive, and the garbage
    collector's full passes during the in-memory rows go over it too.
    """
    return importlib.util.find_spec("huey") is not None


@dataclass
class Config:
    burst: int = 100_000
    concurrency: int = 100
    trickle: int = 10_000
    enqueue_calls: int = 100_000
    prefill: tuple[int, ...] = (1_000, 100_000, 1_000_000)
    fill: int = 1_000_000
    memory: int = 100_000
    submits: int = 300
    # SQLite drains, tickler's and huey's: requests in the file before the
    # worker starts (huey takes a commit per request, so fewer than a burst).
    sqlite_drain: int = 10_000
    rounds: int = 5
    postgres: postgres.PgConfig = field(default_factory=postgres.PgConfig)


QUICK = Config(
    burst=2_000,
    trickle=200,
    enqueue_calls=2_000,
    prefill=(100, 1_000, 10_000),
    fill=10_000,
    memory=2_000,
    submits=20,
    sqlite_drain=300,
    rounds=2,
    postgres=postgres.QUICK,
)


# The burst with limits: its requests spread over this many groups.
BURST_GROUPS = 1_000


async def _checkpoint_handler(request: object) -> None:
    await trio.lowlevel.checkpoint()


# -- burst: 100,000 no-op requests enqueued at once ------------------------------


async def burst_tickler(
    n: int,
    concurrency: int,
    context_per_request: bool = False,
    histograms: bool | None = None,
    priorities: bool = False,
    groups: int = 0,
    tracing: str | None = None,
) -> tuple[float, float]:
    """Seconds for the burst, and wake-ups per request.

    With context_per_request, each request is enqueued from a context of its
    own (see in_own_context), so each carries a distinct Context. With
    priorities, every other request is enqueued with priority=1 (half of
    them, interleaved with the priority-0 half). With groups, request i is
    in group ``f"g{i % groups}"`` (the names made before the clock starts)
    and the service has ``limits=tickler.Limit(concurrency=1)``. Without
    histograms, the service keeps its default (on), as a user gets it.
    """
    options: dict[str, Any] = {} if histograms is None else {"histograms": histograms}
    service = tickler.Service(
        _checkpoint_handler,
        capacity=concurrency,
        max_queue_length=None,
        limits=tickler.Limit(concurrency=1) if groups else None,
        **options,
    )
    names = [f"g{g}" for g in range(groups)]
    # With tracing "drop", the requests are enqueued under a span of a trace that the
    # sampler dropped, as a web request's span is when its trace is not sampled.
    scope: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if tracing is not None:
        scope = _instrument(service, tracing)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        enqueue = service.enqueue_request
        before = service.statistics().wakeups
        start = time.perf_counter()
        with scope:
            _enqueue_burst(enqueue, n, context_per_request, priorities, names)
        await service.stop()
        elapsed = time.perf_counter() - start
    stats = service.statistics()
    assert stats.succeeded == n, stats
    return elapsed, (stats.wakeups - before) / n


def _enqueue_burst(
    enqueue: Callable[..., object],
    n: int,
    context_per_request: bool,
    priorities: bool,
    names: list[str],
) -> None:
    """The enqueues of burst_tickler (see there)."""
    groups = len(names)
    if context_per_request:
        for i in range(n):
            in_own_context(enqueue, i)
    elif groups:
        for i in range(n):
            enqueue(i, group=names[i % groups])
    elif priorities:
        for i in range(0, n - 1, 2):
            enqueue(i)
            enqueue(i + 1, priority=1)
        if n % 2:
            enqueue(n - 1)
    else:
        for i in range(n):
            enqueue(i)


def has_otel() -> bool:
    """Whether tickler.otel and the OpenTelemetry SDK can be imported (the bench extra)."""
    try:
        importlib.import_module("opentelemetry.sdk.trace")
    except ImportError:
        return False
    return True


def _instrument(
    service: tickler.Service[Any, None], tracing: str
) -> contextlib.AbstractContextManager[object]:
    """Trace ``service``: "noop" (the API's no-op provider), "drop" and "drop_roots" (the SDK,
    with a sampler that drops every trace), "drop_parent" (the SDK's default sampler,
    ParentBased(ALWAYS_ON), under a span whose trace an upstream caller did not sample),
    "sdk" (no exporter), "memory" (an in-memory exporter). Returns the scope to enqueue
    in: for "drop" and "drop_parent", a span of a dropped trace."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
    from opentelemetry.trace import NoOpTracerProvider

    import tickler.otel

    provider: Any = (
        NoOpTracerProvider()
        if tracing == "noop"
        else TracerProvider(sampler=ALWAYS_OFF)
        if tracing in ("drop", "drop_roots")
        else TracerProvider()
    )
    if tracing == "memory":
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tickler.otel.instrument(service, tracer_provider=provider)
    if tracing == "drop":
        return provider.get_tracer("app").start_as_current_span("burst")  # type: ignore[no-any-return]
    if tracing == "drop_parent":
        # As a web framework's server span is, under an incoming traceparent ending -00.
        upstream = trace.NonRecordingSpan(
            trace.SpanContext(0x5CE4E, 0xCA11E4, is_remote=True, trace_flags=trace.TraceFlags(0))
        )
        context = trace.set_span_in_context(upstream)
        return provider.get_tracer("app").start_as_current_span("burst", context=context)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


async def burst_sqlite(n: int, concurrency: int, tracing: str | None = None) -> float:
    """Seconds from the first enqueue to the last completion committed, SqliteStore FULL.

    With tracing, the service is traced as _instrument says, and enqueued in its scope."""
    with tempfile.TemporaryDirectory() as directory:
        store = tickler.SqliteStore(Path(directory) / "queue.db", synchronous="FULL")
        service = tickler.Service(
            _checkpoint_handler,
            capacity=concurrency,
            max_queue_length=None,
            store=store,
            name="bench",
        )
        scope: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if tracing is not None:
            scope = _instrument(service, tracing)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            enqueue = service.enqueue_request
            start = time.perf_counter()
            with scope:
                for i in range(n):
                    enqueue(i)
            await service.join()  # nothing of the queue is live in the store
            elapsed = time.perf_counter() - start
            await service.stop()
    stats = service.statistics()
    assert stats.succeeded == n, stats
    return elapsed


# -- SQLite: a drain of requests already in the file, tickler and huey -------------

QUEUE = "bench"


def _prefill_tickler(path: Path, n: int) -> tickler.SqliteStore:
    """A FULL SqliteStore at path holding n requests, written in one transaction."""
    store = tickler.SqliteStore(path, synchronous="FULL")
    store.create_schema()
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN")
        store.enqueue_many_in(db, QUEUE, range(n))
        db.execute("COMMIT")
    finally:
        db.close()
    return store


async def drain_sqlite(n: int, concurrency: int) -> float:
    """Seconds from the service's start to the last outcome committed, n requests queued first."""
    with tempfile.TemporaryDirectory() as directory:
        store = _prefill_tickler(Path(directory) / "queue.db", n)
        service = tickler.Service(
            _checkpoint_handler,
            capacity=concurrency,
            max_queue_length=None,
            store=store,
            name=QUEUE,
        )
        gc.collect()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            await service.join()  # nothing of the queue is live in the store
            elapsed = time.perf_counter() - start
            await service.stop()
    stats = service.statistics()
    assert stats.succeeded == n, stats
    return elapsed


def drain_huey(n: int, workers: int, timeout: float = 600.0) -> float:
    """Seconds from huey's consumer start to its n-th no-op task run, n tasks queued first.

    SqliteHuey with fsync=True (synchronous=FULL, as tickler's store here) in
    WAL mode (its default). Its consumer runs in this process with `workers`
    thread workers (``huey_consumer -w workers -k thread``), without its
    periodic-task scheduler's work (periodic=False), and stops once the last
    task has run. huey has no batch enqueue, so the n tasks are written as
    its ``enqueue`` writes each (``huey.serialize_task``, the same INSERT),
    in one transaction instead of a committed transaction each.
    """
    import huey  # type: ignore[import-untyped,unused-ignore]  # huey ships no types
    import huey.consumer  # type: ignore[import-untyped,unused-ignore]

    with tempfile.TemporaryDirectory() as directory:
        queue = huey.SqliteHuey(QUEUE, filename=str(Path(directory) / "huey.db"), fsync=True)
        lock = threading.Lock()
        done = threading.Event()
        count = 0
        finished = 0.0

        @queue.task()  # type: ignore[untyped-decorator,unused-ignore]
        def noop(request: int) -> None:
            nonlocal count, finished
            with lock:
                count += 1
                if count == n:
                    finished = time.perf_counter()
                    done.set()

        rows = [(QUEUE, queue.serialize_task(noop.s(i)), 0) for i in range(n)]
        with queue.storage.db(commit=True) as cursor:
            cursor.executemany("insert into task (queue, data, priority) values (?, ?, ?)", rows)
        del rows
        consumer = huey.consumer.Consumer(
            queue, workers=workers, periodic=False, worker_type="thread", check_worker_health=False
        )
        # The consumer takes SIGINT, SIGTERM and SIGHUP for itself: give them back.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        if hasattr(signal, "SIGHUP"):
            handlers[signal.SIGHUP] = signal.getsignal(signal.SIGHUP)
        gc.collect()
        start = time.perf_counter()
        try:
            consumer.start()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        try:
            if not done.wait(timeout):
                raise TimeoutError(f"huey ran {count:,} of {n:,} tasks in {timeout:g} s")
        finally:
            consumer.stop(graceful=True)
            queue.storage.close()
        assert count == n, count
    return finished - start


# -- SQLite: many requests in one caller transaction -----------------------------------


def sqlite_bulk(path: Path, n: int, many: bool) -> float:
    """Requests a second: n requests in one transaction on the caller's sqlite3 connection.

    By one enqueue_many_in (many) or n enqueue_in calls, COMMIT included, on
    a connection with synchronous=FULL (the store's own connections' setting
    here) in WAL mode (which the store's schema sets).
    """
    store = tickler.SqliteStore(path, synchronous="FULL")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous = FULL")
        gc.collect()
        start = time.perf_counter()
        db.execute("BEGIN")
        if many:
            store.enqueue_many_in(db, QUEUE, range(n))
        else:
            for i in range(n):
                store.enqueue_in(db, QUEUE, i)
        db.execute("COMMIT")
        elapsed = time.perf_counter() - start
    finally:
        db.close()
    return n / elapsed


async def submit_latencies(n: int) -> list[float]:
    """Nanoseconds from calling submit to its return (the commit), on an idle service."""
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as directory:
        store = tickler.SqliteStore(Path(directory) / "queue.db", synchronous="FULL")
        async with tickler.open_service(_checkpoint_handler, store=store, name="bench") as service:
            for i in range(n):
                start = time.perf_counter_ns()
                ticket = await service.submit(i)
                latencies.append(time.perf_counter_ns() - start)
                await ticket.wait()
    return latencies


async def burst_pool(n: int, concurrency: int, context_per_request: bool = False) -> float:
    """Seconds for the burst through a fixed pool of workers on a memory channel.

    With context_per_request the producer pays the same per-request context
    setup as tickler's variant before each send; the channel still carries
    only the request, so the workers never see that context.
    """
    send, receive = trio.open_memory_channel[int](n)
    start = time.perf_counter()

    async def worker() -> None:
        async for request in receive:
            await _checkpoint_handler(request)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
        send_nowait = send.send_nowait
        if context_per_request:
            for i in range(n):
                in_own_context(send_nowait, i)
        else:
            for i in range(n):
                send_nowait(i)
        send.close()
    return time.perf_counter() - start


async def burst_pool_keeping_contexts(n: int, concurrency: int) -> float:
    """The pool with a context per request, each kept in the channel until a worker takes it.

    Each item carries a copy of its producer's context, as any queue that
    must hand the handler its enqueuer's context keeps one per waiting
    request; the worker creates the handler's coroutine in it. This shows the
    cost of keeping 100,000 live contexts (and the garbage collector's
    passes over them), which the plain pool never pays.
    """
    send, receive = trio.open_memory_channel[tuple[contextvars.Context, int]](n)
    start = time.perf_counter()

    async def worker() -> None:
        async for context, request in receive:
            await context.run(_checkpoint_handler, request)

    def send_with_context(request: int) -> None:
        send.send_nowait((contextvars.copy_context(), request))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
        for i in range(n):
            in_own_context(send_with_context, i)
        send.close()
    return time.perf_counter() - start


async def burst_spawn(n: int, concurrency: int) -> float:
    limiter = trio.CapacityLimiter(concurrency)

    async def one(request: int) -> None:
        async with limiter:
            await _checkpoint_handler(request)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return time.perf_counter() - start


async def burst_aiojobs(n: int, concurrency: int) -> float:
    assert aiojobs is not None
    scheduler = aiojobs.Scheduler(limit=concurrency, pending_limit=n, wait_timeout=None)

    async def job(request: int) -> None:
        await asyncio.sleep(0)

    start = time.perf_counter()
    for i in range(n):
        await scheduler.spawn(job(i))
    await scheduler.wait_and_close()
    return time.perf_counter() - start


# -- trickle: latency from enqueue to handler start on an idle service -----------


async def trickle_tickler(n: int) -> list[float]:
    latencies: list[float] = []
    started_at = 0
    done = trio.Event()

    async def handler(enqueued_ns: int) -> None:
        nonlocal started_at
        started_at = time.perf_counter_ns()
        done.set()

    service = tickler.Service(handler, capacity=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for _ in range(n):
            done = trio.Event()
            await trio.testing.wait_all_tasks_blocked()  # the service is idle
            t0 = time.perf_counter_ns()
            service.enqueue_request(t0)
            await done.wait()
            latencies.append(started_at - t0)
        await service.stop()
    return latencies


async def trickle_pool(n: int) -> list[float]:
    latencies: list[float] = []
    send, receive = trio.open_memory_channel[int](0)
    started_at = 0
    done = trio.Event()

    async def worker() -> None:
        nonlocal started_at
        async for _ in receive:
            started_at = time.perf_counter_ns()
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        for _ in range(n):
            done = trio.Event()
            await trio.testing.wait_all_tasks_blocked()  # the worker is waiting
            t0 = time.perf_counter_ns()
            send.send_nowait(t0)
            await done.wait()
            latencies.append(started_at - t0)
        send.close()
    return latencies


# -- enqueue cost -----------------------------------------------------------------


def bare_append(n: int) -> float:
    lock = threading.Lock()
    queue: collections.deque[int] = collections.deque()
    items = range(n)
    gc.collect()
    start = time.perf_counter_ns()
    for x in items:
        with lock:
            queue.append(x)
    return (time.perf_counter_ns() - start) / n


async def enqueue_cost(n: int, prefill: int = 0) -> float:
    service = tickler.Service(_checkpoint_handler, max_queue_length=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        enqueue = service.enqueue_request
        for i in range(prefill):
            enqueue(i)
        items = range(n)
        # Collect first, as for the baseline: the window then holds the
        # collections its own allocations cause, not those of the prefill.
        gc.collect()
        start = time.perf_counter_ns()
        for x in items:
            enqueue(x)
        elapsed = time.perf_counter_ns() - start
        await service.stop(drain=False)
    return elapsed / n


async def fill_cost(n: int, collector: bool = True) -> float:
    """Average ns per enqueue while filling a fresh running service from empty to n.

    The window holds the garbage collections the growing queue causes (the
    scaling rows, which collect just before their window, mostly miss them),
    or, with collector=False, none: the collector is disabled throughout it.
    """
    service = tickler.Service(_checkpoint_handler, max_queue_length=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        enqueue = service.enqueue_request
        items = range(n)
        gc.collect()
        was_enabled = gc.isenabled()
        if not collector:
            gc.disable()
        try:
            start = time.perf_counter_ns()
            for x in items:
                enqueue(x)
            elapsed = time.perf_counter_ns() - start
        finally:
            if was_enabled:
                gc.enable()
        assert service.statistics().queued == n
        await service.stop(drain=False)
    return elapsed / n


def has_enqueue_many() -> bool:
    """Whether this tickler's Service has enqueue_many."""
    return hasattr(tickler.Service, "enqueue_many")


async def enqueue_many_cost(n: int, many: bool) -> float:
    """Average ns per request: n requests, as a list, by one enqueue_many or n enqueue_request.

    On a fresh running service, after a collection; the window holds the
    collections its own allocations cause.
    """
    service = tickler.Service(_checkpoint_handler, max_queue_length=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        requests = list(range(n))
        gc.collect()
        if many:
            enqueue_many = service.enqueue_many  # type: ignore[attr-defined,unused-ignore]
            start = time.perf_counter_ns()
            enqueue_many(requests)
            elapsed = time.perf_counter_ns() - start
        else:
            enqueue = service.enqueue_request
            start = time.perf_counter_ns()
            for x in requests:
                enqueue(x)
            elapsed = time.perf_counter_ns() - start
        assert service.statistics().queued == n
        await service.stop(drain=False)
    return elapsed / n


# -- memory -------------------------------------------------------------------------


async def memory_per_request(n: int) -> float:
    """Bytes traced per request queued on a running service, beyond the request itself."""
    requests = [object() for _ in range(n)]
    gate = trio.Event()

    async def held(request: object) -> None:
        await gate.wait()

    service = tickler.Service(held, capacity=1, max_queue_length=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        service.enqueue_request(object())  # takes the only slot and holds it
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for request in requests:
            service.enqueue_request(request)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert service.statistics().queued == n
        gate.set()
        await service.stop(drain=False)
    return used / n


# -- the run ----------------------------------------------------------------------


def _machine() -> str:
    return (
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, trio {version('trio')}, "
        f"trio-tickler {version('trio-tickler')}"
        + (f", aiojobs {version('aiojobs')}" if aiojobs is not None else "")
        + (f", huey {version('huey')}" if has_huey() else "")
    )


def run(config: Config, out: Callable[[str], object] = print) -> list[Row]:
    n, c = config.burst, config.concurrency
    pool = "trio memory-channel pool"
    per_request = "a context per request"
    # "tickler, a context per request" is held to its target against the plain
    # pool, which pays for no context at all: the stricter comparison, since an
    # application that wants the request id in its handler pays for the context
    # setup whichever queue it uses. The pool paying the same setup is measured
    # too, and a second tickler row divides by it: that ratio compares like
    # with like, and the pool's own ratio shows what the setup costs.
    # Every tickler row runs the service as a user gets it (histograms on), but the one
    # labelled histograms=False.
    table = {
        "tickler": Row("tickler", "burst", "tickler", [], "req/s", "pool", ("ratio", ">=", 1.25)),
        # The pool carries no context, so run from the enqueuer's context with
        # the variable set it is the same pool; tickler's row divides by that
        # run all the same, so that both sides ran in one context.
        "tickler_var": Row(
            "tickler_var",
            "burst",
            "tickler, a contextvar set",
            [],
            "req/s",
            "pool_var",
            ("ratio", ">=", 1.1),
        ),
        "tickler_ctx": Row(
            "tickler_ctx",
            "burst",
            f"tickler, {per_request}",
            [],
            "req/s",
            "pool",
            ("ratio", ">=", 1.0),
        ),
        "tickler_ctx_like": Row(
            "tickler_ctx_like", "burst", f"tickler, {per_request}", [], "req/s", "pool_ctx"
        ),
        "pool": Row("pool", "burst", pool, [], "req/s"),
        "pool_var": Row("pool_var", "burst", f"{pool}, a contextvar set", [], "req/s", "pool"),
        "pool_ctx": Row("pool_ctx", "burst", f"{pool}, {per_request}", [], "req/s", "pool"),
        "pool_kept": Row(
            "pool_kept",
            "burst",
            f"{pool}, {per_request} kept until a worker takes it",
            [],
            "req/s",
            "pool",
        ),
        "tickler_ctx_kept": Row(
            "tickler_ctx_kept", "burst", f"tickler, {per_request}", [], "req/s", "pool_kept"
        ),
        "spawn": Row("spawn", "burst", "trio spawn per request + limiter", [], "req/s", "pool"),
        "aiojobs": Row("aiojobs", "burst", "aiojobs (asyncio)", [], "req/s", "pool"),
        "vs_aiojobs": Row(
            "vs_aiojobs", "burst", "tickler", [], "req/s", "aiojobs", ("ratio", ">=", 10.0)
        ),
        "wakeups": Row("wakeups", "burst", "tickler wake-ups per request", [], "wakeups/req"),
        # The wait and run time histograms' cost (on by default): the "tickler" row (with
        # them) over the same burst with histograms=False.
        "no_histograms": Row(
            "no_histograms", "burst", "tickler, histograms=False", [], "req/s", "pool"
        ),
        "histograms": Row(
            "histograms",
            "burst",
            "tickler (histograms on, the default)",
            [],
            "req/s",
            "no_histograms",
            ("ratio", ">=", 0.97),
        ),
        # Tracing (tickler.otel), over the burst untraced: instrumented with the API's
        # no-op tracer provider, with the SDK and a sampler that drops every trace
        # (what is not recorded must cost little), with the SDK's and no exporter, and
        # with the SDK's in-memory exporter (each span kept).
        "otel_noop": Row(
            "otel_noop",
            "burst",
            "tickler, traced: NoOpTracerProvider",
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.8),
        ),
        "otel_drop": Row(
            "otel_drop",
            "burst",
            "tickler, traced: SDK, sampler ALWAYS_OFF, enqueued under a dropped trace's span",
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.8),
        ),
        # Each enqueue the root of a trace of its own: the sampler is asked for each.
        "otel_drop_roots": Row(
            "otel_drop_roots",
            "burst",
            "tickler, traced: SDK, sampler ALWAYS_OFF, each enqueue a root",
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.8),
        ),
        # The SDK's default sampler (ParentBased(ALWAYS_ON)), enqueued under a span whose
        # trace an upstream caller did not sample: its children are dropped.
        "otel_drop_parent": Row(
            "otel_drop_parent",
            "burst",
            "tickler, traced: SDK, default sampler, enqueued under a dropped parent",
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.8),
        ),
        "otel_sdk": Row(
            "otel_sdk", "burst", "tickler, traced: SDK, no exporter", [], "req/s", "tickler"
        ),
        "otel_memory": Row(
            "otel_memory",
            "burst",
            "tickler, traced: SDK, InMemorySpanExporter",
            [],
            "req/s",
            "tickler",
        ),
        # The burst with each request in one of 1,000 groups, each group limited
        # to one in flight, over the plain burst of the same round.
        "groups": Row(
            "groups",
            "burst",
            f"tickler, {BURST_GROUPS:,} groups, Limit(concurrency=1)",
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.5),
        ),
        # The burst with half its requests at priority=1, over the plain burst.
        "priorities": Row(
            "priorities",
            "burst",
            "tickler, every other request priority=1",
            [],
            "req/s",
            "tickler",
        ),
        "sqlite": Row(
            "sqlite",
            "burst",
            'tickler, SqliteStore(synchronous="FULL"), to the last commit',
            [],
            "req/s",
            "tickler",
            ("ratio", ">=", 0.2),
        ),
        # A drain of requests already in the file: tickler's store and huey's.
        "sqlite_drain": Row(
            "sqlite_drain",
            "sqlite drain",
            f'tickler SqliteStore(synchronous="FULL"), capacity={c}',
            [],
            "req/s",
            "huey",
        ),
        "sqlite_drain_h1": Row(
            "sqlite_drain_h1",
            "sqlite drain",
            f'tickler SqliteStore(synchronous="FULL"), capacity={c}',
            [],
            "req/s",
            "huey1",
        ),
        "huey": Row(
            "huey", "sqlite drain", f"huey SqliteHuey(fsync=True), {c} thread workers", [], "req/s"
        ),
        "huey1": Row(
            "huey1",
            "sqlite drain",
            "huey SqliteHuey(fsync=True), 1 worker (its default)",
            [],
            "req/s",
            "huey",
        ),
        "submit_p50": Row("submit_p50", "submit p50", "SqliteStore FULL, call to commit", [], "us"),
        "submit_p99": Row("submit_p99", "submit p99", "SqliteStore FULL, call to commit", [], "us"),
        "p50": Row("p50", "trickle p50", "tickler", [], "us", "p50_pool", ("ratio", "<=", 1.5)),
        "p50_pool": Row("p50_pool", "trickle p50", "worker pool hand-off", [], "us"),
        "p99": Row("p99", "trickle p99", "tickler", [], "us", "p99_pool"),
        "p99_pool": Row("p99_pool", "trickle p99", "worker pool hand-off", [], "us"),
        "enqueue": Row(
            "enqueue", "enqueue", "tickler", [], "ns/call", "bare", ("ratio", "<=", 5.0)
        ),
        "enqueue_var": Row(
            "enqueue_var",
            "enqueue",
            "tickler, a contextvar set",
            [],
            "ns/call",
            "bare",
            ("ratio", "<=", 5.0),
        ),
        "bare": Row("bare", "enqueue", "bare `with lock: deque.append(x)`", [], "ns/call"),
        # One enqueue_many of a list against enqueue_request over the same
        # list: a ratio of 0.5x or less is a speed-up of 2x or more.
        "enqueue_many": Row(
            "enqueue_many",
            "enqueue_many",
            f"tickler enqueue_many, a list of {config.enqueue_calls:,}",
            [],
            "ns/req",
            "enqueue_loop",
            ("ratio", "<=", 0.5),
        ),
        "enqueue_loop": Row(
            "enqueue_loop",
            "enqueue_many",
            f"tickler enqueue_request, {config.enqueue_calls:,} calls over the list",
            [],
            "ns/req",
        ),
        # Shown after the PostgreSQL batch rows (see the end of run()).
        "sqlite_many": Row(
            "sqlite_many",
            "sqlite enqueue",
            f"tickler SqliteStore.enqueue_many_in, {config.postgres.batch:,} requests"
            " in one caller transaction",
            [],
            "req/s",
            "sqlite_batch",
        ),
        "sqlite_batch": Row(
            "sqlite_batch",
            "sqlite enqueue",
            f"tickler SqliteStore.enqueue_in, {config.postgres.batch:,} calls"
            " in one caller transaction",
            [],
            "req/s",
        ),
    }
    first = config.prefill[0]
    for prefill in config.prefill:
        table[f"scaling{prefill}"] = Row(
            f"scaling{prefill}",
            "scaling",
            f"enqueue with {prefill:,} queued",
            [],
            "ns/call",
            None if prefill == first else f"scaling{first}",
            None if prefill == first else ("ratio", "<=", 1.5),
        )
    # Informational: the fill's ratio is what the collector and a growing
    # queue add to an enqueue, over the scaling row with the fewest queued.
    table["fill"] = Row(
        "fill", "scaling", f"fill from empty to {config.fill:,}", [], "ns/call", f"scaling{first}"
    )
    table["fill_nogc"] = Row(
        "fill_nogc",
        "scaling",
        f"fill from empty to {config.fill:,}, gc disabled",
        [],
        "ns/call",
        f"scaling{first}",
    )
    table["memory"] = Row(
        "memory", "memory", "per queued request", [], "bytes", None, ("value", "<=", 160)
    )
    table["memory_var"] = Row(
        "memory_var",
        "memory",
        "per queued request, a contextvar set",
        [],
        "bytes",
        None,
        ("value", "<=", 160),
    )

    def sample(key: str, value: float) -> None:
        table[key].samples.append(value)

    for round_no in range(config.rounds):
        out(f"  round {round_no + 1}/{config.rounds}: burst")
        # Each tickler variant runs next to the pool it is divided by.
        elapsed, wakeups = in_context(False, trio.run, burst_tickler, n, c)
        sample("tickler", n / elapsed)
        sample("vs_aiojobs", n / elapsed)
        sample("wakeups", wakeups)
        sample("histograms", n / elapsed)
        sample("pool", n / in_context(False, trio.run, burst_pool, n, c))
        timed = in_context(False, trio.run, burst_tickler, n, c, False, False)[0]
        sample("no_histograms", n / timed)
        if has_otel():
            for tracing in ("noop", "drop", "drop_roots", "drop_parent", "sdk", "memory"):
                args = (n, c, False, None, False, 0, tracing)
                timed = in_context(False, trio.run, burst_tickler, *args)[0]
                sample(f"otel_{tracing}", n / timed)
        sample("tickler_var", n / in_context(True, trio.run, burst_tickler, n, c)[0])
        sample("pool_var", n / in_context(True, trio.run, burst_pool, n, c))
        elapsed = in_context(False, trio.run, burst_tickler, n, c, True)[0]
        sample("tickler_ctx", n / elapsed)
        sample("tickler_ctx_like", n / elapsed)
        sample("pool_ctx", n / in_context(False, trio.run, burst_pool, n, c, True))
        sample("tickler_ctx_kept", n / elapsed)
        sample("pool_kept", n / in_context(False, trio.run, burst_pool_keeping_contexts, n, c))
        sample("spawn", n / in_context(False, trio.run, burst_spawn, n, c))
        if aiojobs is not None:
            sample("aiojobs", n / in_context(False, asyncio.run, burst_aiojobs(n, c)))
        timed = in_context(False, trio.run, burst_tickler, n, c, False, None, True)[0]
        sample("priorities", n / timed)
        timed = in_context(False, trio.run, burst_tickler, n, c, False, None, False, BURST_GROUPS)[
            0
        ]
        sample("groups", n / timed)
        sample("sqlite", n / in_context(False, trio.run, burst_sqlite, n, c))

        out(f"  round {round_no + 1}/{config.rounds}: sqlite drain and enqueue")
        d = config.sqlite_drain
        elapsed = in_context(False, trio.run, drain_sqlite, d, c)
        sample("sqlite_drain", d / elapsed)
        sample("sqlite_drain_h1", d / elapsed)
        if has_huey():
            sample("huey", d / in_context(False, drain_huey, d, c))
            sample("huey1", d / in_context(False, drain_huey, d, 1))
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "queue.db"
            tickler.SqliteStore(path).create_schema()
            # The two ways take turns as to which goes first.
            for many in (True, False) if round_no % 2 == 0 else (False, True):
                rate = in_context(False, sqlite_bulk, path, config.postgres.batch, many)
                sample("sqlite_many" if many else "sqlite_batch", rate)

        out(f"  round {round_no + 1}/{config.rounds}: submit")
        latencies = in_context(False, trio.run, submit_latencies, config.submits)
        sample("submit_p50", statistics.median(latencies) / 1000)
        sample("submit_p99", statistics.quantiles(latencies, n=100)[98] / 1000)

        out(f"  round {round_no + 1}/{config.rounds}: trickle")
        for key, latencies in (
            ("p50", in_context(False, trio.run, trickle_tickler, config.trickle)),
            ("p50_pool", in_context(False, trio.run, trickle_pool, config.trickle)),
        ):
            sample(key, statistics.median(latencies) / 1000)
            sample(key.replace("50", "99"), statistics.quantiles(latencies, n=100)[98] / 1000)

        out(f"  round {round_no + 1}/{config.rounds}: enqueue and scaling")
        e = config.enqueue_calls
        sample("bare", bare_append(config.enqueue_calls))
        sample("enqueue", in_context(False, trio.run, enqueue_cost, config.enqueue_calls))
        sample("enqueue_var", in_context(True, trio.run, enqueue_cost, config.enqueue_calls))
        sample("enqueue_loop", in_context(False, trio.run, enqueue_many_cost, e, False))
        if has_enqueue_many():
            sample("enqueue_many", in_context(False, trio.run, enqueue_many_cost, e, True))
        for prefill in config.prefill:
            cost = in_context(False, trio.run, enqueue_cost, config.enqueue_calls, prefill)
            sample(f"scaling{prefill}", cost)
        sample("fill", in_context(False, trio.run, fill_cost, config.fill))
        sample("fill_nogc", in_context(False, trio.run, fill_cost, config.fill, False))

        sample("memory", in_context(False, trio.run, memory_per_request, config.memory))
        sample("memory_var", in_context(True, trio.run, memory_per_request, config.memory))
    # The SQLite batch rows go beside the PostgreSQL ones.
    sqlite_enqueue = [table.pop("sqlite_many"), table.pop("sqlite_batch")]
    pg = postgres.run(config.postgres, out)
    at = next((i + 1 for i, row in enumerate(pg) if row.key == "pg_batch_proc"), len(pg))
    return [*table.values(), *pg[:at], *sqlite_enqueue, *pg[at:]]


def _collector_share(rows: dict[str, Row]) -> str:
    """What the collector adds to a fill, per enqueue, as a clause; '' unmeasured."""
    fill, nogc = rows["fill"], rows["fill_nogc"]
    if not fill.samples or not nogc.samples:
        return ""
    cost = fill.median - nogc.median
    return f" (the collector: {cost:,.0f} ns per enqueue, {cost / fill.median:.0%} of the fill)"


def render(table: list[Row], config: Config) -> str:
    rows = {row.key: row for row in table}
    lines = markdown(table)
    lines.append("")
    if "tickler" in rows:  # not with --postgres-only
        lines += _in_memory_notes(rows, config)
    lines += postgres.notes(config.postgres)
    return "\n".join(lines)


def _in_memory_notes(rows: dict[str, Row], config: Config) -> list[str]:
    lines = [
        f"Burst: {config.burst:,} no-op requests (one checkpoint each) at concurrency"
        f" {config.concurrency}, all enqueued at once; tickler"
        f" {1e6 / rows['tickler'].median:.2f} us/request. Trickle: {config.trickle:,} requests"
        f" on an idle service. Enqueue: {config.enqueue_calls:,} calls in a row, garbage"
        f" collection included. Scaling: {config.enqueue_calls:,} calls after a collection"
        f" with the queue pre-filled; a fill enqueues {config.fill:,} requests into an empty"
        f" queue, its collections included{_collector_share(rows)}."
        f" Medians of {config.rounds} rounds.",
        f"Burst with priorities: the burst with every other request enqueued with"
        f" priority=1 ({config.burst // 2:,} of {config.burst:,}), over the plain burst of"
        f" the same round.",
        f"Burst with groups: the burst with request i in group g{{i % {BURST_GROUPS}}}"
        f" (names made before the clock starts) on a service with"
        f" limits=tickler.Limit(concurrency=1), over the plain burst of the same round.",
        _enqueue_many_note(rows, config),
        f"SQLite drain: {config.sqlite_drain:,} no-op requests written to a fresh file in one"
        f" transaction before the worker starts (tickler: SqliteStore.enqueue_many_in; huey:"
        f" its enqueue's INSERT of each serialized task, as it has no batch enqueue), then"
        f" timed from the worker's start to the last request run (tickler: service.join(),"
        f" its outcomes committed; huey: its consumer in this process, thread workers,"
        f" periodic tasks off, to the last task's return; it deletes each task at its dequeue"
        f" and stores no None result). Both synchronous=FULL, WAL, on the same file system.",
        f"SQLite enqueue: {config.postgres.batch:,} requests in one BEGIN ... COMMIT on the"
        f" caller's sqlite3 connection (synchronous=FULL), COMMIT included, the two ways taking"
        f" turns; medians of {config.rounds} rounds.",
        f"Machine: {_machine()}.",
    ]
    if aiojobs is None:
        lines.append("aiojobs skipped: install the bench extra (pip install -e '.[bench]').")
    if not has_huey():
        lines.append("huey skipped: install the bench extra (pip install -e '.[bench]').")
    return lines


def _enqueue_many_note(rows: dict[str, Row], config: Config) -> str:
    """The enqueue_many rows' line: their speed-up, or why they were skipped."""
    many, loop = rows["enqueue_many"], rows["enqueue_loop"]
    head = (
        f"enqueue_many: one call with a list of {config.enqueue_calls:,} requests against"
        f" enqueue_request called over the same list, per request, collections included"
    )
    if not has_enqueue_many():
        return f"{head}: skipped, this tickler's Service has no enqueue_many."
    if not many.samples or not loop.samples:
        return f"{head}: not measured."
    return f"{head}: a speed-up of {loop.median / many.median:.2f}x (target 2x)."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--rounds", type=int, help="rounds per workload (default 5)")
    parser.add_argument(
        "--postgres-only", action="store_true", help="only the PostgreSQL rows (bench/postgres.py)"
    )
    parser.add_argument(
        "--postgres-rounds", type=int, help="rounds of the PostgreSQL rows (default 1)"
    )
    parser.add_argument(
        "--only",
        choices=("drain", "tickler-drain"),
        help="with --postgres-only: only these PostgreSQL rows (drain: every system's drain,"
        " no latency nor enqueue rows; tickler-drain: tickler's two drains alone)",
    )
    parser.add_argument(
        "--admin",
        action="store_true",
        help="only the admin API's rows on a PostgreSQL queue of 1,000,000 (bench/admin.py)",
    )
    parser.add_argument(
        "--rescue-only",
        action="store_true",
        help="only the rescue rows (bench/rescue.py): from SIGKILL to the rescued start",
    )
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help="disable the garbage collector for the whole run, to see what it costs",
    )
    args = parser.parse_args(argv)
    if args.rescue_only:
        from . import rescue

        rescue.main(["--rounds", str(args.rounds or 5)])
        return
    if args.no_gc:
        gc.disable()
    config = QUICK if args.quick else Config()
    if args.rounds is not None:
        config.rounds = args.rounds
    if args.postgres_rounds is not None:
        config.postgres.rounds = args.postgres_rounds
    if args.only is not None:
        if not args.postgres_only:
            parser.error("--only goes with --postgres-only")
        config.postgres.only = args.only
    print(f"running the {'quick' if args.quick else 'full'} benchmark", file=sys.stderr)

    def out(line: str) -> None:
        print(line, file=sys.stderr)

    if args.admin:
        from . import admin

        rows = admin.run(admin.QUICK if args.quick else admin.AdminConfig(), out)
        print("\n".join(markdown(rows)))
        return
    table = postgres.run(config.postgres, out) if args.postgres_only else run(config, out)
    print(render(table, config))
    if args.no_gc:
        print(
            "The garbage collector was disabled for this run (--no-gc): rows said to include"
            " collection include none."
        )
    if args.quick:
        print("Quick run: a smoke check. Its sizes are too small to judge the targets.")


if __name__ == "__main__":
    main()
