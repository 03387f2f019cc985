"""Outcomes: what ends an attempt, or a request, off the fast path.

The engine's processor loop ends a successful attempt inline. Everything
else that ends one is here: a failure and its retry (pushed onto the
engine's timer heap) or final failure with ``on_error``; an abort
(Cancelled, KeyboardInterrupt); a request cancelled before it started or
taken away while it ran; and ``cancel()`` itself for the in-memory engine.
With a store, each of these is recorded on the store side, which writes it
in the next batch.
"""

from __future__ import annotations

import contextvars
import heapq
import inspect
import logging
import sys
import types
from bisect import bisect_left as _bucket
from collections.abc import Hashable
from typing import Any

import attrs
import trio

from ._core import (
    _CANCELLED,
    _EMPTY_CONTEXT,
    _FAILED,
    _QUEUED,
    _RETRYING,
    _RUNNING,
    ErrorHook,
    _check_key,
    _format_exception,
    _is_cancellation,
    _one_line,
    _run_in,
    logger,
    wall_clock,
)
from ._current import ATTEMPTS, attempt_of_caller
from ._engine import _Engine
from ._exceptions import ServiceClosed, Withdrawn
from ._retry import Retry
from ._statistics import TIME_BUCKETS
from ._ticket import Ticket
from ._values import OutcomeKind

_Coroutine = types.CoroutineType


@attrs.define(eq=False)
class Outcomes:
    """Retries, failures, aborts and cancels; and the counters of each."""

    engine: _Engine[Any, Any]
    retry: Retry | None
    on_error: ErrorHook[Any, Any]
    failed: int = 0
    cancelled: int = 0
    retried: int = 0

    @trio.lowlevel.enable_ki_protection
    def attempt_failed(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        now: float,
        context: contextvars.Context,
    ) -> None:
        engine = self.engine
        engine._in_flight -= 1
        self.ran(ticket, now)
        # Drop the processor's own frame from the traceback: it refers to the
        # ticket, and the ticket will refer to the exception.
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame is sys._getframe(1):
            exc.__traceback__ = tb = tb.tb_next
        if engine._stopping.stop_called and self.refused_by_stop(exc):
            # The handler's follow-up was refused by this service's stop: the
            # stop ended the request, not a fault of the handler. In memory it
            # ends CANCELLED; with a store it goes back to the store, as
            # everything a stop takes away does. No retry, no on_error.
            stored = engine._store_run
            if stored is not None:
                stored.record(OutcomeKind.HANDED_BACK, ticket, wall_clock())
            else:
                self.cancel(ticket, now)
            return
        stored = engine._store_run
        if stored is not None:
            stored.record_failure(ticket, exc, tb, context)
            return
        retry = self.retry
        attempt = ticket.attempts
        if (
            retry is not None
            and retry.should_retry(attempt, exc)
            and not self.cancel_asked(ticket)  # a cancelled request is never retried
        ):
            if not engine._may_start:
                self.cancel(ticket, now)
                return
            delay = retry.delay(attempt)
            ticket.status = _RETRYING
            engine._retrying += 1
            self.retried += 1
            if engine._groups is not None:
                engine._groups.ended(ticket)  # the retry is a new start, counted anew
            heap = engine._heap
            heapq.heappush(heap, (now + delay, next(engine._heap_seq), ticket))
            if heap[0][2] is ticket:
                engine._tickle()  # the loop must now wake earlier
            if engine._tracer is not None:
                engine._tracer.ended(ticket, "retrying", delay=delay, error=exc)
            self.log_retry(ticket, exc, delay, context)
            return
        self.fail(ticket, exc, tb, now)
        del tb
        self.call_on_error(ticket, exc, context)

    def refused_by_stop(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was caused by) this service refusing an enqueue once closed.

        A group (the handler's nursery) is, if each of its errors is, or is
        a cancellation.
        """
        if isinstance(exc, BaseExceptionGroup):
            return all(
                isinstance(inner, trio.Cancelled) or self.refused_by_stop(inner)
                for inner in exc.exceptions
            ) and not _is_cancellation(exc)
        seen = 0
        error: BaseException | None = exc
        while error is not None and seen < 10:
            if isinstance(error, ServiceClosed) and error._service is self.engine:
                return True
            error = error.__cause__ or error.__context__
            seen += 1
        return False

    def log_retry(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        delay: float,
        context: contextvars.Context,
    ) -> None:
        # A retried failure is routine: INFO with the error in one line,
        # the traceback at DEBUG. Only the final failure is an ERROR.
        if logger.isEnabledFor(logging.INFO):
            attempt = ticket.attempts
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

    def call_on_error(
        self, ticket: Ticket[Any, Any], exc: Exception, context: contextvars.Context
    ) -> None:
        try:
            outcome = _run_in(context, self.on_error, ticket, exc)
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

    def aborted(
        self, ticket: Ticket[Any, Any], exc: BaseException, context: contextvars.Context
    ) -> BaseException:
        """Record how an attempt ended by Cancelled (or the like); return what to raise on."""
        cancelled = self.abort_mixed(ticket, exc, context)
        if cancelled is not None:
            return cancelled
        self.abort(ticket, exc)
        return exc

    def abort_mixed(
        self, ticket: Ticket[Any, Any], exc: BaseException, context: contextvars.Context
    ) -> BaseException | None:
        """An attempt cancelled whose handler's nursery also raised errors: those, apart.

        The errors fail the request (never retried: it was cancelled) in
        memory; with a store the cancellation decides, as for any attempt
        taken away, and the errors are logged. Returns the cancellation to
        raise on, or None if ``exc`` is not such a mix.
        """
        engine = self.engine
        if not isinstance(exc, BaseExceptionGroup):
            return None
        cancelled, errors = exc.split(trio.Cancelled)
        if cancelled is None or errors is None or not isinstance(errors, Exception):
            return None
        if engine._store_run is not None:
            logger.warning(
                "request #%d raised as its attempt was cancelled: %s", ticket.id, _one_line(errors)
            )
            self.abort(ticket, cancelled)
            return cancelled
        now = engine._time()
        assert now is not None
        attempt = attempt_of_caller()
        if attempt is not None and attempt.withdrawn is None:
            attempt.withdrawn = ticket  # no retry: the attempt was cancelled
        self.attempt_failed(ticket, errors, now, context)
        return cancelled

    @trio.lowlevel.enable_ki_protection
    def abort(self, ticket: Ticket[Any, Any], exc: BaseException) -> None:
        engine = self.engine
        engine._in_flight -= 1
        now = engine._time()
        if now is not None:
            self.ran(ticket, now)
        stored = engine._store_run
        if stored is not None:
            if _is_cancellation(exc):
                reason = stored.withdrawn_reason(ticket.id)
                if reason is not None:
                    # The loop took the attempt away through the processor's scope.
                    stored.record_failure(ticket, Withdrawn(reason), None, _EMPTY_CONTEXT)
                    return
            # With a store a stop never ends a request: it goes back to the store.
            if not _is_cancellation(exc):
                engine._may_start = engine._draining = False
            stored.record(OutcomeKind.HANDED_BACK, ticket, wall_clock())
            return
        if _is_cancellation(exc):
            # By a stop or a crash; or by cancel(), whose request the stop's
            # list of tickets does not hold.
            self.cancel(ticket, now, stopped=not self.cancel_asked(ticket))
        else:
            # A KeyboardInterrupt or the like ends the run: start nothing more.
            engine._may_start = engine._draining = False
            self.fail(ticket, exc, exc.__traceback__, now)

    def ran(self, ticket: Ticket[Any, Any], now: float) -> None:
        """Count the run time of ``ticket``'s attempt, which ended at ``now``."""
        engine = self.engine
        if not engine._histograms:
            return
        ran = now - ticket.started_at  # type: ignore[operator]
        engine._run_counts[_bucket(TIME_BUCKETS, ran)] += 1
        engine._run_sum += ran

    @trio.lowlevel.enable_ki_protection
    def fail(
        self,
        ticket: Ticket[Any, Any],
        exc: BaseException,
        tb: types.TracebackType | None,
        now: float | None,
    ) -> None:
        # A failed ticket keeps the original traceback beside the exception:
        # result() raises it with that traceback every time.
        engine = self.engine
        engine._finish(ticket, _FAILED, (now, exc, tb, exc.__context__))
        self.failed += 1
        if engine._tracer is not None:
            engine._tracer.ended(ticket, "failed", error=exc)

    @trio.lowlevel.enable_ki_protection
    def cancel(self, ticket: Ticket[Any, Any], now: float | None, *, stopped: bool = True) -> None:
        engine = self.engine
        stored = engine._store_run
        if stored is not None:
            # Claimed but not started: back to the store, to run later.
            stored.record(OutcomeKind.RETURNED, ticket, wall_clock())
            return
        engine._finish(ticket, _CANCELLED, (now, None))
        self.cancelled += 1
        if stopped:
            engine._stopping.stopped_tickets.append(ticket)
        if engine._tracer is not None:
            engine._tracer.ended(ticket, "cancelled", reason="stopped" if stopped else None)

    def finish_cancelled(
        self, ticket: Ticket[Any, Any], now: float | None, *, frees_room: bool = False
    ) -> None:
        """A request that had not started ends CANCELLED by cancel().

        ``frees_room``: it held a place in the queue, which a submit() waiter
        may now take.
        """
        engine = self.engine
        self.cancelled += 1
        engine._finish(ticket, _CANCELLED, (now, None))
        if engine._tracer is not None:
            engine._tracer.ended(ticket, "cancelled")
        if frees_room and engine._submitters:
            engine._intake.room.unpark()
        engine._tickle()

    def cancel_asked(self, ticket: Ticket[Any, Any]) -> bool:
        """Whether cancel() took the calling processor's attempt of ``ticket`` away (in memory)."""
        attempt = attempt_of_caller()
        return attempt is not None and attempt.withdrawn is ticket

    def take_ready(
        self, ticket: Ticket[Any, Any] | None, request_id: object
    ) -> Ticket[Any, Any] | None:
        """Take ``ticket`` (or the request with ``request_id``) out of the ready heap, if there."""
        engine = self.engine
        ready = engine._ready
        found: Ticket[Any, Any] | None = None
        with engine._lock:
            for index, entry in enumerate(ready):
                if entry[3] is ticket or (request_id is not None and entry[2] == request_id):
                    found = entry[3]
                    ready[index] = ready[-1]
                    ready.pop()
                    heapq.heapify(ready)
                    break
        if found is None and engine._groups is not None:
            found = engine._groups.take_held(ticket, request_id)
        if found is not None:
            engine._left(found)
        return found

    async def cancel_in_memory(self, id_or_key: int | Hashable) -> bool:
        engine = self.engine
        by_id = isinstance(id_or_key, int) and not isinstance(id_or_key, bool)
        if not by_id:
            _check_key(id_or_key)
        engine._check_run("used")
        await trio.lowlevel.checkpoint_if_cancelled()
        found = bool(self.cancel_found(id_or_key, by_id))
        await trio.lowlevel.cancel_shielded_checkpoint()
        return found

    @trio.lowlevel.enable_ki_protection
    def cancel_found(self, id_or_key: object, by_id: bool) -> bool | None:
        """Cancel the live request if found waiting or running (True); else None."""
        engine = self.engine
        now = engine._time()
        if now is None:  # before the run: as a stop then, on the caller's clock
            now = trio.current_time()
        ticket: Ticket[Any, Any] | None = None
        removed: Ticket[Any, Any] | None = None
        with engine._lock:
            if by_id:
                for candidate in engine._queue:
                    if candidate.id == id_or_key:
                        ticket = candidate
                        break
            else:
                ticket = engine._intake.keys.get(id_or_key)
            if ticket is not None and ticket.status is _QUEUED:
                try:
                    engine._queue.remove(ticket)
                except ValueError:
                    pass  # taken by a processor that has not started it: below
                else:
                    removed = ticket
            else:
                for index, (_, entry) in enumerate(engine._intake.incoming):
                    if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                        del engine._intake.incoming[index]
                        engine._intake.scheduled -= 1
                        engine._intake.set_admit()
                        removed = entry
                        break
        if removed is not None:
            # A queued request frees a place in the queue; a scheduled one
            # too (it counted against the bound).
            self.finish_cancelled(removed, now, frees_room=True)
            return True
        for index, (_, _, entry) in enumerate(engine._heap):
            if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                engine._heap[index] = engine._heap[-1]
                engine._heap.pop()
                heapq.heapify(engine._heap)
                engine._left(entry)  # (a scheduled one gives its place to a submit() waiter)
                self.finish_cancelled(entry, now)
                return True
        ranked = self.take_ready(ticket, id_or_key if by_id and ticket is None else None)
        if ranked is not None:
            self.finish_cancelled(ranked, now, frees_room=True)
            return True
        for attempt in list(ATTEMPTS.values()):
            running = attempt.ticket
            if (
                attempt.service is engine
                and running is not None
                and running.status is _RUNNING
                and (running is ticket or (by_id and ticket is None and running.id == id_or_key))
            ):
                if attempt.withdrawn is not running:
                    attempt.withdrawn = running
                    assert attempt.scope is not None
                    attempt.scope.cancel()
                    # Its key is free from now: a replacement enqueued next
                    # is a request of its own. Its group's slot is not, until
                    # the attempt ends.
                    engine._intake.release_key(running, running=True)
                return True
        # Handed to a processor that has not started it: it never starts.
        if ticket is not None:
            handed = engine._handed.get(ticket.id)
        else:
            handed = engine._handed.get(id_or_key) if by_id else None  # type: ignore[call-overload]
        if handed is not None and (ticket is None or handed is ticket):
            del engine._handed[handed.id]
            engine._doomed.add(handed)
            engine._intake.deferred.discard(handed)  # cancelled, not put back by a pause
            engine._intake.release_key(handed)
            engine._tickle()
            return True
        return None
