"""examples/site_manager with one replica: real sockets, one SQLite file, driven by httpx.

The status table and tickler's SqliteStore share the file; tests with several
replicas on PostgreSQL are in test_site_manager_replicas.py.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import tickler
from examples.site_manager import Settings, serve
from examples.site_manager.store import QUEUE, Sites, SqliteDatabase, Step, Transaction
from examples.site_manager.workflow import (
    BOOTSTRAP_TABLES,
    CREATION_STEPS,
    Backend,
    Workflow,
    enqueue_steps,
)

ROOT = Path(__file__).parent.parent
FAST = {"latency": 0.002, "retry_initial": 0.005, "retry_maximum": 0.05, "poll_interval": 0.05}
DATABASE = "site_manager.sqlite3"


@attrs.define
class Server:
    url: str
    shutdown: trio.Event
    scope: trio.CancelScope


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Server]:
    """Serve on 127.0.0.1, port 0, until the block ends (graceful) or the scope is cancelled."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[str]) -> None:
            with scope:
                await serve(settings, shutdown=shutdown, task_status=task_status)

        url = await nursery.start(run)
        yield Server(url, shutdown, scope)
        shutdown.set()


def settings(data: Path, **overrides: Any) -> Settings:
    return Settings(data=data, port=0, **{**FAST, **overrides})


async def create(client: httpx.AsyncClient, index: int) -> httpx.Response:
    body = {"name": f"Site {index}", "tagline": "a site", "domain": f"site-{index}"}
    return await client.post("/sites", json=body)


async def wait_for(client: httpx.AsyncClient, ids: list[int], state: str) -> None:
    """Poll until every site is in `state`."""
    with trio.fail_after(40):
        pending = set(ids)
        while pending:
            for site_id in sorted(pending):
                response = await client.get(f"/sites/{site_id}")
                if response.json()["state"] == state:
                    pending.discard(site_id)
            if pending:
                await trio.sleep(0.05)


def assert_provisioned(data: Path, site_id: int) -> None:
    metadata = json.loads((data / "metadata" / f"{site_id}.json").read_text())
    assert set(metadata) == {"name", "domain"}
    assert (data / "sites" / str(site_id)).is_dir()
    connection = sqlite3.connect(data / "databases" / f"{site_id}.sqlite3")
    try:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    finally:
        connection.close()
    assert set(BOOTSTRAP_TABLES) <= tables


def assert_removed(data: Path, site_id: int) -> None:
    assert not (data / "sites" / str(site_id)).exists()
    assert not (data / "databases" / f"{site_id}.sqlite3").exists()
    assert not (data / "metadata" / f"{site_id}.json").exists()


async def test_all_sites_reach_running_despite_faults(tmp_path: Path) -> None:
    """200 sites with a 30% backend failure rate all end running and fully provisioned."""
    async with (
        running(settings(tmp_path, fail_rate=0.3, seed=7)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        responses = [await create(client, i) for i in range(200)]
        assert {r.status_code for r in responses} == {202}
        ids = [r.json()["id"] for r in responses]
        assert responses[0].headers["location"] == f"/sites/{ids[0]}"
        assert responses[0].json()["state"] == "creating"
        await wait_for(client, ids, "running")
        statuses = [(await client.get(f"/sites/{i}")).json() for i in ids]
        stats = (await client.get("/stats")).json()
    assert all(s["metadata_ready"] and s["bootstrapped"] for s in statuses)
    # tickler's attempt counts: every step ran, and failures were retried.
    assert all(s["attempts"]["delete"] == 0 for s in statuses)
    assert all(min(s["attempts"][step] for step in CREATION_STEPS) >= 1 for s in statuses)
    assert sum(sum(s["attempts"].values()) for s in statuses) > 4 * 200
    assert stats["replica"]["retried"] > 0
    assert stats["replica"]["failed"] == 0
    assert stats["store"]["succeeded"] == 4 * 200
    store = stats["store"]
    assert store["queued"] + store["claimed"] + store["running"] + store["retrying"] == 0
    for site_id in ids:
        assert_provisioned(tmp_path, site_id)


# What the step log says of a step's attempts: each starts, and ends one of three ways.
ATTEMPT_EVENTS = ("start", "ok", "error", "cancelled")


def read_step_log(path: Path) -> list[tuple[int, int, str, int, str]]:
    """(monotonic ns, pid, event, site id, step) per line of a --step-log file."""
    lines = []
    for line in path.read_text().splitlines() if path.exists() else ():
        time_ns, pid, event, site_id, step = line.split()
        lines.append((int(time_ns), int(pid), event, int(site_id), step))
    return lines


def check_aborts(log: list[tuple[int, int, str, int, str]], deleted: list[int]) -> None:
    """No creation step of a deleted site starts or ends after its delete's cancels returned.

    Each delete records ``aborted`` once its cancels have returned and none of
    the site's creation steps is live: the DELETE handler does, and so does the
    delete step before it removes anything.
    """
    for site_id in deleted:
        aborted = [t for t, _, event, s, _ in log if event == "aborted" and s == site_id]
        assert aborted, f"site {site_id}: no delete reported its creation steps aborted"
        late = [
            line
            for line in log
            if line[2] in ATTEMPT_EVENTS
            and line[3] == site_id
            and line[4] in CREATION_STEPS
            and line[0] > min(aborted)
        ]
        assert not late, (site_id, late)


async def test_delete_during_creation_leaves_nothing(tmp_path: Path) -> None:
    """Sites deleted at every stage of creation end deleted, with no files left."""
    step_log = tmp_path / "steps.log"
    async with (
        running(settings(tmp_path, latency=0.04, step_log=step_log)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        ids = []
        for i in range(12):
            ids.append((await create(client, i)).json()["id"])
            await trio.sleep(0.02 * i)  # later sites get further before their delete
            response = await client.delete(f"/sites/{ids[-1]}")
            assert response.status_code == 202
            assert response.json()["state"] in {"deleting", "deleted"}
        await wait_for(client, ids, "deleted")
        await trio.sleep(0.3)  # aborted steps have had time to do any damage
        assert {(await client.get(f"/sites/{i}")).json()["state"] for i in ids} == {"deleted"}
        # The domain is free again once its site is deleted.
        assert (await create(client, 0)).status_code == 202
    for site_id in ids:
        assert_removed(tmp_path, site_id)
    check_aborts(read_step_log(step_log), ids)


async def test_delete_cancels_the_creation_step_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A creation step in the middle of its backend call is cancelled before DELETE answers.

    The worst case of a status-driven workflow: a step that has read `creating`
    and is busy creating. The DELETE cancels it by its key and answers once it
    is final; only then does the delete step remove anything.
    """
    step_log = tmp_path / "steps.log"
    entered = trio.Event()
    call = Backend.call

    async def entering(backend: Backend) -> None:
        entered.set()
        await call(backend)

    monkeypatch.setattr(Backend, "call", entering)
    async with (
        running(settings(tmp_path, latency=60.0, seed=1580, step_log=step_log)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        site_id = (await create(client, 1)).json()["id"]
        # seed=1580: the first backend call (the metadata step's) sleeps 48 s, the next 0.2 s.
        with trio.fail_after(10):
            await entered.wait()
        with trio.fail_after(10):
            response = await client.delete(f"/sites/{site_id}")
        assert response.status_code == 202
        assert response.json()["attempts"]["metadata"] == 1
        events = [(event, step) for _, _, event, s, step in read_step_log(step_log) if s == site_id]
        assert [e for e in events if e[0] in ATTEMPT_EVENTS and e[1] in CREATION_STEPS] == [
            ("start", "metadata"),
            ("cancelled", "metadata"),
        ]
        # The DELETE answered once the step was cancelled; the delete step
        # (which may start meanwhile) waited for the same.
        cancelled = events.index(("cancelled", "metadata"))
        assert cancelled < events.index(("aborted", "request"))
        await wait_for(client, [site_id], "deleted")
        events = [(event, step) for _, _, event, s, step in read_step_log(step_log) if s == site_id]
        assert cancelled < events.index(("aborted", "delete"))
        body = (await client.get(f"/sites/{site_id}")).json()
        assert body["metadata_ready"] is False
    stored = await trio.to_thread.run_sync(stored_requests, tmp_path)
    assert stored[f"{site_id}:metadata"] == ["cancelled"]
    assert_removed(tmp_path, site_id)


async def test_delete_of_a_running_site_removes_it(tmp_path: Path) -> None:
    """A running site's delete workflow removes its directory, database and metadata."""
    async with (
        running(settings(tmp_path)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        site_id = (await create(client, 1)).json()["id"]
        await wait_for(client, [site_id], "running")
        assert_provisioned(tmp_path, site_id)
        assert (await client.delete(f"/sites/{site_id}")).status_code == 202
        await wait_for(client, [site_id], "deleted")
    assert_removed(tmp_path, site_id)


async def test_backpressure_answers_503_and_loses_nothing(tmp_path: Path) -> None:
    """A flood beyond max_pending gets 503s, which leave nothing; every 202 reaches running."""
    responses: list[httpx.Response] = []
    async with (
        running(settings(tmp_path, latency=0.03, capacity=2, max_pending=3)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):

        async def post(index: int) -> None:
            responses.append(await create(client, index))

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(post, i)
        refused = [r for r in responses if r.status_code == 503]
        accepted = [r for r in responses if r.status_code == 202]
        assert len(refused) + len(accepted) == 60
        assert refused
        assert accepted
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert refused[0].json() == {"error": "too many pending requests, retry later"}
        ids = [r.json()["id"] for r in accepted]
        await wait_for(client, ids, "running")
    for site_id in ids:
        assert_provisioned(tmp_path, site_id)
    # A refused site left neither a row nor a step.
    assert set(stored_states(tmp_path)) == set(ids)
    assert {key.split(":")[0] for key in stored_requests(tmp_path)} == {str(i) for i in ids}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tagline": "t", "domain": "d"}, "field 'name' is required"),
        ({"name": "n", "domain": "d"}, "field 'tagline' is required"),
        ({"name": "n", "tagline": "t"}, "field 'domain' is required"),
        ({"name": "  ", "tagline": "t", "domain": "d"}, "field 'name' must not be empty"),
        ({"name": "n", "tagline": "", "domain": "d"}, "field 'tagline' must not be empty"),
        ({"name": "n", "tagline": "t", "domain": 5}, "field 'domain' must be a string"),
        ({"name": "n" * 101, "tagline": "t", "domain": "d"}, "name must be at most 100 characters"),
        ([1, 2], "body must be a JSON object"),
    ]
    + [
        (
            {"name": "n", "tagline": "t", "domain": domain},
            "domain must be a valid DNS label: 1 to 63 letters, digits or hyphens,"
            " not starting or ending with a hyphen",
        )
        for domain in ("bad_label", "-lead", "trail-", "a" * 64, "dots.example", "spa ce")
    ],
)
async def test_bad_input_gets_its_exact_400(tmp_path: Path, body: object, message: str) -> None:
    """Each invalid body is refused with 400 and a message naming the rule."""
    async with (
        running(settings(tmp_path)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        response = await client.post("/sites", json=body)
        assert (response.status_code, response.json()) == (400, {"error": message})
        stats = (await client.get("/stats")).json()
    assert stats["replica"]["enqueued"] == 0
    assert sum(stats["store"].values()) == 0


async def test_not_json_taken_domain_and_unknown_ids(tmp_path: Path) -> None:
    """Non-JSON bodies get 400, a taken domain 409, an unknown id 404."""
    async with (
        running(settings(tmp_path)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        response = await client.post("/sites", content=b"{not json")
        assert (response.status_code, response.json()) == (
            400,
            {"error": "body must be a JSON object"},
        )
        assert (await create(client, 1)).status_code == 202
        taken = await create(client, 1)
        assert (taken.status_code, taken.json()) == (
            409,
            {"error": "domain 'site-1' is already taken"},
        )
        for method in ("GET", "DELETE"):
            missing = await client.request(method, "/sites/999")
            assert (missing.status_code, missing.json()) == (404, {"error": "no site with id 999"})


def stored_states(data: Path) -> dict[int, tuple[str, bool]]:
    """(state, metadata_ready) of every site, read from the status table itself."""
    connection = sqlite3.connect(data / DATABASE)
    try:
        rows = connection.execute("SELECT id, state, metadata_ready FROM sites").fetchall()
    finally:
        connection.close()
    return {site_id: (state, bool(ready)) for site_id, state, ready in rows}


def stored_requests(data: Path) -> dict[str, list[str]]:
    """The states of tickler's requests by key, oldest first, read from the same file."""
    connection = sqlite3.connect(data / DATABASE)
    try:
        rows = connection.execute(
            "SELECT key, state FROM tickler_requests WHERE queue = ? ORDER BY id", (QUEUE,)
        ).fetchall()
    finally:
        connection.close()
    requests: dict[str, list[str]] = {}
    for key, state in rows:
        requests.setdefault(json.loads(key), []).append(state)
    return requests


async def test_a_202_means_the_site_and_its_first_step_both_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST and DELETE write the status and enqueue the step in one transaction."""
    hold = trio.Event()
    entered = trio.Event()

    async def held(backend: Backend) -> None:
        entered.set()
        await hold.wait()

    monkeypatch.setattr(Backend, "call", held)
    async with (
        running(settings(tmp_path)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        site_id = (await create(client, 1)).json()["id"]
        assert stored_states(tmp_path) == {site_id: ("creating", False)}
        assert stored_requests(tmp_path)[f"{site_id}:metadata"] in (["queued"], ["running"])
        # An enqueue that fails takes the site with it: no row, no 202.
        enqueue = Transaction.enqueue

        def failing(self: Transaction, step: Step) -> None:
            enqueue(self, step)
            raise sqlite3.OperationalError("disk I/O error")

        with monkeypatch.context() as patch:
            patch.setattr(Transaction, "enqueue", failing)
            assert (await create(client, 2)).status_code == 500
            assert (await client.delete(f"/sites/{site_id}")).status_code == 500
        assert stored_states(tmp_path) == {site_id: ("creating", False)}
        assert set(stored_requests(tmp_path)) == {f"{site_id}:metadata"}
        # Deleted twice: one delete step. (The first DELETE cancels the metadata step.)
        with trio.fail_after(10):
            await entered.wait()
        assert (await client.delete(f"/sites/{site_id}")).status_code == 202
        assert (await client.delete(f"/sites/{site_id}")).status_code == 202
        assert stored_requests(tmp_path)[f"{site_id}:delete"] in (["queued"], ["running"])
        hold.set()
        await wait_for(client, [site_id], "deleted")
    assert stored_requests(tmp_path) == {
        f"{site_id}:metadata": ["cancelled"],
        f"{site_id}:delete": ["succeeded"],
    }


# The first server's backend takes this many calls, then hangs every later one, and the hard
# stop comes once a call hangs. A site needs four calls (metadata, fs, db, bootstrap) to be
# running, so at most 10 of the 30 are. Of the 40, at most 31 are metadata steps, 1 is the
# delete and 3 are the deleted site's other steps, so at least 5 follow a finished metadata step
# of one of the 30: some of them have begun.
CALLS_BEFORE_HANG = 40


async def test_restart_recovery_finishes_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a hard stop mid-workflow, a new server on the same data finishes every site."""
    calls = 0
    hanging = trio.Event()
    call = Backend.call

    async def call_then_hang(backend: Backend) -> None:
        nonlocal calls
        if calls == CALLS_BEFORE_HANG:
            hanging.set()
            await trio.sleep_forever()
        calls += 1
        await call(backend)

    slow = settings(tmp_path, latency=0.05)
    with monkeypatch.context() as patch:
        patch.setattr(Backend, "call", call_then_hang)
        async with running(slow) as server, httpx.AsyncClient(base_url=server.url) as client:
            ids = [(await create(client, i)).json()["id"] for i in range(30)]
            doomed = (await create(client, 99)).json()["id"]
            await client.delete(f"/sites/{doomed}")
            with trio.fail_after(40):
                await hanging.wait()
            server.scope.cancel()  # a hard stop: nothing is drained
    stopped = stored_states(tmp_path)
    assert "creating" in {stopped[i][0] for i in ids}  # the stop really came mid-workflow,
    assert any(stopped[i][1] for i in ids)  # after some sites had begun
    async with running(slow) as server, httpx.AsyncClient(base_url=server.url) as client:
        await wait_for(client, ids, "running")
        await wait_for(client, [doomed], "deleted")
    for site_id in ids:
        assert_provisioned(tmp_path, site_id)
    assert_removed(tmp_path, doomed)


async def test_sigterm_shuts_down_gracefully(tmp_path: Path) -> None:
    """SIGTERM stops taking requests, drains within a bounded time, exits 0; recovery finishes."""
    command = [
        sys.executable,
        "-m",
        "examples.site_manager",
        "--data",
        str(tmp_path),
        "--port",
        "0",
        "--latency",
        "0.05",
        "--shutdown-timeout",
        "0.5",
        "--poll-interval",
        "0.05",
    ]
    process = await trio.lowlevel.open_process(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert process.stdout is not None
    output = b""
    with trio.fail_after(20):
        while b"listening on " not in output:
            chunk = await process.stdout.receive_some()
            assert chunk, output
            output += chunk
    url = output.split(b"listening on ")[1].split()[0].decode()
    async with httpx.AsyncClient(base_url=url) as client:
        ids = [(await create(client, i)).json()["id"] for i in range(25)]
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await process.wait() == 0
    async with httpx.AsyncClient() as probe:
        with pytest.raises(httpx.ConnectError):
            await probe.get(url)  # the old server is gone
    async with (
        running(settings(tmp_path)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        await wait_for(client, ids, "running")
    for site_id in ids:
        assert_provisioned(tmp_path, site_id)


async def test_a_step_is_never_live_twice(tmp_path: Path) -> None:
    """Steps are keyed "{site_id}:{step}": enqueued again while live, they run once."""
    gate = trio.Event()

    @attrs.define
    class HeldBackend(Backend):
        async def call(self) -> None:
            await gate.wait()

    database = SqliteDatabase(tmp_path / DATABASE, lease=30.0, poll_interval=0.05)
    sites = Sites(database)
    try:
        async with tickler.open_service(
            Workflow(sites, tmp_path, HeldBackend()), name=QUEUE, store=database.store
        ) as service:
            status = await sites.create("Site", "a site", "site-1", max_pending=10)
            step = Step(status["id"], "metadata")
            enqueue_steps(service, [step, step])
            with trio.fail_after(10):
                while (ticket := await service.lookup(step.key)) is None or ticket.attempts == 0:
                    await trio.sleep(0.01)
            enqueue_steps(service, [step])  # while it runs
            with trio.fail_after(10):  # each enqueue, once committed, found the key live
                while service.statistics().deduplicated < 3:
                    await trio.sleep(0.01)
            gate.set()
            with trio.fail_after(10):
                while (await sites.get(status["id"]) or {}).get("state") != "running":
                    await trio.sleep(0.01)
            await service.join()
            ticket = await service.lookup(step.key)
        final = await sites.get(status["id"])
    finally:
        database.close()
    assert final is not None
    assert final["state"] == "running"
    assert ticket is not None
    assert (ticket.status, ticket.attempts) == (tickler.Status.SUCCEEDED, 1)
    assert stored_requests(tmp_path)[step.key] == ["succeeded"]
