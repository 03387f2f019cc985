"""What the engine and its parts ask of each other: one protocol per part.

The engine (``_engine._Engine``) holds its parts as fields, as trio's
``Runner`` holds its ``entry_queue``, ``deadlines`` and ``io_manager``:
:class:`IntakePart`, :class:`OutcomesPart`, :class:`StoppingPart`, and with a
store :class:`StorePart`. It never imports them: it names them here, by what
it calls, and ``Service.__init__`` hands it the real ones (``_intake``,
``_outcomes``, ``_stopping``, ``_stores._sync``), which mypy checks against
these protocols. A part reaches another through the engine's field, typed
here too; so no module of tickler imports one that imports it back.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import trio

from ._retry import Retry
from ._stores._seam import Batch, BatchResult, Session, Store
from ._ticket import Ticket
from ._values import Insert, OutcomeKind, Tick


class IntakePart(Protocol):
    """The cold ways in: keys, delays, ``submit``, refusals; and where a request goes back."""

    keys: dict[object, Ticket[Any, Any]]
    key_of: dict[Ticket[Any, Any], object]
    priority_of: dict[Ticket[Any, Any], int]
    deferred: set[Ticket[Any, Any]]
    ranked: int
    incoming: list[tuple[float, Ticket[Any, Any]]]
    scheduled: int
    room: trio.lowlevel.ParkingLot
    rejected: int
    deduplicated: int

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
    ) -> Ticket[Any, Any]: ...

    def enqueue_grouped(self, request: Any, group: str | None) -> Ticket[Any, Any]: ...

    def unrank(self) -> None: ...

    def enqueue_many(
        self,
        requests: Iterable[Any],
        key: Callable[[Any], Hashable | None] | None,
        unique_for: float | None,
        priority: int,
        delay: float | None,
        group: str | None = None,
    ) -> list[Ticket[Any, Any]]: ...

    def check_open(self) -> None: ...

    async def submit(
        self,
        request: Any,
        *,
        key: Hashable | None = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> Ticket[Any, Any]: ...

    def enqueue_checked(self, ticket: Ticket[Any, Any]) -> Ticket[Any, Any]:
        """The rest of enqueue_request off its fast path: refused, or taken and logged."""
        ...

    def set_admit(self) -> None: ...

    def schedule_incoming(self) -> None: ...

    def unschedule(self) -> None: ...

    def release_key(self, ticket: Ticket[Any, Any], running: bool = False) -> None: ...

    def put_back(self, ticket: Ticket[Any, Any], now: float) -> None: ...


class GroupsPart(Protocol):
    """Limits per group, in memory (see _limits.Groups)."""

    group_of: dict[Ticket[Any, Any], str]

    @property
    def limited(self) -> int: ...

    def admit(
        self, entry: tuple[int, float, int, Ticket[Any, Any]], group: str, now: float
    ) -> bool: ...

    def admit_queued(self, ticket: Ticket[Any, Any], now: float) -> bool: ...

    def ended(self, ticket: Ticket[Any, Any]) -> None: ...

    def forget(self, ticket: Ticket[Any, Any]) -> None: ...

    def take_held(
        self, ticket: Ticket[Any, Any] | None, request_id: object
    ) -> Ticket[Any, Any] | None: ...

    def drain(self) -> list[Ticket[Any, Any]]: ...


class OutcomesPart(Protocol):
    """What ends an attempt, or a request, off the fast path."""

    retry: Retry | None
    failed: int
    cancelled: int
    retried: int

    async def cancel_in_memory(self, id_or_key: int | Hashable) -> bool: ...

    def attempt_failed(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        now: float,
        context: contextvars.Context,
    ) -> None: ...

    def aborted(
        self, ticket: Ticket[Any, Any], exc: BaseException, context: contextvars.Context
    ) -> BaseException: ...

    def fail(
        self,
        ticket: Ticket[Any, Any],
        exc: BaseException,
        tb: types.TracebackType | None,
        now: float | None,
    ) -> None: ...

    def cancel(
        self, ticket: Ticket[Any, Any], now: float | None, *, stopped: bool = True
    ) -> None: ...

    def finish_cancelled(
        self, ticket: Ticket[Any, Any], now: float | None, *, frees_room: bool = False
    ) -> None: ...

    def log_retry(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        delay: float,
        context: contextvars.Context,
    ) -> None: ...

    def call_on_error(
        self, ticket: Ticket[Any, Any], exc: Exception, context: contextvars.Context
    ) -> None: ...


class StoppingPart(Protocol):
    """Stopping and joining: what the others read of a stop."""

    event: trio.Event
    stop_called: bool
    stop_deadline: float
    finished: trio.Event
    stopped_tickets: list[Ticket[Any, Any]]

    def expire(self) -> None: ...

    async def stop(
        self, *, drain: bool = True, timeout: float | None = None
    ) -> list[Ticket[Any, Any]]: ...

    async def join(self) -> None: ...


class StorePart(Protocol):
    """The store side, as the engine and the parts below it use it."""

    store: Store
    connection: Session | None
    pending: list[Insert]
    committed: trio.Event
    errors: int
    rescued: dict[str, int]
    pause_wanted: bool | None
    limited: int
    ticks: list[Tick]

    def encode(self, request: Any) -> tuple[bytes, Any]: ...

    async def cancel(self, id_or_key: object) -> bool: ...

    async def lookup(self, id_or_key: object) -> Ticket[Any, Any] | None: ...

    async def statistics(self) -> dict[str, int]: ...

    def accept(
        self,
        request: Any,
        key: Hashable | None,
        delay: float | None,
        ticket: Ticket[Any, Any] | None,
        *,
        waits: bool = False,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> Ticket[Any, Any]: ...

    def accept_many(
        self,
        requests: list[Any],
        keys: list[Hashable | None] | None,
        delay: float | None,
        priority: int,
        unique_for: float | None,
        group: str | None = None,
    ) -> list[Ticket[Any, Any]]: ...

    def return_claimed(self) -> None: ...

    def attempt_started(self, request_id: int, scope: trio.CancelScope) -> None: ...

    def attempt_ended(self, request_id: int) -> None: ...

    def withdrawn_reason(self, request_id: int) -> str | None:
        """Why the loop took the attempt away, once (then forgotten); None if it did not."""
        ...

    def record(self, kind: OutcomeKind, ticket: Ticket[Any, Any], at: float) -> None:
        """A claimed attempt goes back (HANDED_BACK, RETURNED) at ``at``: the next batch
        writes it."""
        ...

    def record_success(
        self, ticket: Ticket[Any, Any], result: Any, context: contextvars.Context
    ) -> bool: ...

    def record_failure(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        tb: types.TracebackType | None,
        context: contextvars.Context,
    ) -> None: ...


class TracerPart(Protocol):
    """Tracing, once ``tickler.otel.instrument`` turned it on (the engine holds None until then).

    Called only off the hot path: each enqueue goes through the intake while
    it is on (see ``Intake.set_admit``), the handler is wrapped, and the
    outcomes and the store side report how each attempt ended.
    """

    # Whether each request is traced: False when the tracer records nothing and carries
    # nothing a request's own context does not (the no-op tracer, in memory). Then
    # enqueues keep the fast path.
    per_request: bool

    def enqueued(self, tickets: Sequence[Ticket[Any, Any]]) -> None:
        """New requests were accepted: one producer span, a child of the current span."""

    def ended(
        self,
        ticket: Ticket[Any, Any],
        outcome: str,
        *,
        delay: float | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """How ``ticket``'s attempt ended (a no-op if no attempt span is open for it)."""

    def periodic(self, enqueue: Callable[[], object]) -> None:
        """Call ``enqueue`` (a periodic tick's) outside any trace: the tick starts a new one."""

    def traces_of(self, tickets: Sequence[Ticket[Any, Any]]) -> list[tuple[str, str] | None]:
        """The W3C (traceparent, tracestate) of each request's enqueue span, to store."""

    def batch_started(self, batch: Batch) -> object:
        """A batch is about to be exchanged with the store: what ``batch_ended`` is handed."""

    def batch_ended(
        self, span: object, result: BatchResult | None, error: BaseException | None
    ) -> None:
        """The batch committed (``result``) or failed (``error``)."""
