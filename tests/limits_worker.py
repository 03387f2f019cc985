"""A worker process for the per-group limits process tests (tests/test_limits_processes.py).

    python -m tests.limits_worker DB LOG STOP [--schema S] [--lease L]
        [--poll-interval P] [--capacity N] [--sleep S]
        [--concurrency C] [--rate R] [--per W]

DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).
It runs the queue "jobs" with ``limits=tickler.Limit(C, R, W)`` (every
group's limit, "*") until the file STOP exists, appending lines to LOG, which
every worker shares (tests/worker_plumbing.py). Each line is ``PID KIND ...
TIME`` (TIME is time.time() when it was logged) and reaches the file with one
write before the worker goes on, so a SIGKILL loses none:

- ``owner OWNER TIME``: the store's name for this worker's leases;
- ``ready TIME``: the service runs;
- ``start ID REQUEST ATTEMPT TIME`` and ``end ID REQUEST TIME``: an attempt of
  the request with that id (the handler sleeps --sleep seconds in between).
  A request is a str ``GROUP/N`` (``plain/N`` or ``fed/N``: no group);
- ``stopping TIME`` and ``exit TIME``: it saw STOP, and its service has stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import trio

import tickler
from tickler._stores._sync import StoreSync

from .worker_plumbing import Log, arguments, open_store


async def main(args: argparse.Namespace) -> None:
    log = Log(Path(args.log))
    stop = Path(args.stop)

    async def handler(request: str) -> str:
        ticket = tickler.current_ticket()
        log("start", ticket.id, request, ticket.attempts)
        await trio.sleep(args.sleep)
        log("end", ticket.id, request)
        return request

    store = open_store(args)
    limits = tickler.Limit(concurrency=args.concurrency, rate=args.rate, per=args.per)
    async with tickler.open_service(
        handler, store=store, name="jobs", capacity=args.capacity, limits=limits
    ) as service:
        stored = service._store_run
        assert isinstance(stored, StoreSync)
        log("owner", stored.owner)
        log("ready")
        while not stop.exists():
            await trio.sleep(0.02)
        log("stopping")
    log("exit")


if __name__ == "__main__":
    parser = arguments(capacity=64, sleep=0.02)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rate", type=int, default=None)
    parser.add_argument("--per", type=float, default=1.0)
    trio.run(main, parser.parse_args())
