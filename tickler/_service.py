"""The tickler pattern: a queue, a supervisor loop woken by a one-slot signal, a limiter."""

from __future__ import annotations

import collections
import contextvars
import heapq
import inspect
import itertools
import logging
import math
import sys
import threading
import time
import traceback
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Hashable
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any, Generic

import trio

from ._exceptions import QueueFull, ServiceClosed
from ._retry import Retry
from ._statistics import ServiceStatistics
from ._ticket import RequestT, ResultT, Status, Ticket, Waiting

logger = logging.getLogger("tickler")

Handler = Callable[[RequestT], Awaitable[ResultT]]
ErrorHook = Callable[[Ticket[RequestT, ResultT], Exception], object]

_QUEUED = Status.QUEUED
_SCHEDULED = Status.SCHEDULED
_RUNNING = Status.RUNNING
_RETRYING = Status.RETRYING
_SUCCEEDED = Status.SUCCEEDED
_FAILED = Status.FAILED
_CANCELLED = Status.CANCELLED

_Context = contextvars.Context
_Coroutine = types.CoroutineType
_copy_context = contextvars.copy_context
_get_ident = threading.get_ident
_UNBOUNDED = sys.maxsize
_EMPTY_CONTEXT = contextvars.Context()
_MISSING = object()
_new_ticket = object.__new__
_KEYWORD_ONLY = object()

# Processors check before every start whether their scope is cancelled. Trio's
# public ways to ask (current_effective_deadline, checkpoint_if_cancelled)
# cost up to a tenth of a request; the flag they read costs two attribute
# loads. Refuse to import against a Trio that no longer has it, rather than
# start requests in a cancelled run.
if not hasattr(trio.lowlevel.Task, "_cancel_status"):  # pragma: no cover
    raise ImportError("tickler needs trio.lowlevel.Task._cancel_status; check the trio version")
# A processor that keeps its slot yields to the scheduler after this many
# requests in a row, even if every handler returned without yielding.
_CHAIN_BUDGET = 64


def _check_capacity(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("capacity must be an int")
    if value < 1:
        raise ValueError("capacity must be >= 1")
    return value


def _check_timeout(name: str, value: object, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number or None")
    if allow_zero:
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0")
    elif not value > 0:
        raise ValueError(f"{name} must be > 0")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be at most {sys.float_info.max:g} seconds") from None


def _check_delay(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"delay must be a number of seconds or None, not {type(value).__name__}")
    if not value >= 0:
        raise ValueError("delay must be >= 0")
    if value == math.inf:
        raise ValueError("delay must be finite")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"delay must be at most {sys.float_info.max:g} seconds") from None


def _check_key(key: object) -> None:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable, not {type(key).__name__}") from None


def _format_exception(exc: BaseException) -> str:
    # Log records get the traceback as text: a record that kept the exception
    # would keep its frames, and through them the request, alive.
    return "".join(traceback.format_exception(exc)).rstrip()


def _one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def default_on_error(ticket: Ticket[Any, Any], exc: Exception) -> None:
    """Log a request's final failure, with its traceback, on the ``tickler`` logger."""
    if logger.isEnabledFor(logging.ERROR):
        logger.error(
            "request #%d failed after %d attempt(s)\n%s",
            ticket.id,
            ticket.attempts,
            _format_exception(exc),
        )


def _is_async(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine: an async function, or an object with one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the bound __call__ itself is what is asked
    )


@types.coroutine
def _iterate(steps: Any) -> Generator[Any, Any, Any]:
    """The iterator an awaitable's ``__await__`` returned, as a coroutine with send and throw."""
    return (yield from steps)


def _steps_of(awaitable: object) -> Any:
    """Call ``__await__`` once and return its steps; refuse what is not awaitable."""
    if (
        inspect.isgenerator(awaitable)
        and awaitable.gi_code.co_flags & inspect.CO_ITERABLE_COROUTINE
    ):
        return awaitable  # a @types.coroutine generator: awaitable as it is
    await_ = getattr(type(awaitable), "__await__", None)
    if await_ is None:
        raise TypeError(f"handler must return an awaitable, not {type(awaitable).__name__}")
    return _iterate(await_(awaitable))


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


def _is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is trio.Cancelled, or a group (a handler's nursery) holding only that."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def _holds(context: contextvars.Context, captured: contextvars.Context) -> bool:
    """Whether the running ``context`` holds exactly ``captured``'s variables and objects.

    Called in ``context``; compares by identity only, never with ``==``.
    """
    if len(context) != len(captured):
        return False
    for var, value in captured.items():  # noqa: SIM110 - all() would build a generator
        if var.get(_MISSING) is not value:
            return False
    return True


def _reset(tokens: list[contextvars.Token[Any]]) -> None:
    """Undo the variables an attempt set, with the tokens their setting returned.

    A function of its own so that no token (which refers to the context it
    was made in) stays behind in the processor's frame.
    """
    for token in tokens:
        token.var.reset(token)


def _run_in(context: contextvars.Context, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` in a copy of a request's context: hooks and log lines for a request.

    A copy, because the request's context is the one running right now, and a
    Context cannot be entered twice; and the hook's own writes stay its own.
    """
    return context.copy().run(fn, *args)


class Service(Generic[RequestT, ResultT]):
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

    __slots__ = (
        "__weakref__",
        "_admit",
        "_bound",
        "_cancelled",
        "_capacity",
        "_closed",
        "_debug",
        "_deduplicated",
        "_draining",
        "_failed",
        "_finished",
        "_foreign_pending",
        "_handler",
        "_heap",
        "_heap_seq",
        "_idle",
        "_idle_event",
        "_in_flight",
        "_incoming",
        "_insiders",
        "_key_of",
        "_keys",
        "_last_context",
        "_last_id",
        "_limiter",
        "_lock",
        "_may_start",
        "_nursery",
        "_offset",
        "_on_error",
        "_peak",
        "_queue",
        "_quiet",
        "_rejected",
        "_retried",
        "_retry",
        "_retrying",
        "_room",
        "_scheduled",
        "_signal_rx",
        "_signal_tx",
        "_started",
        "_stop_called",
        "_stop_deadline",
        "_stopped_tickets",
        "_submitters",
        "_succeeded",
        "_thread",
        "_timeout",
        "_timer",
        "_token",
        "_wakeup_pending",
        "_wakeups",
        "max_queue_length",
        "name",
        "stopping",
    )

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

        self._handler = handler
        self._retry = retry
        self._on_error = on_error if on_error is not None else default_on_error
        self.name = name
        self.max_queue_length = max_queue_length
        # The queue length at which enqueue_request refuses: the cap less the
        # delayed requests while the service is open, 0 once it is closed, so
        # one comparison on the hot path covers every refusal.
        self._admit = max_queue_length if max_queue_length is not None else _UNBOUNDED
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

    # -- public surface -------------------------------------------------

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
    def closed(self) -> bool:
        """Whether ``enqueue_request`` now raises :class:`ServiceClosed`."""
        return self._closed

    # A KeyboardInterrupt never lands halfway through the bookkeeping of the
    # methods marked so (Trio delivers it at the next unprotected point).
    #
    # key and delay are keyword-only, but the code does not declare them so:
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
        """Queue ``request`` for the handler and return its :class:`Ticket`.

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
        if key is not None or delay is not None or _keyword_only is not _KEYWORD_ONLY:
            if _keyword_only is not _KEYWORD_ONLY:
                raise TypeError(
                    "enqueue_request() takes one positional argument, the request;"
                    " key and delay are keyword-only"
                )
            return self._enqueue_keyed(request, key, delay)
        # (Everything below is the hot path. _enqueue_keyed is its twin for
        # keys and delays; _capture_context, the part on contextvars.)
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
        # The ticket is built field by field, outside the lock: Ticket's own
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
        # acquire/release rather than `with`: the context-manager protocol
        # costs about as much again as the lock itself on this path.
        lock.acquire()
        try:
            queue = self._queue
            length = len(queue)
            if length >= self._admit:
                # Refused, unless it is a follow-up from one of the service's
                # own handlers during a drain, with room in the queue. Only
                # this slow path asks which.
                if self._closed and not (self._draining and self._is_follow_up()):
                    self._rejected += 1
                    self._last_context = None  # a refused caller's context is kept by nothing
                    raise ServiceClosed(f"service {self.name!r} is closed")
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
        if self._closed:
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
            if self._closed and not (self._draining and self._is_follow_up()):
                self._rejected += 1
                self._last_context = None
                raise ServiceClosed(f"service {self.name!r} is closed")
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
                wakeups=self._wakeups,
                peak_queued=max(self._peak, queued),
            )

    def __repr__(self) -> str:
        return (
            f"<tickler.Service {self.name!r} {self._in_flight}/{self.capacity} in flight,"
            f" {len(self._queue)} queued, {self._retrying} retrying>"
        )

    # -- the signal -----------------------------------------------------

    def _tickle(self) -> None:
        """Wake the supervisor loop. Trio thread only.

        The channel has one slot: a full slot means a wake-up is already
        pending, and the loop will see everything that happened before it
        runs, so any number of tickles between two wake-ups cost one wake-up.
        """
        tx = self._signal_tx
        if tx is None or self._wakeup_pending:
            return
        self._wakeup_pending = True
        try:  # noqa: SIM105 - suppress() would add a context manager to a hot path
            tx.send_nowait(None)
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass  # a wake-up is already pending, or the loop has ended

    def _wake_from_thread(self) -> None:
        # Called with the lock held, from a thread that is not running the
        # service. One callback in flight at a time is enough: it runs after
        # everything queued before it.
        token = self._token
        if token is None or self._foreign_pending:
            return
        self._foreign_pending = True
        try:
            token.run_sync_soon(self._tickle_from_thread)
        except trio.RunFinishedError:
            self._foreign_pending = False

    def _tickle_from_thread(self) -> None:
        with self._lock:
            self._foreign_pending = False
        self._tickle()

    # -- the loop -------------------------------------------------------

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

    # -- the processors -------------------------------------------------

    async def _process(self, ticket: Ticket[RequestT, ResultT], slot: _Slot) -> None:
        """Run ``ticket``; then, while work waits and the cap allows, keep the slot for the next.

        Keeping the slot saves a task spawn per request. With nothing left to
        take, the processor gives its slot back and parks until the supervisor,
        which owns every start into a free slot, hands it the next one.

        The context of an attempt: Trio runs every step of a task inside
        ``task.context``, read afresh at each step. An attempt sets its
        enqueuer's variables there (the very objects) and the handler runs in
        it like any code of the task. The next attempt for the same enqueuer's
        context reuses them if they still hold the very same objects and
        nothing else; otherwise the processor resets them with the tokens it
        got, which also undoes the handler's writes to them. A handler that set
        a variable of its own leaves the context non-empty after that: the
        processor then takes a fresh empty context and yields once, so the next
        attempt starts clean. Every request, with or without contextvars,
        takes this one path.
        """
        timer = self._timer
        assert timer is not None
        offset = self._offset
        handler = self._handler
        timeout = self._timeout
        heap = self._heap
        queue = self._queue
        lock = self._lock
        task = trio.lowlevel.current_task()
        # What current_service() and current_ticket() find for this task and
        # the tasks its handlers spawn.
        attempt = _ATTEMPTS[task] = _Attempt(self)
        try:
            # The enqueuer's context whose variables this task's context holds
            # now, with the variables and values set and the tokens to undo them.
            held: contextvars.Context | None = None
            held_tokens: list[contextvars.Token[Any]] = []
            now = offset + timer()
            chained = 0
            while True:  # one slot after another
                try:
                    while True:
                        state = ticket._state
                        captured = state if type(state) is _Context else state.context
                        context = task.context  # the context this step runs in
                        if held is not None and (
                            captured is not held or not _holds(context, captured)
                        ):
                            # Another enqueuer's request, or the last handler
                            # changed its enqueuer's variables: undo them.
                            _reset(held_tokens)
                            held = held_tokens = None  # type: ignore[assignment]
                        if held is None:
                            if context:
                                # The last handler set variables of its own. They
                                # must not reach this attempt, which starts in a
                                # fresh context once this step has ended.
                                task.context = _EMPTY_CONTEXT.copy()
                                await trio.lowlevel.cancel_shielded_checkpoint()
                                context = task.context
                                now = offset + timer()
                            if captured:
                                held_tokens = [var.set(value) for var, value in captured.items()]
                                held = captured
                        if not self._may_start or task._cancel_status.effectively_cancelled:
                            # A stop without drain, a crash or a cancellation came
                            # between taking this request and starting it.
                            self._may_start = False
                            self._in_flight -= 1
                            self._cancel(ticket, offset + timer())
                            break
                        ticket.status = _RUNNING
                        attempt.ticket = ticket
                        ticket.attempts += 1
                        # Read afresh: a hook or another thread may have enqueued
                        # this request after the last reading.
                        ticket.started_at = now = offset + timer()
                        self._started += 1
                        if self._debug:
                            _run_in(
                                context,
                                logger.debug,
                                "processing request #%d (attempt %d)",
                                ticket.id,
                                ticket.attempts,
                            )
                        try:
                            awaitable = handler(ticket.request)
                            if type(awaitable) is not _Coroutine:
                                awaitable = _steps_of(awaitable)
                            if timeout is None:
                                result = await awaitable
                            else:
                                with trio.move_on_at(now + timeout) as scope:
                                    result = await awaitable
                                if scope.cancelled_caught:
                                    # Raised here so that a timeout is one more failure.
                                    raise TimeoutError(  # noqa: TRY301
                                        f"attempt timed out after {timeout:g} seconds"
                                    )
                        except Exception as exc:
                            now = offset + timer()
                            self._attempt_failed(ticket, exc, now, context)
                        except BaseException as exc:
                            # Cancelled, KeyboardInterrupt and the like: record the
                            # request's final state and let the exception go on.
                            self._abort(ticket, exc)
                            raise
                        else:
                            now = offset + timer()
                            self._in_flight -= 1
                            self._succeeded += 1
                            if self._key_of:
                                self._release_key(ticket)
                            state = ticket._state  # a waiter may have wrapped it meanwhile
                            ticket._state = (now, result)
                            ticket.status = _SUCCEEDED
                            if type(state) is Waiting:
                                self._wake(state)
                            result = None
                        # The request is final: keep nothing of it while choosing the
                        # next. (What it left in this task's context is looked at
                        # when the next attempt starts, or before parking.)
                        state = captured = context = awaitable = ticket = None  # type: ignore[assignment]
                        chained += 1
                        if chained == _CHAIN_BUDGET:
                            # Handlers that never yield must not starve other tasks.
                            chained = 0
                            await trio.lowlevel.cancel_shielded_checkpoint()
                            now = offset + timer()
                        if not self._may_start or self._in_flight >= self._capacity:
                            break
                        if heap and heap[0][0] <= now:
                            following = self._take(now)
                            assert following is not None
                            ticket = following
                            following = None
                        elif queue:
                            # The common case of _take, inlined: calling _take (and
                            # _finish above) here cost about 2% of burst throughput.
                            lock.acquire()
                            try:
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
                        else:
                            break
                finally:
                    # A parked processor keeps no request (or context) alive.
                    attempt.ticket = None
                    if held is not None:
                        _reset(held_tokens)
                        held = held_tokens = None  # type: ignore[assignment]
                    if task.context:
                        task.context = _EMPTY_CONTEXT.copy()
                    # A completion that frees a slot tickles the loop.
                    self._limiter.release_on_behalf_of(slot)
                    self._tickle()
                    if self._debug:
                        # Not a line for any one request: no request's context.
                        _run_in(
                            _EMPTY_CONTEXT,
                            logger.debug,
                            "slot freed: now %d/%d slots in use",
                            self._in_flight,
                            self._capacity,
                        )
                handed = await self._park()
                if handed is None:
                    return
                ticket, slot = handed
                handed = None
                now = offset + timer()
                chained = 0
        finally:
            del _ATTEMPTS[task]

    def _log_dequeued(self, ticket: Ticket[RequestT, ResultT]) -> None:
        state = ticket._state
        captured = state if type(state) is _Context else state.context
        _run_in(captured, logger.debug, "request #%d dequeued", ticket.id)

    async def _park(self) -> tuple[Ticket[RequestT, ResultT], _Slot] | None:
        """Wait, holding no slot, for the supervisor to hand over a start; None means exit.

        At most `capacity` processors wait; the others exit at once.
        """
        idle = self._idle
        if not self._may_start or self._stop_called or len(idle) >= self._capacity:
            return None
        parked = _Parked(trio.lowlevel.current_task())
        idle.append(parked)

        def abort(_: object) -> trio.lowlevel.Abort:
            idle.remove(parked)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return parked.handed

    def _release_idle(self) -> None:
        """Tell every parked processor to exit."""
        idle = self._idle
        while idle:
            trio.lowlevel.reschedule(idle.pop().task)

    @trio.lowlevel.enable_ki_protection
    def _wake(self, waiting: Waiting | None) -> None:
        """Wake the waiters of a ticket that just became final."""
        # Before the service ran, only a stop finishes tickets, in its caller's run.
        token = self._token or trio.lowlevel.current_trio_token()
        while waiting is not None:
            if waiting.token is token:
                waiting.event.set()
            else:
                # Waiters in another Trio run: wake them there, where wait()
                # raises its error. Setting their event from here would break
                # this run.
                waiting.foreign = True
                with suppress(trio.RunFinishedError):
                    waiting.token.run_sync_soon(waiting.event.set)
            waiting = waiting.following

    @trio.lowlevel.enable_ki_protection
    def _finish(
        self, ticket: Ticket[RequestT, ResultT], status: Status, final: tuple[Any, ...]
    ) -> None:
        """Make ``ticket`` final: ``final`` is its state, starting with finished_at."""
        if self._key_of:
            self._release_key(ticket)
        state = ticket._state
        ticket._state = final
        ticket.status = status
        if type(state) is Waiting:
            self._wake(state)

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
                logger.error(  # noqa: TRY400 - records keep text, not the exception
                    "the key of request #%d could not be freed; its hash or equality"
                    " changed while the request was live (%s)",
                    ticket.id,
                    _one_line(exc),
                )

    @trio.lowlevel.enable_ki_protection
    def _attempt_failed(
        self,
        ticket: Ticket[RequestT, ResultT],
        exc: Exception,
        now: float,
        context: contextvars.Context,
    ) -> None:
        self._in_flight -= 1
        # Drop the processor's own frame from the traceback: it refers to the
        # ticket, and the ticket will refer to the exception.
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame is sys._getframe(1):
            exc.__traceback__ = tb = tb.tb_next
        retry = self._retry
        attempt = ticket.attempts
        if retry is not None and retry.should_retry(attempt, exc):
            if not self._may_start:
                self._cancel(ticket, now)
                return
            delay = retry.delay(attempt)
            ticket.status = _RETRYING
            self._retrying += 1
            self._retried += 1
            heap = self._heap
            heapq.heappush(heap, (now + delay, next(self._heap_seq), ticket))
            if heap[0][2] is ticket:
                self._tickle()  # the loop must now wake earlier
            # A retried failure is routine: INFO with the error in one line,
            # the traceback at DEBUG. Only the final failure is an ERROR.
            if logger.isEnabledFor(logging.INFO):
                _run_in(
                    context,
                    logger.info,
                    "request #%d attempt %d failed (%s), retrying in %.3f seconds",
                    ticket.id,
                    attempt,
                    _one_line(exc),
                    delay,
                )
                if logger.isEnabledFor(logging.DEBUG):
                    _run_in(
                        context,
                        logger.debug,
                        "request #%d attempt %d failed\n%s",
                        ticket.id,
                        attempt,
                        _format_exception(exc),
                    )
            return
        self._fail(ticket, exc, tb, now)
        del tb
        try:
            outcome = _run_in(context, self._on_error, ticket, exc)
            if inspect.isawaitable(outcome):
                # A plain function that returned an awaitable: it will never
                # be awaited, so say so rather than drop it silently.
                if isinstance(outcome, _Coroutine):
                    outcome.close()
                raise TypeError(  # noqa: TRY301
                    "on_error returned an awaitable; it must be a plain function"
                )
        except Exception as hook_exc:
            if logger.isEnabledFor(logging.ERROR):
                _run_in(
                    context,
                    logger.error,
                    "on_error hook raised for request #%d\n%s",
                    ticket.id,
                    _format_exception(hook_exc),
                )

    @trio.lowlevel.enable_ki_protection
    def _abort(self, ticket: Ticket[RequestT, ResultT], exc: BaseException) -> None:
        self._in_flight -= 1
        now = self._time()
        if _is_cancellation(exc):
            self._cancel(ticket, now)
        else:
            # A KeyboardInterrupt or the like ends the run: start nothing more.
            self._may_start = self._draining = False
            self._fail(ticket, exc, exc.__traceback__, now)

    @trio.lowlevel.enable_ki_protection
    def _fail(
        self,
        ticket: Ticket[RequestT, ResultT],
        exc: BaseException,
        tb: types.TracebackType | None,
        now: float | None,
    ) -> None:
        # A failed ticket keeps the original traceback beside the exception:
        # result() raises it with that traceback every time.
        self._finish(ticket, _FAILED, (now, exc, tb, exc.__context__))
        self._failed += 1

    def _time(self) -> float | None:
        """The Trio clock's time, or None before the service has run."""
        timer = self._timer
        return self._offset + timer() if timer is not None else None

    @trio.lowlevel.enable_ki_protection
    def _cancel(self, ticket: Ticket[RequestT, ResultT], now: float | None) -> None:
        self._finish(ticket, _CANCELLED, (now, None))
        self._cancelled += 1
        self._stopped_tickets.append(ticket)

    # -- stopping -------------------------------------------------------

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

    def _insider(self) -> trio.lowlevel.Task | None:
        """The processor whose handler (or a task it spawned) is the current task, if any."""
        nursery = self._nursery
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        while task is not None:
            parent = task.parent_nursery
            if parent is None:
                return None
            if parent is nursery:
                return task
            task = parent.parent_task
        return None

    def _is_follow_up(self) -> bool:
        """Whether the caller is one of this service's handlers (or a task it spawned)."""
        try:
            return self._insider() is not None
        except RuntimeError:  # not in a Trio task: another thread
            return False

    def _check_run(self, what: str) -> trio.lowlevel.TrioToken | None:
        """The service's run's token, after checking the caller runs there too.

        Before the run, the run that first waited on the service stands in for it.
        """
        token = self._token
        run = token if token is not None else self._bound
        if run is not None and run is not trio.lowlevel.current_trio_token():
            raise RuntimeError(f"service {self.name!r} must be {what} from the Trio run running it")
        return token

    def _bind(self) -> None:
        """Before the run, tie the service to the caller's run, which is about to wait on it.

        What it waits on (the room for submit, the idle event for join) can
        be woken only from its own run: the service must then run there.
        """
        if self._token is None and self._bound is None:
            self._bound = trio.lowlevel.current_trio_token()

    def _has_room(self) -> bool:
        bound = self.max_queue_length
        return not self._closed and (bound is None or len(self._queue) + self._scheduled < bound)

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
            await trio.lowlevel.cancel_shielded_checkpoint()
            return ticket

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


Service.enqueue_request.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("key", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("delay", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
)


class _Attempt:
    """A processor's service and the request it is running, for current_ticket()."""

    __slots__ = ("service", "ticket")

    def __init__(self, service: Service[Any, Any]) -> None:
        self.service = service
        self.ticket: Ticket[Any, Any] | None = None


# Every running processor's task, in every Trio run of the process. A
# processor writes its running request to its entry as it starts each
# attempt: one attribute store, where a context variable set per attempt
# would allocate.
_ATTEMPTS: dict[trio.lowlevel.Task, _Attempt] = {}


def _current_attempt(what: str) -> _Attempt:
    """The attempt the calling task belongs to: its processor's, or its nearest ancestor's."""
    try:
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
    except RuntimeError:
        task = None
    while task is not None:
        attempt = _ATTEMPTS.get(task)
        if attempt is not None and attempt.ticket is not None:
            return attempt
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    raise RuntimeError(f"{what}() called outside a tickler handler")


def current_service() -> Service[Any, Any]:
    """The service running the calling handler.

    Works in the handler, in everything it calls, and in the tasks it spawns
    into its own nurseries (which end before the handler returns); from a
    thread the handler started with ``trio.to_thread.run_sync``, call
    ``trio.from_thread.run_sync(tickler.current_service)``.

    Raises:
        RuntimeError: called outside a tickler handler.
    """
    return _current_attempt("current_service").service


def current_ticket() -> Ticket[Any, Any]:
    """The ticket of the request whose handler is calling; see :func:`current_service`.

    Raises:
        RuntimeError: called outside a tickler handler.
    """
    ticket = _current_attempt("current_ticket").ticket
    assert ticket is not None
    return ticket


class _Slot:
    """The limiter's borrower for one processor start.

    One token per start, named for the request it was started for: the
    limiter's statistics show which starts hold slots, and the token keeps no
    request alive. The processor releases on behalf of the same token.
    """

    __slots__ = ("request_id",)

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"<tickler slot started for request #{self.request_id}>"


class _Parked:
    """A processor waiting for a start, and the start once the loop hands it over."""

    __slots__ = ("handed", "task")

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.handed: tuple[Ticket[Any, Any], _Slot] | None = None


def _by_id(ticket: Ticket[Any, Any]) -> int:
    return ticket.id


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
    )
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            try:
                yield service
            except BaseException as exc:
                body_error = exc
                nursery.cancel_scope.cancel()
                raise
            await service.stop(drain=True, timeout=shutdown_timeout)
    except BaseExceptionGroup as group:
        # The nursery wraps the body's own exception in a group; a caller of
        # a context manager expects the exception it raised.
        if (
            body_error is not None
            and len(group.exceptions) == 1
            and group.exceptions[0] is body_error
        ):
            raise body_error from None
        raise
