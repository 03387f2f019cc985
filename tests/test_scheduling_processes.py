"""Periodic requests and pause across real processes, on SQLite files and PostgreSQL.

Worker processes (tests/schedule_worker.py) share a queue and a log: each
attempt's start and end, and when each saw the queue paused, with the time.
Two promises are checked from outside, on each store of BACKENDS:

- a periodic request ticking every second is enqueued and run once per tick
  across the replicas, and no tick is skipped while one of them lives, though
  one is killed (SIGKILL) mid-run and restarted;
- ``python -m tickler pause URL QUEUE`` stops every replica from starting
  anything within one poll_interval of its return, what runs finishes,
  enqueueing goes on, and ``resume`` lets the work go on.

Each store's Backend (tests/store_backends.py) gives its location and the
workers' arguments; PostgreSQL runs three replicas, a SQLite file two
(BACKENDS of tests/store_runs.py).
"""

from __future__ import annotations

import collections
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from . import store_runs
from .store_runs import BACKENDS, ROOT

LEASE = 2.0
POLL_INTERVAL = 0.1
# Slack over poll_interval for a batch in flight when the pause committed, and
# for the worker's log line (a batch takes milliseconds; on a starved machine
# one has been seen to take a second).
PAUSE_MARGIN = 0.25


@attrs.define
class Place(store_runs.Place):
    """The workers of tests/schedule_worker.py; and the command line's pause and resume."""

    worker = "tests.schedule_worker"
    lease = LEASE
    poll_interval = POLL_INTERVAL

    def cli(self, command: str) -> float:
        """Run ``python -m tickler COMMAND URL jobs``: the time.time() its flag was committed by.

        That is when a look at the store first found the flag set, while the
        command ran (its interpreter takes a while to exit after the commit),
        or else when the command returned.
        """
        db, *rest = self.backend.worker_args()
        url = db if db.startswith("postgresql://") else f"sqlite:///{db}"
        wanted = command == "pause"
        committed = math.inf
        with (
            self.backend.connect() as store,
            subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", "tickler", command, url, "jobs", *rest],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ) as process,
        ):
            flag = f"SELECT paused FROM {self.backend.table('tickler_queues')} WHERE queue = 'jobs'"  # noqa: S608
            while process.poll() is None and committed == math.inf:
                found = store.execute(flag).fetchone()
                if found is not None and bool(found[0]) is wanted:
                    committed = time.time()
                time.sleep(0.005)
            stdout, stderr = process.communicate(timeout=60)
            committed = min(committed, time.time())
        assert process.returncode == 0, stderr
        assert stdout.startswith(f"{command}d queue 'jobs' of "), stdout
        return committed

    def stop_all(self) -> float:
        """Write STOP; wait until every live worker exited cleanly. The time STOP was written."""
        written = time.time()
        self.stop.touch()
        for process in self.processes:
            if process.returncode == -signal.SIGKILL:
                continue
            assert process.wait(timeout=60) == 0
        return written

    def rows(self) -> list[tuple[int, str, float]]:
        """Each row of the queue: (id, state, enqueued_at), in id order."""
        return [
            (int(i), str(state), float(at))
            for i, state, at in self.backend.select("id, state, enqueued_at", "queue = 'jobs'")
        ]

    def count(self, state: str) -> int:
        return len(self.backend.select("id", f"queue = 'jobs' AND state = '{state}'"))


@pytest.fixture(params=list(BACKENDS))
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    with Place.open(request, tmp_path) as place:
        yield place


def sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.time()))


# -- periodic: one run per tick across the replicas, none skipped


def test_each_tick_runs_once_across_replicas_through_a_kill(place: Place) -> None:
    """``every=1`` for ~18 s; one replica is killed while it runs a tick, and restarted.

    Each tick row is a plain queued row, enqueued by the batch that took the
    tick: its enqueued_at is just after its tick, a whole second. So the
    rows are read as ticks, and must be one per second, none twice, none
    missing from the first replica's start until the stop; each ran and
    succeeded, only the one the kill cut short twice.
    """
    options = ("--every", "1", "--sleep", "0.5", "--capacity", "4")
    launched = time.time()
    for _ in range(place.replicas):
        place.launch(*options)
    ready = place.wait_ready(place.replicas, killed=True)
    first_ready = min(line.at for line in ready)
    began = max(line.at for line in ready)

    # ~8 s in, kill a replica while it runs a tick: its row is rescued after the lease.
    sleep_until(began + 8)
    deadline = time.monotonic() + 10
    while True:
        lines = place.lines()
        ended = {(line.pid, line.fields[0]) for line in lines if line.kind == "end"}
        running = [
            line
            for line in lines
            if line.kind == "start" and (line.pid, line.fields[0]) not in ended
        ]
        if running:
            break
        assert time.monotonic() < deadline, "no tick ran"
        time.sleep(0.01)
    victim_pid, cut_short = running[-1].pid, int(running[-1].fields[0])
    (victim,) = [p for p in place.processes if p.pid == victim_pid]
    assert victim.poll() is None
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.time()
    assert victim.wait(timeout=10) == -signal.SIGKILL
    sleep_until(killed_at + 2)
    place.launch(*options)
    place.wait_ready(place.replicas + 1, killed=True)
    sleep_until(began + 18)
    stopped = place.stop_all()

    rows = place.rows()
    lines = place.lines()
    # Rows as ticks: enqueued at most 0.5 s after a whole second.
    ticks = [math.floor(at + 0.1) for _, _, at in rows]
    late = [(i, at) for (i, _, at), tick in zip(rows, ticks, strict=True) if at - tick > 0.5]
    assert not late, late
    # One row a tick, none skipped: consecutive seconds.
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), ticks
    # From the first tick after the first replica ran to the last before the stop.
    assert math.floor(launched) <= ticks[0] <= math.floor(first_ready) + 1, (launched, ticks)
    assert math.ceil(stopped - 0.3) - 1 <= ticks[-1] <= stopped + 1, (stopped, ticks)
    assert len(rows) >= 16
    # The store's record of the schedule is the last tick's.
    periodic = place.backend.table("tickler_periodic")
    with place.backend.connect() as db:
        recorded = list(db.execute(f"SELECT queue, name, last_tick FROM {periodic}"))  # noqa: S608
    assert [tuple(row) for row in recorded] == [("jobs", "beat", float(ticks[-1]))]

    # Every tick before the stop ran to success; after it, a row may wait for the next replica.
    for (i, state, at), tick in zip(rows, ticks, strict=True):
        if tick < stopped - 1:
            assert state == "succeeded", (i, state, at, stopped)
        else:
            assert state in ("queued", "succeeded"), (i, state, at, stopped)
    # One run a tick: the only row that started twice is the one the kill cut short,
    # which ran again (after the lease) in another replica, to its end.
    starts: dict[int, list[int]] = collections.defaultdict(list)
    for line in lines:
        if line.kind == "start":
            starts[int(line.fields[0])].append(line.pid)
    succeeded = {i for i, state, _ in rows if state == "succeeded"}
    assert set(starts) == succeeded
    assert {i: pids for i, pids in starts.items() if len(pids) > 1} == {
        cut_short: [victim_pid, starts[cut_short][1]]
    }
    assert starts[cut_short][1] != victim_pid
    assert cut_short in succeeded
    ends = collections.Counter(int(line.fields[0]) for line in lines if line.kind == "end")
    assert ends == dict.fromkeys(succeeded, 1)


# -- pause from the command line: every replica, within poll_interval


def test_a_pause_from_the_cli_stops_every_replica_within_a_poll_interval(place: Place) -> None:
    """Replicas feeding their queue a request every 20 ms; ``pause``, then ``resume``.

    Once the pause is committed (seen in the store while the command runs;
    its interpreter takes a while to exit), no replica starts anything past
    one poll_interval (and a batch in flight); each logged the pause within
    it, what ran finished, and the rows enqueued meanwhile wait. After
    ``resume`` every replica starts again, and in the end every request ran
    once.
    """
    for _ in range(place.replicas):
        place.launch("--feed", "0.02", "--sleep", "0.05", "--capacity", "4", "--join")
    ready = place.wait_ready(place.replicas, killed=True)
    pids = {line.pid for line in ready}
    began = max(line.at for line in ready)
    sleep_until(began + 1.5)
    assert [line for line in place.lines() if line.kind == "start" and line.at > began]

    paused_at = place.cli("pause")  # (committed by then)
    bound = paused_at + POLL_INTERVAL + PAUSE_MARGIN
    time.sleep(0.5)
    queued_early = place.count("queued")
    time.sleep(1.0)
    queued_late = place.count("queued")
    lines = place.lines()
    late_starts = [line for line in lines if line.kind == "start" and line.at > bound]
    assert not late_starts, (paused_at, late_starts[:5])
    saw_pause = {
        line.pid: line.at for line in lines if line.kind == "paused" and line.fields == ("True",)
    }
    assert set(saw_pause) == pids, saw_pause
    assert max(saw_pause.values()) <= bound, (paused_at, saw_pause)
    # What ran when the pause came finished; what was fed meanwhile waits in the store.
    started = collections.Counter(line.fields[0] for line in lines if line.kind == "start")
    ended = collections.Counter(line.fields[0] for line in lines if line.kind == "end")
    assert started == ended
    # No attempt runs: a row the store still has running is one a replica claimed
    # ahead and has not started (it starts after the resume).
    held = place.backend.select("id, started_at", "queue = 'jobs' AND state = 'running'")
    assert all(started_at is None for _, started_at in held), held
    assert not {str(i) for i, _ in held} & set(started), held
    assert queued_late > queued_early > 0

    # After the resume every replica learns of it (at a look) and starts again.
    resumed_at = place.cli("resume")
    deadline = time.monotonic() + 10
    while True:
        lines = place.lines()
        restarted = {line.pid for line in lines if line.kind == "start" and line.at > resumed_at}
        saw_resume = {
            line.pid
            for line in lines
            if line.kind == "paused" and line.fields == ("False",) and line.at > paused_at
        }
        if restarted == saw_resume == pids:
            break
        assert time.monotonic() < deadline, (resumed_at, restarted, saw_resume)
        time.sleep(0.05)
    time.sleep(0.5)

    place.stop_all()
    lines = place.lines()
    fed = {line.pid: int(line.fields[0]) for line in lines if line.kind == "fed"}  # the last
    rows = place.rows()
    assert len(rows) == sum(fed.values())
    assert {state for _, state, _ in rows} == {"succeeded"}
    starts = collections.Counter(int(line.fields[0]) for line in lines if line.kind == "start")
    assert starts == dict.fromkeys((i for i, _, _ in rows), 1)
