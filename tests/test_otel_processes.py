"""A trace across processes: the enqueue here, the attempts in worker processes (otel_worker.py).

The trace context travels in the store's row (its traceparent and tracestate),
on SQLite and on PostgreSQL. This process enqueues inside a span opened as a
web framework would, with the OpenTelemetry SDK's in-memory exporter; each
worker writes its spans to a file, read here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tickler
from tickler.otel import instrument, instrument_store

from .store_backends import owner_id

ROOT = Path(__file__).parent.parent


def start_worker(db: list[str], spans: Path, log: Path, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "tests.otel_worker", db[0], str(spans), str(log), *db[1:], *options],
        cwd=ROOT,
    )


def starts(log: Path) -> list[tuple[int, int, str, int]]:
    """(pid, id, request, attempt) of each attempt started, as the workers logged them."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text().splitlines():
        pid, _, request_id, request, attempt = line.split()
        found.append((int(pid), int(request_id), request, int(attempt)))
    return found


def spans_in(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def attempts(spans: list[dict[str, Any]], request_id: int) -> list[dict[str, Any]]:
    return [
        span
        for span in spans
        if span["name"] == "process jobs"
        and span["attributes"]["messaging.message.id"] == str(request_id)
    ]


def wait_until(what: Callable[[], bool], process: subprocess.Popen[bytes], why: str) -> None:
    deadline = time.monotonic() + 60
    while not what():
        assert process.poll() is None, f"the worker ended before {why}"
        assert time.monotonic() < deadline, f"no {why} within 60 s"
        time.sleep(0.02)


def store_of(db: list[str]) -> tickler.SqliteStore | tickler.PostgresStore:
    options: dict[str, Any] = {"lease": 1.0, "poll_interval": 0.05}
    if db[0].startswith("postgresql://"):
        return tickler.PostgresStore(db[0], schema=db[2], **options)
    return tickler.SqliteStore(db[0], **options)


def connect(db: list[str]) -> Any:
    """A connection of the producer's own, as its web framework would hold."""
    if db[0].startswith("postgresql://"):
        import psycopg

        return psycopg.connect(db[0])
    import sqlite3

    return sqlite3.connect(db[0])


async def idle(request: object) -> None:
    raise AssertionError("this process only enqueues and cancels")


def run_across_processes(db: list[str], tmp_path: Path) -> None:
    """The trace of a request enqueued here and run by a worker, a cancel, and a killed worker."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    web = provider.get_tracer("web")
    log, first_spans, second_spans = tmp_path / "log", tmp_path / "w1.jsonl", tmp_path / "w2.jsonl"
    ids: dict[str, int] = {}

    async def enqueue() -> None:
        # Delayed, so that this process (which stops at once) never claims them.
        async with tickler.open_service(idle, store=store_of(db), name="jobs") as service:
            instrument(service, tracer_provider=provider)
            with web.start_as_current_span("POST /signup"):
                for request in ("flaky", "block", "hang"):
                    ids[request] = (await service.submit(request, delay=1.0)).id
            await service.stop(drain=False)

    trio.run(enqueue)
    # A producer that runs no service: its transactional enqueues, through its own
    # connection, inside the span of another web request.
    producer = store_of(db)
    instrument_store(producer, tracer_provider=provider)
    with web.start_as_current_span("POST /orders"):
        with connect(db) as connection:
            ids["direct"] = producer.enqueue_in(connection, "jobs", "direct", delay=1.0)
            ids["many-1"], ids["many-2"] = producer.enqueue_many_in(
                connection, "jobs", ["many-1", "many-2"], delay=1.0
            )
        connection.close()
    first = start_worker(db, first_spans, log, "--hang", "--lease", "1.0")
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: (
                {"flaky", "block", "hang"} <= {s[2] for s in starts(log)}
                and len(attempts(spans_in(first_spans), ids["flaky"])) == 2
                and all(
                    attempts(spans_in(first_spans), ids[r]) for r in ("direct", "many-1", "many-2")
                )
            ),
            first,
            "attempt of every request",
        )

        async def cancel() -> None:
            async with tickler.open_service(idle, store=store_of(db), name="jobs") as service:
                assert await service.cancel(ids["block"])
                await trio.to_thread.run_sync(
                    wait_until,
                    lambda: bool(attempts(spans_in(first_spans), ids["block"])),
                    first,
                    "end of the cancelled attempt",
                )
                await service.stop(drain=False)

        trio.run(cancel)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        second = start_worker(db, second_spans, log, "--lease", "1.0")
        wait_until(
            lambda: bool(attempts(spans_in(second_spans), ids["hang"])), second, "second attempt"
        )
    finally:
        (tmp_path / "log.done").touch()
        for process in (first, second):
            if process is not None:
                try:
                    process.wait(timeout=30)
                finally:
                    if process.poll() is None:
                        process.kill()
    assert second.returncode == 0

    (request_span,) = [
        span for span in exporter.get_finished_spans() if span.name == "POST /signup"
    ]
    trace_id = f"{request_span.context.trace_id:032x}"
    (orders_span,) = [span for span in exporter.get_finished_spans() if span.name == "POST /orders"]
    all_sends = [span for span in exporter.get_finished_spans() if span.name == "send jobs"]
    sends = [span for span in all_sends if span.parent != orders_span.context]
    assert len(sends) == 3
    for send in sends:
        assert send.parent is not None
        assert send.parent.span_id == request_span.context.span_id
    send_ids = {f"{send.context.span_id:016x}" for send in sends}
    in_first, in_second = spans_in(first_spans), spans_in(second_spans)

    # One trace: the web request's span, the enqueue span here, both attempts in the worker.
    failed, succeeded = sorted(
        attempts(in_first, ids["flaky"]), key=lambda span: span["attributes"]["tickler.attempt"]
    )
    for span in (failed, succeeded):
        assert span["trace_id"] == trace_id
        assert span["parent_id"] in send_ids
        assert span["kind"] == "CONSUMER"
    assert failed["parent_id"] == succeeded["parent_id"]
    assert failed["attributes"]["tickler.outcome"] == "retrying"
    assert failed["attributes"]["tickler.retry.delay"] == pytest.approx(0.2, abs=0.1)
    assert failed["events"] == ["exception"]
    assert failed["status"] == "ERROR"
    assert succeeded["attributes"]["tickler.outcome"] == "succeeded"

    # The cancel, asked in this process, ended the worker's attempt: its span says so.
    (cancelled,) = attempts(in_first, ids["block"])
    assert cancelled["attributes"]["tickler.outcome"] == "cancelled"
    assert cancelled["trace_id"] == trace_id

    # The killed worker's attempt never ended: absent, never shown as succeeded.
    assert next(s for s in starts(log) if s[1] == ids["hang"])[0] == first.pid
    assert attempts(in_first, ids["hang"]) == []
    (taken_over,) = attempts(in_second, ids["hang"])
    assert taken_over["attributes"]["tickler.outcome"] == "succeeded"
    assert taken_over["attributes"]["tickler.attempt"] == 2
    assert taken_over["trace_id"] == trace_id
    assert taken_over["parent_id"] in send_ids

    # The producer's enqueue_in and enqueue_many_in: one send span each, children of its
    # web request's span; the worker's attempts continue that trace from the rows.
    direct_send, many_send = [span for span in all_sends if span not in sends]
    for send in (direct_send, many_send):
        assert send.parent is not None
        assert send.parent.span_id == orders_span.context.span_id
        assert send.kind.name == "PRODUCER"
    assert direct_send.attributes is not None
    assert many_send.attributes is not None
    assert direct_send.attributes["messaging.message.id"] == str(ids["direct"])
    assert many_send.attributes["messaging.batch.message_count"] == 2
    orders_trace = f"{orders_span.context.trace_id:032x}"
    assert orders_trace != trace_id
    for request, send in (("direct", direct_send), ("many-1", many_send), ("many-2", many_send)):
        (attempt,) = attempts(in_first, ids[request])
        assert attempt["trace_id"] == orders_trace
        assert attempt["parent_id"] == f"{send.context.span_id:016x}"
        assert attempt["attributes"]["tickler.outcome"] == "succeeded"

    # Each worker's batches: internal spans, with the rows they claimed.
    batches = [span for span in in_first if span["name"] == "exchange jobs"]
    assert all(span["kind"] == "INTERNAL" and span["parent_id"] is None for span in batches)
    assert sum(span["attributes"]["tickler.batch.claimed"] for span in batches) >= 4
    provider.shutdown()


def test_a_trace_crosses_processes_through_sqlite(tmp_path: Path) -> None:
    run_across_processes([str(tmp_path / "queue.db")], tmp_path)


def test_a_trace_crosses_processes_through_postgres(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    run_across_processes([postgres_dsn, "--schema", postgres_schema], tmp_path)


# -- The migration that adds the trace context to the rows


def check_trace_columns(store: tickler.SqliteStore | tickler.PostgresStore) -> None:
    """A batch writes an insert's trace context, and a claim reads it back with the row."""
    from tickler._stores._seam import Batch, Insert

    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    insert = Insert('"k"', "queued", b"1", 0.0, 7, None, "g")
    session = store.connect()
    try:
        result = session.run(
            "jobs", owner_id("me"), 30.0, 86400.0, Batch(inserts=[insert], traces=[None])
        )
        plain = session.run(
            "jobs",
            owner_id("me"),
            30.0,
            86400.0,
            Batch(inserts=[Insert(None, "queued", b"2", 0.0)], traces=None),
        )
        traced = session.run(
            "jobs",
            owner_id("me"),
            30.0,
            86400.0,
            Batch(
                inserts=[Insert(None, "queued", b"3", 0.0)],
                traces=[(traceparent, "a=1")],
                claim=3,
            ),
        )
    finally:
        session.close()
    first, second, third = result.inserted[0][0], plain.inserted[0][0], traced.inserted[0][0]
    assert {row[0] for row in traced.claimed} == {first, second, third}
    assert traced.traces == {
        first: (None, None, '"k"', 7, "g"),
        second: (None, None, None, 0, None),
        third: (traceparent, "a=1", None, 0, None),
    }


def test_a_sqlite_file_of_the_version_before_gets_the_trace_context(tmp_path: Path) -> None:
    import sqlite3

    from tickler._stores.sqlite import SCHEMA_VERSION

    path = tmp_path / "queue.db"
    tickler.SqliteStore(path).create_schema()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE tickler_requests DROP COLUMN traceparent")
        db.execute("ALTER TABLE tickler_requests DROP COLUMN tracestate")
        db.execute("UPDATE tickler_schema SET version = 5")  # the version before the step
    db.close()
    store = tickler.SqliteStore(path)
    store.create_schema()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM tickler_schema").fetchone() == (SCHEMA_VERSION,)
    db.close()
    check_trace_columns(store)


def test_a_postgres_schema_of_the_version_before_gets_the_trace_context(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores.postgres import SCHEMA_VERSION

    tickler.PostgresStore(postgres_dsn, schema=postgres_schema).create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        db.execute(f'SET search_path TO "{postgres_schema}"')
        db.execute("ALTER TABLE tickler_requests DROP COLUMN traceparent")
        db.execute("ALTER TABLE tickler_requests DROP COLUMN tracestate")
        db.execute("UPDATE tickler_schema SET version = 4")  # the version before the step
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchone()
    assert version == (SCHEMA_VERSION,)
    check_trace_columns(store)
