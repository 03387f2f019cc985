"""What a PostgresStore batch costs per request, the server's CPU and this process's apart.

    python -m bench.batches [-n 50000] [--rounds 2] [--dsn DSN] [--without-index NAME]

The drain rows (bench/postgres.py) time a whole service, whose throughput moves by a
tenth from one run to the next on a shared machine; this times the store alone, in CPU
time, which moves far less. Each row drains ``n`` requests through the store's session
(``PostgresSession.run``, what the service's loop calls once per wake-up) with no
service: each batch writes the previous batch's claims as succeeded and claims the next
``batch``. The requests are written by the drain's own insert (bench/pg_worker.py:
COPY, or ``enqueue_many_in`` for groups), and the table is vacuumed
and analyzed and the server checkpointed before the first batch. The rows:

- *ungrouped, 100 a batch*: what a grouped batch is compared with;
- *ungrouped, 800 a batch*: about what the ungrouped drain claims a batch (it claims
  ahead of its 100 slots);
- *grouped, 100 a batch*: the grouped drain's requests (100 groups, 10 a call, the groups
  taking turns) under ``Limit(concurrency=1)``: at most one claim per group a batch.

Per request: the server's CPU (the session's backend, from ``/proc``: the server must run
on this machine, readable by this user), this process's CPU (``time.thread_time``) and
the wall time; medians of the rounds. ``--without-index`` drops one of the schema's
indexes before each row, to measure what keeping it costs. It runs in the benchmark's
database (bench/postgres.py); run it under ``flock /work/helpers/pg-bench.lock``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import psycopg

import tickler
from tickler._stores._seam import Batch, ClaimedRow, GroupLimit, Outcome, OutcomeKind

from .pg_worker import QUEUE, tickler_insert
from .postgres import DEFAULT_DSN, DSN_ENV, open_database

SCHEMA = "tickler_bench_batches"
GROUPS = 100
CHUNK = 10

# (label, grouped, batch)
ROWS = [
    ("ungrouped, 100 a batch", False, 100),
    ("ungrouped, 800 a batch", False, 800),
    ("grouped, 100 groups, Limit(concurrency=1), 100 a batch", True, 100),
]


def _cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fill(dsn: str, n: int, grouped: bool, without_index: str | None) -> tickler.PostgresStore:
    """A fresh schema holding ``n`` queued requests, written by the drain's own insert."""
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    groups = GROUPS if grouped else 0
    config = {"dsn": dsn, "schema": SCHEMA, "n": n, "groups": groups, "group_chunk": CHUNK}
    tickler_insert(config)
    with psycopg.connect(dsn, autocommit=True) as db:
        if without_index is not None:
            db.execute(f'DROP INDEX "{SCHEMA}"."{without_index}"')
        db.execute(f'VACUUM ANALYZE "{SCHEMA}".tickler_requests')
        db.execute("CHECKPOINT")
    return tickler.PostgresStore(dsn, schema=SCHEMA)


def measure(
    dsn: str, n: int, grouped: bool, batch: int, without_index: str | None
) -> dict[str, float]:
    """One row's round: microseconds per request of server CPU, client CPU and wall time."""
    store = _fill(dsn, n, grouped, without_index)
    session = store.connect()
    try:
        row = session.db.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        pid = int(row[0])
        session.db.commit()
        limits = {"*": GroupLimit(1, None, 1.0)} if grouped else None
        claimed: list[ClaimedRow] = []
        done = 0
        server, client, wall = _cpu_seconds(pid), time.thread_time(), time.perf_counter()
        while True:
            outcomes = [
                Outcome(OutcomeKind.SUCCEEDED, row.id, time.time(), attempt=row.attempts)
                for row in claimed
            ]
            result = session.run(
                QUEUE, "bench", 30.0, 3600.0, Batch(outcomes=outcomes, claim=batch, limits=limits)
            )
            done += len(outcomes)
            claimed = result.claimed
            if not claimed:
                break
        server = _cpu_seconds(pid) - server
        client = time.thread_time() - client
        wall = time.perf_counter() - wall
    finally:
        session.close()
    assert done == n, (done, n)
    return {"server": server / n * 1e6, "client": client / n * 1e6, "wall": wall / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batches", description=__doc__)
    parser.add_argument("-n", type=int, default=50_000, help="requests a row (50,000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each row taking turns (2)")
    parser.add_argument("--dsn", default=os.environ.get(DSN_ENV, DEFAULT_DSN))
    parser.add_argument("--without-index", default=None, help="drop this index before each row")
    args = parser.parse_args()
    dsn = open_database(args.dsn)
    taken: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in ROWS}
    for round_ in range(args.rounds):
        for label, grouped, batch in ROWS:
            print(f"  round {round_ + 1}/{args.rounds}: {label}", flush=True)
            taken[label].append(measure(dsn, args.n, grouped, batch, args.without_index))
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    print("\n| store batches | server CPU | client CPU | wall |")
    print("|---|---:|---:|---:|")
    for label, _, _ in ROWS:
        cells = [
            statistics.median(r[part] for r in taken[label])
            for part in ("server", "client", "wall")
        ]
        print(f"| {label} | " + " | ".join(f"{c:.1f} µs" for c in cells) + " |")
    without = f", without {args.without_index}" if args.without_index else ""
    print(f"\nPer request; {args.n:,} requests a row, medians of {args.rounds} rounds{without}.")


if __name__ == "__main__":
    main()
