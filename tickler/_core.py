"""What every part of a service shares: its state, the loop's signal, its clock, its run.

A :class:`tickler.Service` is one object built in layers, one module each,
so that the hot paths read their state as plain attributes of ``self``:

- ``_core``: the state (declared here, allocated in ``_service``), the
  one-slot signal that wakes the loop, the clock and the caller's run;
- ``_queue``: where requests wait, and how they get in (enqueue, submit,
  keys, delays) and out (``_take``);
- ``_processors``: the tasks that run handlers in the limiter's slots;
- ``_loop``: the supervisor loop, and stopping and joining;
- ``_service``: the public class and ``open_service``.
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import logging
import math
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic

import trio

from ._retry import Retry
from ._ticket import RequestT, ResultT, Status, Ticket

if TYPE_CHECKING:
    from ._processors import _Parked
    from ._stores._sync import StoreSync

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
_get_ident = threading.get_ident
_UNBOUNDED = sys.maxsize
_EMPTY_CONTEXT = contextvars.Context()
_MISSING = object()


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


def _run_in(context: contextvars.Context, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` in a copy of a request's context: hooks and log lines for a request.

    A copy, because the request's context is the one running right now, and a
    Context cannot be entered twice; and the hook's own writes stay its own.
    """
    return context.copy().run(fn, *args)


class _ServiceCore(Generic[RequestT, ResultT]):
    """The state of a service, and what every layer of it uses.

    Declared here, for every layer; ``Service.__init__`` fills it in.
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
        "_doomed",
        "_draining",
        "_failed",
        "_finished",
        "_foreign_pending",
        "_handed",
        "_handler",
        "_heap",
        "_heap_seq",
        "_histograms",
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
        "_run_counts",
        "_run_sum",
        "_scheduled",
        "_signal_rx",
        "_signal_tx",
        "_started",
        "_stop_called",
        "_stop_deadline",
        "_stopped_tickets",
        "_store_run",
        "_submitters",
        "_succeeded",
        "_thread",
        "_timeout",
        "_timer",
        "_token",
        "_wait_counts",
        "_wait_sum",
        "_wakeup_pending",
        "_wakeups",
        "max_queue_length",
        "name",
        "stopping",
    )

    name: str
    max_queue_length: int | None
    stopping: trio.Event
    _handler: Handler[RequestT, ResultT]
    _retry: Retry | None
    _on_error: ErrorHook[RequestT, ResultT]
    _timeout: float | None
    # the queue
    _admit: int
    _closed: bool
    _lock: threading.Lock
    _queue: collections.deque[Ticket[RequestT, ResultT]]
    _last_context: tuple[contextvars.Context, tuple[Any, ...], int] | None
    _incoming: list[tuple[float, Ticket[RequestT, ResultT]]]
    _scheduled: int
    _keys: dict[object, Ticket[RequestT, ResultT]]
    _key_of: dict[Ticket[RequestT, ResultT], object]
    _room: trio.lowlevel.ParkingLot
    _submitters: int
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
    # counters
    _last_id: int
    _started: int
    _succeeded: int
    _failed: int
    _cancelled: int
    _retried: int
    _rejected: int
    _deduplicated: int
    _wakeups: int
    _peak: int
    _in_flight: int
    _retrying: int
    # the wait and run time histograms: kept or not, counts (see TIME_BUCKETS), sums
    _histograms: bool
    _wait_counts: list[int]
    _wait_sum: float
    _run_counts: list[int]
    _run_sum: float
    # stopping and joining
    _finished: trio.Event
    _stop_called: bool
    _stop_deadline: float
    _draining: bool
    _stopped_tickets: list[Ticket[RequestT, ResultT]]
    _may_start: bool
    _insiders: collections.Counter[trio.lowlevel.Task]
    _quiet: trio.Event
    _idle_event: trio.Event | None
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
    # with a store: the loop's side of it (None for the in-memory engine)
    _store_run: StoreSync | None

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
