"""PostgresStore with real processes on a real server: replicas killed and sharing a queue."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import psycopg.sql

import tickler

from .store_runs import check_killed_run, check_shared_run, wait_for_ends

ROOT = Path(__file__).parent.parent


def worker(dsn: str, schema: str, log: Path, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "tests.store_worker", dsn, str(log), "--schema", schema, *options],
        cwd=ROOT,
    )


def enqueue(dsn: str, schema: str, requests: list[str]) -> None:
    store = tickler.PostgresStore(dsn, schema=schema)
    store.connect().close()  # creates the schema
    with psycopg.connect(dsn) as connection:  # one transaction, committed on exit
        for request in requests:
            key = request if request == "blocker" else None
            store.enqueue_in(connection, "jobs", request, key=key)


def states(dsn: str, schema: str) -> dict[int, str]:
    with psycopg.connect(dsn) as connection:
        table = psycopg.sql.Identifier(schema, "tickler_requests")
        rows = connection.execute(psycopg.sql.SQL("SELECT id, state FROM {}").format(table))
        return {row[0]: row[1] for row in rows}


def test_a_replica_killed_mid_run_loses_nothing(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """SIGKILL mid-run, another replica on the same schema: all end; only those running twice."""
    log = tmp_path / "log"
    enqueue(postgres_dsn, postgres_schema, [f"r{i}" for i in range(60)])
    options = ("--capacity", "8", "--lease", "1")
    first = worker(postgres_dsn, postgres_schema, log, *options, "--sleep", "0.1")
    wait_for_ends(first, log, 20)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = states(postgres_dsn, postgres_schema)
    second = worker(postgres_dsn, postgres_schema, log, *options, "--sleep", "0.01")
    assert second.wait(timeout=120) == 0
    check_killed_run(log, at_kill, states(postgres_dsn, postgres_schema), 60)


def test_three_replicas_share_one_queue(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """10,000 requests run once each; keys de-duplicate across replicas; a cancel crosses them."""
    log = tmp_path / "log"
    enqueue(postgres_dsn, postgres_schema, [f"r{i}" for i in range(10_000)] + ["blocker"])
    options = ("--capacity", "50", "--keys", "100", "--cancel-blocker")
    workers = [worker(postgres_dsn, postgres_schema, log, *options) for _ in range(3)]
    for process in workers:
        assert process.wait(timeout=300) == 0
    check_shared_run(log, states(postgres_dsn, postgres_schema), 3)
