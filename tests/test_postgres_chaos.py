"""PostgresStore under chaos: three replicas on one queue, a SIGKILL every 2 s, a server restart.

Three worker processes (tests/store_worker.py) share 20,000 requests and 100
keys that every worker, restarts included, enqueues. For 20 s one of them is
killed with SIGKILL every 2 s and started again, and the server restarts
once in the middle. Then every request has succeeded; the only attempts that
ran again are those a killed worker held running; no lease stays expired
longer than the poll interval (and a margin) while the server is up; each key
made one row; and the workers that lived through the restart logged their
failed batches and went on working.
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import time
from pathlib import Path

import psycopg
import psycopg.sql

import tickler

from .conftest import Cluster
from .store_runs import check_chaos_run, log_lines, owner_of, worker

REQUESTS = 20_000
KEYS = 100
KILLS = 10  # one every 2 s
LEASE = 3.0
POLL_INTERVAL = 0.1
# How long past its expiry a lease may be seen, beyond the poll interval: the
# claiming replica's batch, on a machine whose two cores the three workers,
# the server and this test share.
MARGIN = 1.0
# After the server is back, the replicas' batches wait out their backoff
# (50 ms doubling) before they claim again: leases are not checked meanwhile.
AFTER_RESTART = 2.0


def table(schema: str) -> psycopg.sql.Composed:
    return psycopg.sql.SQL("{}").format(psycopg.sql.Identifier(schema, "tickler_requests"))


def enqueue_many(dsn: str, schema: str, requests: list[str]) -> None:
    """Insert requests as another driver would (see the README), in one statement."""
    tickler.PostgresStore(dsn, schema=schema).connect().close()  # creates the schema
    encoded = [tickler.JsonCodec().encode(request) for request in requests]
    insert = psycopg.sql.SQL(
        "INSERT INTO {} (queue, key, state, request, run_at, enqueued_at)"
        " SELECT 'jobs', NULL, 'queued', request, extract(epoch FROM now()),"
        " extract(epoch FROM now()) FROM unnest(%s::bytea[]) AS request"
    )
    with psycopg.connect(dsn) as connection:
        connection.execute(insert.format(table(schema)), (encoded,))


def release_keys(dsn: str, schema: str) -> int:
    """The keyed requests fall due now; returns how many."""
    update = psycopg.sql.SQL(
        "UPDATE {} SET run_at = extract(epoch FROM clock_timestamp())"
        " WHERE key IS NOT NULL AND state = 'scheduled'"
    )
    with psycopg.connect(dsn) as connection:
        return connection.execute(update.format(table(schema))).rowcount


def held_by(dsn: str, schema: str, owner: str) -> set[int]:
    """The requests the store has running under ``owner``'s lease."""
    query = psycopg.sql.SQL("SELECT id FROM {} WHERE state = 'running' AND owner = %s")
    with psycopg.connect(dsn) as connection:
        return {row[0] for row in connection.execute(query.format(table(schema)), (owner,))}


def expired_leases(dsn: str, schema: str) -> list[tuple[int, float]]:
    """Running rows whose lease has expired, with how many seconds ago (a lease that lapsed
    when its owner's liveness lock was found free holds that time, negated)."""
    query = psycopg.sql.SQL(
        "SELECT id, extract(epoch FROM clock_timestamp()) - abs(lease_until) FROM {}"
        " WHERE state = 'running' AND lease_until < extract(epoch FROM clock_timestamp())"
    )
    with psycopg.connect(dsn) as connection:
        return [(row[0], row[1]) for row in connection.execute(query.format(table(schema)))]


def keys_and_states(dsn: str, schema: str) -> dict[int, tuple[str | None, str]]:
    query = psycopg.sql.SQL("SELECT id, key, state FROM {}")
    with psycopg.connect(dsn) as connection:
        return {row[0]: (row[1], row[2]) for row in connection.execute(query.format(table(schema)))}


def wait_until_running(log: Path, process: subprocess.Popen[bytes]) -> None:
    """Wait until the worker has logged its owner: it runs, and holds leases under that name."""
    deadline = time.monotonic() + 60
    while not any(line[1] == "owner" and int(line[0]) == process.pid for line in log_lines(log)):
        assert process.poll() is None, "a worker ended before it ran"
        assert time.monotonic() < deadline, "a worker never ran"
        time.sleep(0.05)


class LeaseWatch:
    """Looks at the leases every 0.1 s, except while the server restarts and just after."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self.paused_until = 0.0
        self.looks = 0
        self.longest = 0.0  # the longest a lease was seen expired
        self.overdue: list[tuple[int, float]] = []  # seen expired for too long

    def until(self, deadline: float, done: list[subprocess.Popen[bytes]] | None = None) -> None:
        """Look until ``deadline`` (monotonic), or until every process in ``done`` exited."""
        while time.monotonic() < deadline:
            if done is not None and all(process.poll() is not None for process in done):
                return
            if time.monotonic() >= self.paused_until:
                expired = expired_leases(self.dsn, self.schema)
                self.longest = max([self.longest, *(ago for _, ago in expired)])
                self.overdue += [(i, ago) for i, ago in expired if ago > POLL_INTERVAL + MARGIN]
                self.looks += 1
            time.sleep(0.1)


def test_three_replicas_survive_kills_and_a_server_restart(
    tmp_path: Path, postgres_cluster: Cluster, cluster_schema: str
) -> None:
    dsn, schema, log = postgres_cluster.dsn, cluster_schema, tmp_path / "log"
    enqueue_many(dsn, schema, [f"r{i}" for i in range(REQUESTS)])
    # The keyed requests wait until the last restarted worker has enqueued
    # them too (this test then makes them due): until then each is live, so
    # every enqueue of its key, in any worker, finds it.
    keys_due = time.time() + 3600
    options = (
        *("--capacity", "30", "--sleep", "0.06", "--lease", str(LEASE)),
        *("--poll-interval", str(POLL_INTERVAL), "--keys", str(KEYS), "--keys-due", str(keys_due)),
    )
    slots = [worker([dsn, "--schema", schema], log, *options) for _ in range(3)]
    for process in slots:
        wait_until_running(log, process)
    watch = LeaseWatch(dsn, schema)
    held_at_kill: dict[int, set[int]] = {}
    killed_at: dict[int, float] = {}
    alive_at_restart: list[int] = []
    restarted_at = restart_took = 0.0
    began = time.monotonic()
    try:
        for kill in range(1, KILLS + 1):
            watch.until(began + 2 * kill)
            slot = (kill - 1) % 3
            victim = slots[slot]
            wait_until_running(log, victim)
            owner = owner_of(log, victim.pid)
            # Stopped first, it keeps its liveness lock: what it holds at the kill is read
            # before the other replicas can take it over.
            victim.send_signal(signal.SIGSTOP)
            held_at_kill[victim.pid] = held_by(dsn, schema, owner)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            killed_at[victim.pid] = time.monotonic()
            slots[slot] = worker([dsn, "--schema", schema], log, *options)
            if kill == KILLS // 2:
                # Restart the server between two kills, once the new worker runs.
                wait_until_running(log, slots[slot])
                alive_at_restart = [process.pid for process in slots]
                watch.paused_until = float("inf")
                stopping = time.monotonic()
                postgres_cluster.stop()
                postgres_cluster.start()
                restarted_at = time.monotonic()
                restart_took = restarted_at - stopping
                watch.paused_until = restarted_at + AFTER_RESTART
        # Every worker still running has enqueued its keys: they fall due.
        deadline = time.monotonic() + 60
        while True:
            keyed = collections.Counter(line[0] for line in log_lines(log) if line[1] == "keyed")
            if all(keyed[str(process.pid)] == KEYS for process in slots):
                break
            assert time.monotonic() < deadline, "a worker never enqueued its keys"
            watch.until(time.monotonic() + 0.1)
        assert release_keys(dsn, schema) == KEYS
        watch.until(time.monotonic() + 300, done=slots)
        for process in slots:
            assert process.wait(timeout=1) == 0
    finally:
        for process in slots:
            if process.poll() is None:
                process.kill()
                process.wait()
    took = time.monotonic() - began

    lines = log_lines(log)
    print(  # shown with the failure, or with -s
        json.dumps(
            {
                "seconds": round(took, 1),
                "restart_seconds": round(restart_took, 2),
                "held_at_kill": [len(held) for held in held_at_kill.values()],
                "store_errors": collections.Counter(
                    line[0] for line in lines if line[1] == "store_errors"
                ),
                "lease_looks": watch.looks,
                "longest_expired": round(watch.longest, 2),
            }
        )
    )
    repeats = check_chaos_run(log, held_at_kill, keys_and_states(dsn, schema), REQUESTS, KEYS)
    assert repeats > 0  # the kills cut attempts short, and those ran again
    assert sum(1 for held in held_at_kill.values() if held) >= KILLS // 2, held_at_kill
    assert watch.looks > 50
    assert not watch.overdue, watch.overdue[:10]
    # The workers that lived through the restart (and some seconds past it)
    # counted their failed batches, and went on starting attempts afterwards.
    survivors = [
        pid for pid in alive_at_restart if killed_at.get(pid, float("inf")) > restarted_at + 2
    ]
    assert survivors
    for pid in survivors:
        kinds = [line[1] for line in lines if int(line[0]) == pid]
        assert "store_errors" in kinds, f"worker {pid} logged no failed batch"
        assert "start" in kinds[kinds.index("store_errors") :], f"worker {pid} stopped working"
