"""A traced worker process for tests/test_otel_processes.py.

    python -m tests.otel_worker DB SPANS LOG [--schema S] [--lease L] [--hang]

DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).
It runs the queue "jobs", instrumented with the OpenTelemetry SDK, whose spans
go to SPANS as JSON lines, each written whole as its span ends (a SIGKILL
loses none that ended). LOG gets ``start ID REQUEST ATTEMPT`` per attempt.
It stops once the file LOG + ".done" exists.

Requests: "flaky" fails its first attempt; "block" waits until cancelled;
"hang", with --hang, never returns (the test kills the worker); any other
request returns itself.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import tickler
from tickler.otel import instrument


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as one JSON object: what the tests check."""
    assert span.context is not None
    return {
        "pid": os.getpid(),
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "events": [event.name for event in span.events],
    }


class FileExporter(SpanExporter):
    """Appends each finished span to a file, one JSON line, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self.file.write(json.dumps(span_record(span)) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()


async def main(args: argparse.Namespace) -> None:
    log = Path(args.log).open("a", buffering=1)  # noqa: SIM115 - open for the whole run
    done = Path(args.log + ".done")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(Path(args.spans))))

    async def handler(request: str) -> str:
        ticket = tickler.current_ticket()
        log.write(f"{os.getpid()} start {ticket.id} {request} {ticket.attempts}\n")
        if request == "flaky" and ticket.attempts == 1:
            raise ValueError("the first attempt fails")
        if request == "block" or (request == "hang" and args.hang):
            await trio.sleep_forever()
        return request

    store: tickler.SqliteStore | tickler.PostgresStore
    options = {"lease": args.lease, "poll_interval": 0.05}
    if args.db.startswith("postgresql://"):
        store = tickler.PostgresStore(args.db, schema=args.schema, **options)
    else:
        store = tickler.SqliteStore(args.db, **options)
    retry = tickler.Retry(attempts=3, initial=0.2, jitter=False)
    service = tickler.Service(handler, store=store, name="jobs", retry=retry, capacity=4)
    instrument(service, tracer_provider=provider)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        while not done.exists():
            await trio.sleep(0.05)
        await service.stop(drain=False)
    provider.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("spans")
    parser.add_argument("log")
    parser.add_argument("--schema", default="tickler")
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--hang", action="store_true")
    trio.run(main, parser.parse_args())
