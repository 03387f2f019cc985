"""The store side of scheduling: priorities, keys held after their rows end, pause, periodic
ticks, and enqueue_in / enqueue_many_in with them.

Each test runs once per store in BACKENDS (the conformance suite's), against a
real database: a SQLite file, a fresh PostgreSQL schema. Most drive a session at
the seam (``store.connect()``'s ``run``), one Batch at a time, as the loop does;
two sessions on one store are two processes. The migrations from each store's
previous schema version, and the claim's plan on PostgreSQL, are tested per store.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
from tickler._stores._seam import Batch, BatchResult, Session
from tickler._values import Insert, Outcome, OutcomeKind, Tick

from .store_backends import FAST, Backend, owner_id
from .test_store_contract import BACKENDS, double


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Any:
    store = backend.store()
    store.create_schema()
    return store


@pytest.fixture
def session(store: Any) -> Iterator[Session]:
    session = store.connect()
    try:
        yield session
    finally:
        session.close()


def run(session: Session, batch: Batch, *, owner: str = "me", retention: float = 86400.0) -> Any:
    return session.run("jobs", owner_id(owner), 30.0, retention, batch)


def entry(
    request: bytes,
    *,
    key: str | None = None,
    priority: int = 0,
    unique_until: float | None = None,
    at: float | None = None,
) -> Insert:
    """A Batch.inserts entry as the engine sends it, with a ticket of its own at the end."""
    run_at = time.time() if at is None else at
    state = "scheduled" if run_at > time.time() else "queued"
    return Insert(key, state, request, run_at, priority, unique_until, None, object())


def claimed(result: BatchResult) -> list[bytes]:
    return [bytes(row.request) for row in result.claimed]


# -- Priorities


def test_a_claim_takes_the_higher_priority_first_then_the_due_then_the_enqueued(
    session: Session,
) -> None:
    now = time.time()
    run(
        session,
        Batch(
            inserts=[
                entry(b"a", at=now - 1),
                entry(b"b", at=now - 10),
                entry(b"c", priority=5, at=now - 1),
                entry(b"later", priority=9, at=now + 3600),
                entry(b"e", priority=5, at=now - 1),
                entry(b"f", priority=-3, at=now - 100),
                entry(b"g", priority=5, at=now - 2),
            ]
        ),
    )
    first = run(session, Batch(claim=2))
    assert claimed(first) == [b"g", b"c"]
    rest = run(session, Batch(claim=10))
    assert claimed(rest) == [b"e", b"b", b"a", b"f"]
    # Each claimed row carries its priority.
    assert [row.priority for row in first.claimed + rest.claimed] == [5, 5, 5, 0, 0, -3]
    # The row scheduled for later is not claimed, whatever its priority; it is next due.
    assert rest.next_due == pytest.approx(now + 3600, abs=5)


def test_a_retried_request_keeps_its_priority(session: Session) -> None:
    run(session, Batch(inserts=[entry(b"low"), entry(b"high", priority=3), entry(b"low 2")]))
    (row,) = run(session, Batch(claim=1)).claimed
    assert (bytes(row.request), row.priority) == (b"high", 3)
    outcome = Outcome(
        OutcomeKind.RETRYING, row.id, time.time() - 1, None, "ValueError", "again", "tb"
    )
    result = run(session, Batch(outcomes=[outcome], claim=3))
    assert result.applied == ["retrying"]
    assert claimed(result) == [b"high", b"low", b"low 2"]
    assert result.claimed[0][2] == 2  # its second attempt


def test_priorities_are_written_by_a_batch_and_by_enqueue_in(
    backend: Backend, store: Any, session: Session
) -> None:
    run(session, Batch(inserts=[entry(b"1", priority=7), entry(b"2", key='"k"', priority=-7)]))
    with backend.connect(autocommit=False) as connection:
        store.enqueue_in(connection, "jobs", 3, priority=2**31 - 1)
        store.enqueue_many_in(connection, "jobs", [4, 5], priority=-(2**31))
        connection.commit()
    assert backend.select("priority") == [(7,), (-7,), (2**31 - 1,), (-(2**31),), (-(2**31),)]
    assert claimed(run(session, Batch(claim=10))) == [b"3", b"1", b"2", b"4", b"5"]


# -- Keys that stay taken: unique_until


def finish(session: Session, ids: list[int]) -> None:
    """Claim the queue's ready rows and end these ones succeeded."""
    result = run(session, Batch(claim=100))
    assert {row[0] for row in result.claimed} >= set(ids)
    outcomes = [Outcome(OutcomeKind.SUCCEEDED, i, time.time()) for i in ids]
    assert run(session, Batch(outcomes=outcomes)).applied == ["succeeded"] * len(ids)


def test_unique_until_holds_a_final_rows_key_until_it_runs_out(
    backend: Backend, session: Session
) -> None:
    held = run(session, Batch(inserts=[entry(b"1", key='"k"', unique_until=time.time() + 3600)]))
    ((first, new),) = held.inserted
    assert new
    finish(session, [first])
    # Final, and still holding its key: in a batch, and through lookup.
    again = run(session, Batch(inserts=[entry(b"2", key='"k"')]))
    assert again.inserted == [(first, False)]
    found = session.lookup("jobs", "k")
    assert found is not None
    assert (found.id, found.state) == (first, "succeeded")
    # Once the hold has run out, the key is free again.
    backend.execute(
        f"UPDATE {backend.table('tickler_requests')} SET unique_until = {backend.now} - 1"  # noqa: S608
    )
    (fresh,) = run(session, Batch(inserts=[entry(b"3", key='"k"')])).inserted
    assert fresh[1]
    assert fresh[0] > first
    assert [row[0] for row in backend.rows()] == [first, fresh[0]]


def test_a_live_row_of_the_key_is_preferred_to_a_held_one(
    backend: Backend, session: Session
) -> None:
    (old,) = run(session, Batch(inserts=[entry(b"1", key='"k"', unique_until=math.inf)])).inserted
    finish(session, [old[0]])
    # Another driver wrote a live row of the key meanwhile, as the docs say.
    assert backend.insert_as_the_docs_say("k", b"2") == 1
    (live_id,) = [row[0] for row in backend.rows("state = 'queued'")]
    assert run(session, Batch(inserts=[entry(b"3", key='"k"')])).inserted == [(live_id, False)]
    found = session.lookup("jobs", "k")
    assert found is not None
    assert found.id == live_id


def test_retention_keeps_the_rows_that_hold_their_key(backend: Backend, session: Session) -> None:
    now = time.time()
    result = run(
        session,
        Batch(
            inserts=[
                entry(b"held", key='"held"', unique_until=now + 3600),
                entry(b"forever", key='"forever"', unique_until=math.inf),
                entry(b"ran out", key='"ran out"', unique_until=now + 0.01),
                entry(b"plain"),
            ]
        ),
    )
    ids = [i for i, _ in result.inserted]
    finish(session, ids)
    time.sleep(0.05)
    run(session, Batch(prune=True), retention=0.0)
    assert [row[2] for row in backend.rows()] == ['"held"', '"forever"']
    backend.execute(
        f"UPDATE {backend.table('tickler_requests')} SET unique_until = {backend.now} - 1"  # noqa: S608
        " WHERE key = '\"held\"'"
    )
    run(session, Batch(prune=True), retention=0.0)
    assert [row[2] for row in backend.rows()] == ['"forever"']
    assert backend.select("unique_until") == [(math.inf,)]


def test_two_processes_inserting_a_held_key_at_once_both_find_the_holder(
    store: Any, session: Session
) -> None:
    (held,) = run(session, Batch(inserts=[entry(b"1", key='"k"', unique_until=math.inf)])).inserted
    finish(session, [held[0]])
    results: list[Any] = []
    barrier = threading.Barrier(4)

    def insert() -> None:
        other = store.connect()
        try:
            barrier.wait()
            for _ in range(10):
                results.extend(run(other, Batch(inserts=[entry(b"2", key='"k"')])).inserted)
        finally:
            other.close()

    threads = [threading.Thread(target=insert) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [(held[0], False)] * 40


def test_the_batchs_clock_shift_moves_unique_until_like_run_at(
    backend: Backend, session: Session
) -> None:
    """unique_until is this process's clock, moved onto the store's as run_at is."""
    until, at = time.time() + 3600, time.time() - 1
    result = run(session, Batch(inserts=[entry(b"1", key='"k"', unique_until=until, at=at)]))
    ((stored_until, stored_at),) = backend.select("unique_until, run_at")
    assert stored_at == pytest.approx(at + result.shift, abs=1e-6)
    assert stored_until == pytest.approx(until + result.shift, abs=1e-6)


def test_enqueue_many_in_of_keys_another_transaction_is_inserting_finds_its_rows(
    backend: Backend, store: Any
) -> None:
    """The second waits for the first's commit, then finds the keys taken: no duplicate."""
    got: list[int] = []
    with backend.connect(autocommit=False) as first:
        ids = store.enqueue_many_in(first, "jobs", ["x", "y", "z"], key=str, unique_for=60)

        def second() -> None:
            with backend.connect(autocommit=False) as connection:
                got.extend(store.enqueue_many_in(connection, "jobs", ["z", "w", "x"], key=str))
                connection.commit()

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        first.commit()
        thread.join(30)
    assert got[0] == ids[2]
    assert got[2] == ids[0]
    assert got[1] not in ids
    assert len(backend.rows()) == 4


# -- Pause


def test_a_paused_queue_claims_nothing_and_resumes(backend: Backend, store: Any) -> None:
    a, b = store.connect(), store.connect()
    try:
        run(a, Batch(inserts=[entry(b"1"), entry(b"2"), entry(b"3")]))
        (running,) = run(a, Batch(claim=1)).claimed
        paused = run(a, Batch(pause=True, claim=5))
        assert paused.paused
        assert paused.claimed == []
        # Another process sees it: its claims take nothing, its statistics say so.
        assert b.statistics("jobs")["paused"] == 1
        other = run(b, Batch(claim=5), owner="other")
        assert (other.claimed, other.paused) == ([], True)
        # The running row keeps its lease: a renewal holds it, an outcome ends it.
        renewed = run(a, Batch(renew=True, claim=5))
        assert renewed.mine == {running[0]: False}
        assert renewed.claimed == []
        # Even a lapsed lease is not rescued while paused.
        backend.execute(
            f"UPDATE {backend.table('tickler_requests')} SET lease_until = {backend.now} - 1"  # noqa: S608
        )
        assert run(b, Batch(claim=5), owner="other").claimed == []
        # Another queue of the store is not paused.
        assert b.run("other", owner_id("me"), 30.0, 86400.0, Batch(claim=1)).paused is False
        resumed = run(b, Batch(pause=False, claim=5), owner="other")
        assert not resumed.paused
        assert claimed(resumed) == [b"1", b"2", b"3"]
        assert a.statistics("jobs")["paused"] == 0
    finally:
        a.close()
        b.close()


def test_pause_wakes_the_listening_replicas(store: Any, session: Session) -> None:
    listener = store.listener("jobs")
    if listener is None:
        pytest.skip("the store has no listener: its replicas poll")
    import psycopg

    with psycopg.connect(store.dsn, autocommit=True) as connection:
        connection.execute(f'LISTEN "{store.channel}"')
        run(session, Batch(pause=True))
        run(session, Batch(pause=False))
        got = [n.payload for n in connection.notifies(timeout=5, stop_after=2)]
    assert got == ["jobs", "jobs"]


def test_a_batch_that_does_not_pause_leaves_the_flag(session: Session) -> None:
    assert run(session, Batch(pause=True)).paused
    assert run(session, Batch(claim=1)).paused
    assert not run(session, Batch(pause=False)).paused
    assert not run(session, Batch(claim=1)).paused


# A paused replica sleeps until its next look (poll_interval), a tickle or a resume,
# though the queue holds ready work and a delayed request falls due meanwhile.
PAUSE_POLL = 0.2
PAUSE_WINDOW = 1.0


@pytest.mark.parametrize("work", ["ready", "delayed"])
@pytest.mark.parametrize("how", ["service", "admin"])
async def test_a_paused_replica_with_work_waiting_sleeps_until_its_next_look(
    backend: Backend, how: str, work: str
) -> None:
    """Paused by the service or the admin (as the CLI and the dashboard do), with
    ready requests waiting ("ready"), or only one that falls due while paused."""
    ran: list[int] = []

    async def handler(request: int) -> None:
        ran.append(request)

    store = backend.store(lease=5.0, poll_interval=PAUSE_POLL)
    async with (
        backend.store().admin() as admin,
        tickler.open_service(handler, store=store, name="jobs") as service,
    ):
        if how == "service":
            service.pause()
        else:
            await admin.pause("jobs")
        with trio.fail_after(5):  # the admin's pause is seen at the replica's next look
            while not service.paused or (await admin.counts("jobs"))["paused"] != 1:
                await trio.sleep(0.02)
        ready = range(5) if work == "ready" else range(0)
        service.enqueue_many(ready)
        # Due in the middle of the window below: it falls due while paused.
        service.enqueue_request(len(ready), delay=PAUSE_WINDOW / 2)
        with trio.fail_after(5):
            while (counts := await admin.counts("jobs"))["queued"] != len(ready) or counts[
                "scheduled"
            ] != 1:
                await trio.sleep(0.02)
        before, started = service.statistics().wakeups, trio.current_time()
        await trio.sleep(PAUSE_WINDOW)
        wakeups = service.statistics().wakeups - before
        looks = (trio.current_time() - started) / PAUSE_POLL
        # A look per poll_interval (lease/3 is longer here), and a few more.
        assert wakeups <= 2 * looks + 3, f"{wakeups} wake-ups in {looks:.1f} poll intervals"
        assert ran == []
        if how == "service":
            service.resume()
        else:
            await admin.resume("jobs")
        with trio.fail_after(5):
            while (await admin.counts("jobs"))["succeeded"] != len(ready) + 1:
                await trio.sleep(0.02)
    assert sorted(ran) == list(range(len(ready) + 1))


# -- Periodic ticks


def tick(name: str, at: float, *, catch_up: bool = False, priority: int = 0) -> Tick:
    return Tick(name, at, catch_up, f"{name}@{at}".encode(), priority)


def test_each_tick_enqueues_once_though_two_processes_race_for_it(
    backend: Backend, store: Any
) -> None:
    ticks = [tick("every minute", 1_000_000.0 + 60 * i) for i in range(60)]
    got: dict[str, list[int]] = {}
    barrier = threading.Barrier(2)

    def race(name: str) -> None:
        session = store.connect()
        try:
            barrier.wait()
            found = got.setdefault(name, [])
            for start in range(0, len(ticks), 3):
                found += run(session, Batch(ticks=ticks[start : start + 3])).ticked
        finally:
            session.close()

    threads = [threading.Thread(target=race, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    ids = [i for found in got.values() for i in found if i]
    assert len(ids) == len(set(ids)) == 60
    # For each tick, exactly one of the two enqueued it.
    assert all((a == 0) != (b == 0) for a, b in zip(got["a"], got["b"], strict=True))
    requests = backend.select("request, state, key")
    assert sorted(bytes(r[0]) for r in requests) == sorted(t[3] for t in ticks)
    assert {(r[1], r[2]) for r in requests} == {("queued", None)}


def test_a_tick_to_catch_up_with_enqueues_only_after_one_was_recorded(
    backend: Backend, session: Session
) -> None:
    # The first tick ever, caught up with: recorded, nothing enqueued.
    assert run(session, Batch(ticks=[tick("t", 100.0, catch_up=True)])).ticked == [0]
    # The same tick again, or an earlier one: nothing.
    assert run(session, Batch(ticks=[tick("t", 100.0), tick("t", 50.0)])).ticked == [0, 0]
    # A later one, caught up with: enqueued, at its priority.
    result = run(session, Batch(ticks=[tick("t", 200.0, catch_up=True, priority=4)], claim=5))
    (request_id,) = result.ticked
    assert request_id > 0
    assert [(row[0], row[6]) for row in result.claimed] == [(request_id, 4)]
    # A name's first tick not caught up with: enqueued; names are apart.
    (other,) = run(session, Batch(ticks=[tick("u", 100.0)])).ticked
    assert other > request_id
    assert [row[0] for row in backend.rows()] == [request_id, other]


def test_ticks_are_a_queues_own(session: Session) -> None:
    assert run(session, Batch(ticks=[tick("t", 100.0)])).ticked[0] > 0
    other = session.run("other", owner_id("me"), 30.0, 86400.0, Batch(ticks=[tick("t", 100.0)]))
    assert other.ticked[0] > 0


# -- enqueue_in and enqueue_many_in


def test_enqueue_many_in_returns_ids_in_order_and_the_holders_of_taken_keys(
    backend: Backend, store: Any, session: Session
) -> None:
    (live,) = run(session, Batch(inserts=[entry(b"0", key='"live"')])).inserted
    (held,) = run(
        session, Batch(inserts=[entry(b"0", key='"held"', unique_until=math.inf)])
    ).inserted
    finish(session, [held[0]])
    requests = [
        {"n": 1, "k": None},
        {"n": 2, "k": "a"},
        {"n": 3, "k": "live"},
        {"n": 4, "k": "a"},
        {"n": 5, "k": "held"},
        {"n": 6, "k": None},
        {"n": 7, "k": "b"},
    ]
    with backend.connect(autocommit=False) as connection:
        ids = store.enqueue_many_in(
            connection, "jobs", iter(requests), key=lambda r: r["k"], priority=2
        )
        connection.commit()
    new = [i for i in ids if i not in (live[0], held[0])]
    assert ids[2] == live[0]
    assert ids[4] == held[0]
    assert ids[3] == ids[1]
    assert len(set(new)) == 4  # 1, a, 6, b
    assert new == sorted(new)  # enqueued in order
    rows = backend.select("id, key, request, priority", f"id IN ({','.join(map(str, new))})")
    assert [(r[1], bytes(r[2]), r[3]) for r in rows] == [
        (None, b'{"n":1,"k":null}', 2),
        ('"a"', b'{"n":2,"k":"a"}', 2),
        (None, b'{"n":6,"k":null}', 2),
        ('"b"', b'{"n":7,"k":"b"}', 2),
    ]


def test_enqueue_many_in_takes_many_requests_in_one_call(
    backend: Backend, store: Any, session: Session
) -> None:
    with backend.connect(autocommit=False) as connection:
        ids = store.enqueue_many_in(
            connection, "jobs", range(2500), key=lambda n: str(n % 1000) if n % 2 else None
        )
        connection.commit()
    # Odd requests have 500 keys among them; each key's first holds it for the others.
    assert len(ids) == 2500
    assert len(set(ids)) == 1250 + 500
    assert all(ids[n] == ids[n % 1000] for n in range(1001, 2500, 2))
    assert len(backend.rows()) == 1750
    assert len(claimed(run(session, Batch(claim=5000)))) == 1750


def test_enqueue_in_with_unique_for_holds_the_key_after_the_request_ends(
    backend: Backend, store: Any, session: Session
) -> None:
    with backend.connect(autocommit=False) as connection:
        first = store.enqueue_in(connection, "jobs", 1, key="k", unique_for=3600)
        forever = store.enqueue_many_in(
            connection, "jobs", [2], key=lambda _: "f", unique_for=math.inf
        )[0]
        connection.commit()
    finish(session, [first, forever])
    with backend.connect(autocommit=False) as connection:
        assert store.enqueue_in(connection, "jobs", 3, key="k") == first
        assert store.enqueue_many_in(connection, "jobs", [4, 5], key=lambda n: "f") == [
            forever,
            forever,
        ]
        # Without a hold, the key of a final row is free.
        plain = store.enqueue_in(connection, "jobs", 6, key="plain")
        connection.commit()
    finish(session, [plain])
    with backend.connect(autocommit=False) as connection:
        assert store.enqueue_in(connection, "jobs", 7, key="plain") > plain
        connection.commit()
    held = backend.select("id, unique_until", "unique_until IS NOT NULL")
    assert [row[0] for row in held] == [first, forever]
    assert held[1][1] == math.inf
    assert held[0][1] == pytest.approx(time.time() + 3600, abs=60)


def test_enqueue_in_with_a_delay_and_priority(backend: Backend, store: Any) -> None:
    with backend.connect(autocommit=False) as connection:
        store.enqueue_many_in(connection, "jobs", [1, 2], delay=3600, priority=1)
        connection.commit()
    assert backend.select("state, priority") == [("scheduled", 1)] * 2


def test_a_rolled_back_enqueue_many_in_leaves_nothing(backend: Backend, store: Any) -> None:
    with backend.connect(autocommit=False) as connection:
        store.enqueue_many_in(connection, "jobs", range(10), key=str, unique_for=60)
        store.enqueue_in(connection, "jobs", 10, priority=3)
        connection.rollback()
    assert backend.rows() == []
    with backend.connect(autocommit=False) as connection:
        # The keys were never taken.
        ids = store.enqueue_many_in(connection, "jobs", range(3), key=str)
        connection.commit()
    assert [row[0] for row in backend.rows()] == ids


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"priority": 1.5}, TypeError, "priority"),
        ({"priority": True}, TypeError, "priority"),
        ({"priority": "1"}, TypeError, "priority"),
        ({"priority": 2**31}, ValueError, "priority"),
        ({"priority": -(2**31) - 1}, ValueError, "priority"),
        ({"unique_for": 0, "key": "k"}, ValueError, "unique_for"),
        ({"unique_for": -1.0, "key": "k"}, ValueError, "unique_for"),
        ({"unique_for": math.nan, "key": "k"}, ValueError, "unique_for"),
        ({"unique_for": "60", "key": "k"}, TypeError, "unique_for"),
        ({"unique_for": True, "key": "k"}, TypeError, "unique_for"),
        ({"unique_for": 60}, ValueError, "unique_for"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    backend: Backend, store: Any, options: dict[str, Any], error: type[Exception], names: str
) -> None:
    many = dict(options)
    if "key" in many:
        many["key"] = lambda request: "k"
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(error, match=names):
            store.enqueue_in(connection, "jobs", 1, **options)
        with pytest.raises(error, match=names):
            store.enqueue_many_in(connection, "jobs", [1, 2], **many)
        connection.commit()
    assert backend.rows() == []


TOO_FAR = r"^delay must be at most 3153600000\.0 seconds \(100 years\)$"


@pytest.mark.parametrize("delay", [1e12, 3153600000.001, 10**400])
async def test_a_delay_past_100_years_is_refused_on_every_enqueue_path(
    backend: Backend, store: Any, delay: float
) -> None:
    """A due time further off than 100 years is refused at once (the store, the admin
    and the dashboard could not write it as a date); a delay of 100 years is kept."""
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(ValueError, match=TOO_FAR):
            store.enqueue_in(connection, "jobs", 1, delay=delay)
        with pytest.raises(ValueError, match=TOO_FAR):
            store.enqueue_many_in(connection, "jobs", [1, 2], delay=delay)
        connection.commit()
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        with pytest.raises(ValueError, match=TOO_FAR):
            service.enqueue_request(1, delay=delay)
        with pytest.raises(ValueError, match=TOO_FAR):
            service.enqueue_many([1, 2], delay=delay)
        with pytest.raises(ValueError, match=TOO_FAR):
            await service.submit(1, delay=delay)
        far = service.enqueue_request(3, delay=3153600000.0)
        with trio.fail_after(5):  # committed by the next batch
            while not backend.rows():
                await trio.sleep(0.02)
    assert backend.select("state") == [("scheduled",)]
    async with store.admin() as admin:
        (row,) = (await admin.requests("jobs")).rows
        assert row.id == far.id
        assert row.run_at == pytest.approx(time.time() + 3153600000.0, abs=60)


UNIQUE_FOR = (
    r"^unique_for must be > 0 and at most 3153600000\.0 seconds \(100 years\),"
    r" or math\.inf \(for good\)$"
)
NO_KEY = r"^unique_for needs a key: it says how long the key stays taken$"


@pytest.mark.parametrize("unique_for", [3153600000.001, 1e300, math.nan, -math.inf, 0, -1])
async def test_a_unique_for_out_of_range_is_refused_alike_on_every_enqueue_path(
    backend: Backend, store: Any, unique_for: float
) -> None:
    """A hold past 100 years (but math.inf), NaN or not > 0 is refused with one message on
    every path that takes it, before anything is written; so is a hold without a key."""
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(ValueError, match=UNIQUE_FOR):
            store.enqueue_in(connection, "jobs", 1, key="k", unique_for=unique_for)
        with pytest.raises(ValueError, match=UNIQUE_FOR):
            store.enqueue_many_in(
                connection, "jobs", [1, 2], key=lambda n: n, unique_for=unique_for
            )
        with pytest.raises(ValueError, match=NO_KEY):
            store.enqueue_in(connection, "jobs", 1, unique_for=60)
        with pytest.raises(ValueError, match=NO_KEY):
            store.enqueue_many_in(connection, "jobs", [1, 2], unique_for=60)
        connection.commit()
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        with pytest.raises(ValueError, match=UNIQUE_FOR):
            service.enqueue_request(1, key="k", unique_for=unique_for)
        with pytest.raises(ValueError, match=UNIQUE_FOR):
            service.enqueue_many([1, 2], key=lambda n: n, unique_for=unique_for)
        with pytest.raises(ValueError, match=UNIQUE_FOR):
            await service.submit(1, key="k", unique_for=unique_for)
        with pytest.raises(ValueError, match=NO_KEY):
            service.enqueue_many([1, 2], unique_for=60)
    assert backend.rows() == []
    # 100 years, and math.inf (for good), are kept.
    with backend.connect(autocommit=False) as connection:
        store.enqueue_in(connection, "jobs", 1, key="a", unique_for=3153600000.0)
        store.enqueue_many_in(connection, "jobs", [2], key=lambda n: "b", unique_for=math.inf)
        connection.commit()
    assert len(backend.rows()) == 2


def test_enqueue_many_in_refuses_a_key_that_is_not_callable_and_bad_requests_first(
    backend: Backend, store: Any
) -> None:
    def requests() -> Iterator[object]:
        yield 1
        yield object()  # the codec refuses it

    with backend.connect(autocommit=False) as connection:
        with pytest.raises(TypeError, match="key"):
            store.enqueue_many_in(connection, "jobs", [1], key="k")
        with pytest.raises(TypeError):
            store.enqueue_many_in(connection, "jobs", requests())
        with pytest.raises(ValueError, match="key"):
            store.enqueue_many_in(connection, "jobs", [1, 2], key=lambda n: "k" * 2000)
        assert store.enqueue_many_in(connection, "jobs", []) == []
        connection.commit()
    assert backend.rows() == []


# -- The claim's plan, and the migrations from the previous versions


def test_the_postgres_claim_reads_the_claim_index(postgres_dsn: str, postgres_schema: str) -> None:
    import psycopg

    from tickler._stores.postgres import _CLAIM

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema, **FAST)
    store.create_schema()
    table = f'"{postgres_schema}".tickler_requests'
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(
            f"INSERT INTO {table} (queue, state, request, run_at, enqueued_at, priority)"  # noqa: S608
            " SELECT 'jobs', CASE WHEN i % 10 = 0 THEN 'queued' ELSE 'succeeded' END, 'null',"
            " i, i, i % 3 FROM generate_series(1, 20000) AS i"
        )
        connection.execute(f"ANALYZE {table}")
        connection.execute(f'SET search_path TO "{postgres_schema}"')
        params = {
            "owner": owner_id("me"),
            "lease_until": 2e9,
            "now": 1e9,
            "queue": "jobs",
            "limit": 10,
        }
        plan = "\n".join(row[0] for row in connection.execute("EXPLAIN " + _CLAIM, params))
    assert "tickler_ready" in plan, plan
    assert "Seq Scan on tickler_requests" not in plan, plan
    assert "Sort Key: tickler_requests" not in plan, plan


# The tables of SqliteStore's version 2 and PostgresStore's version 1, as they made them.
_SQLITE_V2 = """
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, key TEXT, state TEXT NOT NULL,
    request BLOB NOT NULL, result BLOB, error_type TEXT, error_message TEXT,
    error_traceback TEXT, attempts INTEGER NOT NULL DEFAULT 0, run_at REAL NOT NULL,
    enqueued_at REAL NOT NULL, started_at REAL, finished_at REAL, owner TEXT, lease_until REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until) WHERE state = 'running';
CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)
    WHERE key IS NOT NULL AND (state = 'queued' OR state = 'scheduled' OR state = 'running'
    OR state = 'retrying');
CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)
    WHERE (state = 'queued' OR state = 'scheduled' OR state = 'retrying');
CREATE INDEX tickler_finished ON tickler_requests (finished_at) WHERE finished_at IS NOT NULL;
INSERT INTO tickler_schema VALUES (2);
INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)
    VALUES ('jobs', '"k"', 'queued', X'31', 1.0, 1.0), ('jobs', NULL, 'queued', X'32', 2.0, 2.0);
"""

_POSTGRES_V1 = """
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id BIGSERIAL PRIMARY KEY, queue TEXT NOT NULL, key TEXT, state TEXT NOT NULL,
    request BYTEA NOT NULL, result BYTEA, error_type TEXT, error_message TEXT,
    error_traceback TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    run_at DOUBLE PRECISION NOT NULL, enqueued_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION, finished_at DOUBLE PRECISION, owner TEXT,
    lease_until DOUBLE PRECISION, cancel_requested BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)
    WHERE key IS NOT NULL AND state IN ('queued', 'scheduled', 'running', 'retrying');
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)
    WHERE state IN ('queued', 'scheduled', 'retrying');
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until) WHERE state = 'running';
CREATE INDEX tickler_finished ON tickler_requests (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');
INSERT INTO tickler_schema VALUES (1);
INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)
    VALUES ('jobs', '"k"', 'queued', '1', 1.0, 1.0), ('jobs', NULL, 'queued', '2', 2.0, 2.0)
"""


def check_migrated(store: Any, version: Callable[[], int], latest: int) -> None:
    """The store, made by the previous version, is at ``latest`` and works as new."""
    store.create_schema()
    assert version() == latest
    store.create_schema()  # again: nothing to do
    session = store.connect()
    try:
        result = session.run(
            "jobs",
            owner_id("me"),
            30.0,
            86400.0,
            Batch(inserts=[entry(b"3", priority=1), entry(b"4", key='"k"')], claim=10, pause=False),
        )
        assert result.inserted[1] == (1, False)
        assert claimed(result) == [b"3", b"1", b"2"]
        assert [row[6] for row in result.claimed] == [1, 0, 0]
        assert session.statistics("jobs")["paused"] == 0
        assert session.run(
            "jobs", owner_id("me"), 30.0, 86400.0, Batch(ticks=[tick("t", 1.0)])
        ).ticked[0]
    finally:
        session.close()


def test_a_sqlite_file_of_version_2_is_migrated(tmp_path: Path) -> None:
    from tickler._stores.sqlite import SCHEMA_VERSION

    path = tmp_path / "queue.db"
    with sqlite3.connect(path) as connection:
        connection.executescript(_SQLITE_V2)
    connection.close()

    def version() -> int:
        with sqlite3.connect(path) as db:
            found = db.execute("SELECT version FROM tickler_schema").fetchone()[0]
            index = db.execute("SELECT sql FROM sqlite_master WHERE name = 'tickler_ready'")
            assert "priority DESC, run_at, id" in index.fetchone()[0]
        db.close()
        return int(found)

    check_migrated(tickler.SqliteStore(path, **FAST), version, SCHEMA_VERSION)
    # v3 scheduling, v4 limits, v5 admin, v6 traces, v7 rescues, v8 the replicas' hosts and pids
    assert SCHEMA_VERSION == 8


def test_a_postgres_schema_of_version_1_is_migrated(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores.postgres import SCHEMA_VERSION

    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{postgres_schema}"')
        connection.execute(f'SET search_path TO "{postgres_schema}"')
        for statement in _POSTGRES_V1.split(";"):
            connection.execute(statement)

    def version() -> int:
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            db.execute(f'SET search_path TO "{postgres_schema}"')
            found = db.execute("SELECT version FROM tickler_schema").fetchone()
            index = db.execute(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'tickler_ready'"
                " AND schemaname = %s",
                (postgres_schema,),
            ).fetchone()
        assert found is not None
        assert index is not None
        assert "priority DESC, run_at, id" in index[0]
        return int(found[0])

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema, **FAST)
    check_migrated(store, version, SCHEMA_VERSION)
    # v2 scheduling, v3 limits, v4 admin, v5 traces, v6 rescues, v7 group index without running,
    # v8 replicas, v9 leaner writes of a drain
    assert SCHEMA_VERSION == 9


def _full(room: int, asked: int, bound: int) -> str:
    return (
        rf"^service 'jobs' has room for {room} more requests, not {asked}"
        rf" \(max_queue_length {bound}\); none was enqueued$"
    )


def _refuses_when_full(service: tickler.Service[int, int]) -> None:
    """Of a service of max_queue_length=2 that holds nothing yet: its refusals once full,
    with no checkpoint between the enqueues (with a store, all wait to be committed)."""
    service.enqueue_request(1)
    with pytest.raises(tickler.QueueFull, match=_full(1, 2, 2)):
        service.enqueue_many([2, 3])
    service.enqueue_request(2, delay=5)
    with pytest.raises(tickler.QueueFull, match=_full(0, 1, 2)):
        service.enqueue_request(3)
    with pytest.raises(tickler.QueueFull, match=_full(0, 1, 2)):
        service.enqueue_request(3, delay=5)
    with pytest.raises(tickler.QueueFull, match=_full(0, 1, 2)):
        service.enqueue_many([3])


async def test_a_full_queue_is_refused_alike_on_every_path(backend: Backend) -> None:
    """In memory or with a store, one request or many, delayed or not: one wording."""
    _refuses_when_full(tickler.Service(double, name="jobs", max_queue_length=2))
    async with tickler.open_service(
        double, store=backend.store(), name="jobs", max_queue_length=2
    ) as stored:
        _refuses_when_full(stored)


CLOSED = r"^service 'jobs' is closed$"


async def test_a_closed_service_is_refused_alike_on_every_path(backend: Backend) -> None:
    """After a stop, in memory or with a store, an enqueue and a run get one wording."""
    memory = tickler.Service(double, name="jobs")
    await memory.stop()
    with pytest.raises(tickler.ServiceClosed, match=CLOSED):
        memory.enqueue_request(1)
    with pytest.raises(tickler.ServiceClosed, match=CLOSED):
        memory.enqueue_many([1])
    with pytest.raises(tickler.ServiceClosed, match=CLOSED):
        await memory.run()
    async with tickler.open_service(double, store=backend.store(), name="jobs") as stored:
        await stored.stop()
        with pytest.raises(tickler.ServiceClosed, match=CLOSED):
            stored.enqueue_request(3)
        with pytest.raises(tickler.ServiceClosed, match=CLOSED):
            stored.enqueue_many([3])
        with pytest.raises(tickler.ServiceClosed, match=CLOSED):
            await stored.submit(3)


PRIORITY_TYPE = r"^priority must be an int, not float$"
PRIORITY_RANGE = r"^priority must be between -2147483648 and 2147483647$"


@pytest.mark.parametrize(
    ("priority", "error", "message"),
    [(1.0, TypeError, PRIORITY_TYPE), (2**31, ValueError, PRIORITY_RANGE)],
)
async def test_a_bad_priority_is_refused_alike_on_every_path(
    backend: Backend, store: Any, priority: Any, error: type[Exception], message: str
) -> None:
    """A priority that is not an int, or past a 32-bit int, is refused with one message by
    every path that takes one, before anything is written."""
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(error, match=message):
            store.enqueue_in(connection, "jobs", 1, priority=priority)
        with pytest.raises(error, match=message):
            store.enqueue_many_in(connection, "jobs", [1, 2], priority=priority)
        connection.commit()
    with pytest.raises(error, match=message):
        tickler.Periodic("tick", 1, every=60, priority=priority)
    async with tickler.open_service(double, store=backend.store(), name="jobs") as service:
        with pytest.raises(error, match=message):
            service.enqueue_request(1, priority=priority)
        with pytest.raises(error, match=message):
            service.enqueue_many([1, 2], priority=priority)
        with pytest.raises(error, match=message):
            await service.submit(1, priority=priority)
    memory = tickler.Service(double, name="jobs")
    with pytest.raises(error, match=message):
        memory.enqueue_request(1, priority=priority)
    with pytest.raises(error, match=message):
        memory.enqueue_many([1, 2], priority=priority)
    assert backend.rows() == []


@pytest.mark.parametrize(
    ("queue", "error", "message"),
    [
        (7, TypeError, r"^queue must be a str, not int$"),
        (
            "a\x00b",
            ValueError,
            r"^queue must not contain NUL characters: it names the store's queue$",
        ),
    ],
)
async def test_a_bad_queue_name_is_refused_alike_on_every_path(
    backend: Backend, store: Any, queue: Any, error: type[Exception], message: str
) -> None:
    """The stores' enqueue_in and enqueue_many_in, and the admin, refuse a queue name with
    one message."""
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(error, match=message):
            store.enqueue_in(connection, queue, 1)
        with pytest.raises(error, match=message):
            store.enqueue_many_in(connection, queue, [1, 2])
        connection.commit()
    async with store.admin() as admin:
        with pytest.raises(error, match=message):
            await admin.counts(queue)
        with pytest.raises(error, match=message):
            await admin.pause(queue)
    assert backend.rows() == []
