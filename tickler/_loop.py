"""The supervisor loop: dispatch, sleep until tickled or due; and stopping and joining."""

from __future__ import annotations

import heapq
import logging
import math
import time
from typing import Any

import trio

from ._core import _EMPTY_CONTEXT, _SCHEDULED, _check_timeout, _get_ident, logger
from ._exceptions import ServiceClosed
from ._processors import _Processors, _Slot
from ._ticket import RequestT, ResultT, Ticket


def _offset_of(clock: trio.abc.Clock) -> float:
    """For Trio's default clock, its offset from ``time.perf_counter()``; else 0.

    Trio's default clock reads ``offset + perf_counter()`` through a Python
    method. The hot paths read the same sum themselves, which costs a tenth
    of the call. The formula is checked against the clock before it is used.
    """
    kind = type(clock)
    offset = getattr(clock, "offset", None)
    if (kind.__module__, kind.__qualname__) != ("trio._core._run", "SystemClock") or (
        type(offset) is not float or not offset
    ):
        return 0.0
    before = clock.current_time()
    read = offset + time.perf_counter()
    after = clock.current_time()
    return offset if before <= read <= after else 0.0


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
        self._signal_tx, self._signal_rx = trio.open_memory_channel[None](1)
        clock = trio.lowlevel.current_clock()
        now = clock.current_time()
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = _get_ident()
            # The offset first: a thread that sees the timer sees its offset.
            self._timer, self._offset = None, _offset_of(clock)
            self._timer = time.perf_counter if self._offset else clock.current_time
            for ticket in self._queue:
                ticket.enqueued_at = now
            for _, ticket in self._incoming:
                ticket.enqueued_at = now
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._supervise()
        finally:
            self._wind_down(self._time())

    async def _supervise(self) -> None:
        """The loop: dispatch, then sleep until tickled, a retry is due or the stop's deadline."""
        assert self._signal_rx is not None
        timer = self._timer
        assert timer is not None
        offset = self._offset
        receive = self._signal_rx.receive
        heap = self._heap
        try:
            while True:
                if self._incoming:
                    self._schedule_incoming()
                dispatched_at = self._dispatch()
                if self._stop_called:
                    if self._is_idle():
                        self._release_idle()
                        return
                    if offset + timer() >= self._stop_deadline:
                        self._expire()
                    elif self._insiders:
                        self._check_quiet()
                if not self._queue:
                    # Nothing waits: keep no enqueuer's context alive for sharing.
                    self._last_context = None
                    if self._idle_event is not None and self._is_idle():
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
                if wake_at < math.inf:
                    with trio.move_on_at(wake_at):
                        await receive()
                        self._wakeup_pending = False
                else:
                    await receive()
                    self._wakeup_pending = False
                self._wakeups += 1
                self._debug = logger.isEnabledFor(logging.DEBUG)
        except BaseException:
            # Cancelled with the run, or the run is ending: from this instant
            # no processor starts another request.
            self._may_start = self._draining = False
            raise

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
        while limiter.borrowed_tokens < limiter.total_tokens:
            ticket = self._take(now)
            if ticket is None:
                return now
            slot = _Slot(ticket.id)
            limiter.acquire_on_behalf_of_nowait(slot)
            if self._idle:
                # A parked processor takes the start: no task spawn.
                parked = self._idle.pop()
                parked.handed = (ticket, slot)
                trio.lowlevel.reschedule(parked.task)
            else:
                # Processors start in an empty context of their own.
                _EMPTY_CONTEXT.copy().run(nursery.start_soon, self._process, ticket, slot)
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
        return not self._queue and not self._heap and not self._incoming and self._in_flight == 0

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
        while not (self._is_idle() or self._finished.is_set()):
            self._bind()
            event = self._idle_event
            if event is None:
                event = self._idle_event = trio.Event()
                self._tickle()
            await event.wait()
        await trio.lowlevel.checkpoint()

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
