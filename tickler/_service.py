"""The tickler pattern: a queue, a supervisor loop woken by a one-slot signal, a limiter."""

from __future__ import annotations

import collections
import contextvars
import inspect
import itertools
import logging
import math
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._codec import Codec, JsonCodec, check_codec, check_queue_name
from ._core import (
    _UNBOUNDED,
    ErrorHook,
    Handler,
    _check_timeout,
    _format_exception,
    _get_ident,
    logger,
)
from ._loop import _Loop
from ._processors import _Parked
from ._retry import Retry
from ._statistics import TIME_BUCKETS, Histogram, ServiceStatistics
from ._stores._seam import Store
from ._stores._sync import StoreSync
from ._ticket import RequestT, ResultT, Ticket


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


def _is_async(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine: an async function, or an object with one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the bound __call__ itself is what is asked
    )


class Service(_Loop[RequestT, ResultT]):
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
        name: shown in the repr and in log lines.
    """

    __slots__ = ()  # the state's slots are _ServiceCore's

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
        histograms: bool = False,
    ) -> None:
        if not callable(handler):
            raise TypeError("handler must be callable")
        _check_capacity(capacity)
        if max_queue_length is not None:
            if isinstance(max_queue_length, bool) or not isinstance(max_queue_length, int):
                raise TypeError("max_queue_length must be an int or None")
            if max_queue_length < 1:
                raise ValueError("max_queue_length must be >= 1")
        self._timeout = _check_timeout("timeout", timeout, allow_zero=False)
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
        if codec is not None:
            if store is None:
                raise ValueError("codec is for a service with a store; give store= too")
            check_codec(codec)
        self._store_run: StoreSync | None = None
        if store is not None:
            check_queue_name(name, "name")
            # The name is the queue in the store; one handler per queue: a
            # second service on a queue whose service has not ended is refused.
            services = _RUNNING_QUEUES.setdefault(store, weakref.WeakValueDictionary())
            other = services.get(name)
            if other is not None and not other._finished.is_set():
                raise ValueError(
                    f"name {name!r}: a service of this process already runs that queue on"
                    f" {store!r}; one service per queue and store (stop it first)"
                )
            if codec is None:
                codec = JsonCodec()
            self._store_run = StoreSync(self, store, codec)
            store.use_codec(name, codec)
            services[name] = self

        self._handler = handler
        self._retry = retry
        self._on_error = on_error if on_error is not None else default_on_error
        self.name = name
        self.max_queue_length = max_queue_length
        # tuned (bench: enqueue): the queue length at which enqueue_request
        # refuses: the cap less the delayed requests while the service is
        # open, 0 once closed or with a store (whose path every enqueue takes),
        # so one comparison on the hot path covers every refusal.
        self._admit = max_queue_length if max_queue_length is not None else _UNBOUNDED
        self._admit = 0 if self._store_run is not None else self._admit
        self._closed = False

        # The queue. A threading.Lock, not a Trio lock: enqueue_request is
        # also called from threads that are not running Trio.
        self._lock = threading.Lock()
        self._queue: collections.deque[Ticket[RequestT, ResultT]] = collections.deque()
        # The cap. Slots are borrowed on behalf of each request's ticket, so
        # the limiter's statistics name the requests in flight.
        self._limiter = trio.CapacityLimiter(capacity)
        self._capacity = capacity  # mirrors the limiter's total, for the hot path
        # Retries wait here, ordered by due time, held by the loop itself: a
        # retry never needs a queue place, so a full queue cannot block it.
        self._heap: list[tuple[float, int, Ticket[RequestT, ResultT]]] = []
        self._heap_seq = itertools.count()
        # Delayed requests on their way to the heap: enqueue_request (from any
        # thread) appends (delay, ticket) under the lock; the loop moves them
        # into the heap, which only its own thread touches.
        self._incoming: list[tuple[float, Ticket[RequestT, ResultT]]] = []
        self._scheduled = 0  # delayed requests not yet started, under the lock
        # Keys of live requests, and the key of each keyed live ticket.
        self._keys: dict[object, Ticket[RequestT, ResultT]] = {}
        self._key_of: dict[Ticket[RequestT, ResultT], object] = {}
        # submit() callers waiting for room in the queue, and how many.
        self._room = trio.lowlevel.ParkingLot()
        self._submitters = 0
        # Processors with nothing to do, parked until the loop hands them a start.
        self._idle: list[_Parked] = []
        self._handed: dict[int, Ticket[RequestT, ResultT]] = {}
        self._doomed: set[Ticket[RequestT, ResultT]] = set()

        self._init_counters(histograms)
        self._init_stopping_and_run()

    def _init_counters(self, histograms: bool) -> None:
        """The counters statistics() reads, and the wait and run time histograms."""
        self._last_id = 0  # also the `enqueued` counter
        self._started = 0
        self._succeeded = 0
        self._failed = 0
        self._cancelled = 0
        self._retried = 0
        self._rejected = 0
        self._deduplicated = 0
        self._wakeups = 0
        self._peak = 0
        self._in_flight = 0
        self._retrying = 0
        self._histograms = histograms
        self._wait_counts = [0] * (len(TIME_BUCKETS) + 1)
        self._wait_sum = 0.0
        self._run_counts = [0] * (len(TIME_BUCKETS) + 1)
        self._run_sum = 0.0

    def _init_stopping_and_run(self) -> None:
        """What stopping and joining keep, and what the run sets when it starts."""
        self.stopping = trio.Event()
        self._finished = trio.Event()
        self._stop_called = False
        self._stop_deadline = math.inf
        # A drain is under way and still takes follow-ups from handlers.
        self._draining = False
        self._stopped_tickets: list[Ticket[RequestT, ResultT]] = []
        self._may_start = True
        # Processors whose handlers wait in stop(): a stop called from inside
        # the service waits for everything but them (see stop).
        self._insiders: collections.Counter[trio.lowlevel.Task] = collections.Counter()
        self._quiet = trio.Event()
        # Set when nothing is queued, retrying or in flight, for join().
        self._idle_event: trio.Event | None = None
        # The last context a request was enqueued with: requests enqueued from
        # one unchanged context share one Context object instead of a copy each.
        self._last_context: tuple[contextvars.Context, tuple[Any, ...], int] | None = None

        # Set when run starts: the Trio clock, read as `_offset + _timer()`
        # (see _offset_of), and the token that also tells whether the service
        # has ever run.
        self._offset = 0.0
        self._timer: Callable[[], float] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # Before the run: the run that waited on the service (see _bind).
        self._bound: trio.lowlevel.TrioToken | None = None
        self._thread: int | None = None
        self._nursery: trio.Nursery | None = None
        self._signal_tx: trio.MemorySendChannel[None] | None = None
        self._signal_rx: trio.MemoryReceiveChannel[None] | None = None
        self._wakeup_pending = False
        self._foreign_pending = False
        self._debug = logger.isEnabledFor(logging.DEBUG)

    @property
    def capacity(self) -> int:
        """The cap on attempts in flight; settable at run time to an int >= 1.

        Raising it starts waiting requests at once. Lowering it cancels
        nothing: new starts wait until fewer than the new cap are in flight.
        Set it from the Trio thread.

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
        self._tickle()

    @property
    def running(self) -> bool:
        """Whether the run has started and not ended; with a store, while its session is open."""
        stored = self._store_run
        return (
            self._token is not None
            and not self._finished.is_set()
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
        with self._lock:
            queued = len(self._queue)
            return ServiceStatistics(
                queued=queued,
                scheduled=self._scheduled,
                in_flight=self._in_flight,
                retrying=self._retrying,
                capacity=self._capacity,
                max_queue_length=self.max_queue_length,
                enqueued=self._last_id,
                started=self._started,
                succeeded=self._succeeded,
                failed=self._failed,
                cancelled=self._cancelled,
                retried=self._retried,
                rejected=self._rejected,
                deduplicated=self._deduplicated,
                store_errors=self._store_run.errors if self._store_run is not None else 0,
                wakeups=self._wakeups,
                peak_queued=max(self._peak, queued),
                wait_time=Histogram(TIME_BUCKETS, tuple(self._wait_counts), self._wait_sum)
                if self._histograms
                else None,
                run_time=Histogram(TIME_BUCKETS, tuple(self._run_counts), self._run_sum)
                if self._histograms
                else None,
            )

    def __repr__(self) -> str:
        return (
            f"<tickler.Service {self.name!r} {self._in_flight}/{self.capacity} in flight,"
            f" {len(self._queue)} queued, {self._retrying} retrying>"
        )


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
    histograms: bool = False,
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
