"""Periodic requests: a request enqueued on a schedule, once per tick across every replica.

A :class:`Periodic` says what to enqueue and when: ``every`` seconds (ticks
on a grid counted from the Unix epoch, so every replica computes the same
ticks) or a five-field ``cron`` expression in a time zone, parsed by
croniter (the ``cron`` extra). The supervisor loop keeps the next tick of
each in its timer. In memory it enqueues each tick itself; with a store
each tick goes into the next batch, where the store takes it for one
process only (see ``_stores._seam.Batch.ticks``).

A cron tick is an instant: croniter matches wall-clock times (naive, in no
zone), and :meth:`Periodic._cron_after` maps them onto instants in the
zone with cron's convention for the nights the clocks change (see its
docstring). Each replica computes the same instants, and the store names a
tick by its instant.
"""

from __future__ import annotations

import datetime
import math
import re
import zoneinfo
from typing import Any

import attrs

from ._codec import check_short_name
from ._core import check_priority

# The bounds of `every`, in seconds: a millisecond (below it a tick would be
# due again before the loop had enqueued the last), and ten years of 365 days.
EVERY_RANGE = (0.001, 10 * 365 * 86400.0)

# Each field of a cron line: its name and the range of its numbers (a day of
# week is 0-7: 0 and 7 are both Sunday).
_CRON_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day of month", 1, 31),
    ("month", 1, 12),
    ("day of week", 0, 7),
)
# Any expression that fires at all fires within 8 years of any date (the
# longest gap: 29 February 2096 to 29 February 2104). A search from
# 2000-01-01 (a leap year's start) over that long proves that one never does.
_CRON_PROOF_START = datetime.datetime(2000, 1, 1)
_CRON_PROOF_YEARS = 8
# How far _cron_after looks: past those 8 years, with room for a zone's jumps.
_CRON_HORIZON = 9 * 366 * 86400.0
_EPOCH = datetime.datetime(1970, 1, 1)
_DAY = 86400.0


def _import_croniter() -> Any:
    """croniter's class, or an ImportError that says how to install it."""
    try:
        from croniter import croniter  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(
            "Periodic(cron=...) needs croniter: pip install 'trio-tickler[cron]'"
        ) from exc
    return croniter


def _check_cron(cron: str) -> bool:
    """Check a cron line; return whether it is at a fixed time of day.

    Refuses, with a ValueError naming the field: a count of fields other
    than five, a number out of its field's range, a step of 0, anything
    else croniter refuses; and an expression that never fires (no day
    matches it, like 31 February). Fixed time of day: neither the minute nor
    the hour field starts with ``*`` (cron's own rule, see _cron_after).
    """
    croniter = _import_croniter()
    fields = cron.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron {cron!r} is not a five-field expression (minute hour day month weekday)"
        )
    for index, (text, (label, low, high)) in enumerate(zip(fields, _CRON_FIELDS, strict=True)):
        for part in text.split(","):
            values, slash, step = part.partition("/")
            if slash and step.isdigit() and int(step) == 0:
                raise ValueError(f"cron field {label!r} has a step of 0, not 1 or more: {text!r}")
            # A weekday's "#n" (its n-th in the month) is no weekday: leave it out.
            for number in re.findall(r"\d+", values.partition("#")[0]):
                if not low <= int(number) <= high:
                    raise ValueError(f"cron field {label!r} out of range {low}-{high}: {text!r}")
        alone = ["*"] * 5
        alone[index] = text
        if not croniter.is_valid(" ".join(alone)):
            raise ValueError(f"cron field {label!r} is not valid: {text!r}")
    if not croniter.is_valid(cron):
        raise ValueError(f"cron {cron!r} is not a valid expression")
    try:
        croniter(cron, _CRON_PROOF_START, max_years_between_matches=_CRON_PROOF_YEARS).get_next(
            datetime.datetime
        )
    except Exception:  # croniter's CroniterBadDateError: no match in 8 years
        raise ValueError(
            f"cron {cron!r} never fires: no date has day of month {fields[2]!r}"
            f" in month {fields[3]!r}"
        ) from None
    return not fields[0].startswith("*") and not fields[1].startswith("*")


def _offset(at: float, zone: datetime.tzinfo) -> float:
    """The zone's offset from UTC at the instant ``at``, in seconds."""
    offset = datetime.datetime.fromtimestamp(at, zone).utcoffset()
    assert offset is not None
    return offset.total_seconds()


def _wall(at: float, offset: float) -> datetime.datetime:
    """The naive wall-clock time of the instant ``at`` under ``offset``."""
    return _EPOCH + datetime.timedelta(seconds=at + offset)


def _instant(wall: datetime.datetime, offset: float) -> float:
    """The instant whose wall-clock time under ``offset`` is ``wall``."""
    return (wall - _EPOCH).total_seconds() - offset


def _offset_change(start: float, end: float, offset: float, zone: datetime.tzinfo) -> float | None:
    """The first instant in (start, end] whose offset is not ``offset``, or None.

    Probes a day at a time (a zone changes its offset at most once in a day),
    then bisects to the second (zones change on whole seconds).
    """
    at = start
    while at < end:
        probe = min(at + _DAY, end)
        if _offset(probe, zone) != offset:
            low, high = math.floor(at), math.ceil(probe)
            while high - low > 1:
                middle = (low + high) // 2
                if _offset(middle, zone) == offset:
                    low = middle
                else:
                    high = middle
            return float(high)
        at = probe
    return None


def _attribute(periodic: Periodic, name: str) -> str:
    try:
        return repr(getattr(periodic, name))
    except AttributeError:  # a construction that failed before it was set
        return "<unset>"


@attrs.frozen(init=False, repr=False)
class Periodic:
    """A request enqueued on a schedule: ``every`` seconds, or on a five-field ``cron``.

    Give a list of them as ``Service(..., periodic=[...])``. Exactly one of
    ``every`` and ``cron`` is given. ``every`` ticks fall on multiples of
    ``every`` seconds since the Unix epoch; ``cron`` ticks are read in
    ``timezone`` (an IANA name), once per wall-clock time on the nights the
    clocks change (see docs/scheduling.md). A tick's request is an ordinary
    request: retries, keys, cancel, statistics and metrics see it.

    Raises:
        TypeError, ValueError: at construction, a bad name, interval
            (``every`` from 0.001 s to ten years), expression (each field in
            its range, and a date that exists), time zone or priority.
        ImportError: ``cron`` without croniter: ``pip install 'trio-tickler[cron]'``.
    """

    name: str
    request: Any
    every: float | None
    cron: str | None
    timezone: str
    priority: int
    _zone: datetime.tzinfo = attrs.field(eq=False)
    # A cron line at a fixed time of day (see _cron_after).
    _fixed: bool = attrs.field(eq=False)

    def __init__(
        self,
        name: str,
        request: Any,
        *,
        every: float | None = None,
        cron: str | None = None,
        timezone: str = "UTC",
        priority: int = 0,
    ) -> None:
        name = check_short_name(name, "name")
        if (every is None) == (cron is None):
            raise ValueError("give exactly one of every (seconds) and cron (an expression)")
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int | float):
                raise TypeError(f"every must be a number of seconds, not {type(every).__name__}")
            low, high = EVERY_RANGE
            # Compared before any conversion: an int too large for a float
            # fails here, and so does NaN.
            if not low <= every <= high:
                raise ValueError(f"every must be from {low} to {high:.0f} seconds (ten years)")
            every = float(every)
        if not isinstance(timezone, str):
            raise TypeError(f"timezone must be a str, not {type(timezone).__name__}")
        try:
            zone = zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone {timezone!r} is not a known IANA time zone") from None
        fixed = False
        if cron is not None:
            if not isinstance(cron, str):
                raise TypeError(f"cron must be a str, not {type(cron).__name__}")
            fixed = _check_cron(cron)
        priority = check_priority(priority)
        self.__attrs_init__(name, request, every, cron, timezone, priority, zone, fixed)

    def __repr__(self) -> str:
        # Every attribute read safely: a debugger or a traceback may show an
        # instance whose __init__ raised before any was set.
        names = ("name", "request", "every", "cron", "timezone", "priority")
        return f"Periodic({', '.join(f'{n}={_attribute(self, n)}' for n in names)})"

    def next_tick(self, after: float) -> float:
        """The first tick strictly after ``after`` (seconds since the epoch)."""
        if self.every is not None:
            return (math.floor(after / self.every) + 1) * self.every
        return self._cron_after(after)

    def last_tick(self, at: float) -> float:
        """The latest tick at or before ``at``."""
        if self.every is not None:
            return math.floor(at / self.every) * self.every
        # Look back twice as far each time until a tick is found, then step
        # forward to the last one at or before `at`.
        back = 60.0
        while (tick := self._cron_after(at - back)) > at:
            back *= 2
            if back > _CRON_HORIZON:
                raise RuntimeError(f"cron {self.cron!r} has no tick in {self.timezone}")
        while (following := self._cron_after(tick)) <= at:
            tick = following
        return tick

    def _cron_after(self, after: float) -> float:
        """The first cron tick strictly after ``after``, with cron's rule for DST.

        As Vixie cron and cronie do, a line at a fixed time of day (neither
        its minute nor its hour field starts with ``*``, as ``30 2 * * *``)
        fires once per wall-clock time: in an hour the clocks repeat, at its
        first pass only; in an hour they skip, at the instant they jump (once,
        however many of its times were skipped). Any other line (``*/15 * * *
        *``, ``0 * * * *``) fires at each instant whose wall-clock time
        matches: in both passes of a repeated hour, and not in a skipped one.

        The instants are found offset by offset: between two changes of the
        zone's offset, wall-clock times map onto instants one to one.
        """
        croniter = _import_croniter()
        zone, fixed = self._zone, self._fixed
        at, strictly = after, True
        while at < after + _CRON_HORIZON:
            offset = _offset(at, zone)
            start = _wall(at, offset)
            if not strictly:  # `at` itself may match (croniter looks strictly after)
                start -= datetime.timedelta(seconds=1)
            match = croniter(self.cron, start).get_next(datetime.datetime)
            candidate = _instant(match, offset)
            change = _offset_change(at, candidate, offset, zone)
            if change is None:
                if fixed and datetime.datetime.fromtimestamp(candidate, zone).fold:
                    # The second pass of a repeated hour: it fired on the first.
                    at, strictly = candidate, True
                    continue
                return candidate
            # The offset changes before the match. A fixed time that the jump
            # skips fires at the jump.
            if fixed and match < _wall(change, _offset(change, zone)):
                return change
            at, strictly = change, False
        raise RuntimeError(f"cron {self.cron!r} has no tick in {self.timezone}")
