"""Worker processes on a store, and the checks of what they logged, whatever the store.

Worker processes (tests/store_worker.py) write a line per attempt start and
end to a shared log; the checks of killed runs read it, with the states the
store holds. The process tests of limits and scheduling run their replicas
through a Place, on each store of BACKENDS.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import attrs
import pytest

import tickler
from tickler._stores._sync import StoreSync

from .store_backends import Backend, PostgresBackend, SqliteBackend

ROOT = Path(__file__).parent.parent

# Each store, and how many replicas share its queue.
BACKENDS: dict[str, tuple[Callable[[pytest.FixtureRequest, Path], Backend], int]] = {
    "sqlite": (SqliteBackend.for_test, 2),
    "postgres": (PostgresBackend.for_test, 3),
}


@attrs.frozen
class Line:
    """A line of the shared log: ``PID KIND ... TIME``."""

    pid: int
    kind: str
    fields: tuple[str, ...]
    at: float

    @classmethod
    def parse(cls, text: str) -> Line:
        pid, kind, *fields, at = text.split()
        return cls(int(pid), kind, tuple(fields), float(at))

    @property
    def id(self) -> int:
        """The request's id, on an attempt's start or end."""
        return int(self.fields[0])


@attrs.define
class Place:
    """A store location, its replicas' number, and the files its workers share.

    A subclass names its workers' module (run as ``python -m WORKER DB LOG
    STOP ...``), and the lease and poll_interval they run with.
    """

    worker: ClassVar[str]
    lease: ClassVar[float]
    poll_interval: ClassVar[float]

    backend: Backend
    replicas: int
    log: Path
    stop: Path
    processes: list[subprocess.Popen[bytes]] = attrs.Factory(list)

    @classmethod
    @contextlib.contextmanager
    def open(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Self]:
        """A place on the store of BACKENDS ``request.param`` names, its schema created.

        At the end, every worker still running is killed (SIGKILL).
        """
        make, replicas = BACKENDS[request.param]
        backend = make(request, tmp_path)
        backend.store().create_schema()  # before the replicas race to
        place = cls(backend, replicas, tmp_path / "log", tmp_path / "stop")
        try:
            yield place
        finally:
            place.kill_all()

    def kill_all(self) -> None:
        """Kill (SIGKILL) every worker still running, and reap it."""
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()

    def finish(self, timeout: float = 30.0) -> None:
        """Ask every worker to stop (the stop file), and wait at most ``timeout`` seconds
        in all for them to end: each must end with status 0, but for those killed."""
        self.stop.touch()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            if process.poll() is None:
                process.wait(max(0.1, deadline - time.monotonic()))
        dead = [p.returncode for p in self.processes if p.returncode not in (0, -signal.SIGKILL)]
        assert not dead, f"workers failed: {dead}"

    def launch(self, *options: str) -> subprocess.Popen[bytes]:
        """A worker on the store, logging to the shared log."""
        db, *rest = self.backend.worker_args()
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [
                sys.executable,
                "-m",
                self.worker,
                db,
                str(self.log),
                str(self.stop),
                *rest,
                "--lease",
                str(self.lease),
                "--poll-interval",
                str(self.poll_interval),
                *options,
            ],
            cwd=ROOT,
        )
        self.processes.append(process)
        return process

    def lines(self) -> list[Line]:
        if not self.log.exists():
            return []
        return [Line.parse(text) for text in self.log.read_text().splitlines()]

    def wait_ready(self, count: int | None = None, *, killed: bool = False) -> list[Line]:
        """Wait until ``count`` workers (by default, every one launched) have logged ready.

        Every worker must still run; with ``killed``, one may have been killed (SIGKILL).
        """
        count = len(self.processes) if count is None else count
        alive = (None, -signal.SIGKILL) if killed else (None,)
        deadline = time.monotonic() + 60
        while len(ready := [line for line in self.lines() if line.kind == "ready"]) < count:
            assert time.monotonic() < deadline, "the workers did not start"
            assert all(process.poll() in alive for process in self.processes), "a worker died"
            time.sleep(0.02)
        return ready


def worker(db: Sequence[str], log: Path, *options: str) -> subprocess.Popen[bytes]:
    """A worker process (tests/store_worker.py) on the store ``db`` names, logging to ``log``."""
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "tests.store_worker", db[0], str(log), *db[1:], *options],
        cwd=ROOT,
    )


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def wait_for_ends(process: subprocess.Popen[bytes], log: Path, count: int) -> None:
    """Wait until the log holds ``count`` attempt ends, the process still running."""
    deadline = time.monotonic() + 60
    while sum(1 for line in log_lines(log) if line[1] == "end") < count:
        assert time.monotonic() < deadline, "the worker made no progress"
        assert process.poll() is None
        time.sleep(0.01)


def check_killed_run(log: Path, at_kill: dict[int, str], final: dict[int, str], n: int) -> None:
    """Every one of ``n`` requests succeeded; only those running at the kill started twice."""
    running_at_kill = {i for i, state in at_kill.items() if state == "running"}
    assert running_at_kill, at_kill
    assert set(at_kill.values()) <= {"queued", "running", "succeeded"}
    assert set(final.values()) == {"succeeded"}
    assert len(final) == n
    starts = collections.Counter(int(line[2]) for line in log_lines(log) if line[1] == "start")
    assert set(starts) == set(range(1, n + 1))
    assert {i for i, count in starts.items() if count > 1} <= running_at_kill
    assert max(starts.values()) <= 2


def check_shared_run(log: Path, final: dict[int, str], workers: int) -> None:
    """10,000 requests ran once each, 100 keys made 100 rows, one cancel crossed processes."""
    lines = log_lines(log)
    starts = collections.Counter(" ".join(line[2:4]) for line in lines if line[1] == "start")
    assert all(count == 1 for count in starts.values()), starts.most_common(3)
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
    assert len({line[0] for line in lines if line[1] == "start"}) == workers  # all took part


def owner_of(log: Path, pid: int) -> str:
    """The owner a worker logged once it ran: the store's name for its leases."""
    owners = [line[2] for line in log_lines(log) if line[1] == "owner" and int(line[0]) == pid]
    assert len(owners) == 1, f"worker {pid} logged no owner: it never ran"
    return owners[0]


def check_chaos_run(
    log: Path,
    held_at_kill: dict[int, set[int]],
    final: dict[int, tuple[str | None, str]],
    requests: int,
    keys: int,
) -> int:
    """Every request succeeded; only attempts a kill cut short ran again; keys made one row each.

    ``held_at_kill`` gives, for each killed worker, the requests it held
    running in the store just after it died; ``final`` each row's key and
    state. Returns how many attempts ran again.
    """
    lines = log_lines(log)
    assert collections.Counter(state for _, state in final.values()) == {
        "succeeded": requests + keys
    }
    starts: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # id: (pid, attempt)
    for line in lines:
        if line[1] == "start":
            starts[int(line[2])].append((int(line[0]), int(line[4])))
    ends = {int(line[2]) for line in lines if line[1] == "end"}
    assert set(starts) == set(final), "every row started, and every start is a row"
    assert ends == set(final), "every request ran to its end"
    repeats = 0
    for request_id, attempts in starts.items():
        numbers = [number for _, number in attempts]
        assert numbers == sorted(set(numbers)), (request_id, attempts)  # in order, none twice
        for pid, number in attempts[:-1]:
            # Started again: this attempt's worker was killed while it held it.
            assert request_id in held_at_kill.get(pid, ()), (request_id, pid, number, attempts)
            repeats += 1
    # Keys: however many workers (and restarts) enqueued a key, one row, one id.
    keyed: dict[str, set[int]] = collections.defaultdict(set)
    for line in lines:
        if line[1] == "keyed":
            keyed[line[3]].add(int(line[2]))
    rows_by_key = {key: i for i, (key, _) in final.items() if key is not None}
    assert len(rows_by_key) == sum(1 for key, _ in final.values() if key is not None) == keys
    assert len(keyed) == keys
    for request, ids in keyed.items():
        assert ids == {rows_by_key[f'"{request}"']}, (request, ids)
    return repeats


def driver_of(session: Any) -> Any:
    """The driver connection (sqlite3's or psycopg's) inside a service's store session.

    For tests that act on the very session a service uses: terminate its
    backend, read its settings.
    """
    return session.db


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path, **options: Any) -> Any:
    """A real store of ``kind``: a SQLite file in tmp_path, or a fresh PostgreSQL schema."""
    options = {"poll_interval": 0.05, "lease": 5.0, **options}
    if kind == "sqlite":
        return tickler.SqliteStore(tmp_path / "queue.db", synchronous="NORMAL", **options)
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    return tickler.PostgresStore(dsn, schema=schema, **options)


def caller_connection(store: Any) -> Any:
    """A connection of the caller's own to the store's database, for enqueue_in."""
    if isinstance(store, tickler.SqliteStore):
        return sqlite3.connect(store.path, isolation_level=None)
    import psycopg

    return psycopg.connect(store.dsn, autocommit=True)


def sync_of(service: tickler.Service[Any, Any]) -> StoreSync:
    """The store side of a service with a store: white-box tests of its rules read it."""
    stored = service._store_run
    assert isinstance(stored, StoreSync)
    return stored
