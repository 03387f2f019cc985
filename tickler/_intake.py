"""The intake: the cold ways into the queue, and the places a request waits besides it.

``enqueue_request`` without a key or a delay is the engine's hot path
(``_engine._Engine._enqueue_request``). Everything else that puts a request
in is here: keys, delays, ``submit()`` and its wait for room, the refusals
(closed, full), the delayed requests on their way to the timer heap, and a
request taken but not started that goes back where it waited.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import attrs
import trio

from ._codec import check_group
from ._core import (
    _MISSING,
    _QUEUED,
    _SCHEDULED,
    _UNBOUNDED,
    _check_delay,
    _check_key,
    _get_ident,
    _one_line,
    check_priority,
    check_unique_for,
    logger,
)
from ._engine import _PRIORITY_0, _Engine
from ._exceptions import QueueFull, queue_full, service_closed
from ._ticket import Ticket

_new_ticket = object.__new__
# Stands for a request of enqueue_many's that will hold its key.
_PLACEHOLDER: Any = object()
# The key_of entry of a request with a priority and no key.
_UNKEYED: Any = object()


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
    # The priority of each request that has one other than 0, while live.
    priority_of: dict[Ticket[Any, Any], int] = attrs.Factory(dict)
    # Queued requests with a priority (they wait in the engine's ready heap).
    ranked: int = 0
    # unique_for of each keyed request that has one, while live; and the keys
    # it holds once final, with the time (Trio's clock) until which they do.
    unique_for_of: dict[Ticket[Any, Any], float] = attrs.Factory(dict)
    held: dict[object, tuple[Ticket[Any, Any], float]] = attrs.Factory(dict)
    held_sweep_at: int = 64
    # Requests handed to a processor when a pause came: they go back unstarted.
    deferred: set[Ticket[Any, Any]] = attrs.Factory(set)

    def enqueue_checked(self, ticket: Ticket[Any, Any]) -> Ticket[Any, Any]:
        """The rest of enqueue_request once its fast path's one comparison failed.

        The twin of _Engine._enqueue_request's locked part: the request is
        refused (closed, or the queue is full), unless it is a follow-up
        from one of the service's own handlers during a drain with room in
        the queue; or it is taken and logged at DEBUG.
        """
        engine = self.engine
        with engine._lock:
            queue = engine._queue
            length = len(queue)
            # serves: otel_drop_parent (each traced enqueue comes this way): no call to ask
            # what the engine's own fields answer
            if engine._closed:
                self.check_open()
            if engine.max_queue_length is not None:
                self.check_room(length)
            if ticket.enqueued_at is None:
                ticket.enqueued_at = engine._time()  # the run may have started meanwhile
            engine._last_id = ticket.id = engine._last_id + 1
            queue.append(ticket)
            if engine._wakeup_pending:
                pass  # (the loop has yet to take the lock, and will find this request)
            elif engine._thread == _get_ident():
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._debug:
            logger.debug("request #%d added, queue length now %d", ticket.id, length + 1)
        if engine._tracer is not None:
            engine._tracer.enqueued((ticket,))
        return ticket

    def enqueue_grouped(self, request: Any, group: str | None) -> Ticket[Any, Any]:
        """enqueue_request with a group and no other option, on a service with limits.

        tuned (bench: groups): the twin of _Engine._enqueue_request's hot path
        (and of insert), for a request that waits in the plain queue and is
        checked against its group's limit as it leaves (see Groups).
        """
        engine = self.engine
        checked = check_group(group)
        groups = engine._groups
        timer = engine._timer
        if checked is None or groups is None or timer is None:
            return self.enqueue_keyed(request, None, None, 0, None, group, general=True)
        ticket: Ticket[Any, Any] = _new_ticket(Ticket)
        ticket.request = request
        ticket.status = _QUEUED
        ticket.attempts = 0
        ticket.enqueued_at = engine._offset + timer()
        ticket.started_at = None
        ticket._state = engine._capture_context()
        with engine._lock:
            queue = engine._queue
            taken = len(queue) < engine._admit  # else closed, full, or DEBUG
            if taken:
                engine._last_id = ticket.id = engine._last_id + 1
                groups.group_of[ticket] = checked
                self.key_of[ticket] = _UNKEYED  # (see insert)
                queue.append(ticket)
                if not engine._wakeup_pending:
                    if engine._thread == _get_ident():
                        engine._tickle()
                    else:
                        engine._wake_from_thread()
        if not taken:  # the general path decides
            return self.enqueue_keyed(request, None, None, 0, None, group, general=True)
        return ticket

    def enqueue_keyed(
        self,
        request: Any,
        key: Hashable | None,
        delay: float | None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
        *,
        waits: bool = False,
        general: bool = False,
    ) -> Ticket[Any, Any]:
        """enqueue_request off its fast path, and submit's (which ``waits``).

        ``general``: not by enqueue_grouped, which hands back what it does not take.
        """
        engine = self.engine
        if (
            group is not None
            and key is None
            and delay is None
            and priority is _PRIORITY_0
            and unique_for is None
            and not (waits or general)
            and engine._groups is not None
        ):
            return self.enqueue_grouped(request, group)  # tuned (bench: groups)
        priority = check_priority(priority)
        unique_for = check_unique_for(unique_for, key)
        group = check_group(group)
        if engine._store_run is not None:
            return engine._store_run.accept(
                request,
                key,
                delay,
                None,
                waits=waits,
                priority=priority,
                unique_for=unique_for,
                group=group,
            )
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
                live = self.holder(key)
                if live is not None:
                    self.deduplicated += 1
                    if engine._debug:
                        logger.debug("request #%d already holds this key", live.id)
                    return live
            self.check_room(length, waits=waits)
            on_loop_thread = engine._thread == _get_ident()
            self.insert(
                ticket, key, delay, priority, unique_for, engine._time(), on_loop_thread, group
            )
            if on_loop_thread:
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._debug:
            logger.debug("request #%d added, key %r, delay %r", ticket.id, key, delay)
        if engine._tracer is not None:
            engine._tracer.enqueued((ticket,))
        return ticket

    def insert(
        self,
        ticket: Ticket[Any, Any],
        key: Hashable | None,
        delay: float | None,
        priority: int,
        unique_for: float | None,
        now: float | None,
        on_loop_thread: bool,
        group: str | None = None,
    ) -> None:
        """Give ``ticket`` its id and put it where it waits. Called with the lock held."""
        engine = self.engine
        if key is not None:
            self.keys[key] = ticket  # first: the one step here that may raise
            self.key_of[ticket] = key
            if unique_for is not None:
                self.unique_for_of[ticket] = unique_for
        ticket.enqueued_at = now
        engine._last_id = ticket.id = engine._last_id + 1
        groups = engine._groups
        grouped = False
        if group is not None and groups is not None:
            groups.group_of[ticket] = group
            grouped = True
        if priority:
            self.priority_of[ticket] = priority
        if (priority or grouped) and key is None:
            # In key_of too, which the processor's success path checks
            # tuned (bench: burst): one test of one dict for keys, priorities and groups.
            self.key_of[ticket] = _UNKEYED
        if delay is None and priority:
            # Limits are checked as requests leave the ready heap or the
            # queue (see Groups).
            self.rank(ticket, priority)
        elif delay is None:
            # tuned (bench: groups): a grouped request of priority 0 waits in
            # the plain queue, in enqueue order, as its place in the ready heap
            # would say, with none of the heap's cost.
            engine._queue.append(ticket)
        else:
            self.scheduled += 1
            self.set_admit()
            if on_loop_thread and now is not None:
                # Straight into the heap, where processors look before
                # the queue: due now, it goes before what is queued next.
                heapq.heappush(engine._heap, (now + delay, next(engine._heap_seq), ticket))
            else:
                # The heap is the loop thread's: other threads hand over.
                self.incoming.append((delay, ticket))

    def enqueue_many(
        self,
        requests: Iterable[Any],
        key: Callable[[Any], Hashable | None] | None,
        unique_for: float | None,
        priority: int,
        delay: float | None,
        group: str | None = None,
    ) -> list[Ticket[Any, Any]]:
        """Service.enqueue_many: every request accepted, or none (see its docstring)."""
        engine = self.engine
        if isinstance(requests, str | bytes) or not isinstance(requests, Iterable):
            kind = type(requests).__name__
            raise TypeError(f"requests must be an iterable of requests, not {kind}")
        if key is not None and not callable(key):
            raise TypeError(
                f"key must be a callable (request -> key) or None, not {type(key).__name__}"
            )
        priority = check_priority(priority)
        group = check_group(group)
        unique_for = check_unique_for(unique_for, key)
        if delay is not None:
            delay = _check_delay(delay)
        items = list(requests)
        keys: list[Hashable | None] | None = None
        if key is not None:
            keys = [key(item) for item in items]  # user code: before the lock
            for each in keys:
                if each is not None:
                    _check_key(each)
        if engine._store_run is not None:
            return engine._store_run.accept_many(items, keys, delay, priority, unique_for, group)
        if keys is None and delay is None and not priority and group is None:
            return self.enqueue_plain(items)
        context = engine._capture_context()
        status = _QUEUED if delay is None else _SCHEDULED
        tickets: list[Ticket[Any, Any]] = []
        created: list[Ticket[Any, Any]] = []  # the new ones (the rest had their key taken)
        with engine._lock:
            self.check_open()
            # First which requests are new (a key may be taken, or repeated
            # here): the room is checked for all of them before any is put in.
            fresh: dict[Hashable, Ticket[Any, Any]] = {}
            new = 0
            for index in range(len(items)):
                each = keys[index] if keys is not None else None
                holder = None if each is None else fresh.get(each) or self.holder(each)
                if holder is None:
                    new += 1
                    if each is not None:
                        fresh[each] = _PLACEHOLDER
            bound = engine.max_queue_length
            waiting = len(engine._queue) + self.scheduled + self.ranked
            if bound is not None and waiting + new > bound:
                self.rejected += new
                engine._last_context = None
                raise queue_full(engine.name, bound, waiting, new)
            now = engine._time()
            on_loop_thread = engine._thread == _get_ident()
            fresh.clear()
            for index, item in enumerate(items):
                each = keys[index] if keys is not None else None
                holder = None if each is None else fresh.get(each) or self.holder(each)
                if holder is not None:
                    self.deduplicated += 1
                    tickets.append(holder)
                    continue
                ticket: Ticket[Any, Any] = Ticket(item, 0, status, 0, None, None, context)
                self.insert(ticket, each, delay, priority, unique_for, now, on_loop_thread, group)
                if each is not None:
                    fresh[each] = ticket
                tickets.append(ticket)
                created.append(ticket)
            if on_loop_thread:
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._tracer is not None:
            engine._tracer.enqueued(created)
        return tickets

    def enqueue_plain(self, items: list[Any]) -> list[Ticket[Any, Any]]:
        """enqueue_many of plain requests (no key, delay or priority): one lock, one tickle."""
        engine = self.engine
        context = engine._capture_context()
        now = engine._time()
        # tuned (bench: enqueue_many): tickets built field by field, outside the lock, as in
        # _Engine._enqueue_request (its twin), and given their ids under one lock.
        tickets: list[Ticket[Any, Any]] = []
        append = tickets.append
        # tuned (bench: enqueue_many): no garbage collection while the tickets are
        # made: every one of them stays alive, and the collections that so many
        # new objects would set off (each pass over all of them) cost twice as
        # much as making them.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for item in items:
                ticket = _new_ticket(Ticket)
                ticket.request = item
                ticket.status = _QUEUED
                ticket.attempts = 0
                ticket.enqueued_at = now
                ticket.started_at = None
                ticket._state = context
                append(ticket)
        finally:
            if collecting:
                gc.enable()
        with engine._lock:
            self.check_open()
            queue = engine._queue
            bound = engine.max_queue_length
            waiting = len(queue) + self.scheduled + self.ranked
            if bound is not None and waiting + len(items) > bound:
                self.rejected += len(items)
                engine._last_context = None
                raise queue_full(engine.name, bound, waiting, len(items))
            first = engine._last_id + 1
            for offset, ticket in enumerate(tickets):
                ticket.id = first + offset
            engine._last_id += len(tickets)
            if now is None:
                now = engine._time()  # the run may have started meanwhile
                for ticket in tickets:
                    ticket.enqueued_at = now
            queue.extend(tickets)
            if engine._thread == _get_ident():
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._tracer is not None:
            engine._tracer.enqueued(tickets)
        return tickets

    def check_open(self) -> None:
        """Raise ServiceClosed once a stop has begun, but for a drain's follow-ups.

        Called with the lock held, on a refusal path: only there does it ask
        who the caller is.
        """
        engine = self.engine
        if engine._closed and not (engine._draining and engine._is_follow_up()):
            self.rejected += 1
            engine._last_context = None  # a refused caller's context is kept by nothing
            raise service_closed(engine.name, engine)  # whose stop refused it

    def check_room(self, length: int, *, waits: bool = False) -> None:
        """Raise QueueFull if ``length`` queued requests and the delayed ones fill the queue.

        Called with the lock held, on a refusal path. A caller that ``waits``
        for room (submit) is not refused, and not counted.
        """
        engine = self.engine
        bound = engine.max_queue_length
        if bound is not None and length + self.scheduled + self.ranked >= bound:
            if not waits:
                self.rejected += 1
            engine._last_context = None  # a refused caller's context is kept by nothing
            raise queue_full(engine.name, bound, length + self.scheduled + self.ranked, 1)

    def set_admit(self) -> None:
        """Recompute the hot path's bound. Called with the lock held."""
        engine = self.engine
        bound = engine.max_queue_length
        # tuned (bench: enqueue): logging at DEBUG, or tracing, sends every enqueue
        # through enqueue_checked, which logs or traces it: the fast path need not ask.
        # (Tracing with nothing to do per request, the no-op tracer in memory, does not.)
        tracer = engine._tracer
        if (
            engine._closed
            or engine._store_run is not None
            or engine._debug
            or (tracer is not None and tracer.per_request)
        ):
            engine._admit = 0
        elif bound is not None:
            engine._admit = bound - self.scheduled - self.ranked
        else:
            engine._admit = _UNBOUNDED

    def has_room(self) -> bool:
        engine = self.engine
        bound = engine.max_queue_length
        run = engine._store_run
        waiting = (
            len(run.pending)
            if run is not None
            else len(engine._queue) + self.scheduled + self.ranked
        )
        return not engine._closed and (bound is None or waiting < bound)

    async def submit(
        self,
        request: Any,
        *,
        key: Hashable | None = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> Ticket[Any, Any]:
        """Service.submit: enqueue, waiting for room (see its docstring)."""
        engine = self.engine
        token = engine._check_run("submitted to")
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                ticket = self.enqueue_keyed(
                    request, key, delay, priority, unique_for, group, waits=True
                )
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
                    raise service_closed(engine.name)
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

    def holder(self, key: Hashable) -> Ticket[Any, Any] | None:
        """The request holding ``key``: the live one, else one whose unique_for still runs.

        Called with the lock held.
        """
        live = self.keys.get(key)
        if live is not None or not self.held:
            return live
        held = self.held.get(key)
        if held is None:
            return None
        now = self.engine._time()
        if now is not None and now >= held[1]:
            del self.held[key]
            return None
        return held[0]

    def rank(self, ticket: Ticket[Any, Any], priority: int) -> None:
        """A queued request with a priority waits in the ready heap. Called with the lock held."""
        engine = self.engine
        ready_since = ticket.enqueued_at if ticket.enqueued_at is not None else -math.inf
        heapq.heappush(engine._ready, (-priority, ready_since, ticket.id, ticket))
        self.ranked += 1
        self.set_admit()

    @trio.lowlevel.enable_ki_protection
    def unrank(self) -> None:
        """A queued request with a priority leaves the ready heap to start."""
        engine = self.engine
        with engine._lock:
            self.ranked -= 1
            self.set_admit()
        if engine._submitters:
            self.room.unpark()

    @trio.lowlevel.enable_ki_protection
    def release_key(self, ticket: Ticket[Any, Any], running: bool = False) -> None:
        """Free the key of a request about to become final, and forget its priority.

        Freed before the request is marked final: an enqueue that finds the
        key still taken gets a ticket that was live when it looked. A key
        enqueued with unique_for stays held by this ticket until its time
        is up (see holder). ``running``: a running attempt taken away
        (cancel()), which holds its group's slot until it ends: its group is
        forgotten then, when its end comes here again.
        """
        engine = self.engine
        groups = engine._groups
        grouped = False
        if groups is not None and groups.group_of:
            if running and ticket in groups.group_of:
                grouped = True
            else:
                groups.forget(ticket)  # (before the lock: it may hand the group's next one on)
        with engine._lock:
            key = self.key_of.pop(ticket, _MISSING)
            if grouped:
                self.key_of[ticket] = _UNKEYED  # the attempt's end finds it here (see above)
            if key is _MISSING:
                return
            if self.priority_of:
                self.priority_of.pop(ticket, None)
            if key is _UNKEYED:
                return
            unique_for = self.unique_for_of.pop(ticket, None) if self.unique_for_of else None
            if unique_for is not None:
                self.hold(key, ticket, unique_for)
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

    def hold(self, key: object, ticket: Ticket[Any, Any], unique_for: float) -> None:
        """Keep ``key`` taken by ``ticket`` until unique_for after its enqueue. Lock held."""
        now = self.engine._time()
        enqueued = ticket.enqueued_at if ticket.enqueued_at is not None else now
        if enqueued is None or now is None or enqueued + unique_for <= now:
            return
        held = self.held
        held[key] = (ticket, enqueued + unique_for)
        if len(held) >= self.held_sweep_at:
            # Forget the holds whose time is up, at most once per doubling.
            for old in [k for k, (_, until) in held.items() if until <= now]:
                del held[old]
            self.held_sweep_at = max(64, 2 * len(held))

    @trio.lowlevel.enable_ki_protection
    def put_back(self, ticket: Ticket[Any, Any], now: float) -> None:
        """A request taken but not started goes back where it waited, first in line."""
        engine = self.engine
        if engine._groups is not None:
            engine._groups.ended(ticket)  # admitted, not started: its group's slot is free
        status = ticket.status
        if status is _QUEUED:
            with engine._lock:
                priority = self.priority_of.get(ticket, 0)
                if priority or (engine._groups is not None and ticket in engine._groups.group_of):
                    heapq.heappush(engine._ready, (-priority, -math.inf, ticket.id, ticket))
                    self.ranked += 1
                    self.set_admit()
                else:
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
