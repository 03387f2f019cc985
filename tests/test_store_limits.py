"""The store side of per-group limits: Batch.limits, BatchResult.limited, groups written by a
batch and by enqueue_in / enqueue_many_in, the stored limits, and the schema that holds them.

Each test runs once per store in BACKENDS (the conformance suite's), against a
real database: a SQLite file, a fresh PostgreSQL schema. Most drive a session at
the seam (``store.connect()``'s ``run``), one Batch at a time, as the loop does;
two sessions on one store are two processes, racing in threads.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tickler
from tickler._stores import _sql
from tickler._stores._seam import Batch, BatchResult, Session
from tickler._values import GroupLimit, Insert, Outcome, OutcomeKind

from .store_backends import FAST, Backend, owner_id
from .test_store_contract import BACKENDS

Limit = GroupLimit


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


def run(session: Session, batch: Batch, *, owner: str = "me", lease: float = 30.0) -> Any:
    return session.run("jobs", owner_id(owner), lease, 86400.0, batch)


def entry(
    request: bytes, group: str | None = None, *, priority: int = 0, at: float | None = None
) -> Insert:
    """A Batch.inserts entry as the engine sends it, with a ticket of its own at the end."""
    run_at = time.time() if at is None else at
    state = "scheduled" if run_at > time.time() else "queued"
    return Insert(None, state, request, run_at, priority, None, group, object())


def claimed(result: BatchResult) -> list[bytes]:
    return [bytes(row.request) for row in result.claimed]


def finish(session: Session, result: BatchResult, *, owner: str = "me") -> None:
    outcomes = [Outcome(OutcomeKind.SUCCEEDED, row.id, time.time()) for row in result.claimed]
    if outcomes:
        done = run(session, Batch(outcomes=outcomes), owner=owner)
        assert done.applied == ["succeeded"] * len(outcomes)


def query(backend: Backend, sql: str) -> list[tuple[Any, ...]]:
    """Rows of ``sql``, whose {tables} are the backend's."""
    tables = {
        name: backend.table(name)
        for name in ("tickler_requests", "tickler_queues", "tickler_starts")
    }
    with backend.connect() as connection:
        return [tuple(row) for row in connection.execute(sql.format(**tables))]


def running_by_group(backend: Backend) -> dict[str | None, int]:
    rows = query(
        backend,
        "SELECT group_name, count(*) FROM {tickler_requests}"  # noqa: S608 (the tests' own)
        f" WHERE state = 'running' AND lease_until > {backend.now} GROUP BY group_name",
    )
    return {row[0]: int(row[1]) for row in rows}


ONE_EACH: dict[str, Limit] = {"*": Limit(1, None, 1.0)}


# -- Groups are written


def test_a_batch_and_enqueue_in_write_each_requests_group(
    backend: Backend, store: Any, session: Session
) -> None:
    run(session, Batch(inserts=[entry(b"1", "a"), entry(b"2"), Insert(None, "queued", b"3", 0.0)]))
    with backend.connect(autocommit=False) as connection:
        store.enqueue_in(connection, "jobs", 4, group="b")
        store.enqueue_many_in(connection, "jobs", [5, 6], group="é" * 100)
        store.enqueue_many_in(connection, "jobs", [7], key=str, group="c")
        store.enqueue_in(connection, "jobs", 8)
        connection.commit()
    assert [row[0] for row in backend.select("group_name")] == [
        "a",
        None,
        None,
        "b",
        "é" * 100,
        "é" * 100,
        "c",
        None,
    ]


@pytest.mark.parametrize(
    ("group", "error"),
    [
        (1, TypeError),
        (b"a", TypeError),
        ("", ValueError),
        ("a\0b", ValueError),
        ("\ud800", ValueError),
        ("x" * 201, ValueError),
        ("é" * 101, ValueError),  # 202 bytes
    ],
)
def test_a_bad_group_is_refused_naming_group(
    backend: Backend, store: Any, group: object, error: type[Exception]
) -> None:
    with backend.connect(autocommit=False) as connection:
        with pytest.raises(error, match="group"):
            store.enqueue_in(connection, "jobs", 1, group=group)
        with pytest.raises(error, match="group"):
            store.enqueue_many_in(connection, "jobs", [1, 2], group=group)
        connection.commit()
    assert backend.rows() == []


# -- Concurrency


def test_concurrency_bounds_each_groups_running_rows(backend: Backend, session: Session) -> None:
    inserts = [entry(f"{g}{i}".encode(), g) for i in range(4) for g in "ab"]
    inserts += [entry(b"free 1"), entry(b"free 2")]
    run(session, Batch(inserts=inserts))
    first = run(session, Batch(claim=10, limits={"*": Limit(2, None, 1.0)}))
    assert claimed(first) == [b"a0", b"b0", b"a1", b"b1", b"free 1", b"free 2"]
    assert first.limited == 4
    assert running_by_group(backend) == {"a": 2, "b": 2, None: 2}
    # Full: nothing more until a slot frees.
    again = run(session, Batch(claim=10, limits={"*": Limit(2, None, 1.0)}))
    assert (again.claimed, again.limited) == ([], 4)
    done = [row for row in first.claimed if bytes(row[1]) == b"a0"]
    outcomes = [Outcome(OutcomeKind.SUCCEEDED, done[0].id, time.time())]
    after = run(session, Batch(outcomes=outcomes, claim=10, limits={"*": Limit(2, None, 1.0)}))
    assert claimed(after) == [b"a2"]
    assert after.limited == 3


def test_without_limits_the_claim_takes_every_group(session: Session) -> None:
    run(session, Batch(inserts=[entry(f"a{i}".encode(), "a") for i in range(3)]))
    result = run(session, Batch(claim=10))
    assert claimed(result) == [b"a0", b"a1", b"a2"]
    assert result.limited == 0


def test_two_processes_racing_never_run_two_rows_of_a_group(
    backend: Backend, store: Any, session: Session
) -> None:
    groups = [f"g{n}" for n in range(4)]
    run(session, Batch(inserts=[entry(f"{g}/{i}".encode(), g) for i in range(8) for g in groups]))
    run(session, Batch(inserts=[entry(f"free/{i}".encode()) for i in range(10)]))
    held: set[str] = set()
    guard = threading.Lock()
    violations: list[str] = []
    seen: list[bytes] = []
    owners = ("p1", "p2", "p3", "p4")
    barrier = threading.Barrier(len(owners))

    def worker(owner: str) -> None:
        mine = store.connect()
        try:
            barrier.wait()
            for _ in range(200):
                result = run(mine, Batch(claim=3, limits=ONE_EACH), owner=owner)
                names = claimed(result)
                with guard:
                    seen.extend(names)
                    for name in names:
                        group = name.decode().split("/")[0]
                        if group == "free":
                            continue
                        if group in held:
                            violations.append(f"{owner} claimed {name!r} while {group} ran")
                        held.add(group)
                for running, count in running_by_group(backend).items():
                    if running is not None and count > 1:
                        violations.append(f"{running} had {count} running rows")
                time.sleep(0.001)
                with guard:
                    for name in names:
                        held.discard(name.decode().split("/")[0])
                finish(mine, result, owner=owner)
                if len(seen) >= 42:
                    break
        finally:
            mine.close()

    threads = [threading.Thread(target=worker, args=(owner,)) for owner in owners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert violations == []
    assert sorted(seen) == sorted(
        [f"{g}/{i}".encode() for i in range(8) for g in groups]
        + [f"free/{i}".encode() for i in range(10)]
    )


def test_postgres_limited_claims_of_a_queue_take_turns(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Each replica's limited claim takes the queue's advisory lock first; a claim without
    limits takes none."""
    import psycopg

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema, **FAST)
    store.create_schema()
    session = store.connect()
    done = threading.Event()
    got: list[BatchResult] = []

    def claim() -> None:
        got.append(run(session, Batch(claim=5, limits=ONE_EACH)))
        done.set()

    try:
        run(session, Batch(inserts=[entry(b"1", "g"), entry(b"2", "g")]))
        with psycopg.connect(postgres_dsn) as holder:
            key = f"tickler:{postgres_schema}:limits:jobs"
            holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
            assert claimed(run(session, Batch(claim=0, limits=ONE_EACH))) == []  # no claim
            thread = threading.Thread(target=claim)
            thread.start()
            assert not done.wait(0.5)  # waits for the lock
            holder.commit()
            thread.join(30)
        assert [claimed(result) for result in got] == [[b"1"]]
    finally:
        session.close()


def test_a_lapsed_lease_frees_its_groups_slot(backend: Backend, store: Any) -> None:
    a, b = store.connect(), store.connect()
    try:
        run(a, Batch(inserts=[entry(b"1", "g"), entry(b"2", "g"), entry(b"3", "g")]))
        assert claimed(run(a, Batch(claim=5, limits=ONE_EACH))) == [b"1"]
        blocked = run(b, Batch(claim=5, limits=ONE_EACH), owner="other")
        assert (blocked.claimed, blocked.limited) == ([], 2)
        # The first process died: its lease runs out.
        backend.execute(
            f"UPDATE {backend.table('tickler_requests')} SET lease_until = {backend.now} - 1"  # noqa: S608
            " WHERE state = 'running'"
        )
        rescued = run(b, Batch(claim=5, limits=ONE_EACH), owner="other")
        assert claimed(rescued) == [b"1"]  # its attempt again, first in claim order
        assert rescued.claimed[0][2] == 2
        assert rescued.limited == 2
        assert running_by_group(backend) == {"g": 1}
        # A lapsed lease asked to cancel is not claimed, and holds no slot.
        backend.execute(
            f"UPDATE {backend.table('tickler_requests')}"  # noqa: S608
            f" SET lease_until = {backend.now} - 1, cancel_requested = TRUE"
            " WHERE state = 'running'"
        )
        assert claimed(run(b, Batch(claim=5, limits=ONE_EACH), owner="other")) == [b"2"]
    finally:
        a.close()
        b.close()


# -- Rate


def test_a_rate_bounds_the_starts_of_a_group_in_any_window(backend: Backend, store: Any) -> None:
    rate, per = 3, 0.5
    limits: dict[str, Limit] = {"r": Limit(None, rate, per)}
    setup = store.connect()
    try:
        run(setup, Batch(inserts=[entry(f"r{i}".encode(), "r") for i in range(60)]))
        run(setup, Batch(inserts=[entry(f"free{i}".encode()) for i in range(5)]))
    finally:
        setup.close()
    starts: list[float] = []
    guard = threading.Lock()
    barrier = threading.Barrier(2)
    ends = time.time() + 1.7

    def worker(owner: str) -> None:
        mine = store.connect()
        try:
            barrier.wait()
            while time.time() < ends:
                result = run(mine, Batch(claim=10, limits=limits), owner=owner)
                took = [n for n in claimed(result) if n.startswith(b"r")]
                with guard:
                    starts.extend([time.time()] * len(took))
                finish(mine, result, owner=owner)
                time.sleep(0.01)
        finally:
            mine.close()

    threads = [threading.Thread(target=worker, args=(owner,)) for owner in ("p1", "p2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    starts.sort()
    # In any window of per seconds (less what a batch takes to return), at most rate starts.
    for i, at in enumerate(starts):
        inside = [t for t in starts[i:] if t < at + per - 0.1]
        assert len(inside) <= rate, (i, starts)
    # 1.7 s hold four windows at most, and the limit let the group go on.
    assert rate * 3 <= len(starts) <= rate * 4
    recorded = query(backend, "SELECT group_name, started_at FROM {tickler_starts}")
    assert {row[0] for row in recorded} <= {"r"}
    assert len(recorded) <= rate * 2  # older starts are pruned as the window passes


def test_a_retry_counts_as_a_start(session: Session) -> None:
    limits: dict[str, Limit] = {"r": Limit(None, 2, 60.0)}
    run(session, Batch(inserts=[entry(b"1", "r"), entry(b"2", "r"), entry(b"3", "r")]))
    first = run(session, Batch(claim=1, limits=limits))
    assert claimed(first) == [b"1"]
    retry = Outcome(
        OutcomeKind.RETRYING, first.claimed[0].id, time.time() - 1, None, "E", "again", "tb"
    )
    second = run(session, Batch(outcomes=[retry], claim=5, limits=limits))
    assert claimed(second) == [b"1"]
    assert second.limited == 2
    finish(session, second)
    assert run(session, Batch(claim=5, limits=limits)).claimed == []


# -- No head-of-line blocking


@pytest.mark.parametrize("blocked_priority", [0, 5])
def test_a_blocked_groups_backlog_holds_back_no_other_row(
    backend: Backend,
    store: Any,
    session: Session,
    blocked_priority: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every claim counts the rows held back in full (see the tests of LIMITED_EVERY).
    monkeypatch.setattr(_sql, "LIMITED_EVERY", 0.0)
    monkeypatch.setattr(_sql, "LIMITED_SPACING", 0.0)
    with backend.connect(autocommit=False) as connection:
        store.enqueue_many_in(
            connection, "jobs", range(5000), group="busy", priority=blocked_priority
        )
        connection.commit()
    later = time.time() + 1
    run(
        session,
        Batch(
            inserts=[entry(f"o{i}".encode(), f"other{i % 3}", at=later) for i in range(9)]
            + [entry(f"u{i}".encode(), at=later) for i in range(4)]
        ),
    )
    limits: dict[str, Limit] = {"busy": Limit(1, None, 1.0), "*": Limit(2, None, 1.0)}
    first = run(session, Batch(claim=20, limits=limits))
    assert claimed(first) == [b"0"]
    assert first.limited == 4999
    time.sleep(max(0.0, later - time.time()) + 0.05)
    started = time.perf_counter()
    result = run(session, Batch(claim=20, limits=limits))
    took = time.perf_counter() - started
    assert sorted(claimed(result)) == sorted(
        [b"o0", b"o1", b"o2", b"o3", b"o4", b"o5", b"u0", b"u1", b"u2", b"u3"]
    )
    assert result.limited == 4999 + 3
    assert took < 2.0
    # The busy group's first row ends: its next row goes, and no other of its.
    finish(session, first)
    assert claimed(run(session, Batch(claim=20, limits=limits))) == [b"1"]


def test_the_default_limit_and_its_overrides(session: Session) -> None:
    inserts = [entry(f"{g}{i}".encode(), g) for i in range(5) for g in ("a", "b", "vip")]
    run(session, Batch(inserts=[*inserts, entry(b"free")]))
    limits: dict[str, Limit] = {"*": Limit(1, None, 1.0), "vip": Limit(3, None, 1.0)}
    result = run(session, Batch(claim=100, limits=limits))
    assert sorted(claimed(result)) == sorted([b"a0", b"b0", b"vip0", b"vip1", b"vip2", b"free"])
    assert result.limited == 4 + 4 + 2


def test_only_the_named_groups_are_limited_without_a_default(session: Session) -> None:
    inserts = [entry(f"{g}{i}".encode(), g) for i in range(3) for g in ("a", "b")]
    run(session, Batch(inserts=inserts))
    result = run(session, Batch(claim=100, limits={"a": Limit(1, None, 1.0)}))
    assert sorted(claimed(result)) == [b"a0", b"b0", b"b1", b"b2"]
    assert result.limited == 2


def test_limited_counts_only_due_ready_rows_of_groups_at_their_limit(session: Session) -> None:
    now = time.time()
    run(
        session,
        Batch(
            inserts=[
                entry(b"a0", "a"),
                entry(b"a1", "a"),
                entry(b"a later", "a", at=now + 3600),
                entry(b"b0", "b"),
                entry(b"free"),
            ]
        ),
    )
    result = run(session, Batch(claim=1, limits=ONE_EACH))
    assert claimed(result) == [b"a0"]
    # b0 and free wait for the claim's size, not for a limit.
    assert result.limited == 1
    paused = run(session, Batch(claim=5, pause=True, limits=ONE_EACH))
    assert (paused.claimed, paused.limited) == ([], 0)
    assert run(session, Batch(claim=0, limits=ONE_EACH)).limited == 0


def test_statistics_count_limited_rows_with_the_stored_limits(
    backend: Backend, store: Any, session: Session
) -> None:
    run(session, Batch(inserts=[entry(b"a0", "a"), entry(b"a1", "a"), entry(b"a2", "a")]))
    assert session.statistics("jobs")["limited"] == 0
    run(session, Batch(claim=1, limits={"a": Limit(1, None, 2.5)}))
    stored = query(backend, "SELECT queue, limits FROM {tickler_queues}")
    assert [(q, json.loads(text)) for q, text in stored] == [("jobs", {"a": [1, None, 2.5]})]
    other = store.connect()
    try:
        counts = other.statistics("jobs")
        assert (counts["limited"], counts["queued"], counts["claimed"]) == (2, 2, 1)
    finally:
        other.close()
    # Limits given again unchanged, then changed: the store keeps the last.
    run(session, Batch(claim=1, limits={"a": Limit(1, None, 2.5)}))
    run(session, Batch(claim=1, limits={"a": Limit(3, None, 1.0)}))
    assert json.loads(query(backend, "SELECT limits FROM {tickler_queues}")[0][0]) == {
        "a": [3, None, 1.0]
    }
    assert session.statistics("jobs")["limited"] == 0


def test_every_claim_takes_exactly_what_the_limits_allow_whichever_way_it_looks(
    backend: Backend, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims of one session, against a model of the rules computed from the rows: the claim
    looks in claim order, or group by group (after a look in claim order fell short, and
    then at once), and takes the same rows every way, and counts the rows held back."""
    monkeypatch.setattr(_sql, "LIMITED_EVERY", 0.0)  # every claim counts in full
    monkeypatch.setattr(_sql, "LIMITED_SPACING", 0.0)
    rng = random.Random(23)
    groups = [f"g{n}" for n in range(8)]
    limits: dict[str, Limit] = {
        "*": Limit(2, None, 1.0),
        "g1": Limit(1, 3, 60.0),
        "g2": Limit(None, 2, 60.0),
    }
    inserts = [
        entry(f"{n}".encode(), rng.choice([*groups, None]), priority=rng.choice([0, 0, 1]))
        for n in range(400)
    ]
    run(session, Batch(inserts=inserts))

    def expected(size: int) -> tuple[list[int], int]:
        running: dict[str, int] = {}
        for (group,) in query(
            backend, "SELECT group_name FROM {tickler_requests} WHERE state = 'running'"
        ):
            if group is not None:
                running[group] = running.get(group, 0) + 1
        starts: dict[str, int] = {}
        for (group,) in query(backend, "SELECT group_name FROM {tickler_starts}"):
            starts[group] = starts.get(group, 0) + 1
        ready = query(
            backend,
            "SELECT id, group_name FROM {tickler_requests} WHERE state = 'queued'"
            " ORDER BY priority DESC, run_at, id",
        )

        def room(group: str) -> int:
            concurrency, rate, _ = limits.get(group, limits["*"])
            rooms = [] if concurrency is None else [concurrency - running.get(group, 0)]
            rooms += [] if rate is None else [rate - starts.get(group, 0)]
            return min(rooms)

        picked: list[int] = []
        for request_id, group in ready:
            if len(picked) == size:
                break
            if group is not None:
                if room(group) <= 0:
                    continue
                running[group] = running.get(group, 0) + 1
                if limits.get(group, limits["*"])[1] is not None:
                    starts[group] = starts.get(group, 0) + 1
            picked.append(request_id)
        held = sum(
            1
            for request_id, group in ready
            if group is not None and request_id not in picked and room(group) <= 0
        )
        return picked, held

    memo = session.limited_memo.setdefault("jobs", _sql.LimitedMemo())  # type: ignore[attr-defined]
    known: list[int | None] = []  # how many groups the session knew of, before each claim
    looks = 0
    while looks < 60:
        known.append(memo.groups)
        size = rng.choice([1, 3, 5, 12])
        want, held = expected(size)
        result = run(session, Batch(claim=size, limits=limits))
        assert [row.id for row in result.claimed] == want, looks
        assert result.limited == held, looks
        running = query(backend, "SELECT id FROM {tickler_requests} WHERE state = 'running'")
        done = [row[0] for row in running if rng.random() < 0.6]
        outcomes = [Outcome(OutcomeKind.SUCCEEDED, request_id, time.time()) for request_id in done]
        if outcomes:
            run(session, Batch(outcomes=outcomes))
        looks += 1
    # Both ways were taken: in claim order first, until that fell short and the claim
    # looked group by group; then group by group at once, for the many looks after.
    assert known[0] is None
    assert sum(1 for count in known if count is not None) >= 30


LIMITS_TO_COMPARE: list[dict[str, Limit]] = [
    {"*": Limit(1, None, 1.0)},
    {"*": Limit(2, None, 1.0), "g1": Limit(1, 3, 60.0), "g2": Limit(None, 2, 60.0)},
    {
        "g0": Limit(1, None, 1.0),
        "g3": Limit(3, 2, 60.0),
        "g4": Limit(None, None, 1.0),
    },  # no default
    {"*": Limit(None, 2, 60.0), "g5": Limit(4, None, 1.0)},
]


@pytest.mark.parametrize("seed", range(8))
def test_postgres_claims_group_by_group_in_one_statement_as_the_walk_does(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """PostgreSQL's claim group by group in one statement (claim_by_groups) takes the rows
    that the walk over the rows read first takes (claim_limited without it), in the same
    states, and counts as many rows held back: whatever the limits, priorities, due
    times, ungrouped rows, lapsed leases (asked to cancel or not), running rows, recorded
    starts and claim sizes; and nothing while the queue is paused. It answers what the
    batch's due_and_live() answers after the walk's claim (but the next due time where
    rows are held back, which the loop does not read then)."""
    import psycopg

    monkeypatch.setattr(_sql, "LIMITED_EVERY", 0.0)  # every claim counts in full
    monkeypatch.setattr(_sql, "LIMITED_SPACING", 0.0)
    rng = random.Random(seed)
    limits = LIMITS_TO_COMPARE[seed % len(LIMITS_TO_COMPARE)]
    groups = [f"g{n}" for n in range(12)]
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema, **FAST)
    store.create_schema()
    session, other = store.connect(), store.connect()
    table = f'"{postgres_schema}".tickler_requests'

    def claim(size: int, *, at_once: bool) -> tuple[list[tuple[Any, ...]], int, Any]:
        """The claim, rolled back instead of committed: each way claims from the same rows
        (group by group: its session knew of few groups at its last claim)."""

        def roll_back() -> None:
            session.db.execute("ROLLBACK")
            assert session._pipeline is not None  # (run() is under way)
            session._pipeline.sync()

        with pytest.MonkeyPatch.context() as patch:
            if not at_once:
                patch.setattr(session, "claim_by_groups", None)
            patch.setattr(session, "commit", roll_back)
            session.limited_memo["jobs"] = _sql.LimitedMemo(groups=1)
            result = run(session, Batch(claim=size, limits=limits))
        rows = [(row[0], row[2], row[6], row[7]) for row in result.claimed]
        # What the loop reads of the rest: the next due time only where no row is held back.
        due = (None if result.limited else result.next_due, result.live, result.paused)
        if at_once:
            assert result.next_due is None or not result.limited
        return rows, result.limited, due

    try:
        later = time.time() + 3600
        inserts = [
            entry(
                f"{n}".encode(),
                rng.choice([*groups, None]),
                priority=rng.choice([0, 0, 1, 2]),
                at=later if rng.random() < 0.15 else None,
            )
            for n in range(300)
        ]
        # Groups whose first row in claim order is not due, with due rows behind it.
        inserts += [entry(b"later", group, priority=5, at=later) for group in groups[::3]]
        # First a few rows, one a group, none held back: the next due time is compared too.
        few = [entry(b"first", group) for group in groups[:4]] + [entry(b"first")]
        run(session, Batch(inserts=[*few, entry(b"soon", "g5", at=later - 60)]))
        walked = claim(300, at_once=False)
        assert walked[1] == 0
        assert walked[2][0] == pytest.approx(later - 60, abs=30)  # (the store's clock)
        assert claim(300, at_once=True) == walked
        run(session, Batch(inserts=inserts))
        compared, held, rescued = 0, 0, 0
        for _ in range(3):
            for size in (1, 3, 7, 25, 300):
                walked = claim(size, at_once=False)
                assert claim(size, at_once=True) == walked, size
                compared, held = compared + len(walked[0]), held + walked[1]
                rescued += sum(1 for row in walked[0] if row[1] > 1)  # (its second attempt)
            # Another process runs some rows, and started them; some of its leases lapse,
            # some of those asked to cancel.
            run(other, Batch(claim=rng.choice([5, 20]), limits=limits), owner="other")
            with psycopg.connect(postgres_dsn, autocommit=True) as db:
                running = db.execute(
                    f"SELECT id FROM {table} WHERE state = 'running' ORDER BY id"  # noqa: S608
                ).fetchall()
                lapsed = [row[0] for row in running if rng.random() < 0.4]
                db.execute(
                    f"UPDATE {table} SET lease_until = lease_until - 1e6,"  # noqa: S608
                    " cancel_requested = id = ANY(%s) WHERE id = ANY(%s)",
                    ([i for i in lapsed if rng.random() < 0.3], lapsed),
                )
        assert compared > 0  # (else the test says nothing)
        assert held > 0
        assert rescued > 0
        run(session, Batch(pause=True))
        paused = claim(300, at_once=False)
        assert paused[:2] == ([], 0)
        assert paused[2][1:] == (1, True)
        assert claim(300, at_once=True) == paused
    finally:
        session.close()
        other.close()


def test_a_large_limited_count_is_made_again_once_a_while(
    backend: Backend, store: Any, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to LIMITED_EXACT rows held back are counted at every claim; more than that, at
    most once every LIMITED_EVERY seconds: in between, the claim gives the last count."""
    every = 1.5  # (a little longer than the store's, so that a slow machine cannot pass it)
    monkeypatch.setattr(_sql, "LIMITED_EVERY", every)
    monkeypatch.setattr(_sql, "LIMITED_SPACING", 0.0)  # (see the test below)
    limits: dict[str, Limit] = {"*": Limit(1, None, 1.0)}

    def enqueue(count: int) -> None:
        with backend.connect(autocommit=False) as connection:
            store.enqueue_many_in(connection, "jobs", range(count), group="busy")
            connection.commit()

    enqueue(3)
    assert run(session, Batch(claim=5, limits=limits)).limited == 2
    enqueue(2)
    assert run(session, Batch(claim=5, limits=limits)).limited == 4  # exact: few
    enqueue(_sql.LIMITED_EXACT)
    counted = run(session, Batch(claim=5, limits=limits))
    assert counted.limited == _sql.LIMITED_EXACT + 4  # many, and the last count was few
    started = time.monotonic()
    enqueue(7)
    again = run(session, Batch(claim=5, limits=limits))
    assert time.monotonic() - started < every  # (else the test says nothing)
    assert again.limited == _sql.LIMITED_EXACT + 4  # the last count, made less than `every` ago
    # Another session counts for itself; statistics count in full at every call.
    other = store.connect()
    try:
        assert other.statistics("jobs")["limited"] == _sql.LIMITED_EXACT + 11
    finally:
        other.close()
    assert session.statistics("jobs")["limited"] == _sql.LIMITED_EXACT + 11
    time.sleep(every)
    assert run(session, Batch(claim=5, limits=limits)).limited == _sql.LIMITED_EXACT + 11


@pytest.mark.parametrize("spacing", [0.0, 1e9])
def test_a_slow_full_count_is_made_less_often(
    backend: Backend, store: Any, session: Session, monkeypatch: pytest.MonkeyPatch, spacing: float
) -> None:
    """A full count is made again no sooner than LIMITED_SPACING times what the last took."""
    monkeypatch.setattr(_sql, "LIMITED_EVERY", 0.0)
    monkeypatch.setattr(_sql, "LIMITED_SPACING", spacing)
    limits: dict[str, Limit] = {"*": Limit(1, None, 1.0)}
    with backend.connect(autocommit=False) as connection:
        store.enqueue_many_in(connection, "jobs", range(_sql.LIMITED_EXACT + 1), group="busy")
        connection.commit()
    assert run(session, Batch(claim=5, limits=limits)).limited == _sql.LIMITED_EXACT
    with backend.connect(autocommit=False) as connection:
        store.enqueue_many_in(connection, "jobs", range(3), group="busy")
        connection.commit()
    # Every claim counts again without spacing; with a spacing of ages, none does.
    again = run(session, Batch(claim=5, limits=limits)).limited
    assert again == (_sql.LIMITED_EXACT + 3 if spacing == 0.0 else _sql.LIMITED_EXACT)


# -- Migrations


def test_a_sqlite_file_of_version_3_is_migrated(tmp_path: Path) -> None:
    from tickler._stores import sqlite as sqlite_store

    from .test_store_scheduling import _SQLITE_V2

    path = tmp_path / "queue.db"
    with sqlite3.connect(path) as connection:
        connection.executescript(_SQLITE_V2)
        sqlite_store._to_v3(connection)
        connection.execute("UPDATE tickler_schema SET version = 3")
    connection.close()
    check_migrated(tickler.SqliteStore(path, **FAST))
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM tickler_schema").fetchone() == (8,)
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    db.close()
    assert {
        "tickler_groups",
        "tickler_starts",
        "tickler_starts_by_group",
        "tickler_by_state",
    } <= names
    # v4 -> v5 (admin), v6 (traces), v7 (rescues), v8 (the replicas' hosts and pids)
    assert sqlite_store.SCHEMA_VERSION == 8


def test_a_postgres_schema_of_version_2_is_migrated(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores import postgres as postgres_store

    from .test_store_scheduling import _POSTGRES_V1

    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{postgres_schema}"')
        connection.execute(f'SET search_path TO "{postgres_schema}"')
        for statement in (_POSTGRES_V1 + ";" + postgres_store._MIGRATIONS[1]).split(";"):
            if statement.strip():
                connection.execute(statement)
        connection.execute("UPDATE tickler_schema SET version = 2")
    check_migrated(tickler.PostgresStore(postgres_dsn, schema=postgres_schema, **FAST))
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchone()
        indexes = {
            row[0]
            for row in db.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (postgres_schema,)
            )
        }
    assert version == (9,)
    assert {
        "tickler_groups",
        "tickler_starts_by_group",
        "tickler_by_state",
        "tickler_by_group",
    } <= indexes
    # v3 -> v4 (admin), v5 (traces), v6 (rescues), v7 (a group's index without running rows),
    # v8 (the replicas' hosts and pids), v9 (leaner writes of a drain)
    assert postgres_store.SCHEMA_VERSION == 9


def check_migrated(store: Any) -> None:
    """The store, made by the previous version, takes groups and limits; its rows have none."""
    store.create_schema()
    store.create_schema()  # again: nothing to do
    session = store.connect()
    try:
        result = session.run(
            "jobs",
            owner_id("me"),
            30.0,
            86400.0,
            Batch(
                inserts=[entry(b"3", "g"), entry(b"4", "g")],
                claim=10,
                limits={"g": Limit(1, 1, 60.0)},
            ),
        )
        assert claimed(result) == [b"1", b"2", b"3"]
        assert result.limited == 1
        assert session.statistics("jobs")["limited"] == 1
    finally:
        session.close()
