"""How a Trio program best hears PostgreSQL's NOTIFY: a thread, or the socket itself.

``python -m bench.listen`` measures, on one server, the time from sending a
NOTIFY (its own round trip included) to a Trio task receiving it, two ways:

- ``thread``: psycopg's ``Connection.notifies()`` on a worker thread, which
  hands each notification to the Trio run (what ``PostgresStore`` does);
- ``wait_readable``: ``psycopg.pq`` on the connection's socket, waited for
  with ``trio.lowlevel.wait_readable`` in the Trio thread.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import psycopg
import trio

DSN = os.environ.get("TICKLER_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
_CHANNELS = itertools.count()


async def _listen_on_a_thread(
    listener: psycopg.Connection, received: trio.MemorySendChannel[int]
) -> None:
    token = trio.lowlevel.current_trio_token()

    def run() -> None:
        for _ in listener.notifies():
            token.run_sync_soon(received.send_nowait, time.perf_counter_ns())

    await trio.to_thread.run_sync(run, abandon_on_cancel=True)


async def _listen_on_the_socket(
    listener: psycopg.Connection, received: trio.MemorySendChannel[int]
) -> None:
    pgconn = listener.pgconn
    while True:
        await trio.lowlevel.wait_readable(pgconn.socket)
        pgconn.consume_input()
        while pgconn.notifies() is not None:
            received.send_nowait(time.perf_counter_ns())


async def latencies(
    listen: Callable[[psycopg.Connection, trio.MemorySendChannel[int]], Awaitable[None]], n: int
) -> list[float]:
    """Microseconds from sending each of ``n`` NOTIFYs to a Trio task holding it."""
    channel = f"tickler_bench_listen{next(_CHANNELS)}"
    sender = psycopg.connect(DSN, autocommit=True)
    listener = psycopg.connect(DSN, autocommit=True)
    listener.execute(f"LISTEN {channel}")
    send, receive = trio.open_memory_channel[int](n)
    samples: list[float] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen, listener, send)
            await trio.sleep(0.2)
            for _ in range(n):
                start = time.perf_counter_ns()
                await trio.to_thread.run_sync(sender.execute, f"NOTIFY {channel}")
                await receive.receive()
                samples.append((time.perf_counter_ns() - start) / 1e3)
                await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
    finally:
        sender.close()
        listener.close()  # ends an abandoned listening thread's iteration
    return samples


async def main() -> None:
    samples: dict[str, list[float]] = {"thread": [], "wait_readable": []}
    for _ in range(3):
        samples["thread"] += await latencies(_listen_on_a_thread, 200)
        samples["wait_readable"] += await latencies(_listen_on_the_socket, 200)
    for kind, values in samples.items():
        p99 = statistics.quantiles(values, n=100)[98]
        print(f"{kind:14} p50 {statistics.median(values):6.0f} us   p99 {p99:6.0f} us")


if __name__ == "__main__":
    trio.run(main)
