"""Per-group limits across real worker processes, on a SQLite file and on PostgreSQL.

Worker processes (tests/limits_worker.py) share one queue and one log, each
with ``limits=tickler.Limit(...)`` for every group ("*"). 1,000 grouped
requests (10 heavy groups of 60, 40 light ones of 10) and 40 ungrouped ones
are enqueued up front through the store's ``enqueue_many_in``, one
transaction per group; while the grouped backlog waits, the test enqueues an
ungrouped request every 0.1 s through ``enqueue_in``. Midway, one worker is
killed (SIGKILL) while it runs a grouped attempt; the others finish the run.
From the log (each attempt's start and end, time.time()) and the store's rows:

- with ``concurrency=1``, no two attempts of a group overlap in time; an
  attempt the kill cut has a start and no end, and holds its group until the
  others find its worker's liveness lock free (well before its lease runs
  out): it lasts until its re-run starts;
- with ``rate=10, per=1.0``, no window of a second holds more than 10 starts
  of a group, re-runs counted;
- ungrouped requests are never held back by the groups: each starts within
  poll_interval and a margin of its enqueue, while grouped backlogs wait;
- nothing is lost: every request succeeded, once; only the attempts the kill
  cut ran again, and only the rows the victim held were claimed twice.

PostgreSQL runs three replicas, a SQLite file two (BACKENDS of
tests/store_runs.py).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from . import store_runs
from .store_backends import Backend
from .store_runs import BACKENDS, Line

LEASE = 5.0
# How soon after the kill a cut attempt runs again: the others' next claim finds the
# victim's liveness lock free (within POLL_INTERVAL), then a rate-limited group may wait
# for room in its window (per = 1 s); all well before the lease.
RESCUE_WITHIN = 2.0
POLL_INTERVAL = 0.1
SLEEP = 0.02  # each attempt's handler
CAPACITY = 64  # per worker: more than the groups, so that slots never run short
# Slack over poll_interval for an ungrouped request's start: the batch that
# claims it, and the worker's log line.
START_MARGIN = 0.25
# How long before its death a killed worker may last have renewed its leases:
# it renews every min(lease / 3, poll_interval), and a batch takes a while.
RENEW_SLACK = 0.5
# The ledger's start is the handler's, a little after the claim the store
# counts (at the claim transaction's time, taken once it holds the queue's
# lock): the rest of that transaction, its commit and the task's start. On
# PostgreSQL the first, large claims of a run take ~50 ms more than the later
# ones, so 11 handler starts of a group have been seen within 0.95 s. A
# window of the ledger that holds more than ``rate`` starts must be at least
# this much shorter than ``per`` to show a fault.
CLAIM_TO_START = 0.15

HEAVY = [f"g{i:02d}" for i in range(10)]  # 60 requests each
LIGHT = [f"g{i:02d}" for i in range(10, 50)]  # 10 requests each
SIZES = {**dict.fromkeys(HEAVY, 60), **dict.fromkeys(LIGHT, 10)}
GROUPED = sum(SIZES.values())
UP_FRONT = 40  # ungrouped requests enqueued with the groups' ("plain/N")
assert GROUPED == 1000


def group_of(line: Line) -> str | None:
    """The group of an attempt's request: its name's prefix (None for plain/ and fed/)."""
    prefix = line.fields[1].split("/")[0]
    return None if prefix in ("plain", "fed") else prefix


@attrs.frozen
class Attempt:
    pid: int
    id: int
    group: str | None
    start: float
    end: float | None  # None: cut by the kill


@attrs.define
class Run:
    """What a run left: the log, the rows, the kill, the ungrouped requests fed."""

    lines: list[Line]
    rows: dict[int, tuple[str | None, str, int, float, str]]  # id: group, state, attempts, ...
    victim: int
    killed_before: float  # time.time() just before the SIGSTOP that precedes the SIGKILL
    killed_after: float
    held_at_kill: set[int]  # the rows the victim held (running, its lease) at the kill
    fed: dict[int, int]  # id of each fed ungrouped request: the grouped backlog at its enqueue

    def attempts(self) -> list[Attempt]:
        ends = {(line.pid, line.id): line.at for line in self.lines if line.kind == "end"}
        return [
            Attempt(line.pid, line.id, group_of(line), line.at, ends.get((line.pid, line.id)))
            for line in self.lines
            if line.kind == "start"
        ]

    def cut(self) -> list[Attempt]:
        """The attempts the kill cut: the victim's, of the rows it held at the kill.

        Such an attempt may have logged its end (its handler returned, its
        outcome not yet written): the row still ran again.
        """
        cut = [
            attempt
            for attempt in self.attempts()
            if attempt.pid == self.victim and attempt.id in self.held_at_kill
        ]
        assert all(attempt.end is not None or attempt in cut for attempt in self.attempts()), (
            "only an attempt the kill cut has no end"
        )
        return cut


@attrs.define
class Place(store_runs.Place):
    """The workers of tests/limits_worker.py, each with CAPACITY and a handler of SLEEP."""

    worker = "tests.limits_worker"
    lease = LEASE
    poll_interval = POLL_INTERVAL

    def launch(self, *options: str) -> subprocess.Popen[bytes]:
        return super().launch("--capacity", str(CAPACITY), "--sleep", str(SLEEP), *options)

    def unfinished(self) -> int:
        return len(self.backend.select("id", "queue = 'jobs' AND state <> 'succeeded'"))

    def rows(self) -> dict[int, tuple[str | None, str, int, float, str]]:
        """Each row of the queue: id: (group_name, state, attempts, enqueued_at, request)."""
        return {
            int(i): (group, str(state), int(attempts), float(at), json.loads(bytes(request)))
            for i, group, state, attempts, at, request in self.backend.select(
                "id, group_name, state, attempts, enqueued_at, request", "queue = 'jobs'"
            )
        }


@pytest.fixture(params=list(BACKENDS))
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    with Place.open(request, tmp_path) as place:
        store = place.backend.store()
        if not (hasattr(store, "enqueue_many_in") and hasattr(store, "enqueue_in")):
            pytest.skip("the store takes no requests through the caller's connection")
        yield place


def enqueue_up_front(backend: Backend) -> None:
    """The ungrouped requests, then each group's, in a transaction of its own."""
    store = backend.store()
    batches: list[tuple[str | None, list[str]]] = [
        (None, [f"plain/{n}" for n in range(UP_FRONT)]),
        *((group, [f"{group}/{n}" for n in range(size)]) for group, size in SIZES.items()),
    ]
    for group, requests in batches:
        with backend.connect(autocommit=False) as connection:
            ids = store.enqueue_many_in(connection, "jobs", requests, group=group)
            connection.commit()
        assert len(set(ids)) == len(requests)


def grouped_backlog(connection: Any, backend: Backend) -> int:
    """Grouped rows not claimed yet."""
    table = backend.table("tickler_requests")
    found = connection.execute(
        f"SELECT count(*) FROM {table}"  # noqa: S608 - the tests' own
        " WHERE queue = 'jobs' AND group_name IS NOT NULL AND state = 'queued'"
    ).fetchone()
    return int(found[0])


def _running_grouped(lines: list[Line]) -> collections.Counter[int]:
    """Each process's grouped attempts that started and have not ended, as the lines say."""
    tail = lines[-300:]  # an attempt's start and end are 20 ms apart
    ends = {(line.pid, line.id) for line in tail if line.kind == "end"}
    return collections.Counter(
        line.pid
        for line in tail
        if line.kind == "start" and group_of(line) is not None and (line.pid, line.id) not in ends
    )


def stop_mid_attempt(place: Place) -> tuple[subprocess.Popen[bytes], str, float]:
    """A live worker stopped (SIGSTOP) while it runs a grouped attempt, its owner, and
    the time.time() just before the signal.

    A worker seen mid-attempt may end that attempt before the signal lands (its
    attempts last 20 ms): the lines are read again once it is stopped, and a worker
    that holds no attempt any more is let go on (SIGCONT) and another one is caught.
    """
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "no worker was stopped mid-attempt"
        running = _running_grouped(place.lines())
        candidates = [p for p in place.processes if running[p.pid] and p.poll() is None]
        if not candidates:
            time.sleep(0.002)
            continue
        victim = max(candidates, key=lambda p: running[p.pid])
        stopped_at = time.time()
        os.kill(victim.pid, signal.SIGSTOP)
        lines = place.lines()
        if _running_grouped(lines)[victim.pid]:
            (owner,) = [
                line.fields[0] for line in lines if line.kind == "owner" and line.pid == victim.pid
            ]
            return victim, owner, stopped_at
        os.kill(victim.pid, signal.SIGCONT)


def run(place: Place, *limit: str) -> Run:
    """Enqueue, launch the replicas, feed ungrouped requests, kill one midway, finish, stop."""
    enqueue_up_front(place.backend)
    for _ in range(place.replicas):
        place.launch(*limit)
    place.wait_ready()
    store = place.backend.store()
    fed: dict[int, int] = {}
    victim: subprocess.Popen[bytes] | None = None
    killed_before = killed_after = 0.0
    held_at_kill: set[int] = set()
    deadline = time.monotonic() + 60
    with place.backend.connect(autocommit=False) as feeder:
        while victim is None or place.unfinished():
            if time.monotonic() > deadline:
                left = place.backend.select(
                    "id, group_name, state, owner, lease_until, attempts",
                    "queue = 'jobs' AND state <> 'succeeded'",
                )
                alive = [p.pid for p in place.processes if p.poll() is None]
                pytest.fail(f"the run did not finish: {left[:20]} ({len(left)}), alive {alive}")
            lines = place.lines()
            ended = sum(1 for line in lines if line.kind == "end")
            if victim is None and ended >= 400:
                # No feeding for 0.3 s before the kill, so that no ungrouped
                # request waits in the victim.
                time.sleep(0.3)
                # Stopped first, it keeps its liveness lock: what it holds at the kill is
                # read before the others can rescue it.
                victim, owner, killed_before = stop_mid_attempt(place)
                held_at_kill = {
                    int(row[0])
                    for row in place.backend.select(
                        "id", f"queue = 'jobs' AND state = 'running' AND owner = '{owner}'"
                    )
                }
                os.kill(victim.pid, signal.SIGKILL)
                killed_after = time.time()
                assert victim.wait(timeout=10) == -signal.SIGKILL
                continue
            backlog = grouped_backlog(feeder, place.backend)
            if backlog:
                request_id = store.enqueue_in(feeder, "jobs", f"fed/{len(fed)}")
                fed[request_id] = backlog
            feeder.commit()
            time.sleep(0.1)
    assert victim is not None
    place.stop.touch()
    for process in place.processes:
        if process is not victim:
            assert process.wait(timeout=60) == 0
    return Run(
        place.lines(),
        place.rows(),
        victim.pid,
        killed_before,
        killed_after,
        held_at_kill,
        fed,
    )


# -- the checks every run passes


def check_nothing_lost(result: Run) -> None:
    """Every request succeeded once; re-runs only for the cut attempts; groups as enqueued."""
    rows = result.rows
    assert len(rows) == GROUPED + UP_FRONT + len(result.fed)
    assert {state for _, state, _, _, _ in rows.values()} == {"succeeded"}
    # Each row's group is its request's, as enqueued.
    for group, _, _, _, request in rows.values():
        prefix = request.split("/")[0]
        assert group == (None if prefix in ("plain", "fed") else prefix), (group, request)
    assert collections.Counter(request.split("/")[0] for *_, request in rows.values()) == {
        **SIZES,
        "plain": UP_FRONT,
        "fed": len(result.fed),
    }
    attempts = result.attempts()
    cut = result.cut()
    cut_ids = {attempt.id for attempt in cut}
    assert cut, "the kill cut no attempt"
    assert len(cut_ids) == len(cut)
    ended = collections.Counter(
        attempt.id for attempt in attempts if attempt.end is not None and attempt not in cut
    )
    assert ended == dict.fromkeys(rows, 1), "every request ran to its end once (the kill aside)"
    started = collections.Counter(attempt.id for attempt in attempts)
    assert {i for i, count in started.items() if count > 1} == cut_ids
    assert max(started.values()) == 2
    # The store counted a claim for every start, and one more for each row
    # the victim held at the kill (whether it had started it or not).
    for i, (_, _, count, _, _) in rows.items():
        assert count == (2 if i in result.held_at_kill else 1), (i, count)


def check_reruns_came_at_once(result: Run) -> dict[int, float]:
    """Each cut attempt ran again elsewhere after the kill, well before its lease ran out (the
    victim's liveness lock was free): its re-run's start by id."""
    reruns: dict[int, float] = {}
    for attempt in result.cut():
        (rerun,) = [
            other
            for other in result.attempts()
            if other.id == attempt.id and other.pid != result.victim
        ]
        assert rerun.end is not None
        assert rerun.start >= result.killed_before, (attempt, rerun)
        assert rerun.start <= result.killed_after + RESCUE_WITHIN, (attempt, rerun)
        assert RESCUE_WITHIN < LEASE - RENEW_SLACK
        reruns[attempt.id] = rerun.start
    return reruns


def check_ungrouped_never_held_back(result: Run) -> None:
    """Ungrouped requests start within poll_interval and a margin of their enqueue."""
    ready = min(line.at for line in result.lines if line.kind == "ready")
    first_start: dict[int, float] = {}
    for attempt in result.attempts():
        first_start.setdefault(attempt.id, attempt.start)
    late = []
    for i, (group, _, _, enqueued_at, request) in result.rows.items():
        if group is not None:
            continue
        # The requests enqueued up front: from when the first worker ran.
        since = enqueued_at if request.startswith("fed/") else max(enqueued_at, ready)
        if first_start[i] - since > POLL_INTERVAL + START_MARGIN:
            late.append((i, request, round(first_start[i] - since, 3)))
    assert not late, late
    # Those fed came while the grouped backlog waited, and there were some.
    assert len(result.fed) >= 5, result.fed
    assert all(backlog > 0 for backlog in result.fed.values())


# -- concurrency=1: no two attempts of a group overlap


def test_concurrency_one_per_group_across_replicas_through_a_kill(place: Place) -> None:
    result = run(place, "--concurrency", "1")
    check_nothing_lost(result)
    reruns = check_reruns_came_at_once(result)
    check_ungrouped_never_held_back(result)

    cut = result.cut()
    spans: dict[str, list[tuple[float, float, int, int]]] = collections.defaultdict(list)
    for attempt in result.attempts():
        if attempt.group is None:
            continue
        # An attempt the kill cut holds its group until its re-run starts.
        end = reruns[attempt.id] if attempt in cut else attempt.end
        assert end is not None
        spans[attempt.group].append((attempt.start, end, attempt.pid, attempt.id))
    assert set(spans) == set(SIZES)
    overlaps = []
    for group, each in spans.items():
        each.sort()
        for before, after in itertools.pairwise(each):
            if after[0] < before[1]:
                overlaps.append((group, before, after))
    assert not overlaps, overlaps
    # The groups ran side by side: many attempts of different groups at once.
    events = sorted(
        [(start, 1) for each in spans.values() for start, _, _, _ in each]
        + [(end, -1) for each in spans.values() for _, end, _, _ in each]
    )
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak >= 10, peak
    # A heavy group ran its 60 one after another, in more than 60 handlers' time.
    for group in HEAVY:
        assert spans[group][-1][1] - spans[group][0][0] >= 60 * SLEEP, group


# -- rate=10 per second: no second holds more than 10 starts of a group


def test_rate_per_group_across_replicas_through_a_kill(place: Place) -> None:
    rate, per = 10, 1.0
    result = run(place, "--rate", str(rate), "--per", str(per))
    check_nothing_lost(result)
    check_reruns_came_at_once(result)
    check_ungrouped_never_held_back(result)

    starts: dict[str, list[float]] = collections.defaultdict(list)
    for attempt in result.attempts():  # re-runs too: each is a start
        if attempt.group is not None:
            starts[attempt.group].append(attempt.start)
    assert set(starts) == set(SIZES)
    crowded = []
    busiest: dict[str, int] = {}
    for group, times in starts.items():
        times.sort()
        for index, at in enumerate(times):
            within = sum(1 for other in times[index:] if other < at + per - CLAIM_TO_START)
            if within > rate:
                crowded.append((group, at, within))
            busiest[group] = max(
                busiest.get(group, 0), sum(1 for other in times[index:] if other < at + per)
            )
    assert not crowded, crowded
    for group in HEAVY:
        # 60 starts at 10 a second: the limit held the group back, and let it go at its rate.
        assert starts[group][-1] - starts[group][0] >= (60 / rate - 1) * per - CLAIM_TO_START
        assert busiest[group] >= rate - 2, (group, busiest[group])
