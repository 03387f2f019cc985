"""Limits per group: at most N attempts in flight, and at most R starts per window, per group.

A request may name its ``group``; ``Service(limits=...)`` bounds each group
separately (:class:`Limit`, or a mapping of group names to limits with
``"*"`` for every other group). In memory the :class:`Groups` part keeps
the rules: a request of a group at its limit is held here, out of the
engine's ready heap, so it takes no slot and holds back no other request;
when its group frees up, its next request goes back to the ready heap, in
priority and enqueue order. With a store the claim transaction enforces
the same limits across every replica (see ``_stores._seam.Batch.limits``).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Mapping
from typing import Any

import attrs

from ._codec import check_group
from ._engine import _Engine
from ._ticket import Ticket

# A ready request as the engine's ready heap holds it: (-priority, ready since, id, ticket).
Entry = tuple[int, float, int, Ticket[Any, Any]]


@attrs.frozen(init=False)
class Limit:
    """The limits of one group: attempts in flight, and attempts started per ``per`` seconds.

    ``concurrency`` bounds the group's attempts in flight at once;
    ``rate`` bounds the attempts the group starts within any window of
    ``per`` seconds. Retries count as starts. None: no bound of that kind.

    Raises:
        TypeError, ValueError: a bound that is not an int >= 1, or ``per``
            that is not a finite number > 0.
    """

    concurrency: int | None
    rate: int | None
    per: float

    def __init__(
        self, concurrency: int | None = None, rate: int | None = None, per: float = 1.0
    ) -> None:
        for name, value in (("concurrency", concurrency), ("rate", rate)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1")
        if isinstance(per, bool) or not isinstance(per, int | float):
            raise TypeError(f"per must be a number of seconds, not {type(per).__name__}")
        if not (per > 0 and math.isfinite(per)):
            raise ValueError("per must be a finite number of seconds > 0")
        self.__attrs_init__(concurrency, rate, float(per))


def check_limits(value: object) -> dict[str, Limit] | None:
    """``limits=``, checked: None, a Limit for every group, or a mapping by group name."""
    if value is None:
        return None
    if isinstance(value, Limit):
        return {"*": value}
    if not isinstance(value, Mapping):
        raise TypeError("limits must be a tickler.Limit, a mapping of group names to them, or None")
    limits: dict[str, Limit] = {}
    for group, limit in value.items():
        if group != "*":
            check_group(group)
        if not isinstance(limit, Limit):
            raise TypeError(f"limits[{group!r}] must be a tickler.Limit")
        limits[group] = limit
    return limits


@attrs.define(eq=False)
class Groups:
    """The in-memory side of limits: who runs, who started when, and who waits held.

    A grouped request of priority 0 waits in the engine's plain queue, and
    any other in its ready heap; either way its group is checked as it
    leaves (admit_queued, admit). One held for its group waits here, and
    counts with the intake's ``ranked`` as the ready heap's requests do.
    """

    engine: _Engine[Any, Any]
    limits: dict[str, Limit]
    # The limit of every group not named in limits ("*"), or None.
    default: Limit | None = attrs.field(init=False)
    # The group of each live request that has one.
    group_of: dict[Ticket[Any, Any], str] = attrs.Factory(dict)
    # Attempts admitted and not ended, by group (no zeros); and each one's group.
    running: dict[str, int] = attrs.Factory(dict)
    admitted: dict[Ticket[Any, Any], str] = attrs.Factory(dict)
    # The start times within the window, by rate-limited group.
    starts: dict[str, collections.deque[float]] = attrs.Factory(dict)
    # Requests held because their group is at its limit, in ready order.
    held: dict[str, list[Entry]] = attrs.Factory(dict)
    # For a group held by its rate: the request waiting in the engine's timer
    # heap until the window lets the group start again, as it was held.
    wakes: dict[str, Entry] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.default = self.limits.get("*")

    def limit_of(self, group: str) -> Limit | None:
        return self.limits.get(group, self.default)

    @property
    def limited(self) -> int:
        """Requests waiting only because of a limit."""
        return sum(len(held) for held in self.held.values()) + len(self.wakes)

    def blocked_until(self, group: str, now: float) -> float | None:
        """None if the group may start an attempt now; else when it may (inf: once one ends)."""
        limit = self.limits.get(group, self.default)
        if limit is None:
            return None
        if limit.concurrency is not None and self.running.get(group, 0) >= limit.concurrency:
            return math.inf
        if limit.rate is not None:
            starts = self.starts.get(group)
            if starts:
                while starts and starts[0] <= now - limit.per:
                    starts.popleft()
                if len(starts) >= limit.rate:
                    return starts[0] + limit.per
        return None

    def admit_queued(self, ticket: Ticket[Any, Any], now: float) -> bool:
        """admit() for a request taken from the engine's plain queue: True if it starts now.

        Held, it counts with the intake's ``ranked`` from here on, as the
        plain queue no longer holds it.
        """
        group = self.group_of.get(ticket)
        if group is None:
            return True
        # tuned (bench: groups): a group with room, nothing held and no rate
        # starts at once, with no entry built for the heaps.
        limit = self.limits.get(group, self.default)
        if limit is None or (
            limit.rate is None
            and group not in self.held
            and (limit.concurrency is None or self.running.get(group, 0) < limit.concurrency)
        ):
            self.running[group] = self.running.get(group, 0) + 1
            self.admitted[ticket] = group
            return True
        since = ticket.enqueued_at
        entry = (0, since if since is not None else -math.inf, ticket.id, ticket)
        if self.admit(entry, group, now):
            return True
        engine = self.engine
        with engine._lock:
            engine._intake.ranked += 1
            engine._intake.set_admit()
        return False

    def admit(self, entry: Entry, group: str, now: float) -> bool:
        """Start ``entry``'s request if its group allows it now (True); else hold it."""
        ticket = entry[3]
        wake = self.wakes.get(group)
        if wake is not None:
            held = self.held.setdefault(group, [])
            if wake[3] is not ticket:
                # The group's next start is decided when the request waiting for its
                # window wakes (below): until then, another of the group waits held.
                heapq.heappush(held, entry)
                return False
            # The group's window lets it start again: the request that waited for it goes
            # back among the held, ranked as when it was held (not since its wake), and
            # the first of them goes on, which may be one that came since (enqueued
            # earlier, or of a higher priority).
            del self.wakes[group]
            heapq.heappush(held, wake)
            self.pump(group, now)
            return False
        if self.blocked_until(group, now) is not None:
            heapq.heappush(self.held.setdefault(group, []), entry)
            self.pump(group, now)
            return False
        self.running[group] = self.running.get(group, 0) + 1
        self.admitted[ticket] = group
        limit = self.limits.get(group, self.default)
        if limit is not None and limit.rate is not None:
            self.starts.setdefault(group, collections.deque()).append(now)
        if group in self.held:
            self.pump(group, now)
        return True

    def pump(self, group: str, now: float) -> None:
        """Send the group's next held request on, if the group allows a start.

        Now: back to the ready heap. Once its rate window allows: into the
        engine's timer heap until then (one request per group at a time).
        """
        held = self.held.get(group)
        if not held or group in self.wakes:
            return
        engine = self.engine
        until = self.blocked_until(group, now)
        if until is None:
            entry = heapq.heappop(held)
            with engine._lock:
                heapq.heappush(engine._ready, entry)
            engine._tickle()
        elif until < math.inf:
            entry = heapq.heappop(held)
            self.wakes[group] = entry
            heapq.heappush(engine._heap, (until, next(engine._heap_seq), entry[3]))
            engine._tickle()  # the loop's timer must now wake by then
        if not held:
            del self.held[group]

    def ended(self, ticket: Ticket[Any, Any]) -> None:
        """An admitted attempt ended (or went back unstarted): its group's slot is free."""
        group = self.admitted.pop(ticket, None)
        if group is None:
            return
        running = self.running
        left = running[group] - 1
        if left:
            running[group] = left
        else:
            del running[group]
        if group in self.held:
            now = self.engine._time()
            if now is not None:
                self.pump(group, now)

    def forget(self, ticket: Ticket[Any, Any]) -> None:
        """A request became final: it belongs to no group any more."""
        self.ended(ticket)
        group = self.group_of.pop(ticket, None)
        if group is None or not self.wakes:
            return
        wake = self.wakes.get(group)
        if wake is not None and wake[3] is ticket:
            del self.wakes[group]  # cancelled in the timer heap: the next one wakes instead
            now = self.engine._time()
            if now is not None:
                self.pump(group, now)

    def take_held(
        self, ticket: Ticket[Any, Any] | None, request_id: object
    ) -> Ticket[Any, Any] | None:
        """Take a held request out (by ticket, or by id), for cancel(); None if none is held."""
        for group, held in self.held.items():
            for index, entry in enumerate(held):
                if entry[3] is ticket or (request_id is not None and entry[2] == request_id):
                    held[index] = held[-1]
                    held.pop()
                    heapq.heapify(held)
                    if not held:
                        del self.held[group]
                    return entry[3]
        return None

    def drain(self) -> list[Ticket[Any, Any]]:
        """Every held request, taken out: a stop cancels them."""
        tickets = [entry[3] for held in self.held.values() for entry in held]
        self.held.clear()
        return tickets
