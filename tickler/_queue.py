"""The queue: how requests get in (enqueue, submit, keys, delays) and out (_take)."""

from __future__ import annotations

import contextvars
import heapq
import inspect
from collections.abc import Hashable
from typing import TYPE_CHECKING

import trio

from ._core import (
    _EMPTY_CONTEXT,
    _MISSING,
    _QUEUED,
    _SCHEDULED,
    _UNBOUNDED,
    _check_delay,
    _check_key,
    _Context,
    _get_ident,
    _one_line,
    _run_in,
    _ServiceCore,
    logger,
)
from ._exceptions import QueueFull, ServiceClosed
from ._ticket import RequestT, ResultT, Ticket

_copy_context = contextvars.copy_context
_new_ticket = object.__new__
_KEYWORD_ONLY = object()


class _QueueSide(_ServiceCore[RequestT, ResultT]):
    """Requests wait in a deque behind a threading.Lock; delayed ones in the loop's heap."""

    __slots__ = ()

    # A KeyboardInterrupt never lands halfway through the bookkeeping of the
    # methods marked so (Trio delivers it at the next unprotected point).
    #
    # tuned (bench: enqueue): key and delay are keyword-only, but the code does not declare them so:
    # CPython 3.11 does not specialize calls to functions with keyword-only
    # parameters, which costs about 5% of an enqueue. A guard parameter
    # refuses them by position instead; type checkers see the declared
    # signature (below the method), and so does inspect.signature.
    @trio.lowlevel.enable_ki_protection
    def _enqueue_request(
        self,
        request: RequestT,
        _keyword_only: object = _KEYWORD_ONLY,
        key: Hashable | None = None,
        delay: float | None = None,
    ) -> Ticket[RequestT, ResultT]:
        # (The docstring is _ENQUEUE_REQUEST_DOC, below the class.)
        if key is not None or delay is not None or _keyword_only is not _KEYWORD_ONLY:
            if _keyword_only is not _KEYWORD_ONLY:
                raise TypeError(
                    "enqueue_request() takes one positional argument, the request;"
                    " key and delay are keyword-only"
                )
            return self._enqueue_keyed(request, key, delay)
        # (Everything below is the hot path. _enqueue_keyed is its twin for
        # keys and delays; _capture_context, the part on contextvars.)
        # tuned (bench: burst, a contextvar set; enqueue): the context is
        # shared with the last request's when it holds the very same objects;
        # twin: _capture_context.
        context = _copy_context()
        if not context:
            # One shared empty Context serves every request enqueued without
            # contextvars: no per-request Context to keep or to collect.
            context = _EMPTY_CONTEXT
        else:
            last = self._last_context
            shared = last is not None and last[2] == len(context)
            if shared:
                # The same variables holding the very same objects: share the
                # earlier Context. Values are compared by identity only, never
                # with ==, which may run user code and calls equal values alike.
                # (The processor's twin is _holds; here the check is inlined
                # over a cached tuple of items, the cheaper form per enqueue.)
                try:
                    for var, value in last[1]:  # type: ignore[index]
                        if context[var] is not value:
                            shared = False
                            break
                except KeyError:
                    shared = False
            if shared:
                context = last[0]  # type: ignore[index]
            else:
                self._last_context = (context, tuple(context.items()), len(context))
        timer = self._timer
        # tuned (bench: enqueue): the ticket is built field by field, outside the lock: Ticket's own
        # __init__ (its twin) costs about 40 ns more per call. Its id is given
        # under the lock.
        ticket = _new_ticket(Ticket)
        ticket.request = request
        ticket.status = _QUEUED
        ticket.attempts = 0
        ticket.enqueued_at = self._offset + timer() if timer is not None else None
        ticket.started_at = None
        ticket._state = context
        lock = self._lock
        # tuned (bench: enqueue): acquire/release rather than `with`: the context-manager protocol
        # costs about as much again as the lock itself on this path.
        lock.acquire()
        try:
            queue = self._queue
            length = len(queue)
            if length >= self._admit:
                if self._store_run is not None:
                    # A service with a store: _admit is always 0, so that the
                    # in-memory hot path pays nothing for the store's path.
                    lock.release()
                    try:
                        return self._store_run.accept(request, None, None, ticket)
                    finally:
                        lock.acquire()
                # Refused, unless it is a follow-up from one of the service's
                # own handlers during a drain, with room in the queue. Only
                # this slow path asks which.
                self._check_open()
                self._check_room(length)
            if timer is None:
                ticket.enqueued_at = self._time()  # the run may have started meanwhile
            self._last_id = ticket.id = ticket_id = self._last_id + 1
            queue.append(ticket)
            if not self._wakeup_pending:
                # (When a wake-up is pending, the loop has yet to take the
                # lock and will find this request.)
                if self._thread == _get_ident():
                    self._tickle()
                else:
                    self._wake_from_thread()
        finally:
            lock.release()
        if self._debug:
            logger.debug("request #%d added, queue length now %d", ticket_id, length + 1)
        return ticket

    if TYPE_CHECKING:

        def enqueue_request(
            self, request: RequestT, *, key: Hashable | None = None, delay: float | None = None
        ) -> Ticket[RequestT, ResultT]:
            """The declared signature."""
            ...

    else:
        enqueue_request = _enqueue_request

    def _capture_context(self) -> contextvars.Context:
        """The caller's context for a new request, shared with the last one if unchanged.

        The twin of the code at the start of enqueue_request, which inlines it.
        """
        context = _copy_context()
        if not context:
            return _EMPTY_CONTEXT
        last = self._last_context
        if last is not None and last[2] == len(context):
            try:
                if all(context[var] is value for var, value in last[1]):
                    return last[0]
            except KeyError:
                pass
        self._last_context = (context, tuple(context.items()), len(context))
        return context

    def _check_open(self) -> None:
        """Raise ServiceClosed once a stop has begun, but for a drain's follow-ups.

        Called with the lock held, on a refusal path: only there does it ask
        who the caller is.
        """
        if self._closed and not (self._draining and self._is_follow_up()):
            self._rejected += 1
            self._last_context = None  # a refused caller's context is kept by nothing
            closed = ServiceClosed(f"service {self.name!r} is closed")
            closed._service = self  # whose stop refused it: see _Processors._refused_by_stop
            raise closed

    def _check_room(self, length: int, *, waits: bool = False) -> None:
        """Raise QueueFull if ``length`` queued requests and the delayed ones fill the queue.

        Called with the lock held, on a refusal path. A caller that ``waits``
        for room (submit) is not refused, and not counted.
        """
        bound = self.max_queue_length
        if bound is not None and length + self._scheduled >= bound:
            if not waits:
                self._rejected += 1
            self._last_context = None  # a refused caller's context is kept by nothing
            scheduled = f" and {self._scheduled} scheduled" if self._scheduled else ""
            raise QueueFull(
                f"service {self.name!r} already has {length} queued{scheduled} requests"
            )

    def _set_admit(self) -> None:
        """Recompute the hot path's bound. Called with the lock held."""
        bound = self.max_queue_length
        if self._closed or self._store_run is not None:
            self._admit = 0
        elif bound is not None:
            self._admit = bound - self._scheduled
        else:
            self._admit = _UNBOUNDED

    def _enqueue_keyed(
        self,
        request: RequestT,
        key: Hashable | None,
        delay: float | None,
        *,
        waits: bool = False,
    ) -> Ticket[RequestT, ResultT]:
        """enqueue_request with a key or a delay, and for submit (which ``waits``)."""
        if self._store_run is not None:
            return self._store_run.accept(request, key, delay, None, waits=waits)
        if key is not None:
            _check_key(key)
        if delay is not None:
            delay = _check_delay(delay)
        context = self._capture_context()
        status = _QUEUED if delay is None else _SCHEDULED
        ticket: Ticket[RequestT, ResultT] = Ticket(request, 0, status, 0, None, None, context)
        with self._lock:
            queue = self._queue
            length = len(queue)
            self._check_open()
            if key is not None:
                live = self._keys.get(key)
                if live is not None:
                    self._deduplicated += 1
                    if self._debug:
                        logger.debug("request #%d already holds this key", live.id)
                    return live
            self._check_room(length, waits=waits)
            if key is not None:
                self._keys[key] = ticket  # first: the one step here that may raise
                self._key_of[ticket] = key
            ticket.enqueued_at = self._time()
            self._last_id = ticket.id = self._last_id + 1
            on_loop_thread = self._thread == _get_ident()
            if delay is None:
                queue.append(ticket)
            else:
                self._scheduled += 1
                self._set_admit()
                if on_loop_thread and ticket.enqueued_at is not None:
                    # Straight into the heap, where processors look before
                    # the queue: due now, it goes before what is queued next.
                    entry = (ticket.enqueued_at + delay, next(self._heap_seq), ticket)
                    heapq.heappush(self._heap, entry)
                else:
                    # The heap is the loop thread's: other threads hand over.
                    self._incoming.append((delay, ticket))
            if on_loop_thread:
                self._tickle()
            else:
                self._wake_from_thread()
        if self._debug:
            logger.debug("request #%d added, key %r, delay %r", ticket.id, key, delay)
        return ticket

    def _has_room(self) -> bool:
        bound = self.max_queue_length
        run = self._store_run
        waiting = len(run.pending) if run is not None else len(self._queue) + self._scheduled
        return not self._closed and (bound is None or waiting < bound)

    async def submit(
        self, request: RequestT, *, key: Hashable | None = None, delay: float | None = None
    ) -> Ticket[RequestT, ResultT]:
        """Like :meth:`enqueue_request`, but wait for room when the queue is full.

        As Trio's ``send`` is to ``send_nowait``. Always a checkpoint. If it
        is cancelled while it waits, nothing was enqueued; if it returns, the
        request was enqueued even when a cancellation arrived meanwhile (the
        caller's next checkpoint raises it). Waiters get room in turn as
        processors take requests out of the queue. From an OS thread, call
        ``trio.from_thread.run(service.submit, request)``.

        Raises:
            QueueFull: the queue is full and the caller is one of the
                service's own handlers (or a task it spawned): it raises at
                once rather than wait, because every slot could end up
                waiting for room that only a slot can make.
            ServiceClosed: the service is closed, or closes while it waits.
            RuntimeError: called from a different Trio run than the service's.
        """
        token = self._check_run("submitted to")
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                ticket = self._enqueue_keyed(request, key, delay, waits=True)
            except QueueFull:
                if token is not None and self._insider() is not None:
                    with self._lock:
                        self._rejected += 1
                    raise
                self._bind()
                self._submitters += 1
                try:
                    await self._room.park()
                finally:
                    self._submitters -= 1
                continue
            if self._submitters and self._has_room():
                # This caller may have been woken for room it did not use (its
                # key was live) or that is still there: pass the wake-up on.
                self._room.unpark()
            run = self._store_run
            if run is not None:
                # Returns once the batch holding the request has committed.
                while ticket.id == 0 and not ticket.done and not self._finished.is_set():
                    await run.committed.wait()
                if ticket.id == 0 and ticket.done:
                    ticket.result()  # the store refused it: its StoreError
                if ticket.id == 0:
                    raise ServiceClosed(
                        f"service {self.name!r} ended before the request was committed"
                    )
            await trio.lowlevel.cancel_shielded_checkpoint()
            return ticket

    @trio.lowlevel.enable_ki_protection
    def _take(self, now: float) -> Ticket[RequestT, ResultT] | None:
        """Take the next request to start: a due retry or delayed one, else the oldest queued."""
        heap = self._heap
        if heap and heap[0][0] <= now:
            ticket = heapq.heappop(heap)[2]
            if ticket.status is _SCHEDULED:
                self._unschedule()
            else:
                self._retrying -= 1
        else:
            queue = self._queue
            if not queue:
                return None
            # Only this thread pops, so the queue cannot empty meanwhile.
            lock = self._lock
            lock.acquire()
            try:
                # Between pops the queue only grows, so its peak is reached
                # just before a pop: recording it here keeps enqueue lean.
                length = len(queue)
                if length > self._peak:
                    self._peak = length
                ticket = queue.popleft()
            finally:
                lock.release()
            if self._submitters:
                self._room.unpark()
        self._in_flight += 1
        if self._debug:
            self._log_dequeued(ticket)
        return ticket

    def _log_dequeued(self, ticket: Ticket[RequestT, ResultT]) -> None:
        state = ticket._state
        captured = state if type(state) is _Context else state.context
        _run_in(captured, logger.debug, "request #%d dequeued", ticket.id)

    def _schedule_incoming(self) -> None:
        """Move the delayed requests enqueued since the last wake-up into the timer heap."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
        heap = self._heap
        seq = self._heap_seq
        for delay, ticket in incoming:
            assert ticket.enqueued_at is not None
            heapq.heappush(heap, (ticket.enqueued_at + delay, next(seq), ticket))

    @trio.lowlevel.enable_ki_protection
    def _unschedule(self) -> None:
        """A delayed request leaves the heap: it no longer holds a queue place."""
        with self._lock:
            self._scheduled -= 1
            self._set_admit()
        if self._submitters:
            self._room.unpark()

    @trio.lowlevel.enable_ki_protection
    def _release_key(self, ticket: Ticket[RequestT, ResultT]) -> None:
        """Free the key of a request about to become final, if it has one.

        Freed before the request is marked final: an enqueue that finds the
        key still taken gets a ticket that was live when it looked.
        """
        with self._lock:
            key = self._key_of.pop(ticket, _MISSING)
            if key is _MISSING:
                return
            try:
                if self._keys.get(key) is ticket:
                    del self._keys[key]
                    return
            except Exception:  # noqa: S110 - handled below, like a key that is not found
                pass
            # The key's hash or equality changed while its request was live:
            # find its entry by identity instead.
            try:
                self._keys = {k: t for k, t in self._keys.items() if t is not ticket}
            except Exception as exc:
                logger.error(
                    "the key of request #%d could not be freed; its hash or equality"
                    " changed while the request was live (%s)",
                    ticket.id,
                    _one_line(exc),
                )


_ENQUEUE_REQUEST_DOC = """Queue ``request`` for the handler and return its :class:`Ticket`.

Never blocks and costs O(1). Safe to call from the Trio thread, from
any other thread, and before :meth:`run` starts. The handler will run
with a copy of the caller's contextvars.

Args:
    key: any hashable, or None. While a request enqueued with an
        equal key is not final, enqueueing the key again creates
        nothing and returns that request's ticket.
    delay: seconds (>= 0) before the request may start, or None.
        Until then it is SCHEDULED: it waits in the loop's timer,
        holds no slot, and counts against ``max_queue_length``.

Raises:
    QueueFull: ``max_queue_length`` requests are already queued or
        scheduled.
    ServiceClosed: a stop has begun or the run has ended.
    TypeError, ValueError: ``key`` is not hashable, or ``delay`` is
        not a finite number >= 0.
"""
_QueueSide.enqueue_request.__doc__ = _ENQUEUE_REQUEST_DOC
_QueueSide.enqueue_request.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("key", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("delay", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
)
