"""OpenTelemetry tracing for a service: ``instrument(service)``.

Needs the ``otel`` extra (``pip install 'trio-tickler[otel]'``, which brings
opentelemetry-api only); nothing of tickler imports this module, so a service
that is not instrumented never imports OpenTelemetry.

What it traces, following the OpenTelemetry semantic conventions for
messaging (``messaging.system`` is ``tickler``, the destination is the
service's queue, the message id is the request's id):

- each enqueue (``enqueue_request``, ``submit``, ``enqueue_many``, and a
  store's ``enqueue_in`` and ``enqueue_many_in`` once ``instrument_store(store)``
  or ``instrument(service)`` of a service on that store ran): a PRODUCER span
  ``send <queue>``, a child of the span current where it was called;
- each attempt: a CONSUMER span ``process <queue>``, whose parent is the
  enqueue's span, in this process or, through the row's W3C ``traceparent``
  and ``tracestate``, in another one; with the attempt number, the request's
  key, priority and group where set, and ``tickler.outcome``: succeeded,
  failed, retrying (with ``tickler.retry.delay``), cancelled or withdrawn
  (with ``tickler.withdrawn.reason``, ``lost`` for a lease taken over by
  another process); a failure's exception is recorded on it. The handler runs
  with that span current;
- a periodic tick's request has no enqueuer: its spans start a new trace;
- each batch exchanged with a store that inserted, wrote or claimed something
  (or failed): an INTERNAL span ``exchange <queue>`` with the counts it wrote
  and claimed, linked to the enqueue spans of the requests it inserted. An
  idle service's polls make no span.

What is not recorded is not built: a span's attributes beyond the constant
ones (``messaging.system``, the destination, the operation), its links and
the counts of a batch are set only on a span that records. With the API's
no-op tracer provider, no span is started at all: in memory a handler runs
in its enqueuer's context, which holds the span context that provider would
carry on, and tracing costs nothing per request; with a store, an enqueue
notes the span context current where it was called, for its row. A child of
a span that was not sampled (an enqueue under a dropped trace, an attempt
of an enqueue that was not sampled, here or through its row) is not sampled
either, without starting a span, where the sampler's decision is known
without asking it (the SDK's parent-based samplers with ALWAYS_OFF for such
a parent, as its default sampler has, or one that drops every span): it
carries that span context on. The decision is kept per OpenTelemetry
Context, compared by identity (the requests of one enqueuer share one). A
sampler of the application's own is asked, span by span.
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    INVALID_SPAN,
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from ._current import ATTEMPTS
from ._service import Service
from ._stores._seam import Batch, BatchResult
from ._stores.postgres import PostgresStore
from ._stores.sqlite import SqliteStore
from ._ticket import Ticket
from ._values import ClaimTrace

__all__ = ["instrument", "instrument_store", "uninstrument", "uninstrument_store"]

_SYSTEM = "tickler"
# The outcomes that end a request's last attempt: its enqueue span is no longer needed.
_RETRIED = "retrying"


def instrument(
    service: Service[Any, Any], *, tracer_provider: trace.TracerProvider | None = None
) -> None:
    """Turn tracing on for ``service``, before or while it runs.

    Without ``tracer_provider``, the global one (``trace.set_tracer_provider``)
    gives the tracer. Instrumenting again replaces the provider.

    Raises:
        TypeError: ``service`` is not a :class:`tickler.Service`, or
            ``tracer_provider`` not a TracerProvider.
    """
    if not isinstance(service, Service):
        raise TypeError(f"service must be a tickler.Service, not {type(service).__name__}")
    if tracer_provider is not None and not isinstance(tracer_provider, trace.TracerProvider):
        raise TypeError(
            "tracer_provider must be an opentelemetry.trace.TracerProvider or None,"
            f" not {type(tracer_provider).__name__}"
        )
    tracer = trace.get_tracer("tickler", tracer_provider=tracer_provider)
    if service._store_run is not None:
        _traced_store(service._store_run.store)._tracer = _StoreTracing(tracer)
    previous = service._tracer
    handler = previous.handler if isinstance(previous, _Tracing) else service._handler
    tracing = _Tracing(service, tracer, handler)
    if tracing.per_request:
        service._handler = tracing.wrap(handler)
    elif tracing.drops_all:
        service._handler = tracing.unsampled(handler)
    else:
        service._handler = handler
    with service._lock:
        service._tracer = tracing
        service._intake.set_admit()


def uninstrument(service: Service[Any, Any]) -> None:
    """Turn tracing off for ``service`` (and its store's ``enqueue_in``): its enqueues and
    attempts from now on make no span."""
    if service._store_run is not None:
        _traced_store(service._store_run.store)._tracer = None
    tracing = service._tracer
    if not isinstance(tracing, _Tracing):
        return
    service._handler = tracing.handler
    with service._lock:
        service._tracer = None
        service._intake.set_admit()


def instrument_store(
    store: SqliteStore | PostgresStore, *, tracer_provider: trace.TracerProvider | None = None
) -> None:
    """Trace ``store.enqueue_in`` and ``store.enqueue_many_in``, in a process that runs no
    service on ``store`` (``instrument(service)`` of a service on it does this too).

    Each call makes a PRODUCER span ``send <queue>``, a child of the span
    current where it was called, and writes that span's W3C traceparent and
    tracestate into the rows it inserts, in the caller's transaction: the
    attempts, in whichever process, continue its trace. Without
    ``tracer_provider``, the global one gives the tracer.

    Raises:
        TypeError: ``store`` is not a SqliteStore or PostgresStore, or
            ``tracer_provider`` not a TracerProvider.
    """
    _traced_store(store)
    if tracer_provider is not None and not isinstance(tracer_provider, trace.TracerProvider):
        raise TypeError(
            "tracer_provider must be an opentelemetry.trace.TracerProvider or None,"
            f" not {type(tracer_provider).__name__}"
        )
    store._tracer = _StoreTracing(trace.get_tracer("tickler", tracer_provider=tracer_provider))


def uninstrument_store(store: SqliteStore | PostgresStore) -> None:
    """Turn tracing off for ``store.enqueue_in`` and ``store.enqueue_many_in``."""
    _traced_store(store)._tracer = None


def _traced_store(store: object) -> SqliteStore | PostgresStore:
    if not isinstance(store, SqliteStore | PostgresStore):
        raise TypeError(
            f"store must be a tickler.SqliteStore or PostgresStore, not {type(store).__name__}"
        )
    return store


class _StoreTracing:
    """A store's tracer (its ``_tracer``, an ``_sql.EnqueueTracer``): the enqueue_in spans."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def send(
        self, queue: str, count: int, write: Callable[[tuple[str, str] | None], list[int]]
    ) -> list[int]:
        attributes: dict[str, Any] = {
            "messaging.system": _SYSTEM,
            "messaging.destination.name": queue,
            "messaging.operation.type": "send",
            "messaging.operation.name": "enqueue",
        }
        if count > 1:
            attributes["messaging.batch.message_count"] = count
        span = self.tracer.start_span(
            f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes
        )
        span_context = span.get_span_context()
        with trace.use_span(span, end_on_exit=True):
            ids = write(_traceparent(span_context) if span_context.is_valid else None)
            if count == 1:
                span.set_attribute("messaging.message.id", str(ids[0]))
        return ids


def _traceparent(span_context: SpanContext) -> tuple[str, str]:
    """The W3C traceparent and tracestate headers of ``span_context``."""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{int(span_context.trace_flags):02x}",
        span_context.trace_state.to_header(),
    )


def _remote(traceparent: str, tracestate: str | None) -> SpanContext | None:
    """The span context a row's traceparent and tracestate name, or None if they are not valid."""
    parts = traceparent.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    state = TraceState.from_header([tracestate]) if tracestate else TraceState()
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags),
                       trace_state=state)  # fmt: skip


def _records_nothing(tracer: trace.Tracer) -> bool:
    """Whether ``tracer`` is the SDK's, with a sampler that drops every span, whatever its
    parent: ALWAYS_OFF, TraceIdRatioBased(0), or ParentBased of those alone. Its decision is
    known without asking it (a sampler the SDK does not define is asked, span by span)."""
    sampling = sys.modules.get("opentelemetry.sdk.trace.sampling")
    if sampling is None:  # the SDK is not imported: the tracer is not the SDK's
        return False
    return _drops_all(sampling, getattr(tracer, "sampler", None))


def _drops_unsampled_children(tracer: trace.Tracer, remote: bool) -> bool:
    """Whether ``tracer`` is the SDK's, with a sampler known to drop every child of a parent
    that was not sampled (a local one, or with ``remote`` a remote one): one that drops every
    span, or a parent-based one whose sampler for such a parent does (ALWAYS_OFF, as the
    SDK's default sampler has). A sampler the SDK does not define is asked, span by span."""
    sampling = sys.modules.get("opentelemetry.sdk.trace.sampling")
    if sampling is None:  # the SDK is not imported: the tracer is not the SDK's
        return False
    sampler = getattr(tracer, "sampler", None)
    if type(sampler) in (sampling.ParentBased, sampling.ParentBasedTraceIdRatio):
        name = "_remote_parent_not_sampled" if remote else "_local_parent_not_sampled"
        return _drops_all(sampling, getattr(sampler, name))
    return _drops_all(sampling, sampler)


def _drops_all(sampling: Any, sampler: object) -> bool:
    kind = type(sampler)
    if kind is sampling.StaticSampler:
        return bool(sampler._decision == sampling.Decision.DROP)  # type: ignore[attr-defined]
    if kind is sampling.TraceIdRatioBased:
        return bool(sampler._bound == 0)  # type: ignore[attr-defined]
    if kind in (sampling.ParentBased, sampling.ParentBasedTraceIdRatio):
        return all(
            _drops_all(sampling, getattr(sampler, name))
            for name in (
                "_root",
                "_remote_parent_sampled",
                "_remote_parent_not_sampled",
                "_local_parent_sampled",
                "_local_parent_not_sampled",
            )
        )
    return False


def _runtime() -> tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], object]]:
    """OpenTelemetry's get_current, attach and detach; with the default runtime context, the
    methods of its context variable themselves (what those call, without two frames each).
    """
    # serves: otel_drop_roots, otel_drop
    variable = getattr(getattr(otel_context, "_RUNTIME_CONTEXT", None), "_current_context", None)
    if type(variable) is contextvars.ContextVar:
        return variable.get, variable.set, variable.reset
    return otel_context.get_current, otel_context.attach, otel_context.detach


_get_current = _runtime()[0]
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
# The key of the current span in an OpenTelemetry Context (the one set_span_in_context sets).
(_SPAN_KEY,) = trace.set_span_in_context(INVALID_SPAN, otel_context.Context())
_NO_TRACE_STATE = TraceState()


class _Unsampled(NonRecordingSpan):
    """The span an attempt that the sampler drops runs under, when the SDK's tracer would
    start a new one: a child of ``parent`` (in its trace), or without one, a new trace.
    Its span context, with its new ids, is made once something asks for it."""

    # (Made with object.__new__, its fields set where it is made: no frame of __init__.)
    _ids: Any
    _parent: SpanContext | None = None
    _context: SpanContext | None = None  # type: ignore[assignment]

    def get_span_context(self) -> SpanContext:
        made = self._context
        if made is None:
            made = self._context = _dropped_child(self._ids, self._parent)
        return made


def _dropped_child(ids: Any, parent: SpanContext | None) -> SpanContext:
    """The span context the SDK's tracer gives a span its sampler drops: in ``parent``'s
    trace, with its trace state, or without one in a new trace; not sampled."""
    if parent is not None:
        trace_id, state = parent.trace_id, parent.trace_state
    else:
        trace_id, state = ids.generate_trace_id(), _NO_TRACE_STATE
    return SpanContext(trace_id, ids.generate_span_id(), False, _NOT_SAMPLED, state)

    def __repr__(self) -> str:
        return f"NonRecordingSpan({self.get_span_context()!r})"


class _Tracing:
    """The service's tracer (its ``_tracer``, a ``_parts.TracerPart``), and the spans it keeps."""

    def __init__(
        self,
        service: Service[Any, Any],
        tracer: trace.Tracer,
        handler: Callable[[Any], Awaitable[Any]],
    ) -> None:
        self.service = service
        self.tracer = tracer
        self.handler = handler
        self.queue = service.name
        # The API's no-op tracer: it records nothing, and only carries the span context
        # current where a span starts on; so no span is started (see _start and enqueued).
        self.noop = isinstance(tracer, trace.NoOpTracer)
        # The SDK's tracer with a sampler that drops every span, whatever its parent: its
        # decision is known without asking it (see _records_nothing).
        self.drops_all = _records_nothing(tracer)
        # In memory, a handler runs in its enqueuer's context, which holds the span context
        # the no-op tracer would carry on: then there is nothing to do for each request (its
        # enqueues take the engine's fast path, and the handler is not wrapped). Nor under a
        # sampler that drops every span: the handler's wrapper (see unsampled) reads the
        # enqueuer's span context from that context, at the attempt, and records nothing.
        self.stored = service._store_run is not None
        self.per_request = not ((self.noop or self.drops_all) and not self.stored)
        # Whether the sampler is known to drop every child of a parent that was not sampled,
        # a local one and a remote one (the SDK's default sampler does): then such a child
        # is dropped without asking it, and no span is started (see carries).
        self.drops_local = self.drops_all or _drops_unsampled_children(tracer, remote=False)
        self.drops_remote = self.drops_all or _drops_unsampled_children(tracer, remote=True)
        # The last OpenTelemetry Context found whose current span is a local one that was
        # not sampled, whose children are dropped (its span context beside it); and the last
        # one found that is not. Contexts are compared by identity: the requests of one
        # enqueuer, a web request's say, share the very same Context.
        self.carried: object = None
        self.carried_pair: tuple[object, SpanContext] = (None, INVALID_SPAN_CONTEXT)
        self.not_carried: object = None
        self.not_carried_pair: tuple[object, SpanContext] = (None, INVALID_SPAN_CONTEXT)
        # The last span context made into a traceparent, and the last traceparent read
        # back into a span context (a local one: its children are dropped), with theirs.
        self.written: tuple[SpanContext, tuple[str, str]] | None = None
        self.read: tuple[str, str | None, SpanContext | None] | None = None
        self.twin: tuple[SpanContext | None, SpanContext] = (None, INVALID_SPAN_CONTEXT)
        # The attributes every span of a kind has, made once: a span that does not record
        # gets these alone (a sampler sees them), and builds nothing.
        self.send_attributes = self._attributes("enqueue", "send")
        self.process_attributes = self._attributes("process", "process")
        # The enqueue span of each request enqueued here, until its last attempt ended
        # (in memory) or its row was written (with a store).
        self.parents: dict[Ticket[Any, Any], SpanContext] = {}
        # What a store's claim read of each claimed row: (traceparent, tracestate, key,
        # priority, group), by request id, until its attempt starts.
        self.rows: dict[int, ClaimTrace] = {}
        # The attempt span of each attempt whose outcome is not known yet.
        self.open: dict[Ticket[Any, Any], Span] = {}

    def _attributes(self, operation: str, kind: str) -> dict[str, Any]:
        return {
            "messaging.system": _SYSTEM,
            "messaging.destination.name": self.queue,
            "messaging.operation.type": kind,
            "messaging.operation.name": operation,
        }

    # -- enqueues

    def carries(self, context: object) -> bool:
        """Whether the current span of ``context`` (an OpenTelemetry Context) is a local one
        that was not sampled, whose children the sampler drops (known without asking it).

        Then an enqueue, or an attempt, under it is not sampled either, and no span is
        started: it carries that span context on (``carried_pair``'s, once true).
        """
        if context is self.carried:  # serves: otel_drop, otel_drop_parent
            return True
        if context is self.not_carried or not self.drops_local:
            return False
        current = trace.get_current_span(context).get_span_context()  # type: ignore[arg-type]
        if current.is_valid and not (current.trace_flags.sampled or current.is_remote):
            # (The pair first: a thread that finds carried finds its span context beside it.)
            self.carried_pair = (context, current)
            self.carried = context
            return True
        self.not_carried_pair = (context, current)
        self.not_carried = context
        return False

    def enqueued(self, tickets: Sequence[Ticket[Any, Any]]) -> None:
        if not tickets or not self.per_request:
            return
        context = _get_current()
        if context is self.carried or (  # serves: otel_drop_parent (carries, inlined)
            context is not self.not_carried and self.carries(context)
        ):
            # The trace was not sampled here: nor is its enqueue (no span is started). In
            # memory, each attempt runs in its enqueuer's context, under that span: nothing
            # is kept (see wrap); a store's row carries its span context.
            if self.stored:
                carried, span_context = self.carried_pair
                if carried is not context:  # (another thread's found meanwhile)
                    span_context = trace.get_current_span(context).get_span_context()
                for ticket in tickets:
                    self.parents[ticket] = span_context
            return
        current = trace.get_current_span().get_span_context()
        if self.noop:
            # What the no-op tracer's span would carry: the span context current here.
            span_context = current
        elif self.drops_all:
            # serves: otel_drop_roots with a store: the span context the sampler's known
            # decision gives, for the rows, with no span started
            span_context = _dropped_child(
                self.tracer.id_generator,  # type: ignore[attr-defined]  # the SDK's tracer
                current if current.is_valid else None,
            )
        else:
            span = self.tracer.start_span(
                f"send {self.queue}", kind=SpanKind.PRODUCER, attributes=self.send_attributes
            )
            if span.is_recording():
                if len(tickets) > 1:
                    span.set_attribute("messaging.batch.message_count", len(tickets))
                elif tickets[0].id:
                    span.set_attribute("messaging.message.id", str(tickets[0].id))
            span_context = span.get_span_context()
            span.end()
        if span_context.is_valid:
            for ticket in tickets:
                self.parents[ticket] = span_context

    def periodic(self, enqueue: Callable[[], object]) -> None:
        token = otel_context.attach(otel_context.Context())
        try:
            enqueue()
        finally:
            otel_context.detach(token)

    # -- attempts

    def wrap(self, handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        """The handler, each of whose attempts runs in its attempt span.

        In memory, an attempt runs in its enqueuer's context: under a span there that was
        not sampled, whose children are dropped (see carries), it runs as it is, with no
        span started and no frame of its own: its enqueue made no span either.
        """
        get_current = _runtime()[0]
        stored = self.stored
        carries = self.carries

        def attempt(request: Any) -> Awaitable[Any]:
            if not stored:
                context = get_current()
                if context is self.carried:  # serves: otel_drop_parent (carries, inlined)
                    return handler(request)
                if context is not self.not_carried and carries(context):
                    return handler(request)
            return traced(request)

        async def traced(request: Any) -> Any:
            attempt = ATTEMPTS.get(trio.lowlevel.current_task())
            ticket = attempt.ticket if attempt is not None else None
            if ticket is None:
                return await handler(request)
            span = self._start(ticket)
            if span is None:  # nothing to record, and no span context to carry on
                result = await handler(request)
            else:
                token = otel_context.attach(trace.set_span_in_context(span))
                try:
                    result = await handler(request)
                except Exception as exc:
                    if span.is_recording():
                        span.record_exception(exc)
                    raise
                finally:
                    otel_context.detach(token)
            if self.service._store_run is None:
                self.ended(ticket, "succeeded")
            # (With a store, StoreSync.record says how it ended: its result may not encode.)
            return result

        return attempt

    def unsampled(
        self, handler: Callable[[Any], Awaitable[Any]]
    ) -> Callable[[Any], Awaitable[Any]]:
        """The handler in memory under a sampler that drops every span: each attempt runs
        under the span context the SDK would give it, not sampled, and no span is started.

        The enqueuer's span context is current as the attempt starts (a handler runs in
        its enqueuer's context). A local one that is not sampled is carried on as it is;
        under any other (sampled, remote, or none), the attempt runs under a new span
        context that is not sampled, in the enqueuer's trace or, without one, in a new trace.
        """
        get_current, attach, detach = _runtime()
        carries = self.carries
        ids = self.tracer.id_generator  # type: ignore[attr-defined]  # the SDK's tracer
        new_span = object.__new__

        def unsampled(request: Any) -> Awaitable[Any]:
            context = get_current()
            if context is self.carried:  # serves: otel_drop (carries, inlined)
                return handler(request)
            if context is not self.not_carried and carries(context):
                return handler(request)
            return in_new_span(request, context)

        async def in_new_span(request: Any, context: Any) -> Any:
            # serves: otel_drop_roots: its span context is made if it is asked for
            found, current = self.not_carried_pair  # (carries() just read it)
            if found is not context:
                current = trace.get_current_span(context).get_span_context()
            span = new_span(_Unsampled)  # serves: otel_drop_roots
            span._ids = ids
            if current.is_valid:
                span._parent = current
            if context:
                context = trace.set_span_in_context(span, context)
            else:  # serves: otel_drop_roots
                context = otel_context.Context({_SPAN_KEY: span})
            token = attach(context)
            try:
                return await handler(request)
            finally:
                detach(token)

        return unsampled

    def _start(self, ticket: Ticket[Any, Any]) -> Span | None:
        """The attempt's span, to make current while it runs; None: leave the context as it is.

        Only a span that records gets the attributes of its request, and is kept open.
        """
        parent = self.parents.get(ticket)
        row = self.rows.pop(ticket.id, None)
        if row is not None:
            traceparent = row.traceparent
            parent = self._read(traceparent, row.tracestate) if traceparent else None
        if (
            parent is not None
            and not parent.trace_flags.sampled
            and (self.drops_remote if parent.is_remote else self.drops_local or self.noop)
        ):
            # Its enqueue was not sampled: neither is the attempt, as the sampler decides
            # (known without asking it). It runs under its enqueue's span context (a remote
            # one as a local twin, made once for all the attempts under it).
            return NonRecordingSpan(self._local(parent) if parent.is_remote else parent)
        if self.noop:
            if parent is not None:
                return NonRecordingSpan(parent)
            # A new trace, which the no-op tracer does not make: the handler must not see the
            # enqueuer's span as its own, unless there is none.
            current = trace.get_current_span().get_span_context()
            return INVALID_SPAN if current.is_valid else None
        # No enqueue span (a periodic tick, or a request enqueued untraced): a new trace.
        context = (
            trace.set_span_in_context(NonRecordingSpan(parent))
            if parent is not None
            else otel_context.Context()
        )
        span = self.tracer.start_span(
            f"process {self.queue}",
            context=context,
            kind=SpanKind.CONSUMER,
            attributes=self.process_attributes,
        )
        if span.is_recording():
            span.set_attributes(self._request_attributes(ticket, row))
            self.open[ticket] = span
        return span

    def _read(self, traceparent: str, tracestate: str | None) -> SpanContext | None:
        """The span context of a row's traceparent and tracestate (see _remote), the last
        one kept: the rows of one enqueuer's requests hold the same."""
        read = self.read
        if read is not None and read[0] == traceparent and read[1] == tracestate:
            return read[2]  # serves: otel_drop with a store
        parent = _remote(traceparent, tracestate)
        self.read = (traceparent, tracestate, parent)
        return parent

    def _local(self, remote: SpanContext) -> SpanContext:
        """A local twin of ``remote``, a span context read from a row, made once for each."""
        twin = self.twin
        if twin[0] is remote:
            return twin[1]  # serves: otel_drop with a store
        local = SpanContext(
            remote.trace_id, remote.span_id, False, remote.trace_flags, remote.trace_state
        )
        self.twin = (remote, local)
        return local

    def _request_attributes(
        self,
        ticket: Ticket[Any, Any],
        row: ClaimTrace | None,
    ) -> dict[str, Any]:
        """The attributes an attempt's span has of its request (for a span that records)."""
        attributes: dict[str, Any] = {
            "messaging.message.id": str(ticket.id),
            "tickler.attempt": ticket.attempts,
        }
        if row is not None:
            key, priority, group = row.key, row.priority, row.group
        else:
            service = self.service
            intake = service._intake
            key = intake.key_of.get(ticket)  # type: ignore[assignment]
            priority = intake.priority_of.get(ticket, 0)
            groups = service._groups
            group = groups.group_of.get(ticket) if groups is not None else None
        if key is not None:
            attributes["tickler.key"] = str(key)
        if priority:
            attributes["tickler.priority"] = priority
        if group is not None:
            attributes["tickler.group"] = group
        return attributes

    def ended(
        self,
        ticket: Ticket[Any, Any],
        outcome: str,
        *,
        delay: float | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        if outcome != _RETRIED:
            self.parents.pop(ticket, None)
            self.rows.pop(ticket.id, None)
        span = self.open.pop(ticket, None)
        if span is None:
            return  # no attempt of it started here (or it is already ended)
        span.set_attribute("tickler.outcome", outcome)
        if delay is not None:
            span.set_attribute("tickler.retry.delay", max(delay, 0.0))
        if reason is not None:
            span.set_attribute("tickler.withdrawn.reason", reason)
        if outcome in ("failed", _RETRIED):
            if error is not None:
                span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(error) if error is not None else None))
        span.end()

    # -- the store side

    def traces_of(self, tickets: Sequence[Ticket[Any, Any]]) -> list[tuple[str, str] | None]:
        parents = self.parents
        found: list[tuple[str, str] | None] = []
        for ticket in tickets:
            parent = parents.get(ticket)
            if parent is None:
                found.append(None)
                continue
            written = self.written
            if written is None or written[0] is not parent:
                # serves: otel_drop with a store (the rows of one enqueuer share one)
                written = self.written = (parent, _traceparent(parent))
            found.append(written[1])
        return found

    def batch_started(self, batch: Batch) -> object:
        # The span is made as the batch ends, once it is known to have done something
        # (an idle service's polls make none), with this start time.
        return time.time_ns(), batch

    def batch_ended(
        self, started: object, result: BatchResult | None, error: BaseException | None
    ) -> None:
        assert isinstance(started, tuple)
        start_time: int = started[0]
        batch: Batch = started[1]
        if result is None:
            span = self._batch_span(batch, start_time)
            if error is not None and span.is_recording():
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, str(error)))
            span.end()
            return
        inserted = sum(new for _, new in result.inserted)
        written = sum(a is not None for a in result.applied)
        if inserted or written or result.claimed:
            span = self._batch_span(batch, start_time)
            if span.is_recording():
                span.set_attributes(
                    {
                        "tickler.batch.inserted": inserted,
                        "tickler.batch.written": written,
                        "tickler.batch.claimed": len(result.claimed),
                    }
                )
            span.end()
        # The rows are written: their enqueue spans travel in them from now on.
        for entry in batch.inserts:
            self.parents.pop(entry.ticket, None)
        self.rows.update(result.traces)

    def _batch_span(self, batch: Batch, start_time: int) -> Span:
        """A batch's span, started at ``start_time``; what it sent and its links if it records."""
        span = self.tracer.start_span(
            f"exchange {self.queue}",
            context=otel_context.Context(),  # not part of any one request's trace
            kind=SpanKind.INTERNAL,
            attributes={"messaging.system": _SYSTEM, "messaging.destination.name": self.queue},
            start_time=start_time,
        )
        if span.is_recording():
            span.set_attributes(
                {
                    "tickler.batch.inserts": len(batch.inserts),
                    "tickler.batch.outcomes": len(batch.outcomes),
                    "tickler.batch.ticks": len(batch.ticks),
                    "tickler.batch.claim": batch.claim,
                }
            )
            for entry in batch.inserts[:64]:
                parent = self.parents.get(entry.ticket)
                if parent is not None:
                    span.add_link(parent)
        return span
