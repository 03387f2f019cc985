"""The intake: the cold ways into the queue, and the places a request waits besides it.

``enqueue_request`` without a key or a delay is the engine's hot path
(``_engine._Engine._enqueue_request``). Everything else that puts a request
in is here: keys, delays, ``submit()`` and its wait for room, the refusals
(closed, full), the delayed requests on their way to the timer heap, and a
request taken but not started that goes back where it waited.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any

import attrs
import trio

from ._core import (
    _MISSING,
    _QUEUED,
    _SCHEDULED,
    _UNBOUNDED,
    _check_delay,
    _check_key,
    _get_ident,
    _one_line,
    logger,
)
from ._engine import _Engine
from ._exceptions import QueueFull, ServiceClosed
from ._ticket import Ticket


@attrs.define(eq=False)
class Intake:
    """Keys, delays, submit() and refusals: the intake's state and its rules."""

    engine: _Engine[Any, Any]
    # Keys of live requests, and the key of each keyed live ticket.
    keys: dict[object, Ticket[Any, Any]] = attrs.Factory(dict)
    key_of: dict[Ticket[Any, Any], object] = attrs.Factory(dict)
    # Delayed requests on their way to the heap: enqueues (from any thread)
    # append (delay, ticket) under the lock; the loop moves them into the
    # heap, which only its own thread touches.
    incoming: list[tuple[float, Ticket[Any, Any]]] = attrs.Factory(list)
    scheduled: int = 0  # delayed requests not yet started, under the lock
    # submit() callers waiting for room in the queue (the engine counts them).
    room: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    rejected: int = 0
    deduplicated: int = 0

    def refuse(self, length: int) -> None:
        """Raise why the hot path may not take a request; with the lock held.

        A follow-up from one of the service's own handlers during a drain,
        with room in the queue, is not refused: then this returns.
        """
        self.check_open()
        self.check_room(length)

    def enqueue_keyed(
        self,
        request: Any,
        key: Hashable | None,
        delay: float | None,
        *,
        waits: bool = False,
    ) -> Ticket[Any, Any]:
        """enqueue_request with a key or a delay, and for submit (which ``waits``)."""
        engine = self.engine
        if engine._store_run is not None:
            return engine._store_run.accept(request, key, delay, None, waits=waits)
        if key is not None:
            _check_key(key)
        if delay is not None:
            delay = _check_delay(delay)
        context = engine._capture_context()
        status = _QUEUED if delay is None else _SCHEDULED
        ticket: Ticket[Any, Any] = Ticket(request, 0, status, 0, None, None, context)
        with engine._lock:
            queue = engine._queue
            length = len(queue)
            self.check_open()
            if key is not None:
                live = self.keys.get(key)
                if live is not None:
                    self.deduplicated += 1
                    if engine._debug:
                        logger.debug("request #%d already holds this key", live.id)
                    return live
            self.check_room(length, waits=waits)
            if key is not None:
                self.keys[key] = ticket  # first: the one step here that may raise
                self.key_of[ticket] = key
            ticket.enqueued_at = engine._time()
            engine._last_id = ticket.id = engine._last_id + 1
            on_loop_thread = engine._thread == _get_ident()
            if delay is None:
                queue.append(ticket)
            else:
                self.scheduled += 1
                self.set_admit()
                if on_loop_thread and ticket.enqueued_at is not None:
                    # Straight into the heap, where processors look before
                    # the queue: due now, it goes before what is queued next.
                    entry = (ticket.enqueued_at + delay, next(engine._heap_seq), ticket)
                    heapq.heappush(engine._heap, entry)
                else:
                    # The heap is the loop thread's: other threads hand over.
                    self.incoming.append((delay, ticket))
            if on_loop_thread:
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._debug:
            logger.debug("request #%d added, key %r, delay %r", ticket.id, key, delay)
        return ticket

    def check_open(self) -> None:
        """Raise ServiceClosed once a stop has begun, but for a drain's follow-ups.

        Called with the lock held, on a refusal path: only there does it ask
        who the caller is.
        """
        engine = self.engine
        if engine._closed and not (engine._draining and engine._is_follow_up()):
            self.rejected += 1
            engine._last_context = None  # a refused caller's context is kept by nothing
            closed = ServiceClosed(f"service {engine.name!r} is closed")
            closed._service = engine  # whose stop refused it: see Outcomes.refused_by_stop
            raise closed

    def check_room(self, length: int, *, waits: bool = False) -> None:
        """Raise QueueFull if ``length`` queued requests and the delayed ones fill the queue.

        Called with the lock held, on a refusal path. A caller that ``waits``
        for room (submit) is not refused, and not counted.
        """
        engine = self.engine
        bound = engine.max_queue_length
        if bound is not None and length + self.scheduled >= bound:
            if not waits:
                self.rejected += 1
            engine._last_context = None  # a refused caller's context is kept by nothing
            scheduled = f" and {self.scheduled} scheduled" if self.scheduled else ""
            raise QueueFull(
                f"service {engine.name!r} already has {length} queued{scheduled} requests"
            )

    def set_admit(self) -> None:
        """Recompute the hot path's bound. Called with the lock held."""
        engine = self.engine
        bound = engine.max_queue_length
        if engine._closed or engine._store_run is not None:
            engine._admit = 0
        elif bound is not None:
            engine._admit = bound - self.scheduled
        else:
            engine._admit = _UNBOUNDED

    def has_room(self) -> bool:
        engine = self.engine
        bound = engine.max_queue_length
        run = engine._store_run
        waiting = len(run.pending) if run is not None else len(engine._queue) + self.scheduled
        return not engine._closed and (bound is None or waiting < bound)

    async def submit(
        self, request: Any, *, key: Hashable | None = None, delay: float | None = None
    ) -> Ticket[Any, Any]:
        """Service.submit: enqueue, waiting for room (see its docstring)."""
        engine = self.engine
        token = engine._check_run("submitted to")
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                ticket = self.enqueue_keyed(request, key, delay, waits=True)
            except QueueFull:
                if token is not None and engine._insider() is not None:
                    with engine._lock:
                        self.rejected += 1
                    raise
                engine._bind()
                engine._submitters += 1
                try:
                    await self.room.park()
                finally:
                    engine._submitters -= 1
                continue
            if engine._submitters and self.has_room():
                # This caller may have been woken for room it did not use (its
                # key was live) or that is still there: pass the wake-up on.
                self.room.unpark()
            run = engine._store_run
            if run is not None:
                # Returns once the batch holding the request has committed.
                while ticket.id == 0 and not ticket.done and not engine._stopping.finished.is_set():
                    await run.committed.wait()
                if ticket.id == 0 and ticket.done:
                    ticket.result()  # the store refused it: its StoreError
                if ticket.id == 0:
                    raise ServiceClosed(
                        f"service {engine.name!r} ended before the request was committed"
                    )
            await trio.lowlevel.cancel_shielded_checkpoint()
            return ticket

    def schedule_incoming(self) -> None:
        """Move the delayed requests enqueued since the last wake-up into the timer heap."""
        engine = self.engine
        with engine._lock:
            incoming, self.incoming = self.incoming, []
        heap = engine._heap
        seq = engine._heap_seq
        for delay, ticket in incoming:
            assert ticket.enqueued_at is not None
            heapq.heappush(heap, (ticket.enqueued_at + delay, next(seq), ticket))

    @trio.lowlevel.enable_ki_protection
    def unschedule(self) -> None:
        """A delayed request leaves the heap: it no longer holds a queue place."""
        engine = self.engine
        with engine._lock:
            self.scheduled -= 1
            self.set_admit()
        if engine._submitters:
            self.room.unpark()

    @trio.lowlevel.enable_ki_protection
    def release_key(self, ticket: Ticket[Any, Any]) -> None:
        """Free the key of a request about to become final, if it has one.

        Freed before the request is marked final: an enqueue that finds the
        key still taken gets a ticket that was live when it looked.
        """
        engine = self.engine
        with engine._lock:
            key = self.key_of.pop(ticket, _MISSING)
            if key is _MISSING:
                return
            try:
                if self.keys.get(key) is ticket:
                    del self.keys[key]
                    return
            except Exception:  # noqa: S110 - handled below, like a key that is not found
                pass
            # The key's hash or equality changed while its request was live:
            # find its entry by identity instead.
            try:
                self.keys = {k: t for k, t in self.keys.items() if t is not ticket}
            except Exception as exc:
                logger.error(
                    "the key of request #%d could not be freed; its hash or equality"
                    " changed while the request was live (%s)",
                    ticket.id,
                    _one_line(exc),
                )

    @trio.lowlevel.enable_ki_protection
    def put_back(self, ticket: Ticket[Any, Any], now: float) -> None:
        """A request taken but not started goes back where it waited, first in line."""
        engine = self.engine
        status = ticket.status
        if status is _QUEUED:
            with engine._lock:
                engine._queue.appendleft(ticket)
        else:
            if status is _SCHEDULED:
                with engine._lock:
                    self.scheduled += 1
                    self.set_admit()
            else:
                engine._retrying += 1
            heapq.heappush(engine._heap, (now, next(engine._heap_seq), ticket))
        engine._tickle()
