"""Periodic requests: a request enqueued on a schedule, once per tick across every replica.

A :class:`Periodic` says what to enqueue and when: ``every`` seconds (ticks
on a grid counted from the Unix epoch, so every replica computes the same
ticks) or a five-field ``cron`` expression in a time zone, parsed by
croniter (the ``cron`` extra). The supervisor loop keeps the next tick of
each in its timer. In memory it enqueues each tick itself; with a store
each tick goes into the next batch, where the store takes it for one
process only (see ``_stores._seam.Batch.ticks``).
"""

from __future__ import annotations

import datetime
import math
import zoneinfo
from typing import Any

import attrs

from ._codec import check_short_name
from ._core import check_priority


@attrs.frozen(init=False)
class Periodic:
    """A request enqueued on a schedule: ``every`` seconds, or on a five-field ``cron``.

    Give a list of them as ``Service(..., periodic=[...])``. Exactly one of
    ``every`` and ``cron`` is given. ``every`` ticks fall on multiples of
    ``every`` seconds since the Unix epoch; ``cron`` ticks are read in
    ``timezone`` (an IANA name). A tick's request is an ordinary request:
    retries, keys, cancel, statistics and metrics see it.

    Raises:
        TypeError, ValueError: a bad name, interval, expression, time zone
            or priority, at construction.
        ImportError: ``cron`` without croniter: ``pip install 'trio-tickler[cron]'``.
    """

    name: str
    request: Any
    every: float | None
    cron: str | None
    timezone: str
    priority: int
    _zone: datetime.tzinfo = attrs.field(repr=False, eq=False)

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
            if not (every > 0 and math.isfinite(every)):
                raise ValueError("every must be a finite number of seconds > 0")
            every = float(every)
        if not isinstance(timezone, str):
            raise TypeError(f"timezone must be a str, not {type(timezone).__name__}")
        try:
            zone = zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone {timezone!r} is not a known IANA time zone") from None
        if cron is not None:
            if not isinstance(cron, str):
                raise TypeError(f"cron must be a str, not {type(cron).__name__}")
            from croniter import croniter  # type: ignore[import-untyped]

            if len(cron.split()) != 5 or not croniter.is_valid(cron):
                raise ValueError(
                    f"cron {cron!r} is not a five-field expression (minute hour day month weekday)"
                )
        priority = check_priority(priority)
        self.__attrs_init__(name, request, every, cron, timezone, priority, zone)

    def next_tick(self, after: float) -> float:
        """The first tick strictly after ``after`` (seconds since the epoch)."""
        if self.every is not None:
            return (math.floor(after / self.every) + 1) * self.every
        return float(self._croniter(after).get_next(float))

    def last_tick(self, at: float) -> float:
        """The latest tick at or before ``at``."""
        if self.every is not None:
            return math.floor(at / self.every) * self.every
        # croniter's get_prev is strictly before: step a hair past a tick that is exactly `at`.
        return float(self._croniter(at + 1e-6).get_prev(float))

    def _croniter(self, at: float) -> Any:
        from croniter import croniter

        start = datetime.datetime.fromtimestamp(at, self._zone)
        return croniter(self.cron, start)
