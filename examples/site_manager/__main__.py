"""python -m examples.site_manager --data DIR [--postgres DSN] --port 8000

Without --postgres, one replica keeps the status table and tickler's queue in
one SQLite file in DIR. With --postgres, both live in that database, and any
number of replicas (sharing DIR for the sites' files) serve the same sites.

SIGTERM or Ctrl-C shuts down gracefully: no new HTTP requests, in-flight
steps drained for at most --shutdown-timeout seconds, exit status 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import trio

from .app import Settings, serve
from .store import SCHEMA_NAME


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m examples.site_manager")
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="directory for the sites' files and, without --postgres, the SQLite file",
    )
    parser.add_argument(
        "--postgres",
        metavar="DSN",
        help="keep the status table and the queue in this PostgreSQL database",
    )
    parser.add_argument(
        "--schema",
        default="site_manager",
        help="PostgreSQL schema of the status table; the queue's is SCHEMA_queue",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="backend failure rate")
    parser.add_argument("--latency", type=float, default=0.05, help="backend latency, seconds")
    parser.add_argument("--capacity", type=int, default=16, help="steps in flight")
    parser.add_argument("--max-queue-length", type=int, default=1000)
    parser.add_argument(
        "--max-pending", type=int, default=1000, help="sites being created or deleted at once"
    )
    parser.add_argument("--lease", type=float, default=30.0, help="tickler's lease, seconds")
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="tickler's poll interval, seconds"
    )
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    parser.add_argument("--seed", type=int, help="seed of the backend's delays and failures")
    parser.add_argument(
        "--step-log", type=Path, help="append a line per step attempt and per aborted creation"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.fail_rate < 1:
        parser.error("--fail-rate must be >= 0 and < 1")
    if args.latency < 0:
        parser.error("--latency must be >= 0")
    if not SCHEMA_NAME.match(args.schema):
        parser.error("--schema must be a lower-case SQL identifier of at most 49 characters")
    return Settings(
        data=args.data,
        postgres=args.postgres,
        schema=args.schema,
        host=args.host,
        port=args.port,
        fail_rate=args.fail_rate,
        latency=args.latency,
        capacity=args.capacity,
        max_queue_length=args.max_queue_length,
        max_pending=args.max_pending,
        lease=args.lease,
        poll_interval=args.poll_interval,
        shutdown_timeout=args.shutdown_timeout,
        seed=args.seed,
        step_log=args.step_log,
    )


async def main(settings: Settings) -> None:
    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    logging.getLogger("site_manager").info(
                        "%s: shutting down", signal.Signals(signum).name
                    )
                    shutdown.set()
                    return

            nursery.start_soon(watch_signals)
            url = await nursery.start(
                lambda task_status: serve(settings, shutdown=shutdown, task_status=task_status)
            )
            print(f"listening on {url}", flush=True)
    print("stopped", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    trio.run(main, parse_args())
    sys.exit(0)
