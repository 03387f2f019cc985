"""One process of the PostgreSQL benchmark: a worker, or an enqueuer, of one system.

    python bench/pg_worker.py <system> <mode> '<json config>'

``system`` is tickler, pgqueuer or procrastinate; ``mode`` is one of:

- ``drain``: insert ``n`` no-op requests, say ``ready``, wait for ``go`` on
  stdin, then run the system's worker at ``concurrency`` until stdin says
  ``stop`` (or ends), and shut it down. tickler only: with ``groups``, the
  requests are spread over that many groups (enqueue_many_in, ``group_chunk``
  requests a call), and with ``group_concurrency`` the service has
  ``limits=tickler.Limit(concurrency=group_concurrency)``.
- ``latency``: run an idle worker whose handler prints, for each request, the
  time from the stamp in the request (``time.time_ns()`` at its enqueue) to
  the handler's start; say ``ready`` once it listens.
- ``enqueue``: time the system's ways to enqueue, print them, and exit (the
  batches' rates are lists: one a repeat).

bench/postgres.py starts it with ``sys.executable`` on a schema it has just
emptied, and reads its JSON lines on stdout. Each system runs under its own
event loop: tickler under Trio, pgqueuer under uvloop (what its ``pgq run``
uses, with asyncpg, the driver of its examples and its own benchmark),
procrastinate under asyncio (what its ``procrastinate worker`` uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import trio

import tickler

QUEUE = "bench"


def emit(**message: object) -> None:
    """One JSON line to the parent."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def wait_for_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"expected 'go' on stdin, got {line!r}")


# -- tickler -------------------------------------------------------------------------


def tickler_insert(config: dict[str, Any]) -> None:
    """Insert the drain's rows as README tells other drivers to (here by COPY), and NOTIFY once.

    (enqueue_in costs a round trip a request, which would make inserting
    100,000 requests take about as long as draining them; its own throughput
    is measured in the enqueue mode.)
    """
    store = tickler.PostgresStore(config["dsn"], schema=config["schema"])
    store.connect().close()  # creates the schema
    if config.get("groups"):
        tickler_insert_grouped(store, config)
        return
    codec = tickler.JsonCodec()
    now = time.time()
    with psycopg.connect(config["dsn"]) as db, db.transaction():
        copy_sql = (
            f'COPY "{config["schema"]}".tickler_requests'
            " (queue, key, state, request, run_at, enqueued_at) FROM STDIN"
        )
        with db.cursor() as cursor, cursor.copy(copy_sql) as copy:
            for i in range(config["n"]):
                copy.write_row((QUEUE, None, "queued", codec.encode(i), now, now))
        db.execute("SELECT pg_notify(%s, %s)", (store.channel, QUEUE))


def tickler_insert_grouped(store: tickler.PostgresStore, config: dict[str, Any]) -> None:
    """The drain's rows spread over ``groups`` groups, by enqueue_many_in, in one transaction.

    One call a chunk of ``group_chunk`` requests, the groups taking turns
    (g0, g1, ..., then g0 again), so that the groups' rows interleave in the
    claim order as requests from many callers would. Its COMMIT notifies.
    """
    n, groups, chunk = config["n"], config["groups"], config["group_chunk"]
    names = [f"g{g}" for g in range(groups)]
    with psycopg.connect(config["dsn"]) as db, db.transaction():
        for turn, first in enumerate(range(0, n, chunk)):
            requests = range(first, min(first + chunk, n))
            store.enqueue_many_in(db, QUEUE, requests, group=names[turn % groups])


async def tickler_worker(config: dict[str, Any], mode: str) -> None:
    store = tickler.PostgresStore(config["dsn"], schema=config["schema"])

    async def noop(request: int) -> None:
        await trio.lowlevel.checkpoint()

    async def stamped(request: int) -> None:
        emit(latency_ns=time.time_ns() - request)

    handler = noop if mode == "drain" else stamped
    limit = config.get("group_concurrency")
    async with tickler.open_service(
        handler,
        store=store,
        capacity=config["concurrency"],
        name=QUEUE,
        limits=tickler.Limit(concurrency=limit) if limit else None,
    ) as service:
        if mode == "latency":
            await trio.sleep(config["settle"])  # the listener's LISTEN is in place
            emit(ready=True)
        await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    stats = service.statistics()
    emit(done=True, succeeded=stats.succeeded)


async def tickler_enqueue(config: dict[str, Any]) -> dict[str, Any]:
    """Requests a second: submit in parallel; enqueue_in alone per transaction; and batched.

    Batched: ``batch`` enqueue_in calls in one transaction, and one
    enqueue_many_in of ``batch`` requests, each ``repeats`` times (a list of
    rates each).
    """
    store = tickler.PostgresStore(config["dsn"], schema=config["schema"])

    async def held(request: int) -> None:
        await trio.sleep_forever()

    rates: dict[str, Any] = {}
    # capacity=1 and a handler that holds its slot: once the first request
    # runs, every batch only writes (nothing to claim), so the rate is the
    # enqueue path's alone.
    async with tickler.open_service(held, store=store, capacity=1, name=QUEUE) as service:
        await service.submit(-1)
        while service.statistics().in_flight < 1:
            await trio.sleep(0.01)
        n = config["submits"]
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(service.submit, i)
        rates["submit"] = n / (time.perf_counter() - start)
        await service.stop(drain=False)

    # enqueue_in with no service running: the caller's transactions alone.
    with psycopg.connect(config["dsn"]) as db:
        n = config["each"]
        start = time.perf_counter()
        for i in range(n):
            with db.transaction():
                store.enqueue_in(db, QUEUE, i)
        rates["each"] = n / (time.perf_counter() - start)
        # `batch` requests in one transaction, COMMIT included: by as many
        # enqueue_in calls (batch), and by one enqueue_many_in (many). Each
        # is repeated, the two taking turns as to which goes first.
        n = config["batch"]
        rates["batch"], rates["many"] = [], []
        for repeat in range(config["repeats"]):
            for kind in ("batch", "many") if repeat % 2 == 0 else ("many", "batch"):
                start = time.perf_counter()
                with db.transaction():
                    if kind == "many":
                        store.enqueue_many_in(db, QUEUE, range(n))
                    else:
                        for i in range(n):
                            store.enqueue_in(db, QUEUE, i)
                rates[kind].append(n / (time.perf_counter() - start))
    return rates


# -- pgqueuer ------------------------------------------------------------------------


async def pgqueuer_connect(config: dict[str, Any]) -> Any:
    import asyncpg

    return await asyncpg.connect(config["dsn"], server_settings={"search_path": config["schema"]})


async def pgqueuer_install(config: dict[str, Any]) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    connection = await pgqueuer_connect(config)
    try:
        await Queries(AsyncpgDriver(connection)).install(create_schema=False)  # `pgq install`
    finally:
        await connection.close()


async def pgqueuer_insert(config: dict[str, Any]) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    await pgqueuer_install(config)
    connection = await pgqueuer_connect(config)
    try:
        n = config["n"]
        queries = Queries(AsyncpgDriver(connection))
        # Its batch enqueue: one statement for every row.
        await queries.enqueue([QUEUE] * n, [str(i).encode() for i in range(n)], [0] * n)
    finally:
        await connection.close()


async def pgqueuer_worker(config: dict[str, Any], mode: str) -> None:
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

    connection = await pgqueuer_connect(config)
    manager = QueueManager(Queries(AsyncpgDriver(connection)))

    async def noop(job: Job) -> None:
        await asyncio.sleep(0)

    async def stamped(job: Job) -> None:
        assert job.payload is not None
        emit(latency_ns=time.time_ns() - int(job.payload))

    manager.entrypoint(QUEUE)(noop if mode == "drain" else stamped)

    async def until_stopped() -> None:
        if mode == "latency":
            await asyncio.sleep(config["settle"])
            emit(ready=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        manager.shutdown.set()

    stopper = asyncio.create_task(until_stopped())
    await manager.run(batch_size=config["batch_size"], max_concurrent_tasks=config["concurrency"])
    await stopper
    await connection.close()
    emit(done=True)


async def pgqueuer_enqueue(config: dict[str, Any]) -> dict[str, Any]:
    """Requests a second: concurrent calls over a pool; one call at a time; one batch, repeated."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver, Queries

    await pgqueuer_install(config)
    rates: dict[str, Any] = {}
    pool = await asyncpg.create_pool(
        config["dsn"], server_settings={"search_path": config["schema"]}
    )  # asyncpg's default size: 10
    try:
        queries = Queries(AsyncpgPoolDriver(pool))
        n = config["submits"]
        start = time.perf_counter()
        await asyncio.gather(*(queries.enqueue(QUEUE, str(i).encode()) for i in range(n)))
        rates["submit"] = n / (time.perf_counter() - start)
    finally:
        await pool.close()
    connection = await pgqueuer_connect(config)
    try:
        queries = Queries(AsyncpgDriver(connection))
        n = config["each"]
        start = time.perf_counter()
        for i in range(n):
            await queries.enqueue(QUEUE, str(i).encode())
        rates["each"] = n / (time.perf_counter() - start)
        n = config["batch"]
        rates["batch"] = []
        for _ in range(config["repeats"]):
            start = time.perf_counter()
            # Its one-call batch: one statement (autocommitted) for every job.
            await queries.enqueue([QUEUE] * n, [str(i).encode() for i in range(n)], [0] * n)
            rates["batch"].append(n / (time.perf_counter() - start))
    finally:
        await connection.close()
    return rates


# -- procrastinate -------------------------------------------------------------------


def procrastinate_app(config: dict[str, Any], mode: str) -> Any:
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=config["dsn"],
            kwargs={"options": f"-c search_path={config['schema']}"},
        )
    )

    async def noop(stamp: int = 0) -> None:
        await asyncio.sleep(0)

    async def stamped(stamp: int = 0) -> None:
        emit(latency_ns=time.time_ns() - stamp)

    app.task(name="noop", queue=QUEUE)(noop if mode != "latency" else stamped)
    return app


async def procrastinate_install(config: dict[str, Any]) -> None:
    app = procrastinate_app(config, "install")
    async with app.open_async():
        await app.schema_manager.apply_schema_async()  # `procrastinate schema --apply`


async def procrastinate_insert(config: dict[str, Any]) -> None:
    await procrastinate_install(config)
    app = procrastinate_app(config, "drain")
    async with app.open_async():
        task = app.tasks["noop"]
        # Its batch defer: one statement for every job.
        await task.batch_defer_async(*({"stamp": i} for i in range(config["n"])))


async def procrastinate_worker(config: dict[str, Any], mode: str) -> None:
    app = procrastinate_app(config, mode)
    async with app.open_async():
        worker = asyncio.create_task(
            app.run_worker_async(
                queues=[QUEUE], concurrency=config["concurrency"], install_signal_handlers=False
            )
        )
        if mode == "latency":
            await asyncio.sleep(config["settle"])
            emit(ready=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        worker.cancel()  # procrastinate's graceful stop
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    emit(done=True)


async def procrastinate_enqueue(config: dict[str, Any]) -> dict[str, Any]:
    """Requests a second: concurrent defers over its pool; one at a time; one batch, repeated."""
    await procrastinate_install(config)
    app = procrastinate_app(config, "enqueue")
    rates: dict[str, Any] = {}
    async with app.open_async():  # psycopg_pool's default size: 4
        task = app.tasks["noop"]
        n = config["submits"]
        start = time.perf_counter()
        await asyncio.gather(*(task.defer_async(stamp=i) for i in range(n)))
        rates["submit"] = n / (time.perf_counter() - start)
        n = config["each"]
        start = time.perf_counter()
        for i in range(n):
            await task.defer_async(stamp=i)
        rates["each"] = n / (time.perf_counter() - start)
        n = config["batch"]
        rates["batch"] = []
        for _ in range(config["repeats"]):
            start = time.perf_counter()
            await task.batch_defer_async(*({"stamp": i} for i in range(n)))
            rates["batch"].append(n / (time.perf_counter() - start))
    return rates


# -- main ----------------------------------------------------------------------------


def run_asyncio(system: str, main: Callable[[], Awaitable[Any]]) -> Any:
    """pgqueuer under uvloop, as its CLI runs it; procrastinate under asyncio, as its CLI does."""

    async def wrapped() -> Any:
        return await main()

    if system == "pgqueuer":
        import uvloop

        return uvloop.run(wrapped())
    return asyncio.run(wrapped())


def main() -> None:
    system, mode, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    config: dict[str, Any] = json.loads(raw)
    if mode == "enqueue":
        if system == "tickler":
            rates = trio.run(tickler_enqueue, config)
        else:
            enqueue = pgqueuer_enqueue if system == "pgqueuer" else procrastinate_enqueue
            rates = run_asyncio(system, lambda: enqueue(config))
        emit(rates=rates)
        return
    if mode == "drain":
        if system == "tickler":
            tickler_insert(config)
        else:
            insert = pgqueuer_insert if system == "pgqueuer" else procrastinate_insert
            run_asyncio(system, lambda: insert(config))
        gc.collect()
        emit(ready=True)
        wait_for_go()
    elif system == "pgqueuer":
        run_asyncio(system, lambda: pgqueuer_install(config))
    elif system == "procrastinate":
        run_asyncio(system, lambda: procrastinate_install(config))
    if system == "tickler":
        trio.run(tickler_worker, config, mode)
    else:
        worker = pgqueuer_worker if system == "pgqueuer" else procrastinate_worker
        run_asyncio(system, lambda: worker(config, mode))


if __name__ == "__main__":
    main()
