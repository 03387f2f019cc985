"""A worker process for the store's crash and many-process tests.

    python -m tests.store_worker DB LOG [--capacity N] [--sleep S] [--lease L]
        [--poll-interval P] [--keys K] [--keys-due T] [--cancel-blocker] [--schema S]
        [--result-attempt]

DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).

It runs the queue "jobs" until nothing of it is live, appending lines to LOG,
which every worker shares. Each line is ``PID KIND ...`` and reaches the
file with one write before the worker goes on, so a SIGKILL loses none:

- ``owner OWNER``: the store's name for this worker's leases, once it runs;
- ``reowner OWNER``: the new name it took after it lost its liveness lock;
- ``start ID REQUEST ATTEMPT TIME`` and ``end ID REQUEST``: an attempt (TIME: when it
  started, time.time()); with --result-attempt each returns "REQUEST@ATTEMPT";
- ``keyed ID REQUEST``: with --keys, it first enqueues requests
  "key-0".."key-{K-1}", each keyed by itself and delayed 1 s (or until the
  epoch time --keys-due), and logs the id each got once committed;
- ``store_errors N``: its statistics' count of failed batches, when it grows;
- ``cancel ID blocker`` and ``cancelled ID blocker``: a request "blocker"
  sleeps until cancelled; with --cancel-blocker the worker cancels it once it
  sees it running in another process.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import trio

import tickler
from tickler._stores._sync import StoreSync


class Log:
    """The shared log, opened for appending: one write() per line, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)  # line-buffered: each line is written whole

    def __call__(self, *fields: Any) -> None:
        self.file.write(" ".join(map(str, (os.getpid(), *fields))) + "\n")


async def report_store_errors(service: tickler.Service[Any, Any], log: Log) -> None:
    reported = 0
    stored = service._store_run
    assert isinstance(stored, StoreSync)
    owner = stored.owner
    while True:
        if stored.owner != owner:
            owner = stored.owner
            log("reowner", owner)
        errors = service.statistics().store_errors
        if errors > reported:
            log("store_errors", errors)
            reported = errors
        await trio.sleep(0.05)


async def main(args: argparse.Namespace) -> None:
    log = Log(Path(args.log))
    running_blocker = False

    async def handler(request: str) -> str:
        nonlocal running_blocker
        ticket = tickler.current_ticket()
        log("start", ticket.id, request, ticket.attempts, repr(time.time()))
        if request == "blocker":
            running_blocker = True
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                log("cancelled", ticket.id, request)
                raise
        await trio.sleep(args.sleep)
        log("end", ticket.id, request)
        if args.result_attempt:
            return f"{request}@{ticket.attempts}"
        return request

    store: tickler.SqliteStore | tickler.PostgresStore
    options = {"lease": args.lease, "poll_interval": args.poll_interval}
    if args.db.startswith("postgresql://"):
        store = tickler.PostgresStore(args.db, schema=args.schema, **options)
    else:
        store = tickler.SqliteStore(args.db, **options)
    async with (
        tickler.open_service(handler, store=store, name="jobs", capacity=args.capacity) as service,
        trio.open_nursery() as nursery,
    ):
        stored = service._store_run
        assert isinstance(stored, StoreSync)
        log("owner", stored.owner)
        nursery.start_soon(report_store_errors, service, log)
        delay = 1.0 if args.keys_due is None else max(0.0, args.keys_due - time.time())
        keyed = [
            service.enqueue_request(f"key-{k}", key=f"key-{k}", delay=delay)
            for k in range(args.keys)
        ]
        while any(ticket.id == 0 for ticket in keyed):  # until committed
            await trio.sleep(0.01)
        for ticket in keyed:
            log("keyed", ticket.id, ticket.request)
        if args.cancel_blocker:
            with trio.move_on_after(30):
                while True:
                    found = await service.lookup("blocker")
                    # Running in another process: that one logged its start.
                    # (RUNNING in the store alone could be this process's own
                    # claim ahead of its free slots.)
                    started_elsewhere = any(
                        line.split()[1:2] == ["start"]
                        and line.split()[3] == "blocker"
                        and line.split()[0] != str(os.getpid())
                        for line in Path(args.log).read_text().splitlines()
                    )
                    if found is not None and started_elsewhere and not running_blocker:
                        if await service.cancel("blocker"):
                            log("cancel", found.id, "blocker")
                        break
                    if found is not None and found.done:
                        break
                    await trio.sleep(0.05)
        await service.join()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("log")
    parser.add_argument("--capacity", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--keys", type=int, default=0)
    parser.add_argument("--keys-due", type=float, default=None, help="epoch time")
    parser.add_argument("--cancel-blocker", action="store_true")
    parser.add_argument("--schema", default="tickler", help="with a postgresql:// DB")
    parser.add_argument("--result-attempt", action="store_true")
    trio.run(main, parser.parse_args())
