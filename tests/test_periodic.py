"""tickler.Periodic's rules: what is refused at construction, and cron's ticks on the nights
the clocks change (computed alone, then run by a service in memory and on each store).

The wall clock of a run is moved onto a chosen night by shifting time.time()
(each run reads it once, at its start); in memory Trio's virtual clock runs
the night, on a store the real one runs a few seconds around each tick.
"""

from __future__ import annotations

import datetime
import math
import re
import subprocess
import sys
import time
import zoneinfo
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
from tickler._periodic import Periodic

from .store_runs import make_store

ROOT = Path(__file__).parent.parent
PARIS = zoneinfo.ZoneInfo("Europe/Paris")


def at(text: str) -> float:
    """The instant of an ISO 8601 time with its offset."""
    return datetime.datetime.fromisoformat(text).timestamp()


def ticks(periodic: Periodic, start: str, hours: float) -> list[str]:
    """Each tick in ``hours`` from ``start``, as wall-clock time and offset in Paris."""
    found, now = [], at(start)
    end = now + hours * 3600
    while (now := periodic.next_tick(now)) < end:
        found.append(datetime.datetime.fromtimestamp(now, PARIS).isoformat(timespec="minutes"))
    return found


# -- refused at construction


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("61 * * * *", r"^cron field 'minute' out of range 0-59: '61'$"),
        ("0,75 * * * *", r"^cron field 'minute' out of range 0-59: '0,75'$"),
        ("* 25 * * *", r"^cron field 'hour' out of range 0-23: '25'$"),
        ("0 0 0 * *", r"^cron field 'day of month' out of range 1-31: '0'$"),
        ("0 0 * 13 *", r"^cron field 'month' out of range 1-12: '13'$"),
        ("0 0 * * 8", r"^cron field 'day of week' out of range 0-7: '8'$"),
        ("*/0 * * * *", r"^cron field 'minute' has a step of 0, not 1 or more: '\*/0'$"),
        ("0 1-5/0 * * *", r"^cron field 'hour' has a step of 0, not 1 or more: '1-5/0'$"),
        ("abc * * * *", r"^cron field 'minute' is not valid: 'abc'$"),
        ("* * * * * *", r"^cron '\* \* \* \* \* \*' is not a five-field expression"),
    ],
)
def test_a_bad_cron_field_is_named(cron: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Periodic("a", 1, cron=cron)


@pytest.mark.parametrize("cron", ["0 3 31 2 *", "0 0 30 2 *", "0 0 31 4,6,9,11 *"])
def test_a_cron_that_never_fires_is_refused_at_construction(cron: str) -> None:
    with pytest.raises(
        ValueError, match="^" + re.escape(f"cron {cron!r} never fires: no date has day of month")
    ):
        Periodic("a", 1, cron=cron)


def test_a_cron_that_fires_rarely_is_accepted() -> None:
    leap = Periodic("leap", 1, cron="0 0 29 2 *")
    assert leap.next_tick(at("2026-01-01T00:00+00:00")) == at("2028-02-29T00:00+00:00")
    # 2100 is no leap year: eight years from one to the next.
    assert leap.next_tick(at("2097-01-01T00:00+00:00")) == at("2104-02-29T00:00+00:00")
    assert leap.last_tick(at("2026-01-01T00:00+00:00")) == at("2024-02-29T00:00+00:00")
    # A weekday makes any day of month fire (cron's "or" of the two).
    Periodic("or", 1, cron="0 0 31 2 mon")


async def test_a_service_with_every_rare_cron_runs(autojump_clock: trio.abc.Clock) -> None:
    # A line that fires rarely is no reason for its service not to start.
    leap = Periodic("leap", 1, cron="0 0 29 2 *")

    async def double(request: int) -> int:
        return 2 * request

    async with tickler.open_service(double, periodic=[leap]) as service:
        assert await (await service.submit(5)).wait() == 10


@pytest.mark.parametrize("every", [1e-300, 0, -1, 0.0009, 315360001, 1e308, 10**400, math.inf])
def test_every_out_of_its_bounds_is_refused(every: float) -> None:
    with pytest.raises(
        ValueError, match=r"^every must be from 0\.001 to 315360000 seconds \(ten years\)$"
    ):
        Periodic("a", 1, every=every)


def test_every_nan_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^every must be from 0\.001 to 315360000 seconds"):
        Periodic("a", 1, every=math.nan)


@pytest.mark.parametrize("every", [0.001, 315360000])
def test_every_at_its_bounds_has_ticks(every: float) -> None:
    periodic = Periodic("a", 1, every=every)
    now = time.time()
    assert periodic.last_tick(now) <= now < periodic.next_tick(now)


def test_a_periodic_whose_construction_failed_has_a_repr() -> None:
    # A debugger, or a traceback that shows locals, reads `self` in __init__.
    with pytest.raises(ValueError, match="never fires") as caught:
        Periodic("a", 1, cron="0 3 31 2 *")
    tb = caught.value.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    (half,) = [f.f_locals["self"] for f in frames if f.f_code is Periodic.__init__.__code__]
    assert repr(half) == (
        "Periodic(name=<unset>, request=<unset>, every=<unset>, cron=<unset>,"
        " timezone=<unset>, priority=<unset>)"
    )
    assert repr(Periodic("a", [1], every=5)) == (
        "Periodic(name='a', request=[1], every=5.0, cron=None, timezone='UTC', priority=0)"
    )


def test_cron_without_croniter_names_the_extra() -> None:
    # A fresh interpreter in which croniter cannot be imported.
    code = (
        "import sys; sys.modules['croniter'] = None\n"
        "import tickler\n"
        "tickler.Periodic('a', 1, every=5)  # every needs no croniter\n"
        "try:\n"
        "    tickler.Periodic('a', 1, cron='0 3 * * *')\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(  # noqa: S603 (our own interpreter and code)
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "ImportError Periodic(cron=...) needs croniter: pip install 'trio-tickler[cron]'\n"
    )


# -- the nights the clocks change, computed


def test_a_fixed_time_fires_once_in_the_repeated_hour() -> None:
    # 2026-10-25 in Paris: 03:00+02:00 is followed by 02:00+01:00.
    daily = Periodic("daily", 1, cron="30 2 * * *", timezone="Europe/Paris")
    assert ticks(daily, "2026-10-24T12:00+02:00", 48) == [
        "2026-10-25T02:30+02:00",  # the first pass only
        "2026-10-26T02:30+01:00",
    ]
    # From inside the second pass, and at the tick of the first: next day.
    assert daily.next_tick(at("2026-10-25T02:10+01:00")) == at("2026-10-26T02:30+01:00")
    assert daily.next_tick(at("2026-10-25T02:30+02:00")) == at("2026-10-26T02:30+01:00")
    assert daily.last_tick(at("2026-10-25T02:45+01:00")) == at("2026-10-25T02:30+02:00")
    two = Periodic("two", 1, cron="0,45 1-2 * * *", timezone="Europe/Paris")
    assert ticks(two, "2026-10-25T00:00+02:00", 5) == [
        "2026-10-25T01:00+02:00",
        "2026-10-25T01:45+02:00",
        "2026-10-25T02:00+02:00",
        "2026-10-25T02:45+02:00",
    ]


def test_a_wildcard_hour_or_minute_fires_in_both_passes_of_the_repeated_hour() -> None:
    hourly = Periodic("hourly", 1, cron="30 * * * *", timezone="Europe/Paris")
    assert ticks(hourly, "2026-10-25T01:00+02:00", 4) == [
        "2026-10-25T01:30+02:00",
        "2026-10-25T02:30+02:00",
        "2026-10-25T02:30+01:00",
        "2026-10-25T03:30+01:00",
    ]
    quarter = Periodic("quarter", 1, cron="*/15 * * * *", timezone="Europe/Paris")
    found = ticks(quarter, "2026-10-25T01:50+02:00", 2)
    assert found == [
        *(f"2026-10-25T02:{m}+02:00" for m in ("00", "15", "30", "45")),
        *(f"2026-10-25T02:{m}+01:00" for m in ("00", "15", "30", "45")),
    ]
    # From inside the first pass, the second pass comes next.
    assert hourly.next_tick(at("2026-10-25T02:40+02:00")) == at("2026-10-25T02:30+01:00")
    assert hourly.last_tick(at("2026-10-25T02:40+01:00")) == at("2026-10-25T02:30+01:00")


def test_a_fixed_time_in_the_skipped_hour_fires_once_at_the_jump() -> None:
    # 2026-03-29 in Paris: 02:00+01:00 is 03:00+02:00.
    daily = Periodic("daily", 1, cron="30 2 * * *", timezone="Europe/Paris")
    assert ticks(daily, "2026-03-28T12:00+01:00", 48) == [
        "2026-03-29T03:00+02:00",
        "2026-03-30T02:30+02:00",
    ]
    assert daily.last_tick(at("2026-03-29T03:10+02:00")) == at("2026-03-29T03:00+02:00")
    # Several skipped times, and one just after the jump: one run at 03:00.
    many = Periodic("many", 1, cron="0,30 2-3 * * *", timezone="Europe/Paris")
    assert ticks(many, "2026-03-29T01:00+01:00", 3) == [
        "2026-03-29T03:00+02:00",
        "2026-03-29T03:30+02:00",
    ]


def test_a_wildcard_hour_or_minute_skips_the_skipped_hour() -> None:
    hourly = Periodic("hourly", 1, cron="30 * * * *", timezone="Europe/Paris")
    assert ticks(hourly, "2026-03-29T00:00+01:00", 3) == [
        "2026-03-29T00:30+01:00",
        "2026-03-29T01:30+01:00",
        "2026-03-29T03:30+02:00",  # three hours later: the night is an hour shorter
    ]


def oracle(cron: str, zone: zoneinfo.ZoneInfo, start: float, end: float) -> list[float]:
    """Cron's ticks in (start, end], found minute by minute (every zone here
    changes its offset on a whole minute): a wildcard line at each minute
    whose wall-clock time matches, a fixed one at the first pass only, and
    at a jump if a time it skips matches."""
    from croniter import croniter  # type: ignore[import-untyped]

    fields = cron.split()
    fixed = not fields[0].startswith("*") and not fields[1].startswith("*")
    found: list[float] = []
    minute = math.floor(start / 60) * 60 + 60
    while minute <= end:
        here = datetime.datetime.fromtimestamp(minute, zone)
        if croniter.match(cron, here.replace(tzinfo=None)) and not (fixed and here.fold):
            found.append(float(minute))
        before = datetime.datetime.fromtimestamp(minute - 60, zone)
        jump = here.utcoffset() - before.utcoffset()  # type: ignore[operator]
        if fixed and jump > datetime.timedelta(0):
            skipped = before.replace(tzinfo=None) + datetime.timedelta(minutes=1)
            while skipped < here.replace(tzinfo=None):
                if croniter.match(cron, skipped) and float(minute) not in found:
                    found.append(float(minute))
                skipped += datetime.timedelta(minutes=1)
        minute += 60
    return found


@pytest.mark.parametrize(
    ("zone", "night"),
    [
        ("Europe/Paris", "2026-10-25T00:00+02:00"),
        ("Europe/Paris", "2026-03-29T00:00+01:00"),
        ("America/New_York", "2026-11-01T00:00-04:00"),
        ("America/New_York", "2026-03-08T00:00-05:00"),
        ("Australia/Lord_Howe", "2026-04-05T00:00+11:00"),  # back by 30 minutes
        ("Australia/Lord_Howe", "2026-10-04T00:00+10:30"),  # forward by 30 minutes
    ],
)
@pytest.mark.parametrize(
    "cron", ["30 2 * * *", "15,45 1-2 * * *", "0 * * * *", "*/20 * * * *", "10 */2 * * *"]
)
def test_cron_ticks_on_a_night_the_clocks_change_match_minute_by_minute(
    zone: str, night: str, cron: str
) -> None:
    periodic = Periodic("p", 1, cron=cron, timezone=zone)
    start = at(night)
    end = start + 6 * 3600
    expected = oracle(cron, zoneinfo.ZoneInfo(zone), start, end)
    found, now = [], start
    while (now := periodic.next_tick(now)) <= end:
        found.append(now)
    assert found == expected
    assert [periodic.last_tick(tick + 59) for tick in found] == expected


# -- the nights the clocks change, run by a service


@pytest.fixture
def wall_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Set time.time() to go on from a chosen instant (moved again by each call)."""
    real = time.time

    def move_to(instant: float) -> None:
        shift = instant - real()
        monkeypatch.setattr(time, "time", lambda: real() + shift)

    return move_to


@pytest.mark.parametrize(
    ("night", "expected"),
    [
        # Back: the daily job once; the hourly one in both passes of 02:30.
        (
            "2026-10-25T00:00+02:00",
            [
                ("daily", "2026-10-25T02:30+02:00"),
                ("hourly", "2026-10-25T00:30+02:00"),
                ("hourly", "2026-10-25T01:30+02:00"),
                ("hourly", "2026-10-25T02:30+02:00"),
                ("hourly", "2026-10-25T02:30+01:00"),
            ],
        ),
        # Forward: the daily job once, at the jump; no hourly run at 02:30.
        (
            "2026-03-29T00:00+01:00",
            [
                ("daily", "2026-03-29T03:00+02:00"),
                ("hourly", "2026-03-29T00:30+01:00"),
                ("hourly", "2026-03-29T01:30+01:00"),
                ("hourly", "2026-03-29T03:30+02:00"),
                ("hourly", "2026-03-29T04:30+02:00"),
            ],
        ),
    ],
)
async def test_a_service_in_memory_runs_a_daily_cron_once_on_a_dst_night(
    autojump_clock: trio.abc.Clock, wall_clock: Any, night: str, expected: list[tuple[str, str]]
) -> None:
    runs: list[tuple[str, str]] = []
    start = at(night)

    async def handler(name: str) -> None:
        wall = start + trio.current_time() - began
        minute = datetime.datetime.fromtimestamp(round(wall / 60) * 60, PARIS)
        runs.append((name, minute.isoformat(timespec="minutes")))

    schedules = [
        Periodic("daily", "daily", cron="30 2 * * *", timezone="Europe/Paris"),
        Periodic("hourly", "hourly", cron="30 * * * *", timezone="Europe/Paris"),
    ]
    wall_clock(start)
    began = trio.current_time()
    async with tickler.open_service(handler, periodic=schedules):
        await trio.sleep(4 * 3600 - 60)  # four hours: 02:59 on the longer night
    assert sorted(runs) == sorted(expected)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_replicas_on_a_store_run_a_daily_cron_once_when_the_clocks_go_back(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, wall_clock: Any
) -> None:
    # Two runs around the two passes of 02:30 on 2026-10-25 in Paris: a
    # replica in the first, a restart and a second replica in the second. The
    # hourly job's tick of the second pass falls at the daily one's instant:
    # once it ran, a daily run of that pass would have been in its batch.
    ran: list[str] = []

    async def handler(name: str) -> None:
        ran.append(name)

    schedules = [
        Periodic("daily", "daily", cron="30 2 * * *", timezone="Europe/Paris"),
        Periodic("hourly", "hourly", cron="30 * * * *", timezone="Europe/Paris"),
    ]
    for tick, runs in [("2026-10-25T02:30+02:00", 2), ("2026-10-25T02:30+01:00", 3)]:
        wall_clock(at(tick) - 1.5)
        async with (
            tickler.open_service(
                handler, store=make_store(kind, request, tmp_path), periodic=schedules
            ),
            tickler.open_service(
                handler, store=make_store(kind, request, tmp_path), periodic=schedules
            ),
        ):
            with trio.fail_after(15):  # for the tick's runs, 1.5 s ahead
                while len(ran) < runs:
                    await trio.sleep(0.05)
            await trio.sleep(0.3)  # a few polls more: no other run comes
    assert sorted(ran) == ["daily", "hourly", "hourly"]
