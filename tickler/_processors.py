"""The processors: tasks that run handlers in the limiter's slots, and what they record.

A processor (``_process``) runs attempt after attempt while work waits and
the cap allows, then parks. Its loop is the per-request path, hand-tuned for
the burst rows; the rare branches are helpers: ``_fresh_context`` (the last
handler set variables of its own), ``_not_started`` (a request taken but
ended before it starts: a cancel, a stop, a crash), ``_scoped`` (a timeout,
or a store that may take the attempt away), ``_attempt_failed`` and
``_abort`` (failures and cancellations), and the store's ``record_*``.

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

import contextvars
import heapq
import inspect
import itertools
import logging
import math
import sys
import types
from bisect import bisect_left as _bucket
from collections.abc import Generator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, cast

import trio

from . import _lowlevel
from ._core import (
    _CANCELLED,
    _EMPTY_CONTEXT,
    _FAILED,
    _MISSING,
    _QUEUED,
    _RETRYING,
    _RUNNING,
    _SCHEDULED,
    _SUCCEEDED,
    _Context,
    _format_exception,
    _one_line,
    _run_in,
    logger,
)
from ._exceptions import ServiceClosed
from ._queue import _QueueSide
from ._statistics import TIME_BUCKETS
from ._stores._sync import StoreSync, Withdrawn, wall_clock
from ._ticket import RequestT, ResultT, Status, Ticket, Waiting

if TYPE_CHECKING:
    from ._service import Service

_Coroutine = types.CoroutineType

# A processor that keeps its slot yields to the scheduler after this many
# requests in a row, even if every handler returned without yielding.
_CHAIN_BUDGET = 64


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


class _Processors(_QueueSide[RequestT, ResultT]):
    """Start, run and record attempts; keep a slot while work waits; park when none does."""

    __slots__ = ()

    async def _process_withdrawable(self, ticket: Ticket[RequestT, ResultT], slot: _Slot) -> None:
        """A processor with one cancel scope for all its attempts.

        A running attempt is taken away by cancelling this scope: by
        ``cancel()``, which finds it through the processor's ``_Attempt``;
        and with a store by the loop (a cancel from any process, a lost
        lease, a stop), which finds it under the request's id in
        ``StoreSync.scopes``. The processor records the attempt and ends; the
        loop starts another if work waits. One scope per processor rather
        than one per attempt keeps the cost of a scope off each request
        (the burst rows).
        """
        # Handed over in a list that _process empties: this frame, which lives
        # as long as the processor, keeps no request alive.
        start: list[Any] = [ticket, slot]
        del ticket, slot
        with trio.CancelScope() as withdrawable:
            await self._process(start, withdrawable)

    async def _scoped(
        self,
        ticket: Ticket[RequestT, ResultT],
        awaitable: Any,
        now: float,
        withdrawable: trio.CancelScope,
    ) -> Any:
        """Await an attempt under its timeout, where the store's loop may also take it away.

        With a store and no timeout, the loop takes the attempt away through
        the processor's scope (Cancelled, in the caller); with a timeout,
        through the attempt's own scope (a cancel, a lost lease, a stop):
        then Withdrawn. A timeout is one more failure: TimeoutError.
        """
        stored = self._store_run
        timeout = self._timeout
        if timeout is None:
            assert stored is not None
            stored.scopes[ticket.id] = withdrawable
            try:
                return await awaitable
            finally:
                del stored.scopes[ticket.id]
        scope = trio.CancelScope(deadline=now + timeout)
        if stored is not None:
            stored.scopes[ticket.id] = scope
        result: Any = None
        try:
            with scope:
                result = await awaitable
        finally:
            if stored is not None:
                del stored.scopes[ticket.id]
        if scope.cancelled_caught:
            if stored is not None and ticket.id in stored.reasons:
                raise Withdrawn(stored.reasons.pop(ticket.id))
            raise TimeoutError(f"attempt timed out after {timeout:g} seconds")
        return result

    def _not_started(
        self, ticket: Ticket[RequestT, ResultT], withdrawable: trio.CancelScope, now: float
    ) -> None:
        """A request a processor took ends before it starts; the processor then parks or ends."""
        self._in_flight -= 1
        if ticket in self._doomed:
            # cancel() took it before it started.
            self._doomed.discard(ticket)
            self._finish_cancelled(ticket, now)
        elif self._withdrawn_only(withdrawable):
            # cancel() took this processor's last attempt away: the request
            # taken next goes back, and the processor ends (its scope is cancelled).
            self._put_back(ticket, now)
        else:
            # A stop without drain, a crash or a cancellation came between
            # taking this request and starting it.
            self._may_start = False
            self._cancel(ticket, now)

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

    @trio.lowlevel.enable_ki_protection
    def _put_back(self, ticket: Ticket[RequestT, ResultT], now: float) -> None:
        """A request taken but not started goes back where it waited, first in line."""
        status = ticket.status
        if status is _QUEUED:
            with self._lock:
                self._queue.appendleft(ticket)
        else:
            if status is _SCHEDULED:
                with self._lock:
                    self._scheduled += 1
                    self._set_admit()
            else:
                self._retrying += 1
            heapq.heappush(self._heap, (now, next(self._heap_seq), ticket))
        self._tickle()

    async def _process(self, start: list[Any], withdrawable: trio.CancelScope) -> None:
        """Run ``ticket``; then, while work waits and the cap allows, keep the slot for the next.

        Keeping the slot saves a task spawn per request (the burst rows). With
        nothing left to take, the processor gives its slot back and parks until
        the supervisor, which owns every start into a free slot, hands it the
        next one. How an attempt gets its enqueuer's context: see the module's
        docstring. The rare branches are the helpers named in it.
        """
        ticket: Ticket[RequestT, ResultT]
        slot: _Slot
        ticket, slot = start
        start.clear()
        timer = self._timer
        assert timer is not None
        offset = self._offset
        handler = self._handler
        timeout = self._timeout
        heap = self._heap
        queue = self._queue
        lock = self._lock
        task = trio.lowlevel.current_task()
        stored = self._store_run  # None for the in-memory engine
        # tuned (bench: burst, histograms=True): the histograms' counts, and for each the bucket of
        # the last duration counted with its edges: durations come in runs that share a bucket, and
        # two comparisons cost less than a search.
        timed = self._histograms
        wait_counts = self._wait_counts
        run_counts = self._run_counts
        wait_bucket = run_bucket = 0
        wait_low = wait_high = run_low = run_high = math.nan
        # What current_service() and current_ticket() find for this task and
        # the tasks its handlers spawn.
        attempt = _ATTEMPTS[task] = _Attempt(self, withdrawable)
        # tuned (bench: burst): whether this task is cancelled, one attribute per start: see
        # _lowlevel.
        cancel_status = _lowlevel.cancel_status(task)
        # Requests cancel() took after a processor was handed them, before
        # they started (an alias: the set itself is the service's).
        doomed = self._doomed
        self._handed.pop(ticket.id, None)
        ended = False
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
                                # The last handler set variables of its own.
                                if not await self._fresh_context(task, ticket):
                                    break
                                context = task.context
                                now = offset + timer()
                            if captured:
                                held_tokens = [var.set(value) for var, value in captured.items()]
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
                            waited = now - ticket.enqueued_at  # type: ignore[operator]
                            if not wait_low < waited <= wait_high:
                                wait_bucket = _bucket(TIME_BUCKETS, waited)
                                wait_low, wait_high = _EDGES[wait_bucket]
                            wait_counts[wait_bucket] += 1
                            self._wait_sum += waited
                        self._started += 1
                        if self._debug:
                            _run_in(context, logger.debug, "processing request #%d (attempt %d)",
                                    ticket.id, ticket.attempts)  # fmt: skip
                        try:
                            awaitable = handler(ticket.request)
                            if type(awaitable) is not _Coroutine:
                                awaitable = _steps_of(awaitable)
                            if timeout is None and stored is None:
                                result = await awaitable
                            else:
                                # A deadline, or a store that may take it away.
                                result = await self._scoped(ticket, awaitable, now, withdrawable)
                        except Exception as exc:
                            self._attempt_failed(ticket, exc, offset + timer(), context)
                            if withdrawable.cancel_called:
                                await trio.lowlevel.checkpoint()  # taken away: this ends
                        except BaseException as exc:
                            # Cancelled, KeyboardInterrupt and the like: record the
                            # request's final state, and let the exception go on.
                            raise self._aborted(ticket, exc, context)  # noqa: B904
                        else:
                            now = offset + timer()
                            self._in_flight -= 1
                            if timed:
                                ran = now - ticket.started_at
                                if not run_low < ran <= run_high:
                                    run_bucket = _bucket(TIME_BUCKETS, ran)
                                    run_low, run_high = _EDGES[run_bucket]
                                run_counts[run_bucket] += 1
                                self._run_sum += ran
                            if stored is None:
                                self._succeeded += 1
                                if self._key_of:
                                    self._release_key(ticket)
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
                            await trio.lowlevel.cancel_shielded_checkpoint()
                            now = offset + timer()
                        if (
                            not self._may_start
                            or self._in_flight >= self._capacity
                            or cancel_status.effectively_cancelled
                        ):
                            # (Cancelled: by cancel(), a stop or a crash; the
                            # processor takes nothing more, and ends.)
                            break
                        if heap and heap[0][0] <= now:
                            following = self._take(now)
                            assert following is not None
                            ticket = following
                            following = None
                        elif queue:
                            # tuned (bench: burst): the common case of _take, inlined (twin:
                            # _take); calling _take (and _finish above) here cost about 2% of burst
                            # throughput.
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
                    if task.context and not _lowlevel.reset_context(task, _EMPTY_CONTEXT):
                        ended = True  # a new task starts the next request
                    # A completion that frees a slot tickles the loop.
                    self._limiter.release_on_behalf_of(slot)
                    self._tickle()
                    if self._debug:
                        self._log_slot_freed()
                if ended:
                    return
                handed = await self._park()
                if handed is None:
                    return
                ticket, slot = handed
                handed = None
                self._handed.pop(ticket.id, None)
                now = offset + timer()
                chained = 0
        finally:
            del _ATTEMPTS[task]

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
            self._put_back(ticket, now)
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
    def _attempt_failed(
        self,
        ticket: Ticket[RequestT, ResultT],
        exc: Exception,
        now: float,
        context: contextvars.Context,
    ) -> None:
        self._in_flight -= 1
        self._ran(ticket, now)
        # Drop the processor's own frame from the traceback: it refers to the
        # ticket, and the ticket will refer to the exception.
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame is sys._getframe(1):
            exc.__traceback__ = tb = tb.tb_next
        if self._stop_called and self._refused_by_stop(exc):
            # The handler's follow-up was refused by this service's stop: the
            # stop ended the request, not a fault of the handler. In memory it
            # ends CANCELLED; with a store it goes back to the store, as
            # everything a stop takes away does. No retry, no on_error.
            if self._store_run is not None:
                self._sync().record("handed_back", ticket, (wall_clock(),))
            else:
                self._cancel(ticket, now)
            return
        if self._store_run is not None:
            self._sync().record_failure(ticket, exc, tb, context)
            return
        retry = self._retry
        attempt = ticket.attempts
        if (
            retry is not None
            and retry.should_retry(attempt, exc)
            and not self._cancel_asked(ticket)  # a cancelled request is never retried
        ):
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
            self._log_retry(ticket, exc, delay, context)
            return
        self._fail(ticket, exc, tb, now)
        del tb
        self._call_on_error(ticket, exc, context)

    def _refused_by_stop(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was caused by) this service refusing an enqueue once closed.

        A group (the handler's nursery) is, if each of its errors is, or is
        a cancellation.
        """
        if isinstance(exc, BaseExceptionGroup):
            return all(
                isinstance(inner, trio.Cancelled) or self._refused_by_stop(inner)
                for inner in exc.exceptions
            ) and not _is_cancellation(exc)
        seen = 0
        error: BaseException | None = exc
        while error is not None and seen < 10:
            if isinstance(error, ServiceClosed) and error._service is self:
                return True
            error = error.__cause__ or error.__context__
            seen += 1
        return False

    def _log_retry(
        self,
        ticket: Ticket[RequestT, ResultT],
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

    def _call_on_error(
        self, ticket: Ticket[RequestT, ResultT], exc: Exception, context: contextvars.Context
    ) -> None:
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

    def _sync(self) -> StoreSync:
        """The store side, on a path that runs only with a store."""
        run = self._store_run
        assert run is not None
        return run

    def _aborted(
        self, ticket: Ticket[RequestT, ResultT], exc: BaseException, context: contextvars.Context
    ) -> BaseException:
        """Record how an attempt ended by Cancelled (or the like); return what to raise on."""
        cancelled = self._abort_mixed(ticket, exc, context)
        if cancelled is not None:
            return cancelled
        self._abort(ticket, exc)
        return exc

    def _abort_mixed(
        self, ticket: Ticket[RequestT, ResultT], exc: BaseException, context: contextvars.Context
    ) -> BaseException | None:
        """An attempt cancelled whose handler's nursery also raised errors: those, apart.

        The errors fail the request (never retried: it was cancelled) in
        memory; with a store the cancellation decides, as for any attempt
        taken away, and the errors are logged. Returns the cancellation to
        raise on, or None if ``exc`` is not such a mix.
        """
        if not isinstance(exc, BaseExceptionGroup):
            return None
        cancelled, errors = exc.split(trio.Cancelled)
        if cancelled is None or errors is None or not isinstance(errors, Exception):
            return None
        if self._store_run is not None:
            logger.warning(
                "request #%d raised as its attempt was cancelled: %s", ticket.id, _one_line(errors)
            )
            self._abort(ticket, cancelled)
            return cancelled
        now = self._time()
        assert now is not None
        attempt = _ATTEMPTS.get(trio.lowlevel.current_task())
        if attempt is not None and attempt.withdrawn is None:
            attempt.withdrawn = ticket  # no retry: the attempt was cancelled
        self._attempt_failed(ticket, errors, now, context)
        return cancelled

    @trio.lowlevel.enable_ki_protection
    def _abort(self, ticket: Ticket[RequestT, ResultT], exc: BaseException) -> None:
        self._in_flight -= 1
        now = self._time()
        if now is not None:
            self._ran(ticket, now)
        run = self._store_run
        if run is not None:
            if run.reasons and _is_cancellation(exc):
                reason = run.reasons.pop(ticket.id, None)
                if reason is not None:
                    # The loop took the attempt away through the processor's scope.
                    self._sync().record_failure(ticket, Withdrawn(reason), None, _EMPTY_CONTEXT)
                    return
            # With a store a stop never ends a request: it goes back to the store.
            if not _is_cancellation(exc):
                self._may_start = self._draining = False
            self._sync().record("handed_back", ticket, (wall_clock(),))
            return
        if _is_cancellation(exc):
            # By a stop or a crash; or by cancel(), whose request the stop's
            # list of tickets does not hold.
            self._cancel(ticket, now, stopped=not self._cancel_asked(ticket))
        else:
            # A KeyboardInterrupt or the like ends the run: start nothing more.
            self._may_start = self._draining = False
            self._fail(ticket, exc, exc.__traceback__, now)

    def _ran(self, ticket: Ticket[RequestT, ResultT], now: float) -> None:
        """Count the run time of ``ticket``'s attempt, which ended at ``now``."""
        if not self._histograms:
            return
        ran = now - ticket.started_at  # type: ignore[operator]
        self._run_counts[_bucket(TIME_BUCKETS, ran)] += 1
        self._run_sum += ran

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

    @trio.lowlevel.enable_ki_protection
    def _cancel(
        self, ticket: Ticket[RequestT, ResultT], now: float | None, *, stopped: bool = True
    ) -> None:
        if self._store_run is not None:
            # Claimed but not started: back to the store, to run later.
            self._sync().record("returned", ticket, (wall_clock(),))
            return
        self._finish(ticket, _CANCELLED, (now, None))
        self._cancelled += 1
        if stopped:
            self._stopped_tickets.append(ticket)

    def _finish_cancelled(
        self, ticket: Ticket[RequestT, ResultT], now: float | None, *, frees_room: bool = False
    ) -> None:
        """A request that had not started ends CANCELLED by cancel().

        ``frees_room``: it held a place in the queue, which a submit() waiter
        may now take.
        """
        self._cancelled += 1
        self._finish(ticket, _CANCELLED, (now, None))
        if frees_room and self._submitters:
            self._room.unpark()
        self._tickle()

    def _cancel_asked(self, ticket: Ticket[RequestT, ResultT]) -> bool:
        """Whether cancel() took the calling processor's attempt of ``ticket`` away (in memory)."""
        attempt = _ATTEMPTS.get(trio.lowlevel.current_task())
        return attempt is not None and attempt.withdrawn is ticket


# The edges of each bucket of TIME_BUCKETS: (low, high], the last one open.
_EDGES = tuple(itertools.pairwise((-math.inf, *TIME_BUCKETS, math.inf)))


class _Attempt:
    """A processor's service, the request it is running (for current_ticket()) and its scope.

    ``withdrawn`` is the request whose attempt ``cancel()`` took away.
    """

    __slots__ = ("scope", "service", "ticket", "withdrawn")

    def __init__(self, service: _QueueSide[Any, Any], scope: trio.CancelScope | None) -> None:
        self.service = service  # a Service: the layers exist only as its bases
        self.ticket: Ticket[Any, Any] | None = None
        self.scope = scope
        self.withdrawn: Ticket[Any, Any] | None = None


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
    return cast("Service[Any, Any]", _current_attempt("current_service").service)


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
