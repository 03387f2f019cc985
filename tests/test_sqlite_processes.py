"""SqliteStore with real processes: killed with SIGKILL, and three sharing one file."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import tickler

from .store_runs import check_killed_run, check_shared_run, wait_for_ends

ROOT = Path(__file__).parent.parent


def worker(db: Path, log: Path, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "tests.store_worker", str(db), str(log), *options],
        cwd=ROOT,
    )


def enqueue(db: Path, requests: list[str]) -> None:
    store = tickler.SqliteStore(db)
    store.connect().close()  # creates the schema
    connection = sqlite3.connect(db, isolation_level=None)
    try:
        connection.execute("BEGIN")
        for request in requests:
            key = request if request == "blocker" else None
            store.enqueue_in(connection, "jobs", request, key=key)
        connection.execute("COMMIT")
    finally:
        connection.close()


def states(db: Path) -> dict[int, str]:
    connection = sqlite3.connect(db)
    try:
        return dict(connection.execute("SELECT id, state FROM tickler_requests").fetchall())
    finally:
        connection.close()


def test_a_worker_killed_mid_run_loses_nothing(tmp_path: Path) -> None:
    """SIGKILL mid-run, restart on the same file: all end; only those running ran twice."""
    db, log = tmp_path / "queue.db", tmp_path / "log"
    enqueue(db, [f"r{i}" for i in range(60)])
    first = worker(db, log, "--capacity", "8", "--sleep", "0.1", "--lease", "1")
    wait_for_ends(first, log, 20)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = states(db)
    second = worker(db, log, "--capacity", "8", "--sleep", "0.01", "--lease", "1")
    assert second.wait(timeout=120) == 0
    check_killed_run(log, at_kill, states(db), 60)


def test_three_processes_share_one_queue(tmp_path: Path) -> None:
    """10,000 requests run once each; keys de-duplicate across processes; a cancel crosses them."""
    db, log = tmp_path / "queue.db", tmp_path / "log"
    enqueue(db, [f"r{i}" for i in range(10_000)] + ["blocker"])
    workers = [
        worker(db, log, "--capacity", "50", "--keys", "100", "--cancel-blocker"),
        worker(db, log, "--capacity", "50", "--keys", "100", "--cancel-blocker"),
        worker(db, log, "--capacity", "50", "--keys", "100", "--cancel-blocker"),
    ]
    for process in workers:
        assert process.wait(timeout=300) == 0
    check_shared_run(log, states(db), 3)
