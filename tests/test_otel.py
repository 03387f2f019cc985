"""tickler.otel: spans in memory, read back from the OpenTelemetry SDK's in-memory exporter.

Across processes (the trace context in a store's rows): tests/test_otel_processes.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import tickler
from tickler.otel import instrument, instrument_store, uninstrument, uninstrument_store

FAST: dict[str, Any] = {"poll_interval": 0.05, "lease": 2.0}


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name.startswith(prefix)]


def attempts_of(exporter: InMemorySpanExporter, request_id: int) -> list[ReadableSpan]:
    found = [
        span
        for span in named(exporter, "process ")
        if span.attributes and span.attributes.get("messaging.message.id") == str(request_id)
    ]
    return sorted(found, key=lambda span: int(span.attributes["tickler.attempt"]))  # type: ignore[index,arg-type]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_one_trace_holds_the_web_request_the_enqueue_and_both_attempts(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    failures = [ValueError("flaky")]

    async def handler(request: int) -> int:
        if failures:
            raise failures.pop()
        return request * 2

    retry = tickler.Retry(attempts=3, initial=1.0, jitter=False)
    async with tickler.open_service(handler, retry=retry, name="mail") as service:
        instrument(service, tracer_provider=provider)
        # A span as a web framework opens one around each HTTP request.
        with provider.get_tracer("web").start_as_current_span("GET /signup") as web:
            ticket = service.enqueue_request(21)
        assert await ticket.wait() == 42
    (enqueue,) = named(exporter, "send mail")
    first, second = attempts_of(exporter, ticket.id)
    trace_id = web.get_span_context().trace_id
    assert {s.context.trace_id for s in (enqueue, first, second)} == {trace_id}
    assert enqueue.kind is SpanKind.PRODUCER
    assert parent_id(enqueue) == web.get_span_context().span_id
    # Each attempt is a child of the enqueue span, the retry a span of its own.
    assert parent_id(first) == parent_id(second) == enqueue.context.span_id
    assert first.kind is second.kind is SpanKind.CONSUMER
    assert first.attributes is not None
    assert second.attributes is not None
    assert first.attributes["tickler.outcome"] == "retrying"
    assert first.attributes["tickler.retry.delay"] == pytest.approx(1.0)
    assert first.status.status_code is StatusCode.ERROR
    assert [event.name for event in first.events] == ["exception"]
    assert first.events[0].attributes["exception.type"] == "ValueError"  # type: ignore[index]
    assert second.attributes["tickler.outcome"] == "succeeded"
    assert second.attributes["tickler.attempt"] == 2
    assert first.attributes["messaging.system"] == "tickler"
    assert first.attributes["messaging.destination.name"] == "mail"


async def test_a_cancelled_request_s_span_says_so(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    started = trio.Event()

    async def handler(request: object) -> None:
        started.set()
        await trio.sleep_forever()

    async with tickler.open_service(handler) as service:
        instrument(service, tracer_provider=provider)
        ticket = service.enqueue_request("x")
        await started.wait()
        assert await service.cancel(ticket.id)
        with pytest.raises(tickler.RequestCancelled):
            await ticket.wait()
    (attempt,) = attempts_of(exporter, ticket.id)
    assert attempt.attributes is not None
    assert attempt.attributes["tickler.outcome"] == "cancelled"


async def test_a_final_failure_records_its_exception(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans

    async def handler(request: object) -> None:
        raise KeyError("gone")

    async with tickler.open_service(handler, on_error=lambda ticket, exc: None) as service:
        instrument(service, tracer_provider=provider)
        ticket = service.enqueue_request("x", key="k", priority=3)
        with pytest.raises(KeyError):
            await ticket.wait()
    (attempt,) = attempts_of(exporter, ticket.id)
    assert attempt.attributes is not None
    assert attempt.attributes["tickler.outcome"] == "failed"
    assert attempt.attributes["tickler.key"] == "k"
    assert attempt.attributes["tickler.priority"] == 3
    assert attempt.attributes["error.type"] == "KeyError"
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.events[0].attributes["exception.message"] == "'gone'"  # type: ignore[index]


async def test_the_handler_runs_in_its_attempt_span(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("app")

    async def handler(request: object) -> None:
        with tracer.start_as_current_span("send the mail"):
            await trio.sleep(0.1)

    limits = {"mailer": tickler.Limit(concurrency=5)}  # (a group is kept where it has a limit)
    async with tickler.open_service(handler, limits=limits) as service:
        instrument(service, tracer_provider=provider)
        tickets = service.enqueue_many(["a", "b"], group="mailer")
        for ticket in tickets:
            await ticket.wait()
    (enqueue,) = named(exporter, "send tickler")
    assert enqueue.attributes is not None
    assert enqueue.attributes["messaging.batch.message_count"] == 2
    inner = named(exporter, "send the mail")
    assert len(inner) == 2
    for ticket in tickets:
        (attempt,) = attempts_of(exporter, ticket.id)
        assert parent_id(attempt) == enqueue.context.span_id
        assert attempt.attributes is not None
        assert attempt.attributes["tickler.group"] == "mailer"
        assert any(parent_id(span) == attempt.context.span_id for span in inner)


async def test_instrumented_while_running_and_turned_off_again(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans

    async def handler(request: object) -> None:
        await trio.sleep(1)

    async with tickler.open_service(handler, capacity=1) as service:
        await service.enqueue_request("before").wait()  # its processor parks, then goes on
        instrument(service, tracer_provider=provider)
        traced = service.enqueue_request("traced")
        await traced.wait()
        uninstrument(service)
        untraced = service.enqueue_request("after")
        await untraced.wait()
    assert [span.attributes["messaging.message.id"] for span in named(exporter, "process ")] == [  # type: ignore[index]
        str(traced.id)
    ]
    assert len(named(exporter, "send ")) == 1


async def test_a_periodic_tick_starts_a_new_trace(
    autojump_clock: trio.abc.Clock, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    done = trio.Event()

    async def handler(request: object) -> None:
        done.set()

    service = tickler.Service(handler, periodic=[tickler.Periodic("tick", "t", every=10)])
    instrument(service, tracer_provider=provider)
    tracer = provider.get_tracer("app")
    async with trio.open_nursery() as nursery:
        with tracer.start_as_current_span("startup") as startup:
            await nursery.start(service.run)
        await done.wait()
        await service.stop()
    (attempt,) = named(exporter, "process ")
    (enqueue,) = named(exporter, "send ")
    assert parent_id(attempt) == enqueue.context.span_id
    assert enqueue.parent is None  # a root: not under the span the run started in
    assert attempt.context.trace_id != startup.get_span_context().trace_id


async def test_each_store_batch_has_a_span_with_its_counts(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans

    async def handler(request: int) -> int:
        return request

    store = tickler.SqliteStore(tmp_path / "q.db", **FAST)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        instrument(service, tracer_provider=provider)
        with provider.get_tracer("web").start_as_current_span("POST /jobs") as web:
            tickets = [service.enqueue_request(n) for n in range(3)]
        for ticket in tickets:
            assert await ticket.wait() == ticket.request
    batches = named(exporter, "exchange jobs")
    assert batches
    totals: dict[str, int] = {}
    for batch in batches:
        assert batch.kind is SpanKind.INTERNAL
        assert batch.parent is None
        for name in ("tickler.batch.inserted", "tickler.batch.claimed", "tickler.batch.written"):
            totals[name] = totals.get(name, 0) + int(batch.attributes[name])  # type: ignore[index,arg-type]
    assert totals == {
        "tickler.batch.inserted": 3,
        "tickler.batch.claimed": 3,
        "tickler.batch.written": 3,
    }
    enqueues = {span.context.span_id for span in named(exporter, "send jobs")}
    assert len(enqueues) == 3
    linked = [link.context.span_id for batch in batches for link in batch.links]
    assert sorted(linked) == sorted(enqueues)
    parents = set()
    for ticket in tickets:
        (attempt,) = attempts_of(exporter, ticket.id)
        assert attempt.context.trace_id == web.get_span_context().trace_id
        parents.add(parent_id(attempt))
        assert attempt.attributes["tickler.outcome"] == "succeeded"  # type: ignore[index]
    assert parents == enqueues


def test_instrument_refuses_what_is_not_a_service() -> None:
    with pytest.raises(TypeError, match=r"service must be a tickler\.Service"):
        instrument(object())  # type: ignore[arg-type]

    async def handler(request: object) -> None:
        pass

    with pytest.raises(TypeError, match="tracer_provider must be"):
        instrument(tickler.Service(handler), tracer_provider=object())  # type: ignore[arg-type]


def test_untraced_services_never_import_opentelemetry(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sqlite3
        import sys
        import trio
        import tickler

        async def handler(request):
            return request

        async def main():
            async with tickler.open_service(handler, histograms=True) as service:
                assert await service.enqueue_request(1).wait() == 1
            store = tickler.SqliteStore({str(tmp_path / "q.db")!r}, poll_interval=0.05)
            async with tickler.open_service(handler, store=store) as service:
                assert await service.enqueue_request(2).wait() == 2
                await service.submit(3)

        trio.run(main)
        # A producer's transactional enqueues, through its own connection.
        store = tickler.SqliteStore({str(tmp_path / "q.db")!r})
        with sqlite3.connect(store.path) as connection:
            store.enqueue_in(connection, "jobs", 4)
            store.enqueue_many_in(connection, "jobs", [5, 6])
        connection.close()
        assert store._tracer is None
        loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
        print(loaded)
        """
    )
    done = subprocess.run(  # noqa: S603 - our own interpreter running our own script
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
    # The same script, instrumented, does import it: the check can see an import.
    traced = script.replace(
        "async with tickler.open_service(handler, histograms=True) as service:",
        "async with tickler.open_service(handler, histograms=True) as service:\n"
        "        __import__('importlib').import_module('tickler.otel').instrument(service)",
    )
    done = subprocess.run(  # noqa: S603 - our own interpreter running our own script
        [sys.executable, "-c", traced], capture_output=True, text=True, timeout=60, check=True
    )
    assert "'opentelemetry.trace'" in done.stdout


# -- A store's enqueue_in and enqueue_many_in


def rows_trace(path: Path) -> dict[int, tuple[str | None, str | None]]:
    import sqlite3

    with sqlite3.connect(path) as db:
        found = db.execute("SELECT id, traceparent, tracestate FROM tickler_requests").fetchall()
    db.close()
    return {row[0]: (row[1], row[2]) for row in found}


def traceparent_of(span: ReadableSpan) -> str:
    assert span.context is not None
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def test_enqueue_in_makes_a_producer_span_and_writes_its_trace_context_into_the_rows(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    import sqlite3

    provider, exporter = spans
    web = provider.get_tracer("web")
    store = tickler.SqliteStore(tmp_path / "q.db")
    store.create_schema()
    # Off: no span, no trace context in the row.
    with sqlite3.connect(store.path) as connection:
        untraced = store.enqueue_in(connection, "jobs", 0)
    instrument_store(store, tracer_provider=provider)
    with (
        web.start_as_current_span("POST /orders") as request_span,
        sqlite3.connect(store.path) as connection,
    ):
        one = store.enqueue_in(connection, "jobs", 1, key="k")
        held = store.enqueue_in(connection, "jobs", 2, key="k")
        many = store.enqueue_many_in(connection, "jobs", [3, 4, 5], key=lambda r: f"m{r % 2}")
        assert store.enqueue_many_in(connection, "jobs", []) == []
    connection.close()
    assert held == one
    first, second, batch = named(exporter, "send jobs")
    for span in (first, second, batch):
        assert span.kind is SpanKind.PRODUCER
        assert parent_id(span) == request_span.get_span_context().span_id
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == "tickler"
        assert span.attributes["messaging.destination.name"] == "jobs"
    assert first.attributes is not None
    assert batch.attributes is not None
    assert first.attributes["messaging.message.id"] == str(one)
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in batch.attributes
    # Each row written holds its enqueue span's context; a key met again writes no row.
    assert rows_trace(store.path) == {
        untraced: (None, None),
        one: (traceparent_of(first), None),
        many[0]: (traceparent_of(batch), None),
        many[1]: (traceparent_of(batch), None),
    }
    assert many[2] == many[0]
    uninstrument_store(store)
    with sqlite3.connect(store.path) as connection:
        off = store.enqueue_in(connection, "jobs", 6)
    connection.close()
    assert rows_trace(store.path)[off] == (None, None)
    assert len(named(exporter, "send jobs")) == 3


def test_a_rolled_back_enqueue_in_writes_nothing_and_its_span_says_why(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    import sqlite3

    provider, exporter = spans
    store = tickler.SqliteStore(tmp_path / "q.db")
    instrument_store(store, tracer_provider=provider)
    connection = sqlite3.connect(store.path)
    with pytest.raises(tickler.StoreError, match="no tickler schema"):
        store.enqueue_in(connection, "jobs", 1)
    connection.close()
    (span,) = named(exporter, "send jobs")
    assert span.status.status_code is StatusCode.ERROR
    assert [event.name for event in span.events] == ["exception"]


async def test_instrument_of_a_service_traces_its_stores_enqueue_in(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    import sqlite3

    provider, exporter = spans

    async def handler(request: object) -> object:
        return request

    store = tickler.SqliteStore(tmp_path / "q.db", **FAST)
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        instrument(service, tracer_provider=provider)
        with sqlite3.connect(store.path) as connection:
            traced = store.enqueue_in(connection, "jobs", 1, delay=60.0)
        connection.close()
        uninstrument(service)
        with sqlite3.connect(store.path) as connection:
            untraced = store.enqueue_in(connection, "jobs", 2, delay=60.0)
        connection.close()
        await service.stop(drain=False)
    (send,) = named(exporter, "send jobs")
    assert rows_trace(store.path) == {
        traced: (traceparent_of(send), None),
        untraced: (None, None),
    }


def test_instrument_store_refuses_what_is_not_a_store() -> None:
    with pytest.raises(TypeError, match=r"store must be a tickler\.SqliteStore or PostgresStore"):
        instrument_store(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tracer_provider must be"):
        instrument_store(tickler.SqliteStore("x.db"), tracer_provider=object())  # type: ignore[arg-type]


class CountedKey:
    """A key that counts how often it is made into text (a span attribute's value)."""

    made = 0

    def __hash__(self) -> int:
        return 1

    def __str__(self) -> str:
        CountedKey.made += 1
        return "counted"


def provider_of(kind: str) -> Any:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
    from opentelemetry.trace import NoOpTracerProvider

    if kind == "no-op provider":
        return NoOpTracerProvider()
    if kind == "a sampler that drops":
        return TracerProvider(sampler=ALWAYS_OFF)
    return TracerProvider()


@pytest.mark.parametrize("kind", ["no-op provider", "a sampler that drops", "the SDK, recording"])
async def test_an_attempt_that_is_not_recorded_builds_no_attributes(
    autojump_clock: trio.abc.Clock, kind: str
) -> None:
    from opentelemetry import trace

    seen: list[bool] = []

    async def handler(request: int) -> int:
        seen.append(trace.get_current_span().is_recording())
        return request

    CountedKey.made = 0
    async with tickler.open_service(handler, name="mail") as service:
        instrument(service, tracer_provider=provider_of(kind))
        ticket = service.enqueue_request(1, key=CountedKey(), priority=3, group="g")
        assert await ticket.wait() == 1
    recording = kind == "the SDK, recording"
    assert seen == [recording]
    # The key is made into text for a span that records, and only then.
    assert CountedKey.made == (1 if recording else 0)


@pytest.mark.parametrize("kind", ["no-op provider", "a sampler that drops"])
async def test_an_enqueue_span_that_is_not_recorded_carries_its_context_on(
    autojump_clock: trio.abc.Clock, kind: str, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    from opentelemetry import trace

    web_provider, _ = spans
    current: list[trace.SpanContext] = []

    async def handler(request: int) -> None:
        current.append(trace.get_current_span().get_span_context())

    async with tickler.open_service(handler, name="mail") as service:
        instrument(service, tracer_provider=provider_of(kind))
        with web_provider.get_tracer("web").start_as_current_span("GET /") as web:
            await service.enqueue_request(1).wait()
        await service.enqueue_request(2).wait()  # no span current where it was enqueued
    # The no-op tracer carries the enqueuer's span context on; a dropped trace keeps
    # its trace id (a dropping sampler makes a root of its own under the web span's).
    first, second = current
    if kind == "no-op provider":
        assert first == web.get_span_context()
        assert not second.is_valid
    else:
        for context in (first, second):
            assert context.is_valid
            assert not context.trace_flags.sampled
        assert first.trace_id == web.get_span_context().trace_id


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
async def test_an_idle_service_polls_without_spans_and_a_busy_batch_makes_one(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    store_kind: str,
) -> None:
    provider, exporter = spans
    if store_kind == "sqlite":
        store: Any = tickler.SqliteStore(tmp_path / "q.db", **FAST)
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        schema = request.getfixturevalue("postgres_schema")
        store = tickler.PostgresStore(dsn, schema=schema, **FAST)

    async def handler(request: int) -> int:
        return request

    ended = 0
    polled = trio.Event()
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        instrument(service, tracer_provider=provider)
        tracing = service._tracer
        assert tracing is not None
        batch_ended = tracing.batch_ended

        def counted(*args: Any) -> None:  # counts the batches; the tracing itself runs
            nonlocal ended
            ended += 1
            if ended == 8:
                polled.set()
            batch_ended(*args)

        tracing.batch_ended = counted  # type: ignore[method-assign,assignment]
        # Eight polls of an idle queue (poll_interval 0.05 s).
        with trio.move_on_after(10):
            await polled.wait()
        assert polled.is_set(), f"only {ended} batches of an idle service in 10 s"
        assert named(exporter, "exchange ") == []
        ticket = service.enqueue_request(7)
        assert await ticket.wait() == 7
    batches = named(exporter, "exchange jobs")
    assert batches
    for batch in batches:
        attributes = batch.attributes or {}
        counts = [attributes[f"tickler.batch.{n}"] for n in ("inserted", "written", "claimed")]
        assert any(counts), attributes


class SpanStarts:
    """Counts the spans the SDK's tracers start, from ``count_on`` until the monkeypatch
    is undone (each still started as the SDK starts it)."""

    def __init__(self) -> None:
        self.count = 0

    def count_on(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from opentelemetry.sdk.trace import Tracer

        start_span = Tracer.start_span

        def counted(tracer: Tracer, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return start_span(tracer, *args, **kwargs)

        monkeypatch.setattr(Tracer, "start_span", counted)


async def test_a_sampler_that_drops_every_span_starts_none_in_memory(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    provider = TracerProvider(sampler=ALWAYS_OFF)
    started = SpanStarts()

    seen: dict[int, trace.SpanContext] = {}

    async def handler(request: int) -> int:
        seen[request] = trace.get_current_span().get_span_context()
        return request * 2

    async with tickler.open_service(handler, name="mail") as service:
        instrument(service, tracer_provider=provider)
        with provider.get_tracer("web").start_as_current_span("GET /") as web:
            started.count_on(monkeypatch)
            tickets = [service.enqueue_request(i) for i in range(3)]
        tickets += [service.enqueue_request(i) for i in range(3, 6)]  # each a root
        assert [await ticket.wait() for ticket in tickets] == [0, 2, 4, 6, 8, 10]
    assert started.count == 0  # the sampler's decision is known: no span is started
    assert service.statistics().succeeded == 6
    # Under the dropped web span, its context is carried on; the roots get new unsampled ones.
    assert [seen[i] for i in range(3)] == [web.get_span_context()] * 3
    for i in range(3, 6):
        assert seen[i].is_valid, seen[i]
        assert not seen[i].trace_flags.sampled, seen[i]


class SamplesEverything:
    """A sampler of the application's own (not one of the SDK's): it samples every span,
    whatever its parent, and counts how often it is asked."""

    def __new__(cls) -> Any:
        from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

        class Counting(Sampler):
            asked = 0

            def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
                Counting.asked += 1
                return SamplingResult(Decision.RECORD_AND_SAMPLE)

            def get_description(self) -> str:
                return "SamplesEverything"

        return Counting()


def dropped_web_span(web_provider: TracerProvider) -> Any:
    """A web request's span under an upstream traceparent that was not sampled (…-00)."""
    from opentelemetry import trace

    upstream = trace.NonRecordingSpan(
        trace.SpanContext(0x5CE4E, 0xCA11E4, is_remote=True, trace_flags=trace.TraceFlags(0))
    )
    return web_provider.get_tracer("web").start_as_current_span(
        "GET /", context=trace.set_span_in_context(upstream)
    )


async def test_a_sampler_of_the_application_decides_the_children_of_a_dropped_trace(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Only the SDK's own samplers' decisions are known without asking them: this one samples
    # the enqueue and the attempt of a request enqueued under a dropped trace's span.
    exporter = InMemorySpanExporter()
    sampler = SamplesEverything()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def handler(request: int) -> None:
        await trio.sleep(0)

    async with tickler.open_service(handler, name="mail") as service:
        instrument(service, tracer_provider=provider)
        with dropped_web_span(TracerProvider()) as web:
            assert not web.get_span_context().trace_flags.sampled
            ticket = service.enqueue_request(1)
        await ticket.wait()
    (enqueue,) = named(exporter, "send mail")
    (attempt,) = attempts_of(exporter, ticket.id)
    assert parent_id(enqueue) == web.get_span_context().span_id
    assert parent_id(attempt) == enqueue.context.span_id
    assert type(sampler).asked == 2


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_dropped_trace_starts_no_span_per_request_under_the_default_sampler(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    where: str,
) -> None:
    # The SDK's default sampler, ParentBased(ALWAYS_ON): a child of a parent that was not
    # sampled, local or (through a row's traceparent) remote, is dropped, as it decides.
    from opentelemetry import trace

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    started = SpanStarts()

    seen: list[trace.SpanContext] = []

    async def handler(request: int) -> int:
        seen.append(trace.get_current_span().get_span_context())
        return request

    store = tickler.SqliteStore(tmp_path / "q.db", **FAST) if where == "sqlite" else None
    async with tickler.open_service(handler, name="mail", store=store) as service:
        instrument(service, tracer_provider=provider)
        with dropped_web_span(provider) as web:
            started.count_on(monkeypatch)
            tickets = [service.enqueue_request(i) for i in range(5)]
        assert [await ticket.wait() for ticket in tickets] == list(range(5))
        monkeypatch.undo()
    # Store batches may make spans of their own (not part of any request's trace).
    assert not [span for span in exporter.get_finished_spans() if span.name != "exchange mail"]
    requests = started.count - len(named(exporter, "exchange "))
    assert requests == 0, f"{requests} spans started for the requests of a dropped trace"
    web_context = web.get_span_context()
    for context in seen:  # each attempt runs under the web span's context, not sampled
        assert context.is_valid
        assert not context.is_remote
        assert not context.trace_flags.sampled
        assert (context.trace_id, context.span_id) == (web_context.trace_id, web_context.span_id)
