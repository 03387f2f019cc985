"""SqliteStore with real processes: killed with SIGKILL, and three sharing one file."""

from __future__ import annotations

import collections
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import tickler

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


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def test_a_worker_killed_mid_run_loses_nothing(tmp_path: Path) -> None:
    """SIGKILL mid-run, restart on the same file: all end; only those running ran twice."""
    db, log = tmp_path / "queue.db", tmp_path / "log"
    enqueue(db, [f"r{i}" for i in range(60)])
    first = worker(db, log, "--capacity", "8", "--sleep", "0.1", "--lease", "1")
    deadline = time.monotonic() + 60
    while sum(1 for line in log_lines(log) if line[1] == "end") < 20:
        assert time.monotonic() < deadline, "the first worker made no progress"
        assert first.poll() is None
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = states(db)
    running_at_kill = {i for i, state in at_kill.items() if state == "running"}
    assert running_at_kill, at_kill
    assert set(at_kill.values()) <= {"queued", "running", "succeeded"}

    second = worker(db, log, "--capacity", "8", "--sleep", "0.01", "--lease", "1")
    assert second.wait(timeout=120) == 0
    assert set(states(db).values()) == {"succeeded"}
    assert len(states(db)) == 60
    starts = collections.Counter(int(line[2]) for line in log_lines(log) if line[1] == "start")
    assert set(starts) == set(range(1, 61))
    twice = {i for i, count in starts.items() if count > 1}
    assert twice <= running_at_kill
    assert max(starts.values()) <= 2


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
    lines = log_lines(log)
    starts = collections.Counter(" ".join(line[2:]) for line in lines if line[1] == "start")
    assert all(count == 1 for count in starts.values()), starts.most_common(3)
    final = states(db)
    # 10,000 plain requests, the blocker, and one row per key however many enqueued it.
    assert len(final) == 10_000 + 1 + 100
    assert collections.Counter(final.values()) == {"succeeded": 10_100, "cancelled": 1}
    ran_blocker = {line[0] for line in lines if line[1] == "start" and line[3] == "blocker"}
    cancelled_in = {line[0] for line in lines if line[1] == "cancelled"}
    cancelled_by = {line[0] for line in lines if line[1] == "cancel"}
    assert len(ran_blocker) == 1
    assert cancelled_in == ran_blocker
    assert cancelled_by
    assert not cancelled_by & ran_blocker
    pids = {line[0] for line in lines if line[1] == "start"}
    assert len(pids) == 3  # every process took part
