"""python -m examples.site_manager --data DIR --port 8000

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


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m examples.site_manager")
    parser.add_argument("--data", type=Path, required=True, help="directory for all state")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="backend failure rate")
    parser.add_argument("--latency", type=float, default=0.05, help="backend latency, seconds")
    parser.add_argument("--capacity", type=int, default=16, help="steps in flight")
    parser.add_argument("--max-queue-length", type=int, default=1000)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if not 0 <= args.fail_rate < 1:
        parser.error("--fail-rate must be >= 0 and < 1")
    if args.latency < 0:
        parser.error("--latency must be >= 0")
    return Settings(
        data=args.data,
        host=args.host,
        port=args.port,
        fail_rate=args.fail_rate,
        latency=args.latency,
        capacity=args.capacity,
        max_queue_length=args.max_queue_length,
        shutdown_timeout=args.shutdown_timeout,
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
