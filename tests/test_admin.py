"""store.admin(): the admin API, on every store, with and without a service running.

Each test runs once per store of the conformance suite (tests/test_store_contract.py's
BACKENDS), against a real database: a SQLite file, a fresh PostgreSQL schema.
"""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
from tickler._stores._sync import MAX_ERROR_MESSAGE_CHARS, MAX_TRACEBACK_CHARS

from .store_backends import Backend, PostgresBackend, SqliteBackend
from .test_store_contract import backend, create_schema

__all__ = ["backend"]  # the fixture, used by every test here


async def double(request: int) -> int:
    return request * 2


class Fails:
    """A handler that fails each request the first time it runs it, and doubles it after."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    async def __call__(self, request: int) -> int:
        if request not in self.seen:
            self.seen.add(request)
            raise RuntimeError(f"first try of {request}")
        return request * 2


def enqueue(
    backend: Backend, requests: list[Any], queue: str = "jobs", **options: Any
) -> list[int]:
    """Requests written as an application writes them, no service running."""
    store = backend.store()
    store.create_schema()
    with backend.connect(autocommit=False) as connection:
        ids: list[int] = store.enqueue_many_in(connection, queue, requests, **options)
        connection.commit()
    return ids


async def until_state(admin: tickler.Admin, request_id: int, state: str) -> tickler.AdminRequest:
    with trio.fail_after(10):
        while (found := await admin.lookup("jobs", request_id)) is None or found.state != state:
            await trio.sleep(0.02)
    return found


# -- Lookup


async def test_lookup_by_id_and_by_key_reads_every_column(backend: Backend) -> None:
    store = backend.store()
    async with tickler.open_service(Fails(), store=store, name="jobs") as service:
        failed = await service.submit(3, key=("order", 3), priority=7, group="shop")
        with pytest.raises(RuntimeError, match="first try"):
            await failed.wait()
        other = await service.submit(4, key="four")
        with pytest.raises(RuntimeError, match="first try"):
            await other.wait()
    admin = store.admin()
    try:
        row = await admin.lookup("jobs", failed.id)
        assert row is not None
        assert (row.id, row.queue, row.key, row.state) == (
            failed.id,
            "jobs",
            ["order", 3],
            "failed",
        )
        assert (row.request, row.priority, row.group, row.attempts) == (3, 7, "shop", 1)
        assert (row.error_type, row.error_message) == ("RuntimeError", "first try of 3")
        assert row.error_traceback is not None
        assert row.error_traceback.endswith("RuntimeError: first try of 3")
        assert row.result is None
        assert row.owner is None
        assert not row.cancel_requested
        assert row.started_at is not None
        assert row.finished_at is not None
        assert row.enqueued_at <= row.started_at <= row.finished_at
        assert abs(row.run_at - row.enqueued_at) < 1  # due at once (the engine's clock)
        assert (row.waits_on, row.waited_by) == ([], [])
        assert await admin.lookup("jobs", ("order", 3)) == row
        by_key = await admin.lookup("jobs", "four")
        assert by_key is not None
        assert (by_key.state, by_key.key, by_key.result, by_key.attempts) == (
            "failed",
            "four",
            None,
            1,
        )
        assert await admin.lookup("jobs", 10**6) is None
        assert await admin.lookup("other", failed.id) is None
        assert await admin.lookup("jobs", "nobody") is None
    finally:
        await admin.aclose()


async def test_a_traceback_is_kept_bounded(backend: Backend) -> None:
    async def deep(request: int) -> None:
        def down(n: int) -> None:
            if n == 0:
                raise ValueError("x" * 100_000)
            down(n - 1)

        down(request)

    store = backend.store()
    async with tickler.open_service(deep, store=store, name="jobs") as service:
        ticket = await service.submit(400)
        with pytest.raises(ValueError, match="xxx"):
            await ticket.wait()
    async with store.admin() as admin:
        row = await admin.lookup("jobs", ticket.id)
    assert row is not None
    assert row.error_message is not None
    assert row.error_traceback is not None
    assert len(row.error_message) <= MAX_ERROR_MESSAGE_CHARS
    assert row.error_message.startswith("xxx")
    assert "characters cut" in row.error_message
    assert len(row.error_traceback) <= MAX_TRACEBACK_CHARS
    assert row.error_traceback.startswith("Traceback (most recent call last):")
    assert "characters cut" in row.error_traceback
    assert row.error_traceback.endswith("x" * 100)


# -- Cancel, retry, pause: no service running


async def test_cancel_without_a_service(backend: Backend) -> None:
    ids = enqueue(backend, [1, 2], key=str)
    async with backend.store().admin() as admin:
        assert await admin.cancel("jobs", ids[0]) is True
        assert await admin.cancel("jobs", "2") is True
        assert await admin.cancel("jobs", ids[0]) is False  # final
        assert await admin.cancel("jobs", 10**6) is False  # unknown
        assert await admin.cancel("other", ids[1]) is False  # another queue's
        found = await admin.lookup("jobs", ids[1])
        assert found is not None
        assert found.finished_at is not None
    assert backend.select("id, state") == [(ids[0], "cancelled"), (ids[1], "cancelled")]


async def test_a_cancel_reaches_a_running_attempt_within_one_poll_interval(
    backend: Backend,
) -> None:
    """The admin, a store object of its own with no service, cancels an attempt that runs
    in a service: the service withdraws it within its poll_interval."""
    started = trio.Event()

    async def forever(request: int) -> None:
        started.set()
        await trio.sleep_forever()

    service_store = backend.store(poll_interval=0.2, lease=30.0)
    async with tickler.open_service(forever, store=service_store, name="jobs") as service:
        ticket = await service.submit(1)
        await started.wait()
        async with backend.store().admin() as admin:
            with trio.fail_after(5):
                while (row := await admin.lookup("jobs", ticket.id)) is None or (
                    row.started_at is None
                ):
                    await trio.sleep(0.02)
            assert row.state == "running"
            assert row.owner is not None
            asked_at = time.monotonic()
            assert await admin.cancel("jobs", ticket.id) is True
            with pytest.raises(tickler.RequestCancelled):
                await ticket.wait()
            took = time.monotonic() - asked_at
            assert took < 0.2 + 0.15, took  # one poll_interval, and a batch
            ended = await until_state(admin, ticket.id, "cancelled")
            assert ended.cancel_requested
            assert await admin.cancel("jobs", ticket.id) is False


async def test_a_failed_request_retried_runs_again_and_succeeds(backend: Backend) -> None:
    store = backend.store()
    handler = Fails()
    async with tickler.open_service(handler, store=store, name="jobs") as service:
        ticket = await service.submit(21)
        with pytest.raises(RuntimeError, match="first try"):
            await ticket.wait()
        async with backend.store().admin() as admin:
            assert await admin.retry("jobs", ticket.id) is True
            assert await admin.retry("jobs", ticket.id) is False  # queued now
            row = await until_state(admin, ticket.id, "succeeded")
            assert (row.result, row.attempts, row.error_type) == (42, 2, "RuntimeError")
            assert await admin.retry("jobs", ticket.id) is False  # succeeded
            assert await admin.retry("jobs", 10**6) is False


async def test_a_retried_cancelled_request_runs(backend: Backend) -> None:
    ids = enqueue(backend, [5])
    async with backend.store().admin() as admin:
        assert await admin.cancel("jobs", ids[0])
        assert await admin.retry("jobs", ids[0]) is True
        row = await admin.lookup("jobs", ids[0])
        assert row is not None
        assert (row.state, row.finished_at) == ("queued", None)
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        await service.join()
    assert backend.select("id, state, result") == [(ids[0], "succeeded", b"10")]


async def test_a_key_held_by_a_later_request_is_not_retried(backend: Backend) -> None:
    first = enqueue(backend, [1], key=lambda _: "k")[0]
    async with backend.store().admin() as admin:
        assert await admin.cancel("jobs", first)
        second = enqueue(backend, [2], key=lambda _: "k")[0]
        assert second != first
        assert await admin.retry("jobs", first) is False  # the key is live
        assert await admin.cancel("jobs", second)
        assert await admin.retry("jobs", first) is False  # the key's latest is second's
        assert await admin.retry("jobs", second) is True


async def test_a_key_enqueued_while_a_retry_runs_leaves_the_request_final(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The retry's check passes, then a request of the key commits before the retry's row
    is written: the retry answers False, and the request stays cancelled. On PostgreSQL
    only: a SQLite file's writers take turns, and no such race can happen there."""
    backend = PostgresBackend.for_test(request, tmp_path)
    first = enqueue(backend, [1], key=lambda _: "k")[0]
    store = backend.store()
    async with store.admin() as admin:
        assert await admin.cancel("jobs", first)
        answers: list[bool] = []
        with backend.connect(autocommit=False) as db:
            second = store.enqueue_in(db, "jobs", 2, key="k")  # not committed yet
            async with trio.open_nursery() as nursery:

                async def retry() -> None:
                    answers.append(await admin.retry("jobs", first))

                nursery.start_soon(retry)
                await trio.sleep(0.5)  # the retry's row waits on the uncommitted key
                assert answers == []
                db.commit()
        assert answers == [False]
        assert backend.states() == {first: "cancelled", second: "queued"}
        # The bulk form says so: nothing of its statement is written.
        assert await admin.cancel("jobs", second)
        with backend.connect(autocommit=False) as db:
            third = store.enqueue_in(db, "jobs", 3, key="k")
            async with trio.open_nursery() as nursery:

                async def retry_where() -> None:
                    with pytest.raises(tickler.StoreError, match="nothing was retried"):
                        await admin.retry_where("jobs", state="cancelled")

                nursery.start_soon(retry_where)
                await trio.sleep(0.5)
                db.commit()
        assert backend.states() == {first: "cancelled", second: "cancelled", third: "queued"}


async def test_pause_and_resume_a_queue_without_a_service(backend: Backend) -> None:
    ids = enqueue(backend, [1, 2, 3])
    async with backend.store().admin() as admin:
        assert await admin.pause("jobs") is True
        assert (await admin.counts("jobs"))["paused"] == 1
        async with tickler.open_service(double, store=backend.store(), name="jobs"):
            await trio.sleep(0.3)  # six poll intervals: nothing is claimed
            assert {state for _, state in backend.select("id, state")} == {"queued"}
            assert await admin.resume("jobs") is True
            assert (await admin.counts("jobs"))["paused"] == 0
            for request_id in ids:
                await until_state(admin, request_id, "succeeded")


async def test_pause_says_whether_the_store_knew_the_queue(backend: Backend) -> None:
    """A queue with no requests, never paused nor limited, is paused all the same (ahead
    of its first deploy), and pause() says the store did not know it; from then on the
    store knows it."""
    enqueue(backend, [1], queue="mail")
    async with backend.store().admin() as admin:
        assert await admin.pause("mial") is False
        assert (await admin.counts("mial"))["paused"] == 1
        assert await admin.queues() == ["mail", "mial"]
        assert await admin.resume("mial") is True
        assert await admin.resume("audit") is False
        assert await admin.pause("mail") is True


# -- What the pages read


async def test_counts_are_the_store_statistics_of_a_service(backend: Backend) -> None:
    enqueue(backend, list(range(5)))
    enqueue(backend, [9], delay=3600)
    store = backend.store()
    async with tickler.open_service(Fails(), store=store, name="jobs", capacity=2) as service:
        ticket = await service.submit(7)
        with pytest.raises(RuntimeError, match="first try"):
            await ticket.wait()
        with trio.fail_after(10):
            while (expected := await service.store_statistics())["failed"] < 6:
                await trio.sleep(0.02)
        async with backend.store().admin() as admin:
            assert await admin.counts("jobs") == expected
        await service.stop(drain=False)
    assert expected["failed"] == 6
    assert expected["scheduled"] == 1


async def test_requests_are_paged_newest_first_with_a_cursor(backend: Backend) -> None:
    ids = enqueue(backend, list(range(23)), key=lambda r: f"k{r}", group="g")
    others = enqueue(backend, list(range(4)))
    enqueue(backend, [0], queue="elsewhere")
    every = sorted(ids + others, reverse=True)
    async with backend.store().admin() as admin:
        for i in range(0, 23, 2):
            await admin.cancel("jobs", ids[i])
        seen: list[int] = []
        after = None
        pages = 0
        while True:
            page = await admin.requests("jobs", limit=10, after=after)
            pages += 1
            seen += [row.id for row in page.rows]
            if page.next is None:
                break
            assert page.next == page.rows[-1].id
            after = page.next
        assert (seen, pages) == (every, 3)
        cancelled = await admin.requests("jobs", state="cancelled", limit=5)
        assert [row.id for row in cancelled.rows] == sorted(ids[0::2], reverse=True)[:5]
        assert all(row.state == "cancelled" for row in cancelled.rows)
        assert cancelled.next == cancelled.rows[-1].id
        rest = await admin.requests("jobs", state="cancelled", after=cancelled.next, limit=500)
        assert [row.id for row in rest.rows] == sorted(ids[0::2], reverse=True)[5:]
        assert rest.next is None
        grouped = await admin.requests("jobs", group="g", state="queued")
        assert [row.id for row in grouped.rows] == sorted(ids[1::2], reverse=True)
        assert [r.id for r in (await admin.requests("jobs", group="g")).rows] == ids[::-1]
        keyed = await admin.requests("jobs", key="k4")
        assert [(row.id, row.key, row.request) for row in keyed.rows] == [(ids[4], "k4", 4)]
        assert (await admin.requests("jobs", state="failed")).rows == []
        full = await admin.requests("jobs", limit=27)
        assert (len(full.rows), full.next) == (27, None)


async def test_bulk_cancel_retry_and_count_act_on_the_filter(backend: Backend) -> None:
    a = enqueue(backend, list(range(30)), group="a")
    b = enqueue(backend, list(range(10)), group="b")
    async with backend.store().admin() as admin:
        assert await admin.count_where("jobs") == 40
        assert await admin.count_where("jobs", group="a", state="queued") == 30
        assert await admin.cancel_where("jobs", group="a") == 30
        assert await admin.cancel_where("jobs", group="a") == 0  # final now
        assert await admin.count_where("jobs", state="cancelled") == 30
        assert await admin.count_where("jobs", state="queued", group="b") == 10
        assert await admin.retry_where("jobs", state="queued") == 0
        assert await admin.retry_where("jobs", state="cancelled", group="a") == 30
        assert await admin.count_where("jobs", state="queued") == 40
        assert await admin.cancel_where("jobs", state="queued") == 40
        assert await admin.retry_where("jobs") == 40
    assert {state for _, state in backend.select("id, state")} == {"queued"}
    assert len(a) + len(b) == 40


class Forever:
    """A handler that records each request it starts, and never returns."""

    def __init__(self) -> None:
        self.started: list[int] = []

    async def __call__(self, request: int) -> None:
        self.started.append(request)
        await trio.sleep_forever()


async def test_bulk_cancel_asks_running_attempts_to_stop(backend: Backend) -> None:
    forever = Forever()
    store = backend.store(poll_interval=0.1)
    async with tickler.open_service(forever, store=store, name="jobs", capacity=2) as service:
        tickets = [await service.submit(i) for i in range(5)]
        async with backend.store().admin() as admin:
            with trio.fail_after(5):
                while (await admin.counts("jobs"))["running"] < 2:
                    await trio.sleep(0.02)
            assert await admin.cancel_where("jobs") == 5
            assert await admin.cancel_where("jobs") == 0  # asked already, or final
            for ticket in tickets:
                with pytest.raises(tickler.RequestCancelled):
                    await ticket.wait()
            assert await admin.count_where("jobs", state="cancelled") == 5
    assert len(forever.started) == 2


async def test_a_groups_running_rows_are_counted_paged_and_cancelled(backend: Backend) -> None:
    """A group's running rows are found by every filter by group (PostgreSQL's index of a
    group's rows holds none of them: they are read apart)."""
    forever = Forever()
    store = backend.store(poll_interval=0.1)
    async with tickler.open_service(forever, store=store, name="jobs", capacity=2) as service:
        tickets = [await service.submit(i, group="a" if i < 4 else "b") for i in range(6)]
        ids = [ticket.id for ticket in tickets]
        async with backend.store().admin() as admin:
            with trio.fail_after(5):
                while (await admin.counts("jobs"))["running"] < 2:
                    await trio.sleep(0.02)
            assert sorted(forever.started) == [0, 1]  # group a's first two
            assert await admin.count_where("jobs", group="a") == 4
            assert await admin.count_where("jobs", group="a", state="running") == 2
            assert await admin.count_where("jobs", group="b", state="running") == 0
            page = await admin.requests("jobs", group="a")
            assert [(row.id, row.state) for row in page.rows] == [
                (ids[3], "queued"),
                (ids[2], "queued"),
                (ids[1], "running"),
                (ids[0], "running"),
            ]
            running = await admin.requests("jobs", group="a", state="running")
            assert [row.id for row in running.rows] == [ids[1], ids[0]]
            assert await admin.cancel_where("jobs", group="a") == 4
            assert await admin.cancel_where("jobs", group="a") == 0  # asked already, or final
            for ticket in tickets[:4]:
                with pytest.raises(tickler.RequestCancelled):
                    await ticket.wait()
            assert await admin.count_where("jobs", group="a", state="cancelled") == 4
            assert await admin.count_where("jobs", group="b") == 2
            assert await admin.cancel_where("jobs", group="b") == 2
            for ticket in tickets[4:]:
                with pytest.raises(tickler.RequestCancelled):
                    await ticket.wait()


async def test_the_overview_reads_counts_times_and_rates(backend: Backend) -> None:
    store = backend.store()
    async with tickler.open_service(Fails(), store=store, name="jobs", capacity=4) as service:
        failing = [await service.submit(i) for i in range(3)]
        for ticket in failing:
            with pytest.raises(RuntimeError, match="first try"):
                await ticket.wait()
        for ticket in [await service.submit(i) for i in range(3)]:
            assert await ticket.wait() == ticket.request * 2
        await service.join()
    enqueue(backend, [1, 2], queue="backlog")
    enqueue(backend, [3], queue="backlog", delay=3600)
    await trio.sleep(0.2)
    admin = backend.store().admin()
    await admin.pause("quiet")
    now = time.time()
    overviews = {o.queue: o for o in await admin.overview()}
    await admin.aclose()
    assert list(overviews) == ["backlog", "jobs", "quiet"]
    jobs = overviews["jobs"]
    assert (jobs.counts["succeeded"], jobs.counts["failed"], jobs.running) == (3, 3, 0)
    assert not jobs.paused
    assert jobs.estimated == []
    assert jobs.oldest_queued_age is None
    assert len(jobs.per_minute) == 60
    minutes = [start for start, _, _ in jobs.per_minute]
    assert minutes == [minutes[0] + 60 * i for i in range(60)]
    assert minutes[-1] <= now < minutes[-1] + 60
    assert sum(s for _, s, _ in jobs.per_minute) == 3
    assert sum(f for _, _, f in jobs.per_minute) == 3
    for value in (jobs.wait_p50, jobs.wait_p95, jobs.run_p50, jobs.run_p95):
        assert value is not None
        assert 0 <= value < 5
    assert jobs.wait_p50 <= jobs.wait_p95
    assert jobs.run_p50 <= jobs.run_p95
    backlog = overviews["backlog"]
    assert backlog.counts["queued"] == 2
    assert backlog.counts["scheduled"] == 1
    assert backlog.oldest_queued_age is not None
    assert 0.2 <= backlog.oldest_queued_age < 30
    assert backlog.wait_p50 is None
    assert sum(s for _, s, _ in backlog.per_minute) == 0
    assert overviews["quiet"].paused
    assert sum(overviews["quiet"].counts.values()) == 1


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def test_the_overview_per_minute_and_percentiles_are_those_of_the_rows(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows ended by UPDATEs as replicas end them (several rows a statement, two owners,
    their owner cleared as they end), finished over the last 90 minutes: each minute's
    succeeded and failed are those of the rows, and the percentiles those of the latest
    PERCENTILE_ROWS rows of the hour."""
    from tickler._stores import _admin

    monkeypatch.setattr(_admin, "PERCENTILE_ROWS", 40)
    ids = enqueue(backend, list(range(120)))
    requests, m = backend.table("tickler_requests"), backend.mark
    now = time.time()
    with backend.connect() as db:
        for n, request_id in enumerate(ids):
            # Each row its own finish (over the last 90 minutes), start and due.
            finished = now - 5400 + 45 * n + (n % 7)
            started = finished - 0.5 * (n % 11) - 0.25
            due = started - 0.125 * (n % 13)
            db.execute(
                f"UPDATE {requests} SET state = 'running', owner = {m}, run_at = {m},"  # noqa: S608
                f" started_at = {m}, finished_at = {m} WHERE id = {m}",
                (f"replica-{n % 2}", due, started, finished, request_id),
            )
        # Ended ten statements of twelve rows each, as the replicas end them.
        for chunk in range(10):
            some = ", ".join(str(i) for i in ids[chunk * 12 : chunk * 12 + 12])
            failed = ", ".join(str(i) for i in ids[chunk * 12 : chunk * 12 + 12 : 5])
            db.execute(
                f"UPDATE {requests} SET state = CASE WHEN id IN ({failed}) THEN 'failed'"  # noqa: S608
                f" ELSE 'succeeded' END, owner = NULL WHERE id IN ({some})"
            )
        rows = db.execute(
            f"SELECT state, run_at, started_at, finished_at FROM {requests}"  # noqa: S608
        ).fetchall()
    async with backend.store().admin() as admin:
        (overview,) = await admin.overview()
    first = overview.per_minute[0][0]
    expected = {start: [0, 0] for start, _, _ in overview.per_minute}
    for state, _, _, finished in rows:
        start = math.floor(finished / 60) * 60.0
        if start >= first:
            expected[start][state == "failed"] += 1
    assert [(start, s, f) for start, s, f in overview.per_minute] == [
        (start, s, f) for start, (s, f) in sorted(expected.items())
    ]
    assert sum(s + f for _, s, f in overview.per_minute) > 60  # most rows, not all
    latest = sorted(rows, key=lambda row: row[3])[-40:]
    assert latest[0][3] > now - 3000  # all within the hour
    waits = [started - due for _, due, started, _ in latest]
    runs = [finished - started for _, _, started, finished in latest]
    assert overview.wait_p50 == pytest.approx(nearest_rank(waits, 0.5))
    assert overview.wait_p95 == pytest.approx(nearest_rank(waits, 0.95))
    assert overview.run_p50 == pytest.approx(nearest_rank(runs, 0.5))
    assert overview.run_p95 == pytest.approx(nearest_rank(runs, 0.95))


async def test_the_overview_estimates_a_state_past_its_cap(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past COUNT_CAP rows, a state's count is the store's estimate, never below the cap;
    counts() stays exact."""
    from tickler._stores import _admin

    monkeypatch.setattr(_admin, "COUNT_CAP", 5)
    enqueue(backend, list(range(20)))
    enqueue(backend, [1, 2], delay=3600)
    async with backend.store().admin() as admin:
        (overview,) = await admin.overview()
        assert (await admin.counts("jobs"))["queued"] == 20
    assert overview.estimated == ["queued"]
    assert overview.counts["queued"] >= 5
    assert overview.counts["scheduled"] == 2
    if isinstance(backend, SqliteBackend):
        assert overview.counts["queued"] == 5  # SQLite keeps no estimate


async def test_replicas_are_the_owners_holding_leases(backend: Backend) -> None:
    started = trio.Event()

    async def forever(request: int) -> None:
        started.set()
        await trio.sleep_forever()

    async with backend.store().admin() as admin:
        assert await admin.replicas() == []
        store = backend.store(lease=3.0)
        async with tickler.open_service(forever, store=store, name="jobs", capacity=2) as service:
            for i in range(3):
                await service.submit(i)
            await started.wait()
            with trio.fail_after(5):
                while (await admin.counts("jobs"))["running"] < 2:
                    await trio.sleep(0.02)
            (replica,) = await admin.replicas()
            now = time.time()
            assert (replica.leased, replica.queues) == (2, ["jobs"])
            assert now < replica.lease_until <= now + 3.0 + 1.0
            assert replica.last_renewed is not None
            assert math.isclose(replica.last_renewed, replica.lease_until - 5.0)  # admin's lease
            assert now - 2.0 <= replica.lease_until - 3.0 <= now + 1.0
            await service.stop(drain=False)
        assert await admin.replicas() == []


async def test_queues_are_the_queues_with_rows_or_a_flag(backend: Backend) -> None:
    store = backend.store()
    await create_schema(store)
    async with store.admin() as admin:
        assert await admin.queues() == []
        enqueue(backend, [1], queue="b")
        enqueue(backend, [1], queue="a")
        await admin.pause("c")
        assert await admin.queues() == ["a", "b", "c"]


# -- Bad input


async def test_bad_input_names_the_parameter(backend: Backend) -> None:
    async with backend.store().admin() as admin:
        with pytest.raises(TypeError, match="queue must be a str"):
            await admin.counts(7)
        with pytest.raises(ValueError, match="queue must not contain NUL"):
            await admin.pause("a\x00b")
        with pytest.raises(TypeError, match=r"^id must be an int"):
            await admin.retry("jobs", "1")
        with pytest.raises(TypeError, match=r"^id must be an int"):
            await admin.retry("jobs", True)
        with pytest.raises(TypeError, match=r"^id_or_key: key must be"):
            await admin.cancel("jobs", 1.5)
        with pytest.raises(TypeError, match=r"^id_or_key: key must be"):
            await admin.lookup("jobs", None)
        with pytest.raises(ValueError, match=r"^state must be None or one of queued"):
            await admin.requests("jobs", state="done")
        with pytest.raises(ValueError, match=r"^state must be"):
            await admin.count_where("jobs", state="claimed")
        with pytest.raises(ValueError, match=r"^limit must be an int in 1\.\.500, not 0$"):
            await admin.requests("jobs", limit=0)
        with pytest.raises(ValueError, match=r"^limit must be an int in 1\.\.500, not 501$"):
            await admin.requests("jobs", limit=501)
        with pytest.raises(TypeError, match=r"^limit must be an int"):
            await admin.requests("jobs", limit=1.0)
        with pytest.raises(TypeError, match=r"^after must be an int"):
            await admin.requests("jobs", after="9")
        with pytest.raises(TypeError, match=r"^key: key must be"):
            await admin.cancel_where("jobs", key=3.5)
        with pytest.raises(TypeError, match=r"^group: group must be a str"):
            await admin.retry_where("jobs", group=3)
        with pytest.raises(ValueError, match=r"^group: group must be 1 to 200 bytes"):
            await admin.count_where("jobs", group="")
    with pytest.raises(RuntimeError, match="closed"):
        await admin.counts("jobs")


@pytest.mark.parametrize("value", [0, -1, 2**63, 2**64, 10**30])
async def test_an_id_out_of_range_is_refused_naming_the_parameter_and_the_rule(
    backend: Backend, value: int
) -> None:
    """Every int the admin takes is checked once, before any SQL: the store's integers are
    64-bit, and SQLite's driver raised OverflowError past them."""
    store = backend.store()
    await create_schema(store)
    ids = enqueue(backend, [1, 2])
    rule = r"must be an int in 1\.\.2\*\*63-1 \(a request's id\), not " + str(value) + "$"
    async with store.admin() as admin:
        with pytest.raises(ValueError, match="^after " + rule):
            await admin.requests("jobs", after=value)
        with pytest.raises(ValueError, match="^id_or_key " + rule):
            await admin.lookup("jobs", value)
        with pytest.raises(ValueError, match="^id_or_key " + rule):
            await admin.cancel("jobs", value)
        with pytest.raises(ValueError, match="^id " + rule):
            await admin.retry("jobs", value)
        # The bounds themselves are ids.
        assert [row.id for row in (await admin.requests("jobs", after=2**63 - 1)).rows] == ids[::-1]
        assert (await admin.requests("jobs", after=1)).rows == []
        assert await admin.lookup("jobs", 2**63 - 1) is None
        assert not await admin.cancel("jobs", 2**63 - 1)
        assert not await admin.retry("jobs", 2**63 - 1)
        assert await admin.counts("jobs") == {**await admin.counts("jobs"), "queued": 2}


def test_the_admin_needs_no_trio_run_to_be_made(tmp_path: Any) -> None:
    """Made outside Trio, used in two runs one after the other."""
    admin = tickler.SqliteStore(tmp_path / "q.db").admin()
    assert trio.run(admin.queues) == []
    trio.run(admin.pause, "jobs")
    assert trio.run(admin.queues) == ["jobs"]
    trio.run(admin.aclose)
    with sqlite3.connect(tmp_path / "q.db") as db:
        assert db.execute("SELECT queue, paused FROM tickler_queues").fetchall() == [("jobs", 1)]
    db.close()


def test_a_state_is_written_into_the_sql_only_if_it_is_one_of_the_states() -> None:
    from tickler._stores import _admin

    assert _admin._state_is("failed") == "state = 'failed'"
    with pytest.raises(ValueError, match=r"^state must be one of queued, "):
        _admin._state_is("failed' OR '1' = '1")
