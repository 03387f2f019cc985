"""A worker process for the store's crash and many-process tests.

    python -m tests.store_worker DB LOG [--capacity N] [--sleep S] [--lease L]
        [--keys K] [--cancel-blocker] [--schema S]

DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).

It runs the queue "jobs" until nothing of it is live, writing a line to LOG
(fsync'd) when each attempt starts and ends. With --keys it first enqueues
requests "key-0".."key-{K-1}", each keyed by itself and delayed 1 s. A
request "blocker" sleeps until cancelled; with --cancel-blocker the worker
cancels it once it sees it running in another process.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import trio

import tickler


def log(path: Path, line: str) -> None:
    with path.open("a") as file:
        file.write(f"{os.getpid()} {line}\n")
        file.flush()
        os.fsync(file.fileno())


async def main(args: argparse.Namespace) -> None:
    log_path = Path(args.log)
    running_blocker = False

    async def handler(request: str) -> str:
        nonlocal running_blocker
        ticket = tickler.current_ticket()
        log(log_path, f"start {ticket.id} {request}")
        if request == "blocker":
            running_blocker = True
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                log(log_path, f"cancelled {ticket.id} {request}")
                raise
        await trio.sleep(args.sleep)
        log(log_path, f"end {ticket.id} {request}")
        return request

    store: tickler.SqliteStore | tickler.PostgresStore
    if args.db.startswith("postgresql://"):
        store = tickler.PostgresStore(
            args.db, schema=args.schema, lease=args.lease, poll_interval=0.05
        )
    else:
        store = tickler.SqliteStore(args.db, lease=args.lease, poll_interval=0.05)
    async with tickler.open_service(
        handler, store=store, name="jobs", capacity=args.capacity
    ) as service:
        for k in range(args.keys):
            service.enqueue_request(f"key-{k}", key=f"key-{k}", delay=1.0)
        if args.cancel_blocker:
            with trio.move_on_after(30):
                while True:
                    found = await service.lookup("blocker")
                    if (
                        found is not None
                        and found.status is tickler.Status.RUNNING
                        and not running_blocker
                    ):
                        if await service.cancel("blocker"):
                            log(log_path, f"cancel {found.id} blocker")
                        break
                    if found is not None and found.done:
                        break
                    await trio.sleep(0.02)
        await service.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("log")
    parser.add_argument("--capacity", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--keys", type=int, default=0)
    parser.add_argument("--cancel-blocker", action="store_true")
    parser.add_argument("--schema", default="tickler", help="with a postgresql:// DB")
    trio.run(main, parser.parse_args())
