"""Stopping: stop(), join(), the drain and its deadline, and stops called from handlers.

The supervisor loop asks this part, once per turn, whether a stop is done
(``drained``), past its deadline (``expire``) or waiting on stops called
from inside handlers (``check_quiet``); ``wind_down`` ends a run, whatever
ended it. A stop takes effect on the engine through its flags (``_closed``,
``_admit``, ``_may_start``, ``_draining``).
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Any

import attrs
import trio

from ._core import _check_timeout
from ._current import ATTEMPTS
from ._engine import _Engine
from ._stores._sync import StoreSync
from ._ticket import Ticket


def _by_id(ticket: Ticket[Any, Any]) -> int:
    return ticket.id


@attrs.define(eq=False)
class Stopping:
    """The state of a stop, and of join()'s waits."""

    engine: _Engine[Any, Any]
    sync: StoreSync | None
    # Set once a stop begins (Service.stopping).
    event: trio.Event = attrs.Factory(trio.Event)
    # Set once the run has ended.
    finished: trio.Event = attrs.Factory(trio.Event)
    stop_called: bool = False
    stop_deadline: float = math.inf
    stopped_tickets: list[Ticket[Any, Any]] = attrs.Factory(list)
    # Processors whose handlers wait in stop(): a stop called from inside
    # the service waits for everything but them (see stop).
    insiders: collections.Counter[trio.lowlevel.Task] = attrs.Factory(collections.Counter)
    quiet: trio.Event = attrs.Factory(trio.Event)
    # Set when nothing is queued, retrying or in flight, for join(); with a
    # store, also after each look at the store.
    idle_event: trio.Event | None = None

    async def stop(
        self, *, drain: bool = True, timeout: float | None = None
    ) -> list[Ticket[Any, Any]]:
        """Service.stop (see its docstring)."""
        engine = self.engine
        if not isinstance(drain, bool):
            raise TypeError("drain must be a bool")
        limit = _check_timeout("timeout", timeout, allow_zero=True)
        token = engine._check_run("stopped")
        if not engine._closed:
            self.stop_called = True
            self.close()
            self.event.set()
            if token is None:
                self.wind_down(trio.current_time())
            else:
                now = engine._time()
                assert now is not None
                if limit is not None:
                    self.stop_deadline = now + limit
                if drain:
                    engine._draining = True
                else:
                    engine._may_start = False
                    self.cancel_waiting(now)
                    if self.sync is not None:
                        # With a store, what runs goes back to the store at
                        # once; but for a caller's own attempt (see below).
                        own = self.own_request()
                        for request_id in list(self.sync.scopes):
                            if request_id != own:
                                self.sync.withdraw(request_id, "handback")
                engine._tickle()
        insider = engine._insider() if token is not None else None
        if insider is None:
            await self.finished.wait()
        else:
            self.insiders[insider] += 1
            try:
                if self.quiet.is_set() and not self.finished.is_set():
                    self.quiet = trio.Event()
                engine._tickle()
                await self.quiet.wait()
            finally:
                self.insiders[insider] -= 1
                if not self.insiders[insider]:
                    del self.insiders[insider]
        if self.finished.is_set():
            return list(self.stopped_tickets)  # sorted once, when the run ended
        return sorted(self.stopped_tickets, key=_by_id)

    async def join(self) -> None:
        """Service.join (see its docstring)."""
        engine = self.engine
        token = engine._check_run("joined")
        if token is not None and engine._insider() is not None:
            raise RuntimeError(
                f"join() called from a handler of service {engine.name!r} would wait for itself"
            )
        stored = self.sync
        if stored is not None and token is not None:
            # What the last look at the store saw may be stale: take a fresh
            # one first, and trust only looks taken after the call.
            # (A look already under way may have begun before a commit
            # this caller made: wait for one begun after the call.)
            wanted = stored.looks_begun + 1
            stored.next_check = -math.inf
            engine._tickle()
            while stored.checks < wanted and not self.finished.is_set():
                await self.idle_event_or_new().wait()
        while not (self.is_idle() or self.finished.is_set()):
            engine._bind()
            await self.idle_event_or_new().wait()
        await trio.lowlevel.checkpoint()

    def drained(self, stored: StoreSync | None) -> bool:
        """Whether a stop has nothing left: nothing waits, runs, or waits to be written."""
        engine = self.engine
        return (
            not engine._queue
            and not engine._heap
            and not engine._ready
            and (engine._groups is None or not engine._groups.limited)
            and not engine._intake.incoming
            and engine._in_flight == 0
            and (stored is None or not stored.has_work())
        )

    def is_idle(self) -> bool:
        stored = self.sync
        if not self.drained(stored):
            return False
        # With a store, also: at the last batch nothing of the queue was live
        # in the store, in any process.
        return stored is None or (stored.live == 0 and not stored.watched and not stored.committing)

    def expire(self) -> None:
        """The stop's deadline has passed: cancel everything that is left."""
        engine = self.engine
        engine._draining = False
        engine._may_start = False
        self.cancel_waiting(engine._time())
        assert engine._nursery is not None
        engine._nursery.cancel_scope.cancel()

    def release_idle(self) -> None:
        """Tell every parked processor to exit."""
        engine = self.engine
        idle = engine._idle
        while idle:
            trio.lowlevel.reschedule(idle.pop().task)

    @trio.lowlevel.enable_ki_protection
    def cancel_waiting(self, now: float | None) -> None:
        """Cancel every request that is queued, scheduled or waiting for a retry."""
        engine = self.engine
        with engine._lock:
            waiting = list(engine._queue)
            engine._peak = max(engine._peak, len(waiting))
            engine._queue.clear()
            engine._last_context = None
            waiting.extend(ticket for _, ticket in engine._intake.incoming)
            engine._intake.scheduled -= len(engine._intake.incoming)
            engine._intake.incoming.clear()
            engine._intake.set_admit()
        for ticket in waiting:
            engine._outcomes.cancel(ticket, now)
        heap = engine._heap
        while heap:
            ticket = heapq.heappop(heap)[2]
            engine._left(ticket)
            engine._outcomes.cancel(ticket, now)
        ready = engine._ready
        while ready:
            with engine._lock:
                ticket = heapq.heappop(ready)[3]
            engine._left(ticket)
            engine._outcomes.cancel(ticket, now)
        if engine._groups is not None:
            for ticket in engine._groups.drain():
                engine._left(ticket)
                engine._outcomes.cancel(ticket, now)

    def close(self) -> None:
        """Refuse every enqueue from now on; submit() callers waiting for room get ServiceClosed."""
        engine = self.engine
        with engine._lock:
            engine._closed = True
            engine._admit = 0
        engine._intake.room.unpark_all()

    @trio.lowlevel.enable_ki_protection
    def wind_down(self, now: float | None) -> None:
        engine = self.engine
        engine._draining = False
        self.close()
        engine._may_start = False
        self.event.set()
        self.cancel_waiting(now)
        if engine._signal_tx is not None:
            engine._signal_tx.close()
        self.stopped_tickets.sort(key=_by_id)
        self.quiet.set()
        if self.idle_event is not None:
            self.idle_event.set()
        self.finished.set()

    def check_quiet(self) -> None:
        """Wake stops called from handlers once nothing else can run before they return.

        That is when only requests whose handlers are in stop() still run, and
        either nothing waits, or they hold every slot: what waits then drains
        once they return.
        """
        engine = self.engine
        if engine._in_flight <= len(self.insiders) and (
            (
                not engine._queue
                and not engine._heap
                and not engine._ready
                and not engine._intake.incoming
            )
            or engine._in_flight >= engine._capacity
        ):
            self.quiet.set()

    def own_request(self) -> int | None:
        """The id of the request whose handler (or a task it spawned) is calling, if any."""
        engine = self.engine
        insider = engine._insider()
        if insider is None:
            return None
        attempt = ATTEMPTS.get(insider)
        return attempt.ticket.id if attempt is not None and attempt.ticket is not None else None

    def idle_event_or_new(self) -> trio.Event:
        """The event the loop sets once idle; with a store, also after each look at the store."""
        engine = self.engine
        event = self.idle_event
        if event is None:
            event = self.idle_event = trio.Event()
            engine._tickle()
        return event
