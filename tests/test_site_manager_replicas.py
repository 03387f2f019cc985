"""examples/site_manager as three replicas on one PostgreSQL database: real processes, real sockets.

Every replica appends to one --step-log: a line per step attempt's start and
end, and one when a delete's cancels have returned with no creation step of
the site live. The checks read it with the status table and tickler's rows.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import psycopg
import psycopg.sql
import trio

from examples.site_manager.store import QUEUE, queue_schema
from examples.site_manager.workflow import CREATION_STEPS

from .test_site_manager import (
    ATTEMPT_EVENTS,
    assert_provisioned,
    assert_removed,
    check_aborts,
    read_step_log,
)

ROOT = Path(__file__).parent.parent
SITES = 300
DELETED = 20
KILL_AFTER = 100  # POSTs answered before one replica is killed
LEASE = 2.0


@attrs.define(eq=False)
class Replica:
    process: trio.Process
    url: str

    @property
    def pid(self) -> int:
        return self.process.pid


@attrs.define(eq=False)
class Fleet:
    """Replicas started with the same options: those serving now, and every process started."""

    options: list[str]
    logs: Path
    serving: list[Replica] = attrs.Factory(list)
    started: list[Replica] = attrs.Factory(list)

    async def start(self, *options: str) -> Replica:
        """Start ``python -m examples.site_manager`` and wait until it listens."""
        with (self.logs / f"replica-{len(self.started)}.log").open("ab") as errors:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "examples.site_manager", *self.options, *options],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=errors,
            )
        replica = Replica(process, "")
        self.started.append(replica)
        assert process.stdout is not None
        output = b""
        with trio.fail_after(30):
            while b"listening on " not in output:
                chunk = await process.stdout.receive_some()
                assert chunk, f"replica {len(self.started) - 1} did not start"
                output += chunk
        replica.url = output.split(b"listening on ")[1].split()[0].decode()
        self.serving.append(replica)
        return replica

    async def kill(self, replica: Replica) -> None:
        """SIGKILL, and wait until it is gone."""
        if replica in self.serving:
            self.serving.remove(replica)
        replica.process.kill()
        await replica.process.wait()


@asynccontextmanager
async def fleet_of(options: list[str], logs: Path, count: int) -> AsyncIterator[Fleet]:
    """Start ``count`` replicas; at the end stop those serving (SIGTERM: each exits 0)."""
    fleet = Fleet(options, logs)
    try:
        for _ in range(count):
            await fleet.start()
        yield fleet
        for replica in fleet.serving:
            replica.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            for replica in fleet.serving:
                assert await replica.process.wait() == 0
    finally:
        for replica in fleet.started:
            if replica.process.returncode is None:
                replica.process.kill()
            if replica.process.stdout is not None:
                await replica.process.stdout.aclose()


Line = tuple[int, int, str, int, str]


@attrs.define(eq=False)
class Tail:
    """The step log as it grows, read by one task, for tests that wait on what it says."""

    path: Path
    lines: list[Line] = attrs.Factory(list)
    # The attempts under way, by pid: (site id, step).
    running: dict[int, set[tuple[int, str]]] = attrs.Factory(dict)
    # The pid that first started each (site id, step).
    started: dict[tuple[int, str], int] = attrs.Factory(dict)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def follow(self) -> None:
        offset = 0
        while True:
            data = self.path.read_bytes()[offset:] if self.path.exists() else b""
            complete = data[: data.rfind(b"\n") + 1]
            offset += len(complete)
            for text in complete.decode().splitlines():
                time_ns, pid, event, site_id, step = text.split()
                line = (int(time_ns), int(pid), event, int(site_id), step)
                self.lines.append(line)
                if event == "start":
                    self.running.setdefault(line[1], set()).add((line[3], step))
                    self.started.setdefault((line[3], step), line[1])
                elif event in ("ok", "error", "cancelled"):
                    self.running[line[1]].discard((line[3], step))
            if complete:
                self.changed.set()
                self.changed = trio.Event()
            await trio.sleep(0.01)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        with trio.fail_after(30):
            while not predicate():
                await self.changed.wait()


def query(dsn: str, sql: psycopg.sql.Composed, params: tuple[Any, ...] = ()) -> list[Any]:
    with psycopg.connect(dsn) as connection:
        return list(connection.execute(sql, params).fetchall())


def site_states(dsn: str, schema: str) -> dict[int, str]:
    table = psycopg.sql.Identifier(schema, "sites")
    return dict(query(dsn, psycopg.sql.SQL("SELECT id, state FROM {}").format(table)))


def request_rows(dsn: str, schema: str) -> dict[str, list[tuple[str, int]]]:
    """(state, attempts) of tickler's requests by key, oldest first."""
    table = psycopg.sql.Identifier(queue_schema(schema), "tickler_requests")
    rows = query(
        dsn,
        psycopg.sql.SQL("SELECT key, state, attempts FROM {} WHERE queue = %s ORDER BY id").format(
            table
        ),
        (QUEUE,),
    )
    requests: dict[str, list[tuple[str, int]]] = {}
    for key, state, attempts in rows:
        requests.setdefault(json.loads(key), []).append((state, attempts))
    return requests


def drop_queue_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(queue_schema(schema))
            )
        )


def attempts_of(log: list[Line]) -> dict[tuple[int, str], list[tuple[int, int | None, int]]]:
    """Each attempt of each (site, step) as (start ns, end ns or None if cut, pid)."""
    attempts: dict[tuple[int, str], list[tuple[int, int | None, int]]] = {}
    open_: dict[tuple[int, int, str], int] = {}
    for time_ns, pid, event, site_id, step in log:
        if event == "start":
            open_[pid, site_id, step] = time_ns
        elif event in ("ok", "error", "cancelled"):
            start = open_.pop((pid, site_id, step))
            attempts.setdefault((site_id, step), []).append((start, time_ns, pid))
    for (pid, site_id, step), start in open_.items():
        attempts.setdefault((site_id, step), []).append((start, None, pid))
    return attempts


def live_requests(dsn: str, schema: str) -> int:
    table = psycopg.sql.Identifier(queue_schema(schema), "tickler_requests")
    sql = psycopg.sql.SQL(
        "SELECT count(*) FROM {} WHERE state IN ('queued', 'scheduled', 'running', 'retrying')"
    ).format(table)
    return int(query(dsn, sql)[0][0])


FLAGS = ("metadata_ready", "fs_ready", "db_ready", "bootstrapped")


async def test_three_replicas_share_the_sites(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """300 sites, 30% step failures, three replicas, one killed and restarted, 20 deleted.

    Every created site reaches `running` with its directory and database,
    every deleted one ends `deleted` with no files, no creation step of a
    deleted site starts or ends after its delete's cancels returned, and no
    two attempts of one step of one site ever run at once.
    """
    data = tmp_path / "data"
    step_log = tmp_path / "steps.log"
    options = [
        *("--data", str(data), "--postgres", postgres_dsn, "--schema", postgres_schema),
        *("--port", "0", "--fail-rate", "0.3", "--latency", "0.2", "--capacity", "16"),
        *("--lease", str(LEASE), "--poll-interval", "0.1", "--step-log", str(step_log)),
    ]
    rng = random.Random(12)
    tail = Tail(step_log)
    ids: dict[int, int] = {}  # POST index -> site id
    in_flight: collections.Counter[str] = collections.Counter()
    deleted: list[int] = []
    deleted_while_creating: list[int] = []
    victims = 0  # deletes under way
    killed_at = 0
    killed_pid = 0
    try:
        async with (
            fleet_of(options, tmp_path, 3) as fleet,
            httpx.AsyncClient(timeout=30) as client,
            trio.open_nursery() as background,
        ):
            background.start_soon(tail.follow)
            first = list(fleet.serving)
            # DELETEs go to the two replicas that stay up, POSTs to every replica serving.
            deleters = [first[0], first[2]]

            async def delete(site_id: int, mode: int) -> None:
                """Delete a site being created: at once, or once a given step has started.

                Through another replica than the one running that step, then
                again through the other one: one delete step runs.
                """
                nonlocal victims
                order = list(deleters)
                if mode:
                    step = "metadata" if mode == 1 else "db"
                    await tail.wait_for(lambda: (site_id, step) in tail.started)
                    if tail.started[site_id, step] == order[0].pid:
                        order.reverse()
                responses = [await client.delete(f"{r.url}/sites/{site_id}") for r in order]
                assert [r.status_code for r in responses] == [202, 202]
                deleted.append(site_id)
                victims -= 1
                body = responses[0].json()
                if body["state"] == "deleting" and not all(body[flag] for flag in FLAGS):
                    deleted_while_creating.append(site_id)

            async def post(index: int, replica: Replica) -> None:
                nonlocal victims
                in_flight[replica.url] += 1
                try:
                    body = {"name": f"Site {index}", "tagline": "t", "domain": f"site-{index}"}
                    response = await client.post(f"{replica.url}/sites", json=body)
                finally:
                    in_flight[replica.url] -= 1
                assert response.status_code == 202, response.text
                site_id = ids[index] = response.json()["id"]
                if index % 10 == 5 and len(deleted_while_creating) + victims < DELETED:
                    victims += 1
                    background.start_soon(delete, site_id, index // 10 % 3)

            async def kill_one() -> None:
                """SIGKILL replica 1 while it runs steps, then start it again."""
                nonlocal killed_at, killed_pid
                victim = first[1]
                fleet.serving.remove(victim)  # no new POSTs for it
                with trio.fail_after(30):
                    while in_flight[victim.url]:  # and none left hanging
                        await trio.sleep(0.005)
                await tail.wait_for(lambda: bool(tail.running.get(victim.pid)))
                # Taken as the kill is sent: a step the kill cut runs again once its
                # replica's lock is free, which can be before the kill's wait returns.
                killed_at, killed_pid = time.monotonic_ns(), victim.pid
                await fleet.kill(victim)
                await trio.sleep(0.5)
                await fleet.start()

            async with trio.open_nursery() as posts:
                slots = trio.Semaphore(8)

                async def one(index: int, replica: Replica) -> None:
                    try:
                        await post(index, replica)
                    finally:
                        slots.release()

                for index in range(SITES):
                    if index == KILL_AFTER:
                        posts.start_soon(kill_one)
                        await trio.sleep(0)
                    await slots.acquire()
                    serving = fleet.serving
                    posts.start_soon(one, index, serving[index % len(serving)])
                    await trio.sleep(rng.uniform(0, 0.005))

            with trio.fail_after(60):
                while victims or await trio.to_thread.run_sync(
                    live_requests, postgres_dsn, postgres_schema
                ):
                    await trio.sleep(0.2)
            states = await trio.to_thread.run_sync(site_states, postgres_dsn, postgres_schema)
            requests = await trio.to_thread.run_sync(request_rows, postgres_dsn, postgres_schema)
            await trio.sleep(0.05)
            log = read_step_log(step_log)
            attempts = attempts_of(log)
            # The attempts GET shows are tickler's: for sites created after the
            # kill, one row per step, one attempt per start in the log.
            sample = [ids[i] for i in range(SITES - 60, SITES) if ids[i] not in deleted]
            for site_id in sample:
                replica = fleet.serving[site_id % len(fleet.serving)]
                body = (await client.get(f"{replica.url}/sites/{site_id}")).json()
                assert body["state"] == "running"
                for step in CREATION_STEPS:
                    assert requests[f"{site_id}:{step}"] == [("succeeded", body["attempts"][step])]
                    assert len(attempts[site_id, step]) == body["attempts"][step]
            stats = [(await client.get(f"{r.url}/stats")).json() for r in fleet.serving]
            pids = {replica.pid for replica in fleet.started}
            background.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(drop_queue_schema, postgres_dsn, postgres_schema)

    # Every site ended as it should, files and all.
    assert len(ids) == len(states) == SITES
    assert len(deleted_while_creating) == DELETED
    assert sorted(deleted) == sorted(s for s, state in states.items() if state == "deleted")
    for site_id, state in states.items():
        if state == "running":
            assert_provisioned(data, site_id)
        else:
            assert_removed(data, site_id)
    # No creation step of a deleted site ran after its delete's cancels returned...
    check_aborts(log, deleted)
    # (Some were cancelled mid-run: see below.)
    # Keys: no two attempts of a step of a site overlapped, even across
    # replicas. The kill cut some attempts, and those ran again after it.
    cut = 0
    for (site_id, _), runs in attempts.items():
        runs.sort(key=lambda run: run[0])
        for (_, end, _), (start, _, _) in itertools.pairwise(runs):
            assert (end if end is not None else killed_at) < start, runs
        for _, end, pid in runs:
            if end is None:
                assert pid == killed_pid
                cut += 1
        if site_id not in deleted:
            assert runs[-1][1] is not None, runs
    assert cut
    assert any(line[2] == "cancelled" and line[4] in CREATION_STEPS for line in log)
    assert {line[1] for line in log} == pids  # all four processes ran steps
    # Each site was deleted twice at once, and its delete step was enqueued once.
    for site_id in deleted:
        assert [state for state, _ in requests[f"{site_id}:delete"]] == ["succeeded"]
    # Each replica reports its own work and the store's counts, the same for all.
    assert all(s["store"] == stats[0]["store"] for s in stats)
    store = stats[0]["store"]
    assert (
        store["queued"]
        + store["scheduled"]
        + store["claimed"]
        + store["running"]
        + store["retrying"]
    ) == 0
    assert store["cancelled"] > 0
    assert all(s["replica"]["succeeded"] > 0 for s in stats)


def pg_options(tmp_path: Path, dsn: str, schema: str) -> list[str]:
    return [
        *("--data", str(tmp_path / "data"), "--postgres", dsn, "--schema", schema),
        *("--port", "0", "--lease", str(LEASE), "--poll-interval", "0.1"),
        *("--step-log", str(tmp_path / "steps.log")),
    ]


# With --seed 1580 the first backend call sleeps 48 s of --latency 60, the next 0.2 s: the
# first step a replica runs is busy long enough for a DELETE elsewhere to meet it.
HELD = ("--capacity", "1", "--latency", "60", "--seed", "1580")


async def start_held_step(
    fleet: Fleet, client: httpx.AsyncClient, tail: Tail
) -> tuple[Replica, int]:
    """A replica alone, running a site's metadata step that will not end by itself."""
    held = await fleet.start(*HELD)
    response = await client.post(
        f"{held.url}/sites", json={"name": "Blog", "tagline": "hi", "domain": "blog"}
    )
    site_id = int(response.json()["id"])
    await tail.wait_for(lambda: tail.started.get((site_id, "metadata")) == held.pid)
    return held, site_id


async def test_a_delete_cancels_the_step_another_replica_runs(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """A DELETE cancels the creation step another replica runs; it answers once that ended."""
    tail = Tail(tmp_path / "steps.log")
    try:
        async with (
            fleet_of(pg_options(tmp_path, postgres_dsn, postgres_schema), tmp_path, 0) as fleet,
            httpx.AsyncClient(timeout=30) as client,
            trio.open_nursery() as background,
        ):
            background.start_soon(tail.follow)
            held, site_id = await start_held_step(fleet, client, tail)
            other = await fleet.start("--latency", "0.01")
            with trio.fail_after(10):  # the step's replica sees the cancel within its poll
                response = await client.delete(f"{other.url}/sites/{site_id}")
            assert response.status_code == 202
            answered = time.monotonic_ns()
            with trio.fail_after(20):
                while (await client.get(f"{other.url}/sites/{site_id}")).json()[
                    "state"
                ] != "deleted":
                    await trio.sleep(0.05)
            body = (await client.get(f"{held.url}/sites/{site_id}")).json()
            background.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(drop_queue_schema, postgres_dsn, postgres_schema)
    log = [line for line in read_step_log(tmp_path / "steps.log") if line[3] == site_id]
    attempts = [(pid, event, step) for _, pid, event, _, step in log if event in ATTEMPT_EVENTS]
    assert [a for a in attempts if a[2] in CREATION_STEPS] == [
        (held.pid, "start", "metadata"),
        (held.pid, "cancelled", "metadata"),
    ]
    assert sorted(step for _, event, step in attempts if event == "start") == ["delete", "metadata"]
    # The cancel came from the other replica, which answered the DELETE once it had ended.
    # (The delete step makes the same pass before it removes anything, on whichever
    # replica claims it: the held one may, once its step was cancelled. So only the
    # cancels before the step ended are the DELETE's.)
    cancelled = next(t for t, _, event, _, _ in log if event == "cancelled")
    assert {pid for t, pid, event, _, _ in log if event == "cancel" and t < cancelled} == {
        other.pid
    }
    aborted = [
        (t, pid) for t, pid, event, _, step in log if (event, step) == ("aborted", "request")
    ]
    assert len(aborted) == 1
    assert cancelled < aborted[0][0] < answered
    assert aborted[0][1] == other.pid
    assert body["attempts"] == {"metadata": 1, "fs": 0, "db": 0, "bootstrap": 0, "delete": 1}
    assert_removed(tmp_path / "data", site_id)


async def test_a_step_cancelled_on_a_dead_replica_does_not_run_again(
    tmp_path: Path, postgres_dsn: str, postgres_schema: str
) -> None:
    """A step whose replica was killed runs again at once on another (the dead replica's
    liveness lock is free, whatever its lease); a DELETE cancels it there, and nothing of
    the site runs after."""
    tail = Tail(tmp_path / "steps.log")
    try:
        async with (
            fleet_of(pg_options(tmp_path, postgres_dsn, postgres_schema), tmp_path, 0) as fleet,
            httpx.AsyncClient(timeout=30) as client,
            trio.open_nursery() as background,
        ):
            background.start_soon(tail.follow)
            held, site_id = await start_held_step(fleet, client, tail)
            other = await fleet.start("--latency", "0.01")
            await fleet.kill(held)
            # (Started there, whether or not it has ended since: with --latency 0.01 it may
            # start and end between two reads of the log.)
            started = (other.pid, "start", site_id, "metadata")
            with trio.fail_after(10):
                while not any(line[1:] == started for line in tail.lines):
                    await tail.changed.wait()
            with trio.fail_after(10):
                response = await client.delete(f"{other.url}/sites/{site_id}")
            assert response.status_code == 202
            with trio.fail_after(20):
                while (await client.get(f"{other.url}/sites/{site_id}")).json()[
                    "state"
                ] != "deleted":
                    await trio.sleep(0.05)
            background.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(drop_queue_schema, postgres_dsn, postgres_schema)
    log = [line for line in read_step_log(tmp_path / "steps.log") if line[3] == site_id]
    # The guarantee holds either way: nothing of the site ran after the DELETE's cancels returned.
    check_aborts(log, [site_id])
    assert_removed(tmp_path / "data", site_id)
    # The step started again once, on the replica that rescued it, which the DELETE cancelled.
    assert [
        (pid, event) for _, pid, event, _, step in log if step == "metadata" and event == "start"
    ] == [(held.pid, "start"), (other.pid, "start")]
