"""The admin API's rows: the overview and the first page of requests on a queue of a million.

``python -m bench --admin`` fills a PostgreSQL queue of 1,000,000 rows in one INSERT over
generate_series (a day of work: mostly succeeded, finished over the last 24 hours, with
failed, queued, scheduled, retrying, running and cancelled rows among them, a tenth in
groups), vacuums and analyzes it as autovacuum would, then times ``admin.overview()`` and
``admin.requests(queue)`` (the first page, and the first page of the failed), each call a
sample. It does so twice: once for a day of work, and once, in a schema of its own, for
the overview's worst case, a queue whose rows mostly (900,000 of the million) finished
within the last hour, all of which its figures of the last hour count. The DSN comes
from TICKLER_BENCH_POSTGRES, as for bench/postgres.py. Run it under
``flock /work/helpers/pg-bench.lock`` where benchmarks share a server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

import tickler
from tickler._stores.postgres import BACKFILL_MINUTES

from . import postgres
from ._table import Row

SCHEMA = "bench_admin"
QUEUE = "jobs"
# Each case: its schema, the seconds over which its rows finished (up to now), and its
# rows' names. The busy hour's rows finish over 4,000 s: 90% of them in the last hour.
CASES = {
    "day": (SCHEMA, 86400.0, ""),
    "hour": (SCHEMA + "_hour", 4000.0, ", 90% finished in the last hour"),
}


@dataclass
class AdminConfig:
    rows: int = 1_000_000
    samples: int = 20


QUICK = AdminConfig(rows=10_000, samples=3)

# Each row's state by its number modulo 1,000: 95% succeeded, 3% failed, 1% queued (due),
# 0.5% scheduled, 0.2% retrying, 0.1% running, 0.2% cancelled.
_FILL = """
INSERT INTO tickler_requests (queue, key, state, request, result, error_type, error_message,
    error_traceback, attempts, run_at, enqueued_at, started_at, finished_at, owner,
    lease_until, priority, group_name)
SELECT %(queue)s, NULL, s.state, convert_to('{"n":' || i || '}', 'UTF8'),
    CASE WHEN s.state = 'succeeded' THEN '\\x31'::bytea END,
    CASE WHEN s.state IN ('failed', 'retrying') THEN 'RuntimeError' END,
    CASE WHEN s.state IN ('failed', 'retrying') THEN 'attempt ' || i || ' failed' END,
    CASE WHEN s.state IN ('failed', 'retrying')
        THEN repeat('Traceback (most recent call last): ... ', 20) END,
    CASE WHEN s.state IN ('queued', 'scheduled') THEN 0 ELSE 1 + i %% 3 END,
    CASE WHEN s.state = 'scheduled' THEN %(now)s + 3600 ELSE t.done - 0.05 - (i %% 7) * 0.01 END,
    t.done - 0.06 - (i %% 7) * 0.01,
    CASE WHEN s.state IN ('succeeded', 'failed', 'running', 'cancelled') THEN t.done - 0.05 END,
    CASE WHEN s.state IN ('succeeded', 'failed', 'cancelled') THEN t.done END,
    CASE WHEN s.state = 'running' THEN 'replica-' || i %% 4 END,
    CASE WHEN s.state = 'running' THEN %(now)s + 30 END,
    0,
    CASE WHEN i %% 10 = 0 THEN 'customer-' || i %% 500 END
FROM generate_series(1, %(rows)s) AS i,
LATERAL (SELECT %(now)s - %(spread)s * (%(rows)s - i) / %(rows)s AS done) AS t,
LATERAL (SELECT CASE
    WHEN i %% 1000 < 950 THEN 'succeeded'
    WHEN i %% 1000 < 980 THEN 'failed'
    WHEN i %% 1000 < 990 THEN 'queued'
    WHEN i %% 1000 < 995 THEN 'scheduled'
    WHEN i %% 1000 < 997 THEN 'retrying'
    WHEN i %% 1000 < 998 THEN 'running'
    ELSE 'cancelled' END AS state) AS s
"""


def fill(
    dsn: str,
    rows: int,
    out: Callable[[str], None],
    *,
    schema: str = SCHEMA,
    spread: float = 86400.0,
) -> None:
    """The queue of ``rows`` rows, finished over the last ``spread`` seconds, in a fresh
    schema, vacuumed and analyzed."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    tickler.PostgresStore(dsn, schema=schema).create_schema()
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f"SET search_path TO {schema}")
        db.execute(_FILL, {"queue": QUEUE, "rows": rows, "now": time.time(), "spread": spread})
        # Rows inserted finished: counted per minute as the schema's migration counts them.
        db.execute(BACKFILL_MINUTES)
        db.execute("VACUUM ANALYZE tickler_requests")
    out(f"admin: filled {rows:,} rows in {schema} in {time.perf_counter() - started:.1f} s")


def explain(dsn: str, schema: str = SCHEMA) -> list[str]:
    """Every SELECT the admin runs for the overview, the pages (unfiltered, by state, by
    group), the counts and the replicas, with its plan's scans and time
    (EXPLAIN ANALYZE); a line saying SEQUENTIAL SCAN where one reads the table."""
    from tickler._stores import _admin

    session = tickler.PostgresStore(dsn, schema=schema).connect()
    seen: list[tuple[str, Any]] = []
    execute = session.execute

    def record(sql: str, params: Any = ()) -> Any:
        if sql.lstrip().upper().startswith(("SELECT", "WITH")):
            seen.append((sql, params))
        return execute(sql, params)

    session.execute = record  # type: ignore[method-assign]
    try:
        _admin._overviews(session)
        _admin._replicas(session, session.store.lease)
        for f in [
            _admin._Filter(None, None, None),
            _admin._Filter("failed", None, None),
            _admin._Filter(None, None, "customer-10"),
        ]:
            _admin._page(session, QUEUE, f, None, 51)
            _admin._count_where(session, QUEUE, f)
        session.execute = execute  # type: ignore[method-assign]
        found = []
        for sql, params in seen:
            plan = [
                str(line[0])
                for line in execute(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}", params).fetchall()
            ]
            scans = sorted(
                {
                    line.strip().split(" (")[0].removeprefix("->  ")
                    for line in plan
                    if " Scan " in line or line.strip().startswith("->  Result")
                }
                - {"->  Result"}
            )
            took = next((line for line in plan if line.startswith("Execution Time")), "")
            head = " ".join(sql.split())[:90]
            sequential = any("Seq Scan on tickler_requests" in line for line in plan)
            found.append(
                f"{took:>28} | {'SEQUENTIAL SCAN | ' if sequential else ''}{head} | "
                + "; ".join(scans)
            )
        return found
    finally:
        session.close()


def measure(dsn: str, samples: int, schema: str = SCHEMA) -> dict[str, list[float]]:
    """Milliseconds of each call, ``samples`` times, on one admin (its session opened
    first)."""
    store = tickler.PostgresStore(dsn, schema=schema)
    times: dict[str, list[float]] = {"overview": [], "page": [], "failed": []}

    async def main() -> None:
        async with store.admin() as admin:
            await admin.queues()
            calls: dict[str, Callable[[], Any]] = {
                "overview": admin.overview,
                "page": lambda: admin.requests(QUEUE),
                "failed": lambda: admin.requests(QUEUE, state="failed"),
            }
            for _ in range(samples):
                for name, call in calls.items():
                    started = time.perf_counter()
                    await call()
                    times[name].append((time.perf_counter() - started) * 1000)

    trio.run(main)
    return times


def run(config: AdminConfig, out: Callable[[str], None]) -> list[Row]:
    dsn = postgres.open_database(os.environ.get(postgres.DSN_ENV) or postgres.DEFAULT_DSN)
    found: list[Row] = []
    for case, (schema, spread, said) in CASES.items():
        fill(dsn, config.rows, out, schema=schema, spread=spread)
        times = measure(dsn, config.samples, schema)
        for line in explain(dsn, schema):
            out(f"admin plan ({case}): {line}")
        size = f"{config.rows:,} rows{said}"
        suffix = "" if case == "day" else f"_{case}"
        found += [
            Row(
                f"admin_overview{suffix}",
                f"admin overview, PostgreSQL queue of {size}",
                "tickler admin.overview()",
                times["overview"],
                "ms",
                target=("value", "<=", 200.0),
            ),
            Row(
                f"admin_page{suffix}",
                f"admin first page of requests, {size}",
                "tickler admin.requests(queue), 50 rows",
                times["page"],
                "ms",
                target=("value", "<=", 200.0),
            ),
            Row(
                f"admin_failed_page{suffix}",
                f"admin first page of failed requests, {size}",
                "tickler admin.requests(queue, state='failed')",
                times["failed"],
                "ms",
                target=("value", "<=", 200.0),
            ),
        ]
    return found
