"""How soon a dead worker's request starts again: from SIGKILL to the rescued attempt's start.

    python -m bench.rescue [--rounds 5] [--dsn DSN] [--lease 5]

For each store (a SQLite file; PostgreSQL at --dsn, TICKLER_BENCH_POSTGRES or the local server),
each round starts a victim worker that claims one request and sleeps in it, and a rescuer
worker beside it (both poll_interval 0.1 s); then kills the victim with SIGKILL and
times until the rescuer logs the request's start. The row is the median of the rounds.

Beside it, the lease-only rescue, with the same lease: the victim is stopped with SIGSTOP
instead (alive but stuck, it keeps its liveness lock), so only its lease, running out,
lets the rescuer take the request. With PostgreSQL, pgqueuer's rescue too: two of its
workers at their defaults (``QueueManager.run()``: a heartbeat every 15 s, a job re-picked
once its heartbeat is 30 s old), one killed with SIGKILL while it runs the job. The rows
run in the benchmark's database (bench/postgres.py). Run them under
``flock /work/helpers/pg-bench.lock``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import tickler

from .postgres import DEFAULT_DSN, DSN_ENV, open_database

POLL = 0.1
_phase = random.Random(24)  # noqa: S311 (a benchmark's timing, no secret)
SCHEMA = "tickler_bench_rescue"
PGQ_SCHEMA = "pgqueuer_bench_rescue"


async def _work(db: str, log: str, lease: float) -> None:
    async def handler(request: str) -> None:
        with Path(log).open("a") as out:
            out.write(f"{os.getpid()} start {time.time()!r}\n")
        await trio.sleep(3600)

    store: Any
    if db.startswith("postgresql://"):
        store = tickler.PostgresStore(db, schema=SCHEMA, lease=lease, poll_interval=POLL)
    else:
        store = tickler.SqliteStore(db, lease=lease, poll_interval=POLL, synchronous="NORMAL")
    async with tickler.open_service(handler, store=store, name="jobs", capacity=1):
        with Path(log).open("a") as out:
            out.write(f"{os.getpid()} ready\n")
        await trio.sleep_forever()


async def _pgq_work(db: str, log: str) -> None:
    """A pgqueuer worker at its defaults (heartbeat_timeout 30 s), whose job sleeps."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

    connection = await asyncpg.connect(db, server_settings={"search_path": PGQ_SCHEMA})
    manager = QueueManager(Queries(AsyncpgDriver(connection)))

    async def sleeps(job: Job) -> None:
        with Path(log).open("a") as out:
            out.write(f"{os.getpid()} start {time.time()!r}\n")
        await asyncio.sleep(3600)

    manager.entrypoint("jobs")(sleeps)
    with Path(log).open("a") as out:
        out.write(f"{os.getpid()} ready\n")
    await manager.run()


async def _pgq_reset(db: str) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    connection = await asyncpg.connect(db)
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{PGQ_SCHEMA}" CASCADE')
        await connection.execute(f'CREATE SCHEMA "{PGQ_SCHEMA}"')
        await connection.execute(f'SET search_path TO "{PGQ_SCHEMA}"')
        queries = Queries(AsyncpgDriver(connection))
        await queries.install(create_schema=False)
        await queries.enqueue(["jobs"], [b"r"], [0])
    finally:
        await connection.close()


def _store(db: str) -> Any:
    if db.startswith("postgresql://"):
        return tickler.PostgresStore(db, schema=SCHEMA)
    return tickler.SqliteStore(db)


def _reset(db: str) -> None:
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    else:
        for suffix in ("", "-wal", "-shm"):
            Path(db + suffix).unlink(missing_ok=True)
    store = _store(db)
    store.create_schema()
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as connection:
            store.enqueue_in(connection, "jobs", "r")
    else:
        import sqlite3

        file = sqlite3.connect(db, isolation_level=None)
        with file:
            store.enqueue_in(file, "jobs", "r")
        file.close()


def _lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def _wait(log: Path, pid: int, kind: str, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in _lines(log):
            if line[0] == str(pid) and line[1] == kind:
                return float(line[2]) if len(line) > 2 else 0.0
        time.sleep(0.002)
    raise TimeoutError(f"no {kind} of {pid}")


def one_rescue(db: str, log: Path, lease: float, how: signal.Signals, pgq: bool = False) -> float:
    """Seconds from the signal to the rescued attempt's start (pgq: pgqueuer's workers)."""
    if pgq:
        asyncio.run(_pgq_reset(db))
    else:
        _reset(db)
    log.unlink(missing_ok=True)

    def spawn() -> subprocess.Popen[bytes]:
        which = ["--pgq-worker", db, str(log)] if pgq else ["--worker", db, str(log), str(lease)]
        command = [sys.executable, "-m", "bench.rescue", *which]
        return subprocess.Popen(command, cwd=Path(__file__).parent.parent)  # noqa: S603

    victim = spawn()
    rescuer = None
    try:
        _wait(log, victim.pid, "start")
        rescuer = spawn()
        _wait(log, rescuer.pid, "ready")
        # At a random phase of the rescuer's polls: a fixed sleep would land each kill at
        # the same point of them, and the figure would measure that point.
        time.sleep(3 * POLL + _phase.uniform(0, POLL))
        sent = time.time()
        victim.send_signal(how)
        started = _wait(log, rescuer.pid, "start", timeout=max(lease, 30) + 60)
        return started - sent
    finally:
        for process in (victim, rescuer):
            if process is not None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()


def run(rounds: int, dsn: str | None, lease: float, pgqueuer: bool = True) -> None:
    """Print each store's rows: the median of ``rounds`` rescues, killed and stopped."""
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "log"
        stores = [("sqlite", str(Path(directory) / "queue.db"))]
        if dsn:
            stores.append(("postgres", dsn))
        for name, db in stores:
            variants = (
                ("SIGKILL, liveness lock", signal.SIGKILL),
                (f"SIGSTOP, lease only ({lease:g} s)", signal.SIGSTOP),
            )
            for label, how in variants:
                samples = [one_rescue(db, log, lease, how) for _ in range(rounds)]
                _print(f"rescue, {name}, {label}", samples)
        if dsn and pgqueuer:
            samples = [one_rescue(dsn, log, 0, signal.SIGKILL, pgq=True) for _ in range(rounds)]
            _print("rescue, pgqueuer, SIGKILL, heartbeat at its defaults (30 s)", samples)


def _print(label: str, samples: list[float]) -> None:
    print(
        f"{label}: median {statistics.median(samples):.3f} s of {len(samples)}"
        f" ({', '.join(f'{s:.3f}' for s in samples)})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rescue")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dsn",
        default=os.environ.get(DSN_ENV, DEFAULT_DSN),
        help="the PostgreSQL server (TICKLER_BENCH_POSTGRES; empty: SQLite only)",
    )
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--no-pgqueuer", action="store_true", help="without pgqueuer's row")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--pgq-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        db, log, lease = args.worker
        trio.run(_work, db, log, float(lease))
        return
    if args.pgq_worker:
        asyncio.run(_pgq_work(*args.pgq_worker))
        return
    dsn = args.dsn
    if dsn:
        try:
            dsn = open_database(dsn)  # the benchmark's own database
        except Exception as exc:
            print(f"rescue, postgres: not measured ({type(exc).__name__}: {exc})")
            dsn = None
    run(args.rounds, dsn, args.lease, not args.no_pgqueuer)


if __name__ == "__main__":
    main()
