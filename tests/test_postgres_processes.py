"""PostgresStore with real processes on a real server: replicas killed and sharing a queue."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import psycopg.sql

import tickler

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


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def test_a_replica_killed_mid_run_loses_nothing(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """SIGKILL mid-run, another replica on the same schema: all end; only those running twice."""
    log = tmp_path / "log"
    enqueue(postgres_dsn, postgres_schema, [f"r{i}" for i in range(60)])
    options = ("--capacity", "8", "--lease", "1")
    first = worker(postgres_dsn, postgres_schema, log, *options, "--sleep", "0.1")
    deadline = time.monotonic() + 60
    while sum(1 for line in log_lines(log) if line[1] == "end") < 20:
        assert time.monotonic() < deadline, "the first replica made no progress"
        assert first.poll() is None
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = states(postgres_dsn, postgres_schema)
    running_at_kill = {i for i, state in at_kill.items() if state == "running"}
    assert running_at_kill, at_kill

    second = worker(postgres_dsn, postgres_schema, log, *options, "--sleep", "0.01")
    assert second.wait(timeout=120) == 0
    final = states(postgres_dsn, postgres_schema)
    assert set(final.values()) == {"succeeded"}
    assert len(final) == 60
    starts = collections.Counter(int(line[2]) for line in log_lines(log) if line[1] == "start")
    assert set(starts) == set(final)
    assert {i for i, count in starts.items() if count > 1} <= running_at_kill
    assert max(starts.values()) <= 2


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
    lines = log_lines(log)
    starts = collections.Counter(" ".join(line[2:]) for line in lines if line[1] == "start")
    assert all(count == 1 for count in starts.values()), starts.most_common(3)
    final = states(postgres_dsn, postgres_schema)
    assert len(final) == 10_000 + 1 + 100
    assert collections.Counter(final.values()) == {"succeeded": 10_100, "cancelled": 1}
    ran_blocker = {line[0] for line in lines if line[1] == "start" and line[3] == "blocker"}
    cancelled_in = {line[0] for line in lines if line[1] == "cancelled"}
    cancelled_by = {line[0] for line in lines if line[1] == "cancel"}
    assert len(ran_blocker) == 1
    assert cancelled_in == ran_blocker
    assert cancelled_by
    assert not cancelled_by & ran_blocker
    assert len({line[0] for line in lines if line[1] == "start"}) == 3
