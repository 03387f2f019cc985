"""A worker process for the scheduling process tests (tests/test_scheduling_processes.py).

    python -m tests.schedule_worker DB LOG STOP [--schema S] [--lease L]
        [--poll-interval P] [--capacity N] [--sleep S] [--every E] [--feed F]

DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).
It runs the queue "jobs" until the file STOP exists, appending lines to LOG,
which every worker shares (tests/worker_plumbing.py). Each line is ``PID KIND
... TIME`` (TIME is time.time() when it was logged) and reaches the file with
one write before the worker goes on, so a SIGKILL loses none:

- ``ready TIME``: the service runs (its periodic ticks are scheduled);
- ``start ID REQUEST TIME`` and ``end ID REQUEST TIME``: an attempt of the
  request with that id (the handler sleeps --sleep seconds in between);
- ``paused FLAG TIME``: service.paused changed (seen within 10 ms);
- ``fed N TIME``: with --feed, it enqueued N requests in all so far (every 0.5 s);
- ``stopping TIME`` and ``exit TIME``: it saw STOP, and its service has stopped.

With --every E the service has ``Periodic("beat", "beat", every=E)``.
With --feed F it enqueues a request "fed-PID-N" every F seconds until STOP.

On STOP it stops feeding; with --join it then waits (join()) until nothing
of the queue is live in any process. Then it leaves the service's block: a
stop that drains what this process holds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import trio

import tickler

from .worker_plumbing import Log, arguments, open_store


async def watch_paused(service: tickler.Service[Any, Any], log: Log) -> None:
    seen = service.paused
    log("paused", seen)
    while True:
        if service.paused != seen:
            seen = service.paused
            log("paused", seen)
        await trio.sleep(0.01)


async def feed(service: tickler.Service[Any, Any], log: Log, every: float, stop: Path) -> None:
    fed = 0
    reported = time.monotonic()
    while not stop.exists():
        service.enqueue_request(f"fed-{os.getpid()}-{fed}")
        fed += 1
        if time.monotonic() - reported >= 0.5:
            log("fed", fed)
            reported = time.monotonic()
        await trio.sleep(every)
    log("fed", fed)


async def main(args: argparse.Namespace) -> None:
    log = Log(Path(args.log))
    stop = Path(args.stop)

    async def handler(request: str) -> str:
        ticket = tickler.current_ticket()
        log("start", ticket.id, request)
        await trio.sleep(args.sleep)
        log("end", ticket.id, request)
        return request

    store = open_store(args)
    periodic = [] if args.every is None else [tickler.Periodic("beat", "beat", every=args.every)]
    async with tickler.open_service(
        handler, store=store, name="jobs", capacity=args.capacity, periodic=periodic
    ) as service:
        log("ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_paused, service, log)
            if args.feed is not None:
                nursery.start_soon(feed, service, log, args.feed, stop)
            while not stop.exists():
                await trio.sleep(0.02)
            log("stopping")
            if args.join:
                # The feeder enqueues nothing after it sees STOP, which it
                # checks just before each enqueue: what it fed is in the join.
                await service.join()
            nursery.cancel_scope.cancel()
    log("exit")


if __name__ == "__main__":
    parser = arguments(capacity=4, sleep=0.0)
    parser.add_argument("--every", type=float, default=None)
    parser.add_argument("--feed", type=float, default=None, help="seconds between enqueues")
    parser.add_argument("--join", action="store_true")
    trio.run(main, parser.parse_args())
