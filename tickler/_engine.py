"""The engine: the hot state of a service, and every request's path through it.

One class, :class:`_Engine`, holds what every request touches and every
hand-tuned line (``grep -n "# tuned" tickler/`` lists them, each with the
benchmark row it serves and its twin): the enqueue fast path, ``_take``,
``_dispatch``, the processor loop ``_process``, parking, and the tickle of
the one-slot signal. :class:`tickler.Service` subclasses it directly, so
that ``enqueue_request`` stays a single call.

Everything else is a part the engine holds as a field, as trio's ``Runner``
holds its ``entry_queue`` and ``io_manager``: ``_intake`` (keys, delays,
submit, refusals), ``_outcomes`` (retries, failures, cancels, ``on_error``),
``_stopping`` (stop, join, drains), and with a store ``_store_run`` (the
store side). The engine knows them by the protocols in ``_parts`` and
imports none of them.

The processor loop is the per-request path; its rare branches are helpers:
``_fresh_context`` (the last handler set variables of its own),
``_not_started`` (a request taken but ended before it starts: a cancel, a
stop, a crash), ``_scoped`` (a timeout, or a store that may take the
attempt away), and the outcomes part for failures and cancellations.

The context of an attempt: Trio runs every step of a task inside
``task.context``, read afresh at each step. An attempt sets its enqueuer's
variables there (the very objects) and the handler runs in it like any code
of the task. The next attempt for the same enqueuer's context reuses them if
they still hold the very same objects and nothing else; otherwise the
processor resets them with the tokens it got, which also undoes the
handler's writes to them. A handler that set a variable of its own leaves
the context non-empty after that: the processor then takes a fresh empty
context and yields once, so the next attempt starts clean. Every request,
with or without contextvars, takes this one path.
"""

from __future__ import annotations

import collections
import contextvars
import heapq
import inspect
import itertools
import logging
import math
import threading
import types
from collections.abc import Callable, Generator, Hashable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Generic, NoReturn

import trio

from . import _lowlevel
from ._core import (
    _EMPTY_CONTEXT,
    _MISSING,
    _QUEUED,
    _RUNNING,
    _SCHEDULED,
    _SUCCEEDED,
    _UNBOUNDED,
    Handler,
    _Context,
    _get_ident,
    _run_in,
    logger,
)
from ._current import ATTEMPTS, Attempt
from ._exceptions import Withdrawn
from ._parts import GroupsPart, IntakePart, OutcomesPart, StoppingPart, StorePart, TracerPart
from ._statistics import TIME_BUCKETS, tally
from ._ticket import RequestT, ResultT, Status, Ticket, Waiting

_Coroutine = types.CoroutineType
_copy_context = contextvars.copy_context
_new_ticket = object.__new__
_KEYWORD_ONLY = object()
# The default priority, compared by identity on the hot path: CPython keeps
# one object for the int 0, and None, a bool or a float 0 is not it (so each
# goes the checked way, where None and bools are refused).
_PRIORITY_0 = 0

# A processor that keeps its slot yields to the scheduler after this many
# requests in a row, even if every handler returned without yielding.
_CHAIN_BUDGET = 64

# tuned (bench: histograms): a processor's run times (and as many wait times at most) are
# counted once it ends, parks holding _TALLY_PARKED, or at a yield of its chain once it holds
# this many: counted in bulk, the more at a time the cheaper each (a list of 64 at a time cost
# 0.5% of the burst more than of 512), and no more than this are kept.
_TALLY_AT = 512

# serves: pg drain, grouped: a parked processor's times are counted once it holds this many
# (or as it ends, or at statistics()), not at each park: with a store, processors park after
# each request, and counting one time at a time was 8% of the instructions a request cost
# there. Few, so that the processors parked at once keep little (this many each).
_TALLY_PARKED = 16


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


def _refuse_positional() -> NoReturn:
    raise TypeError(
        "enqueue_request() takes one positional argument, the request;"
        " key, delay, priority, unique_for and group are keyword-only"
    )


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
    """A processor waiting for a start, and the start once the loop hands it over.

    serves: pg drain, grouped: one for each processor, made once and used at each of
    its parks (with a store, processors park after each request).
    """

    __slots__ = ("handed", "idle", "task")

    def __init__(self, task: trio.lowlevel.Task, idle: list[_Parked]) -> None:
        self.task = task
        self.idle = idle
        self.handed: tuple[Ticket[Any, Any], _Slot] | None = None

    def abort(self, _: object) -> trio.lowlevel.Abort:
        """A parked processor cancelled: it waits no more."""
        self.idle.remove(self)
        return trio.lowlevel.Abort.SUCCEEDED


class _Engine(Generic[RequestT, ResultT]):
    """The hot state of a service and the path of every request through it.

    Its parts (see the module's docstring) write a few flags that the hot
    path reads; each flag's writers:

    - ``_admit``, the queue length at which ``enqueue_request`` leaves the
      fast path: the intake (delays, ``set_admit``) and stopping (a close);
    - ``_closed``: stopping;
    - ``_may_start``, whether a processor may start a request: stopping,
      the supervisor loop, and outcomes (an interrupt that ends the run);
    - ``_draining``, whether a stop still takes follow-ups: the same;
    - ``_submitters``, ``submit()`` callers waiting for room: the intake;
    - ``_paused`` and ``_start_cap`` (the capacity, or 0 while paused):
      ``Service.pause``/``resume``, and the store side (a pause from any
      process);
    - ``_retrying``, ``_in_flight``: the engine, outcomes and stopping, as
      requests move between the heap, the slots and their final states.

    Everything else here is written by the engine alone, or read-only after
    ``__init__``.
    """

    __slots__ = (
        "__weakref__",
        "_admit",
        "_bound",
        "_capacity",
        "_closed",
        "_debug",
        "_doomed",
        "_draining",
        "_foreign_pending",
        "_groups",
        "_handed",
        "_handler",
        "_heap",
        "_heap_seq",
        "_histograms",
        "_idle",
        "_in_flight",
        "_intake",
        "_last_context",
        "_last_id",
        "_limiter",
        "_lock",
        "_may_start",
        "_nursery",
        "_offset",
        "_outcomes",
        "_paused",
        "_peak",
        "_queue",
        "_ready",
        "_retrying",
        "_run_counts",
        "_run_sum",
        "_signal_rx",
        "_signal_tx",
        "_start_cap",
        "_started",
        "_stopping",
        "_store_run",
        "_submitters",
        "_succeeded",
        "_thread",
        "_timeout",
        "_timer",
        "_times",
        "_token",
        "_tracer",
        "_wait_counts",
        "_wait_sum",
        "_wakeup_pending",
        "max_queue_length",
        "name",
    )

    name: str
    max_queue_length: int | None
    _handler: Handler[RequestT, ResultT]
    _timeout: float | None
    # the parts (set by Service.__init__, right after this class's)
    _intake: IntakePart
    _outcomes: OutcomesPart
    _stopping: StoppingPart
    _store_run: StorePart | None
    _groups: GroupsPart | None  # limits per group, in memory (None: no limits)
    # Tracing (tickler.otel.instrument), None while off: read off the hot path only.
    _tracer: TracerPart | None
    # the flags parts write (see the class's docstring)
    _admit: int
    _closed: bool
    _may_start: bool
    _draining: bool
    _submitters: int
    _paused: bool
    _start_cap: int
    # the queue
    _lock: threading.Lock
    _queue: collections.deque[Ticket[RequestT, ResultT]]
    # Requests ready to start that are not plain queued ones at priority 0:
    # (-priority, ready since, id, ticket), under the lock (see _take_ranked).
    _ready: list[tuple[int, float, int, Ticket[RequestT, ResultT]]]
    _last_context: tuple[contextvars.Context, tuple[Any, ...], int] | None
    # the cap, the timer heap and the processors
    _limiter: trio.CapacityLimiter
    _capacity: int
    _heap: list[tuple[float, int, Ticket[RequestT, ResultT]]]
    _heap_seq: itertools.count[int]
    _idle: list[_Parked]
    # Requests handed to a processor that has not started them, by id; and
    # those of them cancel() took, which the processor ends unstarted.
    _handed: dict[int, Ticket[RequestT, ResultT]]
    _doomed: set[Ticket[RequestT, ResultT]]
    # the counters the hot path keeps (statistics() reads them)
    _last_id: int  # also the `enqueued` counter
    _started: int
    _succeeded: int
    _peak: int
    _in_flight: int
    _retrying: int
    # the wait and run time histograms: kept or not, counts (see TIME_BUCKETS), sums
    _histograms: bool
    _wait_counts: list[int]
    _wait_sum: float
    _run_counts: list[int]
    _run_sum: float
    # each running processor's wait and run times not counted yet, by its task
    _times: dict[trio.lowlevel.Task, tuple[list[float], list[float]]]
    # the run
    _offset: float
    _timer: Callable[[], float] | None
    _token: trio.lowlevel.TrioToken | None
    _bound: trio.lowlevel.TrioToken | None
    _thread: int | None
    _nursery: trio.Nursery | None
    _signal_tx: trio.MemorySendChannel[None] | None
    _signal_rx: trio.MemoryReceiveChannel[None] | None
    _wakeup_pending: bool
    _foreign_pending: bool
    _debug: bool

    def __init__(
        self,
        handler: Handler[RequestT, ResultT],
        capacity: int,
        max_queue_length: int | None,
        timeout: float | None,
        histograms: bool,
        name: str,
        stored: bool,
    ) -> None:
        """The hot state, its arguments already checked by Service; the parts come next."""
        self.name = name
        self.max_queue_length = max_queue_length
        self._handler = handler
        self._timeout = timeout
        # tuned (bench: enqueue): the queue length at which enqueue_request
        # refuses: the cap less the delayed requests while the service is
        # open, 0 once closed or with a store (whose path every enqueue takes),
        # so one comparison on the hot path covers every refusal.
        self._admit = max_queue_length if max_queue_length is not None else _UNBOUNDED
        self._admit = 0 if stored else self._admit
        self._closed = False
        self._may_start = True
        # A drain is under way and still takes follow-ups from handlers.
        self._draining = False
        # submit() callers waiting for room in the queue.
        self._submitters = 0
        self._paused = False
        self._start_cap = capacity
        # The queue. A threading.Lock, not a Trio lock: enqueue_request is
        # also called from threads that are not running Trio.
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._ready = []
        self._groups = None
        self._tracer = None
        # The last context a request was enqueued with: requests enqueued from
        # one unchanged context share one Context object instead of a copy each.
        self._last_context = None
        # The cap. Slots are borrowed on behalf of each start (_Slot), so the
        # limiter's statistics name the requests in flight.
        self._limiter = trio.CapacityLimiter(capacity)
        self._capacity = capacity  # mirrors the limiter's total, for the hot path
        # Retries and due delayed requests wait here, ordered by due time, held
        # by the loop's thread: a retry never needs a queue place, so a full
        # queue cannot block it.
        self._heap = []
        self._heap_seq = itertools.count()
        # Processors with nothing to do, parked until the loop hands them a start.
        self._idle = []
        self._handed = {}
        self._doomed = set()
        self._last_id = 0
        self._started = 0
        self._succeeded = 0
        self._peak = 0
        self._in_flight = 0
        self._retrying = 0
        self._histograms = histograms
        self._wait_counts = [0] * (len(TIME_BUCKETS) + 1)
        self._wait_sum = 0.0
        self._run_counts = [0] * (len(TIME_BUCKETS) + 1)
        self._run_sum = 0.0
        self._times = {}
        # Set when run starts: the Trio clock, read as `_offset + _timer()`
        # (see _lowlevel.clock_offset), and the token that also tells whether
        # the service has ever run.
        self._offset = 0.0
        self._timer = None
        self._token = None
        # Before the run: the run that waited on the service (see _bind).
        self._bound = None
        self._thread = None
        self._nursery = None
        self._signal_tx = None
        self._signal_rx = None
        self._wakeup_pending = False
        self._foreign_pending = False
        self._debug = logger.isEnabledFor(logging.DEBUG)
        if self._debug:
            self._admit = 0  # enqueues take the path that logs them (see Intake.set_admit)

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
        # tuned (bench: trickle): no suppress(), which adds a context manager to every tickle
        try:  # noqa: SIM105
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

    def _time(self) -> float | None:
        """The Trio clock's time, or None before the service has run."""
        timer = self._timer
        return self._offset + timer() if timer is not None else None

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

    # A KeyboardInterrupt never lands halfway through the bookkeeping of the
    # methods marked so (Trio delivers it at the next unprotected point).
    #
    # tuned (bench: enqueue): key and the rest are keyword-only, but the code does not declare
    # them so:
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
        priority: int = _PRIORITY_0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> Ticket[RequestT, ResultT]:
        # (The docstring is _ENQUEUE_REQUEST_DOC, below the class.)
        if (
            key is not None
            or delay is not None
            or priority is not _PRIORITY_0
            or unique_for is not None
            or group is not None
            or _keyword_only is not _KEYWORD_ONLY
        ):
            if _keyword_only is not _KEYWORD_ONLY:
                _refuse_positional()
            return self._intake.enqueue_keyed(request, key, delay, priority, unique_for, group)
        # (The hot path. Twins: Intake.enqueue_keyed, and _capture_context for contexts.)
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
        # __init__ (its twin) costs about 40 ns more per call. Its id is given under the lock.
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
            if len(queue) >= self._admit:  # tuned (bench: enqueue): no length kept
                if self._store_run is not None:
                    # A service with a store: _admit is always 0, so that the
                    # in-memory hot path pays nothing for the store's path.
                    lock.release()
                    try:
                        return self._store_run.accept(request, None, None, ticket)
                    finally:
                        lock.acquire()
                # Refused, unless it is a follow-up from one of the service's
                # own handlers during a drain, with room in the queue; or
                # logged at DEBUG. Only this slow path asks which: the
                # intake's twin of the rest of this method.
                lock.release()
                try:
                    return self._intake.enqueue_checked(ticket)
                finally:
                    lock.acquire()
            if timer is None:
                ticket.enqueued_at = self._time()  # the run may have started meanwhile
            self._last_id = ticket.id = self._last_id + 1
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
        return ticket

    if TYPE_CHECKING:

        def enqueue_request(
            self,
            request: RequestT,
            *,
            key: Hashable | None = None,
            delay: float | None = None,
            priority: int = 0,
            unique_for: float | None = None,
            group: str | None = None,
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

    @trio.lowlevel.enable_ki_protection
    def _take(self, now: float) -> Ticket[RequestT, ResultT] | None:
        """Take the next request to start, the oldest queued one unless others are ready.

        Others are: requests of another priority than 0, and retries and
        delayed requests that fell due (see _take_ranked).
        """
        heap = self._heap
        if heap and heap[0][0] <= now:
            self._rank_due(now)
        if self._ready:
            taken = self._take_ranked(now)
            if taken is None:
                return None
            ticket = taken
        else:
            queue = self._queue
            groups = self._groups
            while True:
                if not queue:
                    return None
                # Only this thread pops, so the queue cannot empty meanwhile.
                lock = self._lock
                lock.acquire()
                try:
                    # Between pops the queue only grows, so its peak is reached
                    # just before a pop: recording it here keeps enqueue lean.
                    length = len(queue)
                    if groups is not None:  # those held for their group wait too
                        length += self._intake.ranked
                    if length > self._peak:
                        self._peak = length
                    ticket = queue.popleft()
                finally:
                    lock.release()
                if self._submitters:
                    self._intake.room.unpark()
                # tuned (bench: groups, burst): with limits, a queued request's group is
                # checked as it leaves the queue; without, one test of one slot.
                if groups is None or groups.admit_queued(ticket, now):
                    break
        self._in_flight += 1
        if self._debug:
            self._log_dequeued(ticket)
        return ticket

    def _rank_due(self, now: float) -> None:
        """Move the retries and delayed requests that fell due into the ready heap."""
        heap = self._heap
        priority_of = self._intake.priority_of
        ready = self._ready
        with self._lock:
            while heap and heap[0][0] <= now:
                due, _, ticket = heapq.heappop(heap)
                heapq.heappush(ready, (-priority_of.get(ticket, 0), due, ticket.id, ticket))

    @trio.lowlevel.enable_ki_protection
    def _take_ranked(self, now: float) -> Ticket[RequestT, ResultT] | None:
        """Take the first ready request: by priority, then since when ready, then by id.

        A plain queued request (priority 0) is ready since it was enqueued;
        a retry or a delayed request since it fell due. The store's claim
        takes rows in the same order. A request whose group is at its limit
        is held by the groups part, and the next one is taken instead.
        """
        ready = self._ready
        queue = self._queue
        groups = self._groups
        while True:
            with self._lock:
                # The waiting only grow between takes: their peak is just before one.
                waiting = len(queue) + self._intake.ranked
                if waiting > self._peak:
                    self._peak = waiting
                first = ready[0] if ready else None
                if queue and (first is None or (0, queue[0].enqueued_at, queue[0].id) < first[:3]):
                    ticket = queue.popleft()
                    first = None
                elif first is None:
                    return None
                else:
                    heapq.heappop(ready)
            if first is None:  # from the queue
                if self._submitters:
                    self._intake.room.unpark()
                if groups is None or groups.admit_queued(ticket, now):
                    return ticket
                continue
            group = groups.group_of.get(first[3]) if groups is not None else None
            if group is None or groups.admit(first, group, now):  # type: ignore[union-attr]
                break
        ticket = first[3]
        self._left(ticket)
        return ticket

    def _left(self, ticket: Ticket[RequestT, ResultT]) -> None:
        """A request left where it waited (the ready or timer heap) to start, or to end."""
        status = ticket.status
        if status is _SCHEDULED:
            self._intake.unschedule()
        elif status is _QUEUED:
            self._intake.unrank()
        else:
            self._retrying -= 1

    def _set_paused(self, paused: bool) -> None:
        """Pause or resume starts: paused, nothing new starts, and running attempts go on.

        A request handed to a processor that has not started it goes back
        unstarted (see _not_started).
        """
        if paused == self._paused:
            return
        self._paused = paused
        self._start_cap = 0 if paused else self._capacity
        if paused:
            self._hand_back_unstarted()
        else:
            self._tickle()

    def _hand_back_unstarted(self) -> None:
        """Every request handed to a processor that has not started it goes back first in
        line, unstarted, as its processor comes to start it (see _not_started): on a pause,
        and when the cap is lowered below what is in flight."""
        for ticket in self._handed.values():
            self._doomed.add(ticket)
            self._intake.deferred.add(ticket)

    def _log_dequeued(self, ticket: Ticket[RequestT, ResultT]) -> None:
        state = ticket._state
        captured = state if type(state) is _Context else state.context
        _run_in(captured, logger.debug, "request #%d dequeued", ticket.id)

    def _dispatch(self) -> float:
        """Start a processor into every free slot; return the time used (-inf: none may start)."""
        if not self._may_start or self._paused:
            return -math.inf
        limiter = self._limiter
        nursery = self._nursery
        assert nursery is not None
        timer = self._timer
        assert timer is not None
        now = self._offset + timer()
        process = self._process
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
        if self._debug and (self._queue or self._ready):
            logger.debug(
                "received loop signal, but request limit is reached"
                " (%d/%d slots in use, %d queued)",
                self._in_flight,
                self._capacity,
                len(self._queue),
            )
        return now

    async def _scoped(
        self, ticket: Ticket[RequestT, ResultT], awaitable: Any, now: float, attempt: Attempt
    ) -> Any:
        """Await an attempt under its timeout, where the store's loop may also take it away.

        With a store and no timeout, the loop takes the attempt away through
        the processor's scope (Cancelled, in the caller); with a timeout,
        through the attempt's own scope (a cancel, a lost lease, a stop):
        then Withdrawn. A timeout is one more failure: TimeoutError. ``attempt``
        holds the processor's scope.
        """
        stored = self._store_run
        timeout = self._timeout
        if timeout is None:
            assert stored is not None
            assert attempt.scope is not None
            stored.attempt_started(ticket.id, attempt.scope)
            try:
                return await awaitable
            finally:
                stored.attempt_ended(ticket.id)
        scope = trio.CancelScope(deadline=now + timeout)
        if stored is not None:
            stored.attempt_started(ticket.id, scope)
        result: Any = None
        try:
            with scope:
                result = await awaitable
        finally:
            if stored is not None:
                stored.attempt_ended(ticket.id)
        if scope.cancelled_caught:
            reason = stored.withdrawn_reason(ticket.id) if stored is not None else None
            if reason is not None:
                raise Withdrawn(reason)
            raise TimeoutError(f"attempt timed out after {timeout:g} seconds")
        return result

    def _not_started(
        self, ticket: Ticket[RequestT, ResultT], withdrawable: trio.CancelScope, now: float
    ) -> None:
        """A request a processor took ends before it starts; the processor then parks or ends."""
        self._in_flight -= 1
        if ticket in self._doomed:
            self._doomed.discard(ticket)
            deferred = self._intake.deferred
            if ticket in deferred:
                # A pause, or a cap lowered below what was in flight, came
                # between its hand-over and its start.
                deferred.discard(ticket)
                self._intake.put_back(ticket, now)
            else:
                # cancel() took it before it started.
                self._outcomes.finish_cancelled(ticket, now)
        elif self._withdrawn_only(withdrawable):
            # cancel() took this processor's last attempt away: the request
            # taken next goes back, and the processor ends (its scope is cancelled).
            self._intake.put_back(ticket, now)
        else:
            # A stop without drain, a crash or a cancellation came between
            # taking this request and starting it.
            self._may_start = False
            self._outcomes.cancel(ticket, now)

    def _withdrawn_only(self, withdrawable: trio.CancelScope | None) -> bool:
        """Whether only cancel() cancelled this processor, not a stop or a crash (in memory)."""
        nursery = self._nursery
        return (
            self._may_start
            and self._store_run is None
            and withdrawable is not None
            and withdrawable.cancel_called
            and nursery is not None
            and not nursery.cancel_scope.cancel_called
        )

    async def _process(self, ticket: Ticket[RequestT, ResultT], slot: _Slot) -> None:
        """Run ``ticket``; then, while work waits and the cap allows, keep the slot for the next.

        Keeping the slot saves a task spawn per request (the burst rows). With
        nothing left to take, the processor gives its slot back and parks until
        the supervisor, which owns every start into a free slot, hands it the
        next one. How an attempt gets its enqueuer's context: see the module's
        docstring. The rare branches are the helpers named in it.

        tuned (bench: burst): one cancel scope for all its attempts, ``withdrawable``
        (see _scoped), entered here: not in a frame around this one, through which
        every resume of the task passed.
        """
        timer = self._timer
        assert timer is not None
        offset, handler, timeout, groups = self._offset, self._handler, self._timeout, self._groups
        heap, queue, lock, ready = self._heap, self._queue, self._lock, self._ready
        task = trio.lowlevel.current_task()
        parked = _Parked(task, self._idle)  # (see _Parked)
        stored = self._store_run  # None for the in-memory engine
        outcomes = self._outcomes
        # The keys of live requests (the dict itself); a request with a key or a
        # priority is in it, and the intake releases it as it ends.
        key_of = self._intake.key_of
        # tuned (bench: histograms): each wait and run time is appended to this processor's
        # lists, and counted in bulk (_tally) as the chain yields, parks (see _TALLY_PARKED) or
        # ends: an append costs a third of a count. statistics() counts what the lists hold
        # (_times) first.
        timed = self._histograms
        waits: list[float] = []
        runs: list[float] = []
        if timed:
            self._times[task] = (waits, runs)
        # What current_service() and current_ticket() find for this task and
        # the tasks its handlers spawn.
        withdrawable = trio.CancelScope()
        attempt = ATTEMPTS[task] = Attempt(self, withdrawable)
        # Requests cancel() took after a processor was handed them, before
        # they started (an alias: the set itself is the service's).
        doomed = self._doomed
        self._handed.pop(ticket.id, None)
        ended = False
        try:
            with withdrawable:
                # tuned (bench: burst): whether this task (in this scope) is cancelled, read once
                cancel_status = _lowlevel.cancel_status(task)
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
                                    # The last handler set variables of its own.
                                    if not await self._fresh_context(task, ticket):
                                        break
                                    context = task.context
                                    now = offset + timer()
                                if captured:
                                    held_tokens = [v.set(x) for v, x in captured.items()]
                                    held = captured
                            if (
                                not self._may_start
                                or cancel_status.effectively_cancelled
                                or (doomed and ticket in doomed)
                            ):
                                self._not_started(ticket, withdrawable, offset + timer())
                                break
                            ticket.status = _RUNNING
                            attempt.ticket = ticket
                            ticket.attempts += 1
                            # Read afresh: a hook or another thread may have enqueued
                            # this request after the last reading.
                            ticket.started_at = now = offset + timer()
                            if timed and ticket.attempts == 1:
                                waits.append(now - ticket.enqueued_at)  # type: ignore[operator]
                            self._started += 1
                            if self._debug:
                                _run_in(context, logger.debug, "processing request #%d"
                                        " (attempt %d)", ticket.id, ticket.attempts)  # fmt: skip
                            try:
                                awaitable = handler(ticket.request)
                                if type(awaitable) is not _Coroutine:
                                    awaitable = _steps_of(awaitable)
                                if timeout is None and stored is None:
                                    result = await awaitable
                                else:
                                    # A deadline, or a store that may take it away.
                                    result = await self._scoped(ticket, awaitable, now, attempt)
                            except Exception as exc:
                                now = offset + timer()  # afresh: a rate counts from it
                                outcomes.attempt_failed(ticket, exc, now, context)
                                if withdrawable.cancel_called:
                                    await trio.lowlevel.checkpoint()  # taken away: this ends
                            except BaseException as exc:
                                # Cancelled, KeyboardInterrupt and the like: record the
                                # request's final state, and let the exception go on.
                                raise outcomes.aborted(ticket, exc, context)  # noqa: B904
                            else:
                                now = offset + timer()
                                self._in_flight -= 1
                                if timed:
                                    runs.append(now - ticket.started_at)
                                if stored is None:
                                    self._succeeded += 1
                                    if key_of:
                                        self._intake.release_key(ticket)
                                    state = ticket._state  # a waiter may have wrapped it meanwhile
                                    ticket._state = (now, result)
                                    ticket.status = _SUCCEEDED
                                    if type(state) is Waiting:
                                        self._wake(state)
                                elif stored.record_success(ticket, result, context):
                                    # Taken away as it returned: the store decides what
                                    # holds, and Cancelled from here ends the processor.
                                    await trio.lowlevel.checkpoint()
                                result = None
                            # Final: keep nothing of it while choosing the next.
                            state = captured = context = awaitable = ticket = None  # type: ignore[assignment]
                            chained += 1
                            if chained == _CHAIN_BUDGET:
                                # Handlers that never yield must not starve other tasks.
                                chained = 0
                                if len(runs) >= _TALLY_AT:
                                    self._tally(waits, runs)
                                await trio.lowlevel.cancel_shielded_checkpoint()
                                now = offset + timer()
                            if (
                                not self._may_start
                                or self._in_flight >= self._start_cap
                                or cancel_status.effectively_cancelled
                            ):
                                # (Cancelled: by cancel(), a stop or a crash; the
                                # processor takes nothing more, and ends.)
                                break
                            if ready or groups or (heap and heap[0][0] <= now):  # groups: see _take
                                following = self._take(now)
                                if following is None:
                                    break  # all that was ready waits for its group's limit
                                ticket, following = following, None
                            elif queue:
                                # tuned (bench: burst): the common case of _take, inlined
                                # (twin: _take); calling _take (and _finish above) here cost
                                # about 2% of burst throughput.
                                lock.acquire()
                                try:
                                    length = len(queue)
                                    if length > self._peak:
                                        self._peak = length
                                    ticket = queue.popleft()
                                finally:
                                    lock.release()
                                if self._submitters:
                                    self._intake.room.unpark()
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
                        if task.context and not _lowlevel.reset_context(task, _EMPTY_CONTEXT):
                            ended = True  # a new task starts the next request
                        # A completion that frees a slot tickles the loop.
                        self._limiter.release_on_behalf_of(slot)
                        self._tickle()
                        if self._debug:
                            self._log_slot_freed()
                    if ended:
                        return  # (its times are counted below)
                    handed = await self._park(parked, waits, runs)
                    if handed is None:
                        return
                    (ticket, slot), handed = handed, None
                    self._handed.pop(ticket.id, None)
                    handler = self._handler  # instrument() may have wrapped it meanwhile
                    chained = 0  # serves: pg drain, grouped: no clock read (a start reads)
        finally:
            del ATTEMPTS[task]
            if timed:
                del self._times[task]
                self._tally(waits, runs)

    def _tally(self, waits: list[float], runs: list[float]) -> None:
        """Count a processor's wait and run times into the histograms."""
        self._wait_sum += tally(waits, self._wait_counts)
        self._run_sum += tally(runs, self._run_counts)

    def _tally_all(self) -> None:
        """Count every processor's wait and run times not counted yet (for statistics())."""
        for waits, runs in self._times.values():
            self._tally(waits, runs)

    async def _fresh_context(
        self, task: trio.lowlevel.Task, ticket: Ticket[RequestT, ResultT]
    ) -> bool:
        """Give the task a fresh empty context before ``ticket`` starts; False: it cannot.

        The last handler's own variables must not reach this attempt, which
        starts in the fresh context once this step has ended. Where Trio does
        not let the context be replaced, the request goes back to a new task,
        and this processor ends.
        """
        if not _lowlevel.reset_context(task, _EMPTY_CONTEXT):
            self._in_flight -= 1
            now = self._time()
            assert now is not None
            self._intake.put_back(ticket, now)
            return False
        # Taken, not started, across a checkpoint: cancel() finds it here meanwhile.
        self._handed[ticket.id] = ticket
        await trio.lowlevel.cancel_shielded_checkpoint()
        self._handed.pop(ticket.id, None)
        return True

    def _log_slot_freed(self) -> None:
        # Not a line for any one request: no request's context.
        _run_in(
            _EMPTY_CONTEXT,
            logger.debug,
            "slot freed: now %d/%d slots in use",
            self._in_flight,
            self._capacity,
        )

    async def _park(
        self, parked: _Parked, waits: list[float], runs: list[float]
    ) -> tuple[Ticket[RequestT, ResultT], _Slot] | None:
        """Wait, holding no slot, for the supervisor to hand over a start; None means exit.

        ``parked`` is the processor's own (see _Parked), with no start in it.
        At most `capacity` processors wait; the others exit at once. The processor's
        wait and run times not counted yet (``waits``, ``runs``) are counted first if
        there are _TALLY_PARKED of either (see _TALLY_PARKED).
        """
        if len(waits) >= _TALLY_PARKED or len(runs) >= _TALLY_PARKED:
            self._tally(waits, runs)
        idle = self._idle
        if not self._may_start or self._stopping.stop_called or len(idle) >= self._capacity:
            return None
        idle.append(parked)
        await trio.lowlevel.wait_task_rescheduled(parked.abort)
        handed, parked.handed = parked.handed, None  # a parked processor keeps no request
        return handed

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
        if self._intake.key_of:
            self._intake.release_key(ticket)
        state = ticket._state
        ticket._state = final
        ticket.status = status
        if type(state) is Waiting:
            self._wake(state)


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
    priority: an int; a higher priority starts first, equal priorities
        in the order they became ready (enqueued, or fell due). Strict:
        a steady stream of higher priorities holds lower ones back. A
        retry keeps its priority.
    unique_for: seconds (> 0 and at most 100 years, or ``math.inf``) for which ``key``
        stays taken after the request was enqueued, whatever its state:
        a duplicate gets the original's ticket, even once it is final.
        Needs ``key``.
    group: a str naming the request's group, or None: the service's
        ``limits`` bound each group's attempts in flight and starts.

Raises:
    QueueFull: ``max_queue_length`` requests are already queued or
        scheduled.
    ServiceClosed: a stop has begun or the run has ended.
    TypeError, ValueError: ``key`` is not hashable, ``delay`` is not a
        finite number >= 0, ``priority`` not an int in the 32-bit signed
        range, or ``unique_for`` not a number > 0 and at most 100 years
        (or ``math.inf``), or given without ``key``.
"""
_Engine.enqueue_request.__doc__ = _ENQUEUE_REQUEST_DOC
_Engine.enqueue_request.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("key", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("delay", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("priority", inspect.Parameter.KEYWORD_ONLY, default=0),
        inspect.Parameter("unique_for", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("group", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
)
