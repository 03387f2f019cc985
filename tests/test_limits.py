"""Limits per group, in memory: concurrency and rate for each group, and no head-of-line blocking.

On Trio's virtual clock; enqueueing both as pytest-trio's tasks do and with
no contextvars (see conftest's enqueue_context).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest
import trio

import tickler


def ledger() -> tuple[list[tuple[str, str, float, float]], Any]:
    """A handler that records (group, request, start, end) of each attempt."""
    runs: list[tuple[str, str, float, float]] = []

    async def handler(request: tuple[str, str]) -> None:
        start = trio.current_time()
        await trio.sleep(1)
        runs.append((request[0], request[1], start, trio.current_time()))

    return runs, handler


async def test_concurrency_one_per_group_and_no_head_of_line_blocking(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    runs, handler = ledger()
    limits = tickler.Limit(concurrency=1)
    async with tickler.open_service(handler, capacity=4, limits=limits) as service:
        for i in range(10):
            service.enqueue_request(("a", f"a{i}"), group="a")
        service.enqueue_request(("b", "b0"), group="b")
        service.enqueue_request(("-", "plain"))
        await trio.sleep(0.5)
        stats = service.statistics()
        assert stats.in_flight == 3  # a0, b0 and plain: a's backlog holds no slot
        assert stats.limited == 9
    by_group = collections.defaultdict(list)
    for group, _, start, end in runs:
        by_group[group].append((start, end))
    for spans in by_group.values():
        spans.sort()
        assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    starts = {request: start for _, request, start, _ in runs}
    assert starts["b0"] == starts["plain"] == starts["a0"] == 0
    assert [r for g, r, _, _ in sorted(runs, key=lambda run: run[2]) if g == "a"] == [
        f"a{i}" for i in range(10)
    ]


async def test_rate_per_window_counts_every_start(autojump_clock: trio.abc.Clock) -> None:
    starts: list[tuple[str, float]] = []
    failed: set[str] = set()

    async def handler(request: str) -> None:
        starts.append((request, trio.current_time()))
        if request.endswith("!") and request not in failed:
            failed.add(request)
            raise ConnectionError("once")

    retry = tickler.Retry(attempts=2, initial=0.1, jitter=False)
    limits = {"mail": tickler.Limit(rate=3, per=1.0)}
    async with tickler.open_service(handler, retry=retry, limits=limits) as service:
        for i in range(10):
            service.enqueue_request(f"m{i}!" if i % 3 == 0 else f"m{i}", group="mail")
        for i in range(5):
            service.enqueue_request(f"other{i}", group="other")  # no limit: "*" is not set
    mail = sorted(at for request, at in starts if request.startswith("m"))
    assert len(mail) == 14  # 10 first attempts and 4 retries, each a start
    for at in mail:
        assert sum(1 for other in mail if at <= other < at + 1.0) <= 3
    assert all(at == 0 for request, at in starts if request.startswith("other"))


async def test_priority_order_within_a_group_and_overrides(autojump_clock: trio.abc.Clock) -> None:
    runs, handler = ledger()
    limits = {"*": tickler.Limit(concurrency=1), "wide": tickler.Limit(concurrency=3)}
    async with tickler.open_service(handler, capacity=10, limits=limits) as service:
        service.pause()
        for i in range(3):
            service.enqueue_request(("g", f"low{i}"), group="g")
        service.enqueue_request(("g", "high"), group="g", priority=5)
        for i in range(3):
            service.enqueue_request(("wide", f"w{i}"), group="wide")
        service.resume()
    order = [r for g, r, _, _ in sorted(runs, key=lambda run: (run[2], run[1])) if g == "g"]
    assert order == ["high", "low0", "low1", "low2"]
    assert {start for g, _, start, _ in runs if g == "wide"} == {0.0}


async def test_held_requests_can_be_cancelled_and_a_stop_cancels_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    _runs, handler = ledger()
    service = tickler.Service(handler, limits=tickler.Limit(concurrency=1))
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        first = service.enqueue_request(("g", "first"), group="g")
        held = [service.enqueue_request(("g", f"h{i}"), group="g") for i in range(3)]
        await trio.sleep(0.1)
        assert service.statistics().limited == 3
        assert await service.cancel(held[0].id)
        assert held[0].status is tickler.Status.CANCELLED
        assert service.statistics().limited == 2
        left = await service.stop(drain=False, timeout=5)
    assert first.status is tickler.Status.SUCCEEDED
    assert left == held[1:]
    stats = service.statistics()
    assert stats.limited == 0
    assert stats.enqueued == stats.succeeded + stats.cancelled


def test_limits_and_groups_are_checked_at_once() -> None:
    async def handler(request: object) -> None:
        pass

    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        tickler.Limit(concurrency=0)
    with pytest.raises(TypeError, match="rate must be an int"):
        tickler.Limit(rate=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per must be a finite number"):
        tickler.Limit(rate=1, per=0)
    with pytest.raises(TypeError, match=r"limits must be a tickler\.Limit"):
        tickler.Service(handler, limits=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"limits\['a'\] must be a tickler.Limit"):
        tickler.Service(handler, limits={"a": 1})  # type: ignore[dict-item]
    service = tickler.Service(handler, limits=tickler.Limit(concurrency=1))
    with pytest.raises(TypeError, match="group must be a str"):
        service.enqueue_request(1, group=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group must be 1 to 200 bytes"):
        service.enqueue_request(1, group="")
    assert service.statistics().enqueued == 0


async def test_without_limits_a_group_changes_nothing(autojump_clock: trio.abc.Clock) -> None:
    runs, handler = ledger()
    async with tickler.open_service(handler, capacity=5) as service:
        for i in range(5):
            service.enqueue_request(("g", f"r{i}"), group="g")
    assert {start for _, _, start, _ in runs} == {0.0}


async def test_limits_hold_across_two_replicas_on_one_sqlite_file(tmp_path: Any) -> None:
    path = tmp_path / "queue.db"
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    plain_waits: list[float] = []

    async def handler(request: list[Any]) -> None:
        group, enqueued = request
        start = trio.current_time()
        if group == "-":
            plain_waits.append(start - enqueued)
            return
        await trio.sleep(0.05)
        spans[group].append((start, trio.current_time()))

    limits = tickler.Limit(concurrency=1)
    options: dict[str, Any] = {"lease": 2.0, "poll_interval": 0.05}
    async with (
        tickler.open_service(
            handler, store=tickler.SqliteStore(path, **options), capacity=8, limits=limits
        ) as a,
        tickler.open_service(
            handler, store=tickler.SqliteStore(path, **options), capacity=8, limits=limits
        ) as b,
    ):
        for i in range(40):
            group = f"g{i % 4}"
            (a if i % 2 else b).enqueue_request([group, 0.0], group=group)
        for _ in range(5):
            a.enqueue_request(["-", trio.current_time()])
        with trio.fail_after(30):
            while (await a.store_statistics())["succeeded"] < 45:
                await trio.sleep(0.05)
    assert sum(len(s) for s in spans.values()) == 40
    for group, group_spans in spans.items():
        group_spans.sort()
        for (_, end), (start, _) in itertools.pairwise(group_spans):
            assert end <= start + 0.001, group  # one at a time per group, over both replicas
    assert max(plain_waits) < 1.0  # never held behind the groups' backlog


async def test_a_processor_that_finds_only_held_requests_parks(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A slot frees while the only ready request's group is at its limit: nothing starts."""
    runs, handler = ledger()

    async def slow_or_quick(request: tuple[str, str]) -> None:
        if request[1] == "g0":
            await trio.sleep(9)  # holds group g
        await handler(request)

    async with tickler.open_service(
        slow_or_quick, capacity=2, limits=tickler.Limit(concurrency=1)
    ) as service:
        service.enqueue_request(("-", "x0"))
        service.enqueue_request(("g", "g0"), group="g")
        await trio.sleep(0.5)
        service.enqueue_request(("g", "g1"), group="g")  # ready, then held by its group
        await trio.sleep(5)
        assert service.statistics().limited == 1
        assert service.statistics().in_flight == 1
    starts = {request: start for _, request, start, _ in runs}
    assert starts["g1"] >= 10  # once g0 ended


async def test_grouped_requests_start_in_enqueue_order_within_their_group(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    """Requests of priority 0 wait in the plain queue and are checked as they leave it: some
    are held and sent on again; each group still starts in enqueue order, within its limit,
    and nothing of another group or of none waits behind them."""
    durations = itertools.cycle([0.3, 1.7, 0.1, 2.9, 0.6, 1.1, 0.2])
    length: dict[tuple[str, int], float] = {}
    running: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()
    started: dict[tuple[str, int], float] = {}

    async def handler(request: tuple[str, int]) -> None:
        group = request[0]
        running[group] += 1
        most[group] = max(most[group], running[group])
        started[request] = trio.current_time()
        await trio.sleep(length[request])
        running[group] -= 1

    limits = {"*": tickler.Limit(concurrency=2), "solo": tickler.Limit(concurrency=1)}
    async with tickler.open_service(handler, capacity=5, limits=limits) as service:
        for i in range(60):
            group = ("a", "solo", "a", "b", "-")[i % 5]
            length[(group, i)] = next(durations)
            service.enqueue_request((group, i), group=None if group == "-" else group)
        held = 0
        while service.statistics().succeeded < 60:
            held = max(held, service.statistics().limited)
            await trio.sleep(0.05)
        assert held > 0  # some were held, and sent on later
    assert most == {"a": 2, "b": 2, "solo": 1, "-": max(most["-"], 1)}
    for group in ("a", "b", "solo", "-"):
        # In enqueue order, each starts no earlier than the one before it (those that start
        # in the same instant do so in an order Trio chooses).
        times = [started[(g, i)] for g, i in sorted(started) if g == group]
        assert times == sorted(times), (group, times)
    assert len(started) == 60
    assert service.statistics().limited == 0


async def test_a_held_request_still_counts_against_max_queue_length(
    autojump_clock: trio.abc.Clock, enqueue_context: str
) -> None:
    """A grouped request taken from the queue and held for its group keeps its place in
    the bound: the queue is as full as before it left."""
    _runs, handler = ledger()
    service = tickler.Service(
        handler, capacity=2, max_queue_length=3, limits=tickler.Limit(concurrency=1)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        service.enqueue_request(("g", "g0"), group="g")
        await trio.sleep(0.1)  # g0 runs
        for i in (1, 2, 3):
            service.enqueue_request(("g", f"g{i}"), group="g")
        await trio.sleep(0.1)  # the free slot's take holds them, one by one
        assert service.statistics().limited == 3
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request(("g", "g4"), group="g")
        with pytest.raises(tickler.QueueFull):
            service.enqueue_request(("-", "x"))
        assert service.statistics().rejected == 2
        await service.stop()
        with pytest.raises(tickler.ServiceClosed):
            service.enqueue_request(("g", "late"), group="g")
    stats = service.statistics()
    assert stats.succeeded == 4
    assert stats.peak_queued >= 3
    assert stats.limited == 0


async def test_group_names_are_checked_on_a_running_service(
    autojump_clock: trio.abc.Clock,
) -> None:
    runs, handler = ledger()
    async with tickler.open_service(handler, limits=tickler.Limit(concurrency=1)) as service:
        for bad, error, match in [
            (5, TypeError, "group must be a str or None, not int"),
            ("", ValueError, "group must be 1 to 200 bytes"),
            ("x" * 201, ValueError, "group must be 1 to 200 bytes"),
            ("é" * 101, ValueError, "group must be 1 to 200 bytes"),  # 202 bytes of UTF-8
            ("a\x00b", ValueError, "group must not hold a NUL"),
            ("a\ud800", ValueError, "group must not hold a NUL or a lone surrogate"),
        ]:
            with pytest.raises(error, match=match):
                service.enqueue_request(("bad", "r"), group=bad)  # type: ignore[arg-type]
        service.enqueue_request(("é" * 100, "ok"), group="é" * 100)  # 200 bytes: fine
        service.enqueue_request(("x" * 200, "ok"), group="x" * 200)
    assert service.statistics().enqueued == 2
    assert sorted(group for group, _, _, _ in runs) == sorted(["é" * 100, "x" * 200])


async def test_grouped_requests_from_a_thread_and_at_debug(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """From another thread the loop is woken; at DEBUG each grouped enqueue is logged."""
    runs, handler = ledger()
    async with tickler.open_service(handler, limits=tickler.Limit(concurrency=1)) as service:
        tickets = await trio.to_thread.run_sync(
            lambda: [service.enqueue_request(("t", f"t{i}"), group="t") for i in range(3)]
        )
        with trio.fail_after(10):
            while not all(t.done for t in tickets):
                await trio.sleep(0.01)
    in_order = [request for group, request, _, _ in sorted(runs, key=lambda r: r[2])]
    assert in_order == ["t0", "t1", "t2"]
    with caplog.at_level("DEBUG", logger="tickler"):
        async with tickler.open_service(handler, limits=tickler.Limit(concurrency=1)) as service:
            logged = service.enqueue_request(("d", "d0"), group="d")
    assert logged.status is tickler.Status.SUCCEEDED
    assert f"request #{logged.id} added" in caplog.text
