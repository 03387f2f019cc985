"""The supervisor loop: dispatch, sleep until tickled or due; and stopping and joining."""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio

from . import _lowlevel
from ._core import (
    _EMPTY_CONTEXT,
    _QUEUED,
    _RUNNING,
    _SCHEDULED,
    _check_key,
    _check_timeout,
    _get_ident,
    logger,
)
from ._exceptions import ServiceClosed
from ._processors import _ATTEMPTS, _Processors, _Slot
from ._stores._sync import StoreSync, wall_clock
from ._ticket import RequestT, ResultT, Ticket

# With a store, the most a process claims ahead of its free slots, in capacities.
_AHEAD = 8


class _Loop(_Processors[RequestT, ResultT]):
    """One supervisor loop, woken through the one-slot signal, starts every processor."""

    __slots__ = ()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the service until it is stopped; use ``await nursery.start(service.run)``.

        Raises:
            ServiceClosed: the service was stopped before it ran.
            RuntimeError: ``run`` was already called.
        """
        if self._stop_called and self._token is None:
            raise ServiceClosed(f"service {self.name!r} was stopped before it ran")
        if self._token is not None:
            raise RuntimeError(f"service {self.name!r} has already run")
        if self._bound is not None and self._bound is not trio.lowlevel.current_trio_token():
            raise RuntimeError(
                f"service {self.name!r} was waited on from another Trio run before it ran;"
                " run it in that one"
            )
        stored = self._store_run
        if stored is not None:
            # Open and check the store before anything starts: a bad file
            # raises StoreError from here, with nothing written.
            stored.connection = await trio.to_thread.run_sync(stored.store.connect)
            stored.finals_since = wall_clock()
        self._signal_tx, self._signal_rx = trio.open_memory_channel[None](1)
        clock = trio.lowlevel.current_clock()
        now = clock.current_time()
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = _get_ident()
            # The offset first: a thread that sees the timer sees its offset.
            self._timer, self._offset = None, _lowlevel.clock_offset(clock)
            self._timer = time.perf_counter if self._offset else clock.current_time
            for ticket in self._queue:
                ticket.enqueued_at = now
            for _, ticket in self._incoming:
                ticket.enqueued_at = now
            if stored is not None:
                for pending in stored.pending:
                    pending[6].enqueued_at = now
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                listener_scope = trio.CancelScope()
                if stored is not None:
                    listening = stored.store.listener(self.name)
                    if listening is not None:
                        nursery.start_soon(stored.listen, listening, listener_scope)
                await self._supervise(stored)
                listener_scope.cancel()
        finally:
            if stored is not None:
                # Whatever ended the run, commit what was accepted and hand
                # back what was claimed: a stop never loses a request.
                self._close()
                self._may_start = False
                self._cancel_waiting(self._time())
                await stored.final_flush()
            self._wind_down(self._time())

    async def _supervise(self, stored: StoreSync | None) -> None:
        """The one supervisor loop: exchange a batch with the store, dispatch, check a stop, sleep.

        It sleeps on the one-slot signal until tickled (an enqueue, an attempt
        that ended), until the next retry or delayed request falls due, until
        the stop's deadline, and with a store until its next look or the next
        row falling due. The in-memory engine has no batch to exchange.
        """
        assert self._signal_rx is not None
        receive = self._signal_rx.receive
        heap = self._heap
        try:
            while True:
                if self._incoming:
                    self._schedule_incoming()
                looked = False
                if stored is not None:
                    exchanged = await stored.exchange()
                    if exchanged is None:
                        continue  # the batch failed, and the loop backed off
                    looked = exchanged
                dispatched_at = self._dispatch()
                if self._stop_called:
                    if self._drained(stored):
                        self._release_idle()
                        return
                    now = self._time()
                    assert now is not None
                    if now >= self._stop_deadline:
                        self._expire()
                    elif self._insiders:
                        self._check_quiet()
                if not self._queue:
                    # Nothing waits: keep no enqueuer's context alive for sharing.
                    self._last_context = None
                # (With a store, join() also waits for a fresh look.)
                if self._idle_event is not None and (looked or self._is_idle()):
                    self._idle_event.set()
                    self._idle_event = None
                # What was due when _dispatch looked and did not start waits
                # for a slot, and a completion will tickle: only what falls
                # due after that instant needs the timer. (Compared with that
                # very instant: a later reading would miss a request that
                # fell due in between.)
                wake_at = self._stop_deadline
                if heap and self._may_start and heap[0][0] > dispatched_at:
                    wake_at = min(wake_at, heap[0][0])
                if stored is not None:
                    wake_at = min(wake_at, stored.next_look())
                await self._sleep(receive, wake_at)
        except BaseException:
            # Cancelled with the run, or the run is ending: from this instant
            # no processor starts another request.
            self._may_start = self._draining = False
            raise

    def _drained(self, stored: StoreSync | None) -> bool:
        """Whether a stop has nothing left: nothing waits, runs, or waits to be written."""
        return (
            not self._queue
            and not self._heap
            and not self._incoming
            and self._in_flight == 0
            and (stored is None or not stored.has_work())
        )

    async def _sleep(self, receive: Callable[[], Awaitable[None]], wake_at: float) -> None:
        """Sleep until tickled through the one-slot channel, or until ``wake_at``."""
        if wake_at < math.inf:
            with trio.move_on_at(wake_at):
                await receive()
                self._wakeup_pending = False
        else:
            await receive()
            self._wakeup_pending = False
        self._wakeups += 1
        self._debug = logger.isEnabledFor(logging.DEBUG)

    def _expire(self) -> None:
        """The stop's deadline has passed: cancel everything that is left."""
        self._draining = False
        self._may_start = False
        self._cancel_waiting(self._time())
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    def _dispatch(self) -> float:
        """Start a processor into every free slot, due retries first; return the time used."""
        if not self._may_start:
            return -math.inf
        limiter = self._limiter
        nursery = self._nursery
        assert nursery is not None
        timer = self._timer
        assert timer is not None
        now = self._offset + timer()
        process = self._process_withdrawable
        while limiter.borrowed_tokens < limiter.total_tokens:
            ticket = self._take(now)
            if ticket is None:
                return now
            slot = _Slot(ticket.id)
            # Handed to a processor that has yet to start it: cancel() finds it here.
            self._handed[ticket.id] = ticket
            limiter.acquire_on_behalf_of_nowait(slot)
            if self._idle:
                # A parked processor takes the start: no task spawn.
                parked = self._idle.pop()
                parked.handed = (ticket, slot)
                trio.lowlevel.reschedule(parked.task)
            else:
                # Processors start in an empty context of their own.
                _EMPTY_CONTEXT.copy().run(nursery.start_soon, process, ticket, slot)
            if self._debug:
                logger.debug("replenished: now %d/%d slots in use", self._in_flight, self._capacity)
        if self._debug and (self._queue or (self._heap and self._heap[0][0] <= now)):
            logger.debug(
                "received loop signal, but request limit is reached"
                " (%d/%d slots in use, %d queued)",
                self._in_flight,
                self._capacity,
                len(self._queue),
            )
        return now

    def _release_idle(self) -> None:
        """Tell every parked processor to exit."""
        idle = self._idle
        while idle:
            trio.lowlevel.reschedule(idle.pop().task)

    @trio.lowlevel.enable_ki_protection
    def _cancel_waiting(self, now: float | None) -> None:
        """Cancel every request that is queued, scheduled or waiting for a retry."""
        with self._lock:
            waiting = list(self._queue)
            self._peak = max(self._peak, len(waiting))
            self._queue.clear()
            self._last_context = None
            waiting.extend(ticket for _, ticket in self._incoming)
            self._scheduled -= len(self._incoming)
            self._incoming.clear()
            self._set_admit()
        for ticket in waiting:
            self._cancel(ticket, now)
        heap = self._heap
        while heap:
            ticket = heapq.heappop(heap)[2]
            if ticket.status is _SCHEDULED:
                self._unschedule()
            else:
                self._retrying -= 1
            self._cancel(ticket, now)

    def _close(self) -> None:
        """Refuse every enqueue from now on; submit() callers waiting for room get ServiceClosed."""
        with self._lock:
            self._closed = True
            self._admit = 0
        self._room.unpark_all()

    @trio.lowlevel.enable_ki_protection
    def _wind_down(self, now: float | None) -> None:
        self._draining = False
        self._close()
        self._may_start = False
        self.stopping.set()
        self._cancel_waiting(now)
        if self._signal_tx is not None:
            self._signal_tx.close()
        self._stopped_tickets.sort(key=_by_id)
        self._quiet.set()
        if self._idle_event is not None:
            self._idle_event.set()
        self._finished.set()

    def _check_quiet(self) -> None:
        """Wake stops called from handlers once nothing else can run before they return.

        That is when only requests whose handlers are in stop() still run, and
        either nothing waits, or they hold every slot: what waits then drains
        once they return.
        """
        if self._in_flight <= len(self._insiders) and (
            (not self._queue and not self._heap and not self._incoming)
            or self._in_flight >= self._capacity
        ):
            self._quiet.set()

    def _is_idle(self) -> bool:
        stored = self._store_run
        if not self._drained(stored):
            return False
        # With a store, also: at the last batch nothing of the queue was live
        # in the store, in any process.
        return stored is None or (stored.live == 0 and not stored.watched and not stored.committing)

    async def cancel(self, id_or_key: int | Hashable) -> bool:
        """Cancel a live request, by its id (an int) or its key.

        A queued, scheduled or retrying request becomes CANCELLED at once.
        A running one has its handler cancelled: in memory at once, with a
        store in the process that runs it (within the store's
        ``poll_interval``). It is never retried. Requests this service
        accepted before the call are seen by it, as program order says.

        In memory, an attempt cancelled while running ends CANCELLED when
        the cancellation reaches it (at its next checkpoint); one that
        returns without reaching a checkpoint ends as it returned, and one
        that raises something else ends FAILED, not retried. With a store,
        a request whose cancel was asked for ends CANCELLED whatever its
        attempt does.

        Returns:
            Whether a live request with that id or key was found.

        Raises:
            TypeError: a key that is not hashable (with a store: not a str or
                a tuple of strs and ints).
            RuntimeError: called from a different Trio run than the service's.
        """
        if self._store_run is None:
            return await self._cancel_in_memory(id_or_key)
        return await self._require_store("cancel").cancel(id_or_key)

    async def _cancel_in_memory(self, id_or_key: int | Hashable) -> bool:
        by_id = isinstance(id_or_key, int) and not isinstance(id_or_key, bool)
        if not by_id:
            _check_key(id_or_key)
        self._check_run("used")
        await trio.lowlevel.checkpoint_if_cancelled()
        found = bool(self._cancel_found(id_or_key, by_id))
        await trio.lowlevel.cancel_shielded_checkpoint()
        return found

    @trio.lowlevel.enable_ki_protection
    def _cancel_found(self, id_or_key: object, by_id: bool) -> bool | None:
        """Cancel the live request if found waiting or running (True); else None."""
        now = self._time()
        if now is None:  # before the run: as a stop then, on the caller's clock
            now = trio.current_time()
        ticket: Ticket[RequestT, ResultT] | None = None
        removed: Ticket[RequestT, ResultT] | None = None
        with self._lock:
            if by_id:
                for candidate in self._queue:
                    if candidate.id == id_or_key:
                        ticket = candidate
                        break
            else:
                ticket = self._keys.get(id_or_key)
            if ticket is not None and ticket.status is _QUEUED:
                try:
                    self._queue.remove(ticket)
                except ValueError:
                    pass  # taken by a processor that has not started it: below
                else:
                    removed = ticket
            else:
                for index, (_, entry) in enumerate(self._incoming):
                    if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                        del self._incoming[index]
                        self._scheduled -= 1
                        self._set_admit()
                        removed = entry
                        break
        if removed is not None:
            # A queued request frees a place in the queue; a scheduled one
            # too (it counted against the bound).
            self._finish_cancelled(removed, now, frees_room=True)
            return True
        for index, (_, _, entry) in enumerate(self._heap):
            if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                if entry.status is _SCHEDULED:
                    self._unschedule()  # (which gives its place to a submit() waiter)
                else:
                    self._retrying -= 1
                self._finish_cancelled(entry, now)
                return True
        for attempt in list(_ATTEMPTS.values()):
            running = attempt.ticket
            if (
                attempt.service is self
                and running is not None
                and running.status is _RUNNING
                and (running is ticket or (by_id and ticket is None and running.id == id_or_key))
            ):
                if attempt.withdrawn is not running:
                    attempt.withdrawn = running
                    assert attempt.scope is not None
                    attempt.scope.cancel()
                    # Its key is free from now: a replacement enqueued next
                    # is a request of its own.
                    self._release_key(running)
                return True
        # Handed to a processor that has not started it: it never starts.
        if ticket is not None:
            handed = self._handed.get(ticket.id)
        else:
            handed = self._handed.get(id_or_key) if by_id else None  # type: ignore[call-overload]
        if handed is not None and (ticket is None or handed is ticket):
            del self._handed[handed.id]
            self._doomed.add(handed)
            self._release_key(handed)
            self._tickle()
            return True
        return None

    async def lookup(self, id_or_key: int | Hashable) -> Ticket[Any, Any] | None:
        """The request's state as the store has it, from any process; None if unknown.

        The ticket's times are the store's (seconds since the epoch); a
        failure's error is a :class:`tickler.RequestFailed` holding its type,
        message and traceback as text. For a key, the live request, else the
        latest one.
        """
        return await self._require_store("lookup").lookup(id_or_key)

    async def store_statistics(self) -> dict[str, int]:
        """Exact counts of this service's queue in the store, by status, over every process."""
        return await self._require_store("store_statistics").statistics()

    def _require_store(self, what: str) -> StoreSync:
        stored = self._store_run
        if stored is None:
            raise RuntimeError(f"{what}() needs a service with a store")
        self._check_run("used")
        return stored

    async def join(self) -> None:
        """Wait until nothing is queued, retrying or in flight; close nothing.

        Returns at once if the service is idle, and is always a checkpoint.
        Requests enqueued while it waits are waited for too. Before ``run``
        it waits for the run to take the queue; after the run has ended
        nothing is left and it returns.

        Raises:
            RuntimeError: called from one of the service's own handlers (it
                would wait for itself), or from a different Trio run.
        """
        token = self._check_run("joined")
        if token is not None and self._insider() is not None:
            raise RuntimeError(
                f"join() called from a handler of service {self.name!r} would wait for itself"
            )
        stored = self._store_run
        if stored is not None and token is not None:
            # What the last look at the store saw may be stale: take a fresh
            # one first, and trust only looks taken after the call.
            # (A look already under way may have begun before a commit
            # this caller made: wait for one begun after the call.)
            wanted = stored.looks_begun + 1
            stored.next_check = -math.inf
            self._tickle()
            while stored.checks < wanted and not self._finished.is_set():
                await self._idle_event_or_new().wait()
        while not (self._is_idle() or self._finished.is_set()):
            self._bind()
            await self._idle_event_or_new().wait()
        await trio.lowlevel.checkpoint()

    def _own_request(self) -> int | None:
        """The id of the request whose handler (or a task it spawned) is calling, if any."""
        insider = self._insider()
        if insider is None:
            return None
        attempt = _ATTEMPTS.get(insider)
        return attempt.ticket.id if attempt is not None and attempt.ticket is not None else None

    def _idle_event_or_new(self) -> trio.Event:
        """The event the loop sets once idle; with a store, also after each look at the store."""
        event = self._idle_event
        if event is None:
            event = self._idle_event = trio.Event()
            self._tickle()
        return event

    async def stop(
        self, *, drain: bool = True, timeout: float | None = None
    ) -> list[Ticket[RequestT, ResultT]]:
        """Stop the service and return the tickets that did not complete.

        Enqueueing is refused from the first instant. With ``drain=True`` the
        service keeps starting queued requests and due retries until nothing
        is queued, retrying or in flight; with ``drain=False`` it starts
        nothing more and cancels what is queued or retrying at once. Either way
        it then waits for what runs, up to ``timeout`` seconds (``None``: no
        limit; ``0``: not at all), and cancels what still runs.

        The first call decides ``drain`` and ``timeout``, and the deadline
        belongs to the stop, not to that call: cancelling the caller does not
        cancel the stop. Concurrent and later calls wait for the same stop and
        return the same tickets.

        Called from inside one of the service's own handlers (or a task a
        handler spawned), it waits for everything except the requests whose
        handlers are in ``stop()``, and returns the tickets cancelled so far.

        Returns:
            Every ticket that did not complete, marked CANCELLED, by id.

        Raises:
            RuntimeError: called from a different Trio run than the service's.
        """
        if not isinstance(drain, bool):
            raise TypeError("drain must be a bool")
        limit = _check_timeout("timeout", timeout, allow_zero=True)
        token = self._check_run("stopped")
        if not self._closed:
            self._stop_called = True
            self._close()
            self.stopping.set()
            if token is None:
                self._wind_down(trio.current_time())
            else:
                now = self._time()
                assert now is not None
                if limit is not None:
                    self._stop_deadline = now + limit
                if drain:
                    self._draining = True
                else:
                    self._may_start = False
                    self._cancel_waiting(now)
                    if self._store_run is not None:
                        # With a store, what runs goes back to the store at
                        # once; but for a caller's own attempt (see below).
                        own = self._own_request()
                        for request_id in list(self._store_run.scopes):
                            if request_id != own:
                                self._store_run.withdraw(request_id, "handback")
                self._tickle()
        insider = self._insider() if token is not None else None
        if insider is None:
            await self._finished.wait()
        else:
            self._insiders[insider] += 1
            try:
                if self._quiet.is_set() and not self._finished.is_set():
                    self._quiet = trio.Event()
                self._tickle()
                await self._quiet.wait()
            finally:
                self._insiders[insider] -= 1
                if not self._insiders[insider]:
                    del self._insiders[insider]
        if self._finished.is_set():
            return list(self._stopped_tickets)  # sorted once, when the run ended
        return sorted(self._stopped_tickets, key=_by_id)


def _by_id(ticket: Ticket[Any, Any]) -> int:
    return ticket.id
