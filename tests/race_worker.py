"""A worker process for the admin's race tests (tests/test_admin_races.py).

    python -m tests.race_worker DB LOG STOP [--schema S] [--lease L]
        [--poll-interval P] [--capacity N] [--sleep S]

DB is a postgresql:// DSN (--schema names the schema), or a SQLite file. It runs
the queue "jobs" until the file STOP exists, appending lines to LOG, which every
worker shares (tests/worker_plumbing.py). Each line is ``PID KIND ... TIME``:

- ``owner OWNER TIME``: the store's name for this worker's leases;
- ``ready TIME``: the service runs;
- ``store_errors N TIME``: its statistics' count of failed batches, when it grows;
- ``done N TIME``: its attempts ended so far, every 0.2 s while it grows;
- ``stopping TIME`` and ``exit TIME``: it saw STOP, and its service has stopped.

A request ``ok-N`` sleeps up to --sleep seconds (N decides how long: an attempt may
outlive a third of the lease, and its lease is renewed) and succeeds; ``fail-N``
raises, and ends FAILED (no retries; not logged: the failures are expected).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import trio

import tickler
from tickler._stores._sync import StoreSync

from .worker_plumbing import Log, arguments, open_store


async def report(service: tickler.Service[Any, Any], log: Log, stop: Path) -> None:
    errors = done = 0
    while not stop.exists():
        statistics = service.statistics()
        if statistics.store_errors > errors:
            errors = statistics.store_errors
            log("store_errors", errors)
        ended = statistics.succeeded + statistics.failed + statistics.cancelled
        if ended > done:
            done = ended
            log("done", done)
        await trio.sleep(0.2)


async def main(args: argparse.Namespace) -> None:
    log = Log(Path(args.log))
    stop = Path(args.stop)

    async def handler(request: str) -> str:
        kind, n = request.split("-")
        await trio.sleep(args.sleep * (int(n) % 7) / 6)
        if kind == "fail":
            raise RuntimeError(request)
        return request

    store = open_store(args)
    async with tickler.open_service(
        handler,
        store=store,
        name="jobs",
        capacity=args.capacity,
        retry=None,
        on_error=lambda ticket, exc: None,
    ) as service:
        stored = service._store_run
        assert isinstance(stored, StoreSync)
        log("owner", stored.owner)
        log("ready")
        await report(service, log, stop)
        log("stopping")
        await service.stop(drain=False, timeout=0)
    log("exit")


if __name__ == "__main__":
    trio.run(main, arguments(capacity=20, sleep=0.3).parse_args())
