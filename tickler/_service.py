"""The tickler pattern: a queue, a supervisor loop woken by a one-slot signal, a limiter."""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._codec import Codec, JsonCodec, check_codec, check_queue_name
from ._core import (
    ErrorHook,
    Handler,
    _check_timeout,
    _format_exception,
    _get_ident,
    logger,
)
from ._current import current_attempt
from ._engine import _Engine
from ._intake import Intake
from ._limits import Groups, Limit, check_limits
from ._outcomes import Outcomes
from ._parts import StorePart
from ._periodic import Periodic
from ._retry import Retry
from ._statistics import TIME_BUCKETS, Histogram, ServiceStatistics
from ._stopping import Stopping
from ._stores._seam import Store
from ._stores._sync import StoreSync
from ._supervisor import Supervisor
from ._ticket import RequestT, ResultT, Ticket
from ._values import GroupLimit


def _check_capacity(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("capacity must be an int")
    if value < 1:
        raise ValueError("capacity must be >= 1")
    return value


def default_on_error(ticket: Ticket[Any, Any], exc: Exception) -> None:
    """Log a request's final failure, with its traceback, on the ``tickler`` logger."""
    if logger.isEnabledFor(logging.ERROR):
        logger.error(
            "request #%d failed after %d attempt(s)\n%s",
            ticket.id,
            ticket.attempts,
            _format_exception(exc),
        )


# The services of each store object by queue name: while one has not ended,
# a second one on its queue and store is refused. (Two store objects on one
# file or schema act as two replicas would, each with its own services.)
_RUNNING_QUEUES: weakref.WeakKeyDictionary[
    Store, weakref.WeakValueDictionary[str, Service[Any, Any]]
] = weakref.WeakKeyDictionary()


def _check_store(store: object) -> None:
    """Refuse what does not implement the store seam (see _stores._seam.Store)."""
    methods = ("connect", "listener", "use_codec")
    numbers = ("lease", "poll_interval", "retention")
    if not all(callable(getattr(store, name, None)) for name in methods) or not all(
        isinstance(getattr(store, name, None), float) for name in numbers
    ):
        raise TypeError("store must be a tickler.SqliteStore, a tickler.PostgresStore or None")


def _check_periodic(periodic: object) -> tuple[Periodic, ...]:
    if isinstance(periodic, str | bytes) or not isinstance(periodic, Iterable):
        raise TypeError("periodic must be an iterable of tickler.Periodic")
    schedules = tuple(periodic)
    names: set[str] = set()
    for each in schedules:
        if not isinstance(each, Periodic):
            raise TypeError(f"periodic must hold tickler.Periodic, not {type(each).__name__}")
        if each.name in names:
            raise ValueError(f"periodic: two requests are named {each.name!r}; names are unique")
        names.add(each.name)
    return schedules


def _is_async(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine: an async function, or an object with one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the bound __call__ itself is what is asked
    )


class Service(_Engine[RequestT, ResultT]):
    """A background work service built on the tickler pattern.

    Requests wait in a FIFO queue; one supervisor loop, woken ("tickled")
    through a one-slot signal channel, starts processors into the free slots
    of a :class:`trio.CapacityLimiter`.

    The constructor needs no running Trio loop. Start the service with
    ``await nursery.start(service.run)`` or use :func:`open_service`.

    Args:
        handler: ``async def handler(request) -> result``.
        capacity: most attempts in flight at once (int >= 1).
        max_queue_length: most requests waiting in the queue, or ``None``.
        timeout: seconds allowed per attempt, or ``None``.
        retry: a :class:`tickler.Retry` policy, or ``None`` for one attempt.
        on_error: ``on_error(ticket, exc)``, called once after a request's
            final failed attempt; by default the error is logged.
        name: shown in the repr and in log lines; with a store, the queue.
        store: a :class:`tickler.SqliteStore` or :class:`tickler.PostgresStore`, or None.
        codec: how a store keeps requests and results (JSON by default).
        histograms: keep wait and run time histograms in ``statistics()`` (on by
            default: False turns them off).
        periodic: :class:`tickler.Periodic` requests to enqueue on their schedules.
        limits: a :class:`tickler.Limit` for each group of requests, or a mapping
            of group names to limits (``"*"``: every other group).
    """

    # The engine (its base class) holds the hot state and its parts; the
    # supervisor, which only Service calls, is the one part it does not hold.
    __slots__ = ("_supervisor",)

    def __init__(
        self,
        handler: Handler[RequestT, ResultT],
        *,
        capacity: int = 10,
        max_queue_length: int | None = 10_000,
        timeout: float | None = None,
        retry: Retry | None = None,
        on_error: ErrorHook[RequestT, ResultT] | None = None,
        name: str = "tickler",
        store: Store | None = None,
        codec: Codec | None = None,
        histograms: bool = True,
        periodic: Iterable[Periodic] = (),
        limits: Limit | Mapping[str, Limit] | None = None,
    ) -> None:
        if not callable(handler):
            raise TypeError("handler must be callable")
        _check_capacity(capacity)
        if max_queue_length is not None:
            if isinstance(max_queue_length, bool) or not isinstance(max_queue_length, int):
                raise TypeError("max_queue_length must be an int or None")
            if max_queue_length < 1:
                raise ValueError("max_queue_length must be >= 1")
        _check_timeout("timeout", timeout, allow_zero=False)
        if retry is not None and not isinstance(retry, Retry):
            raise TypeError("retry must be a tickler.Retry or None")
        if on_error is not None and not callable(on_error):
            raise TypeError("on_error must be callable or None")
        if on_error is not None and _is_async(on_error):
            raise TypeError("on_error must be a plain function, not an async function")
        if not isinstance(name, str):
            raise TypeError("name must be a str")
        if type(histograms) is not bool:
            raise TypeError("histograms must be True or False")
        if store is not None:
            _check_store(store)
        schedules = _check_periodic(periodic)
        checked_limits = check_limits(limits)
        if codec is not None:
            if store is None:
                raise ValueError("codec is for a service with a store; give store= too")
            check_codec(codec)
        sync: StoreSync | None = None
        if store is not None:
            check_queue_name(name, "name")
            # The name is the queue in the store; one handler per queue: a
            # second service on a queue whose service has not ended is refused.
            services = _RUNNING_QUEUES.setdefault(store, weakref.WeakValueDictionary())
            other = services.get(name)
            if other is not None and not other._stopping.finished.is_set():
                raise ValueError(
                    f"name {name!r}: a service of this process already runs that queue on"
                    f" {store!r}; one service per queue and store (stop it first)"
                )
        timeout = _check_timeout("timeout", timeout, allow_zero=False)
        super().__init__(
            handler, capacity, max_queue_length, timeout, histograms, name, store is not None
        )
        # The parts, each holding the engine (as trio's Runner holds its parts).
        if store is not None:
            if codec is None:
                codec = JsonCodec()
            sync = StoreSync(self, store, codec)
            store.use_codec(name, codec)
            services[name] = self
        self._store_run = sync
        self._intake = intake = Intake(self)
        self._outcomes = Outcomes(
            self, retry, on_error if on_error is not None else default_on_error
        )
        self._stopping = stopping = Stopping(self, sync)
        self._supervisor = Supervisor(self, intake, stopping, sync, schedules)
        if checked_limits is not None:
            if sync is None:
                self._groups = Groups(self, checked_limits)
            else:
                sync.limits = {
                    group: GroupLimit(limit.concurrency, limit.rate, limit.per)
                    for group, limit in checked_limits.items()
                }
                sync.rated = any(limit.rate is not None for limit in checked_limits.values())
        if sync is not None:
            for each in schedules:
                try:
                    self._supervisor.encoded[each.name] = sync.encode(each.request)[0]
                except TypeError as exc:
                    raise TypeError(f"periodic request {each.name!r}: {exc}") from None

    @property
    def capacity(self) -> int:
        """The cap on attempts in flight; settable at run time to an int >= 1.

        Raising it starts waiting requests at once. Lowering it cancels
        nothing: new starts wait until fewer than the new cap are in flight,
        and a request given a slot whose handler has not begun goes back first
        in line, to start under the new cap. Set it from the Trio thread.

        Raises:
            RuntimeError: set from a thread other than the one running the
                service; the cap is unchanged.
        """
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        value = _check_capacity(value)
        if self._thread is not None and self._thread != _get_ident():
            raise RuntimeError(
                f"capacity of service {self.name!r} must be set from the thread running it"
            )
        self._limiter.total_tokens = self._capacity = value
        self._start_cap = 0 if self._paused else value
        if self._in_flight > value:
            # The slots already given (borrowed tokens) outnumber the new cap: what has not
            # started goes back, and the loop gives slots again under the new cap.
            self._hand_back_unstarted()
        self._tickle()

    @property
    def running(self) -> bool:
        """Whether the run has started and not ended; with a store, while its session is open."""
        stored = self._store_run
        return (
            self._token is not None
            and not self._stopping.finished.is_set()
            and (stored is None or stored.connection is not None)
        )

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        """The token of the Trio run that runs the service, once the run has started."""
        return self._token

    @property
    def store(self) -> Store | None:
        """The store given to the constructor, or None for the in-memory engine."""
        stored = self._store_run
        return stored.store if stored is not None else None

    @property
    def closed(self) -> bool:
        """Whether ``enqueue_request`` now raises :class:`ServiceClosed`."""
        return self._closed

    def statistics(self) -> ServiceStatistics:
        """Return a consistent snapshot of the counters. Call it from the Trio thread."""
        if self._histograms:
            self._tally_all()
        with self._lock:
            queued = len(self._queue) + self._intake.ranked
            return ServiceStatistics(
                queued=queued,
                scheduled=self._intake.scheduled,
                in_flight=self._in_flight,
                retrying=self._retrying,
                capacity=self._capacity,
                max_queue_length=self.max_queue_length,
                enqueued=self._last_id,
                started=self._started,
                succeeded=self._succeeded,
                failed=self._outcomes.failed,
                cancelled=self._outcomes.cancelled,
                retried=self._outcomes.retried,
                rejected=self._intake.rejected,
                deduplicated=self._intake.deduplicated,
                store_errors=self._store_run.errors if self._store_run is not None else 0,
                rescued_owner_died=self._store_run.rescued.get("owner_died", 0)
                if self._store_run is not None
                else 0,
                rescued_lease_lapsed=self._store_run.rescued.get("lease_lapsed", 0)
                if self._store_run is not None
                else 0,
                paused=self._paused,
                limited=self._limited(),
                wakeups=self._supervisor.wakeups,
                peak_queued=max(self._peak, queued),
                wait_time=Histogram(TIME_BUCKETS, tuple(self._wait_counts), self._wait_sum)
                if self._histograms
                else None,
                run_time=Histogram(TIME_BUCKETS, tuple(self._run_counts), self._run_sum)
                if self._histograms
                else None,
            )

    def enqueue_many(
        self,
        requests: Iterable[RequestT],
        *,
        key: Callable[[RequestT], Hashable | None] | None = None,
        unique_for: float | None = None,
        priority: int = 0,
        delay: float | None = None,
        group: str | None = None,
    ) -> list[Ticket[RequestT, ResultT]]:
        """Queue every request of ``requests``, or none; return their tickets, in order.

        All or nothing: if the queue has no room for all of them
        (``max_queue_length``), QueueFull is raised and none is enqueued.
        ``key``, if given, is called with each request and returns its key
        (or None for none); a request whose key is taken, or repeated
        earlier in ``requests``, gets the holder's ticket, as
        ``enqueue_request`` would. ``unique_for``, ``priority`` and
        ``delay`` apply to every request. Never blocks; one lock and one
        wake-up for the lot, so it costs far less per request than a loop
        of ``enqueue_request``.

        Raises:
            QueueFull: not all of them fit.
            ServiceClosed: a stop has begun or the run has ended.
            TypeError, ValueError: as ``enqueue_request``; also ``requests``
                that is not an iterable (or is a str), or ``key`` that is
                not callable.
        """
        return self._intake.enqueue_many(requests, key, unique_for, priority, delay, group)

    def pause(self) -> None:
        """Start nothing new until :meth:`resume`; running attempts finish.

        Enqueueing still works (periodic ticks too), retries and delayed
        requests wait, and ``stop()`` works as usual (a drain then waits
        only for what runs). With a store the pause holds for the queue in
        every process, including those that start later, within their
        ``poll_interval``; ``python -m tickler pause URL QUEUE`` does the
        same from a shell. Call it from the Trio thread.
        """
        self._pause(True)

    def resume(self) -> None:
        """Undo :meth:`pause` (with a store, for every process of the queue)."""
        self._pause(False)

    @property
    def paused(self) -> bool:
        """Whether starts are paused; with a store, as of this process's last look."""
        return self._paused

    def _pause(self, paused: bool) -> None:
        if self._thread is not None and self._thread != _get_ident():
            raise RuntimeError(
                f"service {self.name!r} must be paused or resumed from the thread running it"
            )
        self._set_paused(paused)
        stored = self._store_run
        if stored is not None:
            stored.pause_wanted = paused  # written by the next batch
            if paused:
                stored.return_claimed()
            self._tickle()

    @property
    def stopping(self) -> trio.Event:
        """Set once a stop has begun: handlers may watch it to wind down early."""
        return self._stopping.event

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the service until it is stopped; use ``await nursery.start(service.run)``.

        Raises:
            ServiceClosed: the service was stopped before it ran.
            RuntimeError: ``run`` was already called.
        """
        await self._supervisor.run(task_status=task_status)

    async def submit(
        self,
        request: RequestT,
        *,
        key: Hashable | None = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
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
        return await self._intake.submit(
            request, key=key, delay=delay, priority=priority, unique_for=unique_for, group=group
        )

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
        await self._stopping.join()

    async def stop(
        self, *, drain: bool = True, timeout: float | None = None
    ) -> list[Ticket[RequestT, ResultT]]:
        """Stop the service, waiting for what runs up to ``timeout`` (None, the default,
        is no limit, with ``drain=False`` too: ``stop(drain=False, timeout=0)`` cancels
        what runs at once), and return the tickets that did not complete.

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
        return await self._stopping.stop(drain=drain, timeout=timeout)

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
            return await self._outcomes.cancel_in_memory(id_or_key)
        return await self._require_store("cancel").cancel(id_or_key)

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

    def _limited(self) -> int:
        """Requests waiting only because their group is at its limit (with a store: as of the
        last claim, over every process)."""
        if self._groups is not None:
            return self._groups.limited
        stored = self._store_run
        return stored.limited if stored is not None else 0

    def _require_store(self, what: str) -> StorePart:
        stored = self._store_run
        if stored is None:
            raise RuntimeError(f"{what}() needs a service with a store")
        self._check_run("used")
        return stored

    def __repr__(self) -> str:
        return (
            f"<tickler.Service {self.name!r} {self._in_flight}/{self.capacity} in flight,"
            f" {len(self._queue)} queued, {self._retrying} retrying>"
        )


def current_service() -> Service[Any, Any]:
    """The service running the calling handler.

    Works in the handler, in everything it calls, and in the tasks it spawns
    into its own nurseries (which end before the handler returns); from a
    thread the handler started with ``trio.to_thread.run_sync``, call
    ``trio.from_thread.run_sync(tickler.current_service)``.

    Raises:
        RuntimeError: called outside a tickler handler.
    """
    service: Service[Any, Any] = current_attempt("current_service").service
    return service


def current_ticket() -> Ticket[Any, Any]:
    """The ticket of the request whose handler is calling; see :func:`current_service`.

    Raises:
        RuntimeError: called outside a tickler handler.
    """
    ticket = current_attempt("current_ticket").ticket
    assert ticket is not None
    return ticket


@asynccontextmanager
async def open_service(
    handler: Handler[RequestT, ResultT],
    *,
    capacity: int = 10,
    max_queue_length: int | None = 10_000,
    timeout: float | None = None,
    retry: Retry | None = None,
    on_error: ErrorHook[RequestT, ResultT] | None = None,
    name: str = "tickler",
    store: Store | None = None,
    codec: Codec | None = None,
    histograms: bool = True,
    periodic: Iterable[Periodic] = (),
    limits: Limit | Mapping[str, Limit] | None = None,
    shutdown_timeout: float | None = None,
) -> AsyncIterator[Service[RequestT, ResultT]]:
    """Run a :class:`Service` for the duration of an ``async with`` block.

    When the body ends normally the service is stopped with
    ``stop(drain=True, timeout=shutdown_timeout)``. When the body raises, the
    work in flight is cancelled and the body's exception propagates as is.
    """
    _check_timeout("shutdown_timeout", shutdown_timeout, allow_zero=True)
    service = Service(
        handler,
        capacity=capacity,
        max_queue_length=max_queue_length,
        timeout=timeout,
        retry=retry,
        on_error=on_error,
        name=name,
        store=store,
        codec=codec,
        histograms=histograms,
        periodic=periodic,
        limits=limits,
    )
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(service.run)
            except BaseException as exc:
                # The run failed to start (a store that cannot open, say):
                # its own error, as the caller would catch it.
                body_error = exc
                raise
            try:
                yield service
            except BaseException as exc:
                body_error = exc
                nursery.cancel_scope.cancel()
                raise
            await service.stop(drain=True, timeout=shutdown_timeout)
    except BaseExceptionGroup as group:
        # The nursery wraps the body's own exception (or the start's) in a
        # group; a caller of a context manager expects the exception itself.
        if (
            body_error is not None
            and len(group.exceptions) == 1
            and group.exceptions[0] is body_error
        ):
            raise body_error from None
        raise
