"""Scheduling: priorities, keys that stay taken, enqueue_many, pause, and periodic requests.

In memory on Trio's virtual clock (each core test runs enqueueing both as
pytest-trio's tasks do and with no contextvars: see conftest's
enqueue_context); the cross-replica promises on real SQLite files.
"""

from __future__ import annotations

import itertools
import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import tickler

FAST: dict[str, Any] = {"lease": 2.0, "poll_interval": 0.05}


def recorder() -> tuple[list[Any], Any]:
    order: list[Any] = []

    async def handler(request: Any) -> Any:
        order.append(request)
        await trio.sleep(1)
        return request

    return order, handler


# -- priorities


async def test_higher_priority_starts_first_then_in_enqueue_order(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler, capacity=1) as service:
        service.enqueue_request("blocker")
        await trio.sleep(0.1)
        service.enqueue_request("a0")
        service.enqueue_request("b5", priority=5)
        service.enqueue_request("c1", priority=1)
        service.enqueue_request("d5", priority=5)
        service.enqueue_request("e-1", priority=-1)
        service.enqueue_request("f0")
        assert service.statistics().queued == 6
    assert order == ["blocker", "b5", "d5", "c1", "a0", "f0", "e-1"]


async def test_a_retry_keeps_its_priority(autojump_clock: trio.abc.Clock) -> None:
    order: list[str] = []
    failed: set[str] = set()

    async def handler(request: str) -> None:
        order.append(request)
        if request == "urgent" and request not in failed:
            failed.add(request)
            raise ConnectionError("once")
        await trio.sleep(1)

    retry = tickler.Retry(attempts=2, initial=0.5, jitter=False)
    async with tickler.open_service(handler, capacity=1, retry=retry) as service:
        service.enqueue_request("urgent", priority=3)
        for i in range(3):
            service.enqueue_request(f"plain{i}")
    # plain0 starts while the retry waits; once due it goes before plain1,
    # which was enqueued before it fell due, by its priority.
    assert order == ["urgent", "plain0", "urgent", "plain1", "plain2"]


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (True, TypeError, "priority must be an int"),
        (1.0, TypeError, "priority must be an int"),
        (0.0, TypeError, "priority must be an int"),
        (2**31, ValueError, "priority must be between"),
    ],
)
async def test_a_bad_priority_is_refused_at_once(value: Any, error: type, words: str) -> None:
    service = tickler.Service(recorder()[1])
    with pytest.raises(error, match=words):
        service.enqueue_request(1, priority=value)
    with pytest.raises(error, match=words):
        service.enqueue_many([1, 2], priority=value)
    assert service.statistics().enqueued == 0


async def test_prioritized_requests_count_against_the_bound_and_cancel(
    autojump_clock: trio.abc.Clock,
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler, capacity=1, max_queue_length=2) as service:
        service.enqueue_request("blocker")
        await trio.sleep(0.1)
        first = service.enqueue_request("p", priority=2)
        service.enqueue_request("q")
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request("r", priority=9)
        assert await service.cancel(first.id)
        assert first.status is tickler.Status.CANCELLED
        service.enqueue_request("s", priority=1)
    assert order == ["blocker", "s", "q"]


# -- keys that stay taken


async def test_unique_for_holds_a_key_after_its_request_ended(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler) as service:
        first = service.enqueue_request("digest", key="day-1", unique_for=60)
        assert await first.wait() == "digest"
        again = service.enqueue_request("digest again", key="day-1", unique_for=60)
        assert again is first  # final, and still holding its key
        await trio.sleep(60)
        later = service.enqueue_request("digest later", key="day-1", unique_for=60)
        assert later is not first
        await later.wait()
        plain = service.enqueue_request("x", key="k")
        await plain.wait()
        assert service.enqueue_request("y", key="k") is not plain  # no unique_for: free
        forever = service.enqueue_request("once", key="once", unique_for=math.inf)
        await forever.wait()
        await trio.sleep(10**6)
        assert service.enqueue_request("twice", key="once", unique_for=math.inf) is forever
    assert order.count("digest") == 1
    assert "digest again" not in order
    assert service.statistics().deduplicated == 2


async def test_unique_for_needs_a_key_and_a_positive_number() -> None:
    service = tickler.Service(recorder()[1])
    with pytest.raises(ValueError, match="unique_for needs a key"):
        service.enqueue_request(1, unique_for=5)
    with pytest.raises(ValueError, match="unique_for must be > 0 and at most"):
        service.enqueue_request(1, key="k", unique_for=0)
    with pytest.raises(TypeError, match="unique_for must be a number"):
        service.enqueue_request(1, key="k", unique_for="5")  # type: ignore[arg-type]


@pytest.mark.parametrize("unique_for", [3153600000.001, 1e300, math.nan, -math.inf, 0])
async def test_a_unique_for_out_of_range_is_refused_alike_in_memory(unique_for: float) -> None:
    """Past 100 years (but math.inf), NaN or not > 0: enqueue_request, submit and
    enqueue_many refuse it with one message, and enqueue nothing."""
    message = (
        r"^unique_for must be > 0 and at most 3153600000\.0 seconds \(100 years\),"
        r" or math\.inf \(for good\)$"
    )
    async with tickler.open_service(recorder()[1]) as service:
        with pytest.raises(ValueError, match=message):
            service.enqueue_request(1, key="k", unique_for=unique_for)
        with pytest.raises(ValueError, match=message):
            service.enqueue_many([1, 2], key=lambda n: n, unique_for=unique_for)
        with pytest.raises(ValueError, match=message):
            await service.submit(1, key="k", unique_for=unique_for)
    assert service.statistics().enqueued == 0


# -- enqueue_many


async def test_enqueue_many_is_all_or_nothing(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler, capacity=1, max_queue_length=5) as service:
        service.enqueue_request("blocker")
        await trio.sleep(0.1)
        tickets = service.enqueue_many(["a", "b", "c"])
        assert [t.request for t in tickets] == ["a", "b", "c"]
        assert [t.id for t in tickets] == [2, 3, 4]
        with pytest.raises(
            tickler.QueueFull,
            match=r"^service 'tickler' has room for 2 more requests, not 3"
            r" \(max_queue_length 5\); none was enqueued$",
        ):
            service.enqueue_many(["d", "e", "f"])
        assert service.statistics().queued == 3
        assert service.statistics().rejected == 3
        keyed = service.enqueue_many(["x1", "x2", "y1"], key=lambda r: r[0])
        assert keyed[0] is keyed[1]
        assert keyed[2] is not keyed[0]
    assert order == ["blocker", "a", "b", "c", "x1", "y1"]


async def test_enqueue_many_from_a_thread_and_with_priority_and_delay(
    autojump_clock: trio.abc.Clock,
) -> None:
    order: list[str] = []
    gate = trio.Event()

    async def handler(request: str) -> None:
        order.append(request)
        if request == "blocker":
            await gate.wait()  # (the virtual clock jumps while the thread runs)

    async with tickler.open_service(handler, capacity=1) as service:
        service.enqueue_request("blocker")
        await trio.sleep(0.1)
        done = threading.Event()

        def from_thread() -> None:
            service.enqueue_many(["t1", "t2"])
            done.set()

        await trio.to_thread.run_sync(from_thread)
        assert done.is_set()
        service.enqueue_many(["later"], delay=100)
        service.enqueue_many(["u1", "u2"], priority=1)
        gate.set()
    assert order == ["blocker", "u1", "u2", "t1", "t2", "later"]


async def test_enqueue_many_refuses_bad_input_before_anything() -> None:
    service = tickler.Service(recorder()[1])
    with pytest.raises(TypeError, match="requests must be an iterable"):
        service.enqueue_many("abc")
    with pytest.raises(TypeError, match="key must be a callable"):
        service.enqueue_many([1], key="k")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key must be hashable"):
        service.enqueue_many([1], key=lambda r: [r])  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="unique_for needs a key"):
        service.enqueue_many([1], unique_for=3)
    assert service.statistics().enqueued == 0


# -- pause


async def test_pause_starts_nothing_new_and_resume_goes_on(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler, capacity=1) as service:
        running = service.enqueue_request("running")
        await trio.sleep(0.1)
        service.pause()
        assert service.paused
        assert service.statistics().paused
        for i in range(3):
            service.enqueue_request(f"w{i}")
        await trio.sleep(10)
        assert running.done
        assert order == ["running"]
        assert service.statistics().queued == 3
        service.resume()
        assert not service.paused
        await service.join()
    assert order == ["running", "w0", "w1", "w2"]


async def test_a_paused_service_with_ready_and_delayed_work_sleeps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    order, handler = recorder()
    async with tickler.open_service(handler, capacity=2) as service:
        service.pause()
        service.enqueue_many(["r0", "r1", "r2"])
        service.enqueue_request("d", delay=5)  # falls due while paused
        await trio.sleep(0.1)
        before = service.statistics().wakeups
        # Past the delayed request's due time, then a hundred turns of the
        # scheduler (a loop that woke for what is due would wake at each: a
        # sleep on the autojump clock would never end).
        autojump_clock.jump(60)
        for _ in range(100):
            await trio.lowlevel.checkpoint()
        # Nothing due may start: no due time wakes the loop.
        assert service.statistics().wakeups == before
        await trio.sleep(60)
        assert order == []
        service.resume()
        await service.join()
    assert sorted(order) == ["d", "r0", "r1", "r2"]


@pytest.mark.parametrize("drain", [True, False])
async def test_stop_while_paused_waits_only_for_what_runs(
    autojump_clock: trio.abc.Clock, drain: bool
) -> None:
    order, handler = recorder()
    service = tickler.Service(handler, capacity=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        running = service.enqueue_request("running")
        await trio.sleep(0.1)
        service.pause()
        waiting = service.enqueue_request("waiting")
        with trio.fail_after(10):
            left = await service.stop(drain=drain)
    assert running.status is tickler.Status.SUCCEEDED
    assert left == [waiting]
    assert waiting.status is tickler.Status.CANCELLED
    assert order == ["running"]


# -- periodic


async def test_periodic_every_enqueues_each_tick(autojump_clock: trio.abc.Clock) -> None:
    seen: list[tuple[str, float]] = []

    async def handler(request: str) -> None:
        seen.append((request, trio.current_time()))

    ticks = tickler.Periodic("sweep", "sweep", every=10)
    async with tickler.open_service(handler, periodic=[ticks]) as service:
        await trio.sleep(35.5)
        # Ticks fall on multiples of 10 s since the epoch: 3 or 4 in 35.5 s,
        # by where the run started between two of them.
        assert service.statistics().enqueued in (3, 4)
    assert {request for request, _ in seen} == {"sweep"}
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(seen)]
    assert gaps == pytest.approx([10] * (len(seen) - 1), abs=0.01)


def test_periodic_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one of every"):
        tickler.Periodic("a", 1)
    with pytest.raises(ValueError, match="five-field"):
        tickler.Periodic("a", 1, cron="* * * * * *")
    with pytest.raises(ValueError, match="field 'minute' out of range"):
        tickler.Periodic("a", 1, cron="61 * * * *")
    with pytest.raises(ValueError, match="time zone"):
        tickler.Periodic("a", 1, cron="0 3 * * *", timezone="Mars/Olympus")
    with pytest.raises(ValueError, match="every must be"):
        tickler.Periodic("a", 1, every=math.inf)
    with pytest.raises(TypeError, match="priority must be an int"):
        tickler.Periodic("a", 1, every=1, priority=True)
    with pytest.raises(ValueError, match="names are unique"):
        tickler.Service(recorder()[1], periodic=[tickler.Periodic("a", 1, every=1)] * 2)
    nightly = tickler.Periodic("report", "r", cron="0 3 * * *", timezone="Europe/Paris")
    # 2026-11-25 02:00 UTC is 03:00 in Paris.
    assert nightly.next_tick(1795572000 - 1) == 1795572000


# -- across replicas, on one SQLite file


async def test_a_pause_reaches_every_replica_and_the_cli_view(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    ran: list[tuple[str, int]] = []

    def handler_of(who: str) -> Any:
        async def handler(request: int) -> None:
            ran.append((who, request))

        return handler

    async with (
        tickler.open_service(handler_of("a"), store=tickler.SqliteStore(path, **FAST)) as a,
        tickler.open_service(handler_of("b"), store=tickler.SqliteStore(path, **FAST)) as b,
    ):
        a.pause()
        with trio.fail_after(5):
            while not b.paused:
                await trio.sleep(0.02)
        assert (await b.store_statistics())["paused"] == 1
        for i in range(4):
            b.enqueue_request(i)
        await trio.sleep(0.5)
        assert ran == []
        b.resume()
        with trio.fail_after(5):
            while (await a.store_statistics())["succeeded"] < 4:
                await trio.sleep(0.02)
        with trio.fail_after(5):  # a learns of the resume at its next look
            while a.paused:
                await trio.sleep(0.02)
    assert sorted(request for _, request in ran) == [0, 1, 2, 3]


async def test_periodic_ticks_run_once_across_replicas(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    every = tickler.Periodic("tick", "tick", every=0.5)

    async def quick(request: str) -> None:
        pass

    started = trio.current_time()
    async with (
        tickler.open_service(quick, store=tickler.SqliteStore(path, **FAST), periodic=[every]),
        tickler.open_service(quick, store=tickler.SqliteStore(path, **FAST), periodic=[every]),
    ):
        await trio.sleep(3.1)
    elapsed = trio.current_time() - started
    db = sqlite3.connect(path)
    enqueued = [row[0] for row in db.execute("SELECT enqueued_at FROM tickler_requests")]
    db.close()
    # One request per tick, though two replicas saw each. A tick is enqueued
    # just after its time (a multiple of 0.5 s): the nearest multiple names it.
    ticks = [round(at / 0.5) for at in enqueued]
    assert len(ticks) == len(set(ticks)), sorted(enqueued)
    assert 4 <= len(ticks) <= elapsed / 0.5 + 2


async def test_enqueue_many_and_unique_for_with_a_store(tmp_path: Path) -> None:
    store = tickler.SqliteStore(tmp_path / "queue.db", **FAST)
    ran: list[str] = []

    async def handler(request: str) -> str:
        ran.append(request)
        return request.upper()

    async with tickler.open_service(handler, store=store, max_queue_length=4) as service:
        with pytest.raises(
            tickler.QueueFull,
            match=r"^service 'tickler' has room for 4 more requests, not 5"
            r" \(max_queue_length 4\); none was enqueued$",
        ):
            service.enqueue_many(["a", "b", "c", "d", "e"])
        tickets = service.enqueue_many(["a", "b", "a"], key=lambda r: r, unique_for=3600)
        assert [await ticket.wait() for ticket in tickets] == ["A", "B", "A"]
        assert tickets[0].id == tickets[2].id  # one row for the key "a"
        again = service.enqueue_request("a", key="a", unique_for=3600)
        assert await again.wait() == "A"  # follows the final original
        assert again.id == tickets[0].id
        plain = service.enqueue_request("c", key="c")
        await plain.wait()
        fresh = service.enqueue_request("c", key="c")
        assert fresh.id != plain.id  # no unique_for: the key was free once final
        await fresh.wait()
    assert sorted(ran) == ["a", "b", "c", "c"]


async def test_priorities_through_a_store(tmp_path: Path) -> None:
    store = tickler.SqliteStore(tmp_path / "queue.db", **FAST)
    order: list[str] = []

    async def handler(request: str) -> None:
        order.append(request)

    async with tickler.open_service(handler, store=store, capacity=1) as service:
        service.pause()
        with trio.fail_after(5):
            while (await service.store_statistics())["paused"] != 1:
                await trio.sleep(0.02)
        service.enqueue_request("low", priority=-5)
        service.enqueue_request("plain")
        service.enqueue_many(["urgent1", "urgent2"], priority=9)
        with trio.fail_after(5):
            while (await service.store_statistics())["queued"] < 4:
                await trio.sleep(0.02)
        service.resume()
        await service.join()
    assert order == ["urgent1", "urgent2", "plain", "low"]


async def test_a_periodic_schedule_catches_up_once_after_downtime(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    hourly = tickler.Periodic("report", "report", every=3600)

    async def quick(request: str) -> None:
        pass

    def query(sql: str) -> list[Any]:
        db = sqlite3.connect(path)
        try:
            with db:
                return db.execute(sql).fetchall()
        finally:
            db.close()

    async def run_briefly() -> None:
        store = tickler.SqliteStore(path, **FAST)
        async with tickler.open_service(quick, store=store, periodic=[hourly]):
            await trio.sleep(0.2)

    # The first start records the schedule: nothing was missed, nothing runs.
    await run_briefly()
    assert query("SELECT count(*) FROM tickler_requests") == [(0,)]
    # As if no replica had run for three hours: three ticks missed.
    query("UPDATE tickler_periodic SET last_tick = last_tick - 3 * 3600")
    await run_briefly()
    assert query("SELECT count(*) FROM tickler_requests") == [(1,)]  # one catch-up run
    await run_briefly()  # a restart: caught up already
    assert query("SELECT count(*) FROM tickler_requests") == [(1,)]


async def test_periodic_cron_in_memory(autojump_clock: trio.abc.Clock) -> None:
    runs: list[float] = []

    async def handler(request: str) -> None:
        runs.append(trio.current_time())

    five = tickler.Periodic("five", "x", cron="*/5 * * * *", timezone="Asia/Kolkata")
    async with tickler.open_service(handler, periodic=[five]):
        await trio.sleep(3600)
    assert len(runs) == 12  # every five minutes, for an hour
    assert {round(b - a) for a, b in itertools.pairwise(runs)} == {300}


async def test_pause_from_another_thread_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with tickler.open_service(recorder()[1]) as service:
        with pytest.raises(RuntimeError, match="from the thread running it"):
            await trio.to_thread.run_sync(service.pause)
        assert not service.paused


async def test_a_pause_hands_back_what_was_claimed_ahead(tmp_path: Path) -> None:
    gate = trio.Event()

    async def handler(request: int) -> None:
        if request >= 6:
            await gate.wait()

    store = tickler.SqliteStore(tmp_path / "queue.db", **FAST)
    async with tickler.open_service(handler, store=store, capacity=2) as service:
        service.enqueue_many(range(30))
        with trio.fail_after(5):
            while service.statistics().queued == 0:
                await trio.sleep(0.01)  # claimed ahead of a free slot, waiting here
        service.pause()
        assert service.statistics().queued == 0  # handed back at once
        with trio.fail_after(5):
            while (await service.store_statistics())["claimed"] != 0:
                await trio.sleep(0.02)
        counts = await service.store_statistics()
        assert counts["running"] == 2  # the two that run go on
        assert counts["queued"] == 30 - 6 - 2
        gate.set()
        service.resume()
        await service.join()
        assert (await service.store_statistics())["succeeded"] == 30
